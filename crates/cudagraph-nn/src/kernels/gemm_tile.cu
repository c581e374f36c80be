// The tiled SGEMM's building blocks, shared by `sgemm_tiled` (gemm.cu) and the cluster kernels
// (gemm_cluster.cu, sm_90+).

// One 32 x 32 tile of op(A) op(B) over K range [kbeg, kend): rows row0.., columns col0..;
// op(A)(i, p) = ta ? A[p * lda + i] : A[i * lda + p]; op(B)(p, j) = tb ? B[j * ldb + p] : B[p * ldb + j].
// 256 threads, 2 x 2 outputs per thread (rows ty*2.., columns tx*2.. with tx = thread % 16,
// ty = thread / 16) left in acc; K in steps of 32 through shared memory (As, Bs: [32][33]),
// loads coalesced along whichever dimension is contiguous, each sum in increasing k. Every
// thread of the block must call it (it synchronises the block).
__device__ __forceinline__ void tiled_tile(int m, int n, int kend,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        int row0, int col0, int kbeg, float (*As)[33], float (*Bs)[33], float acc[2][2]) {
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float c00 = 0.0f, c01 = 0.0f, c10 = 0.0f, c11 = 0.0f;
    // Software pipeline: the next K tile is loaded into registers while the current one is
    // multiplied out of shared memory, so global-memory latency overlaps the arithmetic.
    float ra[4], rb[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int e = threadIdx.x + r * 256;
        int i = ta ? e % 32 : e / 32, p = ta ? e / 32 : e % 32;
        int gi = row0 + i, gp = kbeg + p;
        ra[r] = (gi < m && gp < kend) ? (ta ? A[(long)gp * lda + gi] : A[(long)gi * lda + gp]) : 0.0f;
        int j = tb ? e / 32 : e % 32, q = tb ? e % 32 : e / 32;
        int gj = col0 + j, gq = kbeg + q;
        rb[r] = (gj < n && gq < kend) ? (tb ? B[(long)gj * ldb + gq] : B[(long)gq * ldb + gj]) : 0.0f;
    }
    for (int p0 = kbeg; p0 < kend; p0 += 32) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int e = threadIdx.x + r * 256;
            int i = ta ? e % 32 : e / 32, p = ta ? e / 32 : e % 32;
            As[p][i] = ra[r];
            int j = tb ? e / 32 : e % 32, q = tb ? e % 32 : e / 32;
            Bs[q][j] = rb[r];
        }
        __syncthreads();
        int p1 = p0 + 32;
        if (p1 < kend) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                int e = threadIdx.x + r * 256;
                int i = ta ? e % 32 : e / 32, p = ta ? e / 32 : e % 32;
                int gi = row0 + i, gp = p1 + p;
                ra[r] = (gi < m && gp < kend) ? (ta ? A[(long)gp * lda + gi] : A[(long)gi * lda + gp]) : 0.0f;
                int j = tb ? e / 32 : e % 32, q = tb ? e % 32 : e / 32;
                int gj = col0 + j, gq = p1 + q;
                rb[r] = (gj < n && gq < kend) ? (tb ? B[(long)gj * ldb + gq] : B[(long)gq * ldb + gj]) : 0.0f;
            }
        }
#pragma unroll
        for (int p = 0; p < 32; p++) {
            float a0 = As[p][ty * 2], a1 = As[p][ty * 2 + 1];
            float b0 = Bs[p][tx * 2], b1 = Bs[p][tx * 2 + 1];
            c00 += a0 * b0; c01 += a0 * b1; c10 += a1 * b0; c11 += a1 * b1;
        }
        __syncthreads();
    }
    acc[0][0] = c00; acc[0][1] = c01; acc[1][0] = c10; acc[1][1] = c11;
}

// bias[j] when there is a bias and 0 <= j < n, else 0. Kernels load it before their main loop
// (after the PDL wait), so that its latency hides under the loop rather than adding one more
// memory round trip after it.
__device__ __forceinline__ float bias_at(const float* bias, int j, int n) {
    return bias != nullptr && j >= 0 && j < n ? __ldg(bias + j) : 0.0f;
}

// The epilogue of one output: alpha * s (+ beta * *c, read only when beta != 0) (+ b, the
// output's bias loaded ahead by bias_at, when there is a bias), then ReLU if asked.
__device__ __forceinline__ float tiled_epilogue(float s, float alpha, float beta, const float* c,
        const float* bias, float b, int relu) {
    float v = alpha * s;
    if (beta != 0.0f) v += beta * *c;
    if (bias) v += b;
    if (relu) v = relu_f(v);
    return v;
}
