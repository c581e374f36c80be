// Shared by every NN kernel (compiled as one module with the other .cu files of this folder).
// IDX is 64-bit: grids of more than 2^32 threads index correctly.
#define IDX ((long)blockIdx.x * blockDim.x + threadIdx.x)

// ReLU as torch.relu: NaN passes through (fmaxf would turn it into 0).
__device__ __forceinline__ float relu_f(float v) { return (v > 0.0f || v != v) ? v : 0.0f; }

// Block-wide sum (blockDim.x a multiple of 32, at most 1024), returned to every thread: each
// warp adds its lanes by a butterfly (every lane gets the same bits), then warp 0 adds the warp
// totals the same way. Fixed order: the same bits on every run. Two barriers instead of the
// ten steps of a shared-memory tree.
__device__ float block_sum(float v) {
    __shared__ float s[33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nw ? s[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
        if (lane == 0) s[32] = w;
    }
    __syncthreads();
    const float r = s[32];
    __syncthreads();  // s is reused by the next call
    return r;
}
