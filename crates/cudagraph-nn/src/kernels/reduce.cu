// db[c] = sum_r dy[r, c]: one block per column.
extern "C" __global__ void col_sum(const float* dy, float* db, int rows, int cols) {
    int c = blockIdx.x;
    float acc = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += dy[(long)r * cols + c];
    acc = block_sum(acc);
    if (threadIdx.x == 0) db[c] = acc;
}

// db[c] = sum over n, h, w of dy[n, c, h, w]: one block per channel.
extern "C" __global__ void channel_sum(const float* dy, float* db, int n, int c, int hw) {
    int ch = blockIdx.x;
    float acc = 0.0f;
    long total = (long)n * hw;
    for (long i = threadIdx.x; i < total; i += blockDim.x) {
        long b = i / hw, p = i % hw;
        acc += dy[(b * c + ch) * hw + p];
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) db[ch] = acc;
}
