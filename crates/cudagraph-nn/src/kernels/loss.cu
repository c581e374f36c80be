// Pass 1 of loss = scale * sum (p - t)^2: each block writes its partial sum (a one-block loop
// over 64K elements is latency-bound; many blocks are not). Pass 2: sum_partials.
extern "C" __global__ void mse_partial(const float* p, const float* t, float* partial, long n) {
    float acc = 0.0f;
    for (long i = IDX; i < n; i += (long)gridDim.x * blockDim.x) { float d = p[i] - t[i]; acc += d * d; }
    acc = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out[0] = scale * sum of `count` partials, one block, fixed order.
extern "C" __global__ void sum_partials(const float* partial, int count, float* out, float scale) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[0] = scale * acc;
}

extern "C" __global__ void mse_bwd(const float* p, const float* t, const float* dloss, float* dp, long n, float scale) {
    long i = IDX;
    if (i < n) dp[i] = 2.0f * scale * (p[i] - t[i]) * dloss[0];
}

// Softmax cross-entropy, mean over rows; probs saved for backward. One block.
// A target outside [0, cols) is clamped (no read outside the row) and reported through the
// device's error flag (cg_report, from cudagraph's DEVICE_CHECK_CUDA), with its row.
extern "C" __global__ void ce_fwd(const float* logits, const int* tgt, float* probs, float* loss,
        int rows, int cols, cg_check* flag, unsigned int check) {
    float acc = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const float* z = logits + (long)r * cols;
        float m = z[0];
        for (int c = 1; c < cols; c++) m = fmaxf(m, z[c]);
        float s = 0.0f;
        for (int c = 0; c < cols; c++) s += expf(z[c] - m);
        for (int c = 0; c < cols; c++) probs[(long)r * cols + c] = expf(z[c] - m) / s;
        int t = tgt[r];
        if (t < 0 || t >= cols) {
            cg_report(flag, check, t, cols, r);
            t = min(max(t, 0), cols - 1);
        }
        acc += logf(s) + m - z[t];
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) loss[0] = acc / rows;
}

extern "C" __global__ void ce_bwd(const float* probs, const int* tgt, const float* dloss, float* dz,
        int rows, int cols) {
    long i = IDX;
    if (i < (long)rows * cols) {
        int r = i / cols, c = i % cols;
        int t = min(max(tgt[r], 0), cols - 1);  // reported by ce_fwd
        dz[i] = (probs[i] - (c == t ? 1.0f : 0.0f)) * dloss[0] / rows;
    }
}
