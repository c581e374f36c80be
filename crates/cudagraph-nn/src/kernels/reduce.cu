// db[c] = sum_r dy[r, c]: one block per column.
extern "C" __global__ void col_sum(const float* dy, float* db, int rows, int cols) {
    int c = blockIdx.x;
    float acc = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += dy[(long)r * cols + c];
    acc = block_sum(acc);
    if (threadIdx.x == 0) db[c] = acc;
}

// The bias gradient of a convolution, in parts: block (ch, z) sums dy[b, ch, p] over the flat
// indices i = b * hw + p in [z * chunk, min((z + 1) * chunk, n * hw)) and writes
// out[z * c + ch]. Consecutive threads take consecutive flat indices (coalesced within a plane,
// and every thread busy however small the planes are); each thread divides once and then steps
// (b, p) by (blockDim / hw, blockDim % hw) with a carry. With one part, out is db itself;
// otherwise sum_parts adds the parts in order (deterministic).
extern "C" __global__ void channel_sum(const float* dy, float* out, int n, int c, int hw, long long chunk) {
    const int ch = blockIdx.x, z = blockIdx.y;
    const long long total = (long long)n * hw;
    const long long lo = (long long)z * chunk;
    const long long hi = min(lo + chunk, total);
    const int step = blockDim.x, db = step / hw, dp = step - db * hw;
    long long i = lo + threadIdx.x;
    long long b = i / hw;
    int p = (int)(i - b * hw);
    float acc = 0.0f;
    for (; i < hi; i += step) {
        acc += dy[(b * c + ch) * (long long)hw + p];
        b += db;
        p += dp;
        if (p >= hw) {
            p -= hw;
            b++;
        }
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[(long long)z * c + ch] = acc;
}

// out[e] = sum over z = 0 .. parts - 1, in order, of partial[z * count + e].
extern "C" __global__ void sum_parts(const float* partial, int parts, float* out, int count) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= count) return;
    float s = 0.0f;
    for (int z = 0; z < parts; z++) s += partial[(long long)z * count + e];
    out[e] = s;
}
