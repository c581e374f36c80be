// Kernels for training steps that run on the device without the host: the next batch from a
// dataset resident in device memory, the loop condition, and the finiteness check that lets an
// IF node skip an optimizer step. Compiled as its own module after cudagraph's PDL_CUDA (every
// kernel starts with CG_PDL_ENTER(): no memory access before the previous kernel is done).

// One block. b = cursor[0] mod batches picks rows [b * rows, (b + 1) * rows) of the resident
// images (batches * rows * features floats) and labels (batches * rows ints); they are copied
// into x (rows * features) and y (rows). advance_cursor, launched next, moves the cursor.
extern "C" __global__ void gather_batch(const float* images, const int* labels, float* x, int* y,
                                        const unsigned int* cursor, int batches, int rows, int features) {
    CG_PDL_ENTER();
    // Every thread reads the cursor itself (advance_cursor, the next kernel, moves it): no
    // shared state, no barrier.
    const unsigned int b = cursor[0] % (unsigned int)batches;
    long row0 = (long)b * rows;
    long count = (long)rows * features;
    for (long i = threadIdx.x; i < count; i += blockDim.x) x[i] = images[row0 * features + i];
    for (int i = threadIdx.x; i < rows; i += blockDim.x) y[i] = labels[row0 + i];
}

// cursor[0] = cursor[0] mod batches + 1 (the batch gather_batch just read, plus one); with
// `cond`, also cond[0] = cursor[0] < batches (one thread).
extern "C" __global__ void advance_cursor(unsigned int* cursor, int batches, unsigned int* cond) {
    CG_PDL_ENTER();
    const unsigned int c = cursor[0] % (unsigned int)batches + 1u;
    cursor[0] = c;
    if (cond != 0) cond[0] = c < (unsigned int)batches ? 1u : 0u;
}

// cond[0] = cursor[0] < batches (one thread).
extern "C" __global__ void batches_left(const unsigned int* cursor, int batches, unsigned int* cond) {
    CG_PDL_ENTER();
    cond[0] = cursor[0] < (unsigned int)batches ? 1u : 0u;
}

// flag[0] = 0 when any of x[0..n) is NaN or infinite (the flag is set to 1 before).
extern "C" __global__ void check_finite(const float* x, long n, unsigned int* flag) {
    CG_PDL_ENTER();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && !isfinite(x[i])) flag[0] = 0u;
}
