// Probe variants of the register-blocked SGEMM (bench/probe/gemm_probe.py), sgemm_tiled's
// arguments; split-K ignored (kc = k). pg<BM, BN, TM, TN, BK, VEC, STRIDED>:
// VEC: float4 global loads along K of both operands (x·wᵀ layout, k % 4 == 0, aligned);
// STRIDED: a thread's TM rows are TM/4 groups of 4, BM/(TM/4) apart (TN likewise), so the
// float4 fragment reads of a warp cover contiguous shared memory.
template <int BM, int BN, int TM, int TN, int BK, bool VEC, bool STRIDED>
__device__ __forceinline__ void pg(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    constexpr int LA = BM * BK / THREADS, LB = BN * BK / THREADS;
    constexpr int VA = VEC ? LA / 4 : LA, VB = VEC ? LB / 4 : LB;
    __shared__ __align__(16) float As[2][BK][BM + 4];
    __shared__ __align__(16) float Bs[2][BK][BN + 4];
    const int tid = threadIdx.x;
    const int tx = tid % (BN / TN), ty = tid / (BN / TN);
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int kend = k;
    float4 ra[VA > 0 ? VA : 1], rb[VB > 0 ? VB : 1];
    float sa[LA], sb[LB];
    auto load = [&](int p0) {
        if (VEC) {
#pragma unroll
            for (int r = 0; r < VA; r++) {
                int e = tid + r * THREADS;           // float4 index: row e / (BK/4), k4 e % (BK/4)
                int i = e / (BK / 4), p = (e % (BK / 4)) * 4;
                int gi = row0 + i, gp = p0 + p;
                ra[r] = (gi < m && gp < kend) ? *reinterpret_cast<const float4*>(A + (long)gi * lda + gp) : make_float4(0, 0, 0, 0);
            }
#pragma unroll
            for (int r = 0; r < VB; r++) {
                int e = tid + r * THREADS;
                int j = e / (BK / 4), p = (e % (BK / 4)) * 4;
                int gj = col0 + j, gp = p0 + p;
                rb[r] = (gj < n && gp < kend) ? *reinterpret_cast<const float4*>(B + (long)gj * ldb + gp) : make_float4(0, 0, 0, 0);
            }
        } else {
#pragma unroll
            for (int r = 0; r < LA; r++) {
                int e = tid + r * THREADS;
                int i = ta ? e % BM : e / BK, p = ta ? e / BM : e % BK;
                int gi = row0 + i, gp = p0 + p;
                sa[r] = (gi < m && gp < kend) ? (ta ? A[(long)gp * lda + gi] : A[(long)gi * lda + gp]) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < LB; r++) {
                int e = tid + r * THREADS;
                int j = tb ? e / BK : e % BN, p = tb ? e % BK : e / BN;
                int gj = col0 + j, gp = p0 + p;
                sb[r] = (gj < n && gp < kend) ? (tb ? B[(long)gj * ldb + gp] : B[(long)gp * ldb + gj]) : 0.0f;
            }
        }
    };
    auto store = [&](int buf) {
        if (VEC) {
#pragma unroll
            for (int r = 0; r < VA; r++) {
                int e = tid + r * THREADS;
                int i = e / (BK / 4), p = (e % (BK / 4)) * 4;
                As[buf][p][i] = ra[r].x; As[buf][p + 1][i] = ra[r].y; As[buf][p + 2][i] = ra[r].z; As[buf][p + 3][i] = ra[r].w;
            }
#pragma unroll
            for (int r = 0; r < VB; r++) {
                int e = tid + r * THREADS;
                int j = e / (BK / 4), p = (e % (BK / 4)) * 4;
                Bs[buf][p][j] = rb[r].x; Bs[buf][p + 1][j] = rb[r].y; Bs[buf][p + 2][j] = rb[r].z; Bs[buf][p + 3][j] = rb[r].w;
            }
        } else {
#pragma unroll
            for (int r = 0; r < LA; r++) {
                int e = tid + r * THREADS;
                int i = ta ? e % BM : e / BK, p = ta ? e / BM : e % BK;
                As[buf][p][i] = sa[r];
            }
#pragma unroll
            for (int r = 0; r < LB; r++) {
                int e = tid + r * THREADS;
                int j = tb ? e / BK : e % BN, p = tb ? e % BK : e / BN;
                Bs[buf][p][j] = sb[r];
            }
        }
    };
    // Row of fragment element x: contiguous (ty*TM + x) or strided groups of 4.
    auto rowof = [&](int x) { return STRIDED ? (x / 4) * (BM / (TM / 4)) + ty * 4 + x % 4 : ty * TM + x; };
    auto colof = [&](int y) { return STRIDED ? (y / 4) * (BN / (TN / 4)) + tx * 4 + y % 4 : tx * TN + y; };
    float acc[TM][TN];
#pragma unroll
    for (int a = 0; a < TM; a++)
#pragma unroll
        for (int b = 0; b < TN; b++) acc[a][b] = 0.0f;
    load(0);
    store(0);
    __syncthreads();
    int buf = 0;
    for (int p0 = 0; p0 < kend; p0 += BK) {
        const bool more = p0 + BK < kend;
        if (more) load(p0 + BK);
#pragma unroll
        for (int p = 0; p < BK; p++) {
            float a[TM], b[TN];
#pragma unroll
            for (int v = 0; v < TM; v += 4) {
                float4 t = *reinterpret_cast<const float4*>(&As[buf][p][rowof(v)]);
                a[v] = t.x; a[v + 1] = t.y; a[v + 2] = t.z; a[v + 3] = t.w;
            }
#pragma unroll
            for (int v = 0; v < TN; v += 4) {
                float4 t = *reinterpret_cast<const float4*>(&Bs[buf][p][colof(v)]);
                b[v] = t.x; b[v + 1] = t.y; b[v + 2] = t.z; b[v + 3] = t.w;
            }
#pragma unroll
            for (int x = 0; x < TM; x++)
#pragma unroll
                for (int y = 0; y < TN; y++) acc[x][y] = fmaf(a[x], b[y], acc[x][y]);
        }
        if (more) store(buf ^ 1);
        __syncthreads();
        buf ^= 1;
    }
#pragma unroll
    for (int x = 0; x < TM; x++)
#pragma unroll
        for (int y = 0; y < TN; y++) {
            int i = row0 + rowof(x), j = col0 + colof(y);
            if (i < m && j < n) C[(long)i * n + j] = tiled_epilogue(acc[x][y], alpha, beta, C + (long)i * n + j, bias, j, relu);
        }
}

#define PROBE(name, BM, BN, TM, TN, BK, VEC, STR) \
extern "C" __global__ void name(int m, int n, int k, float alpha, const float* A, int lda, int ta, \
        const float* B, int ldb, int tb, float beta, float* C, const float* bias, int relu, int kc, float* partial) { \
    pg<BM, BN, TM, TN, BK, VEC, STR>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu); }

// PROBE probe_64x64_4x4_k16 64 64 256
PROBE(probe_64x64_4x4_k16, 64, 64, 4, 4, 16, false, false)
// PROBE probe_64x64_4x4_k16v 64 64 256
PROBE(probe_64x64_4x4_k16v, 64, 64, 4, 4, 16, true, false)
// PROBE probe_64x64_4x4_k32v 64 64 256
PROBE(probe_64x64_4x4_k32v, 64, 64, 4, 4, 32, true, false)
// PROBE probe_64x64_8x4_k16v 64 64 128
PROBE(probe_64x64_8x4_k16v, 64, 64, 8, 4, 16, true, true)
// PROBE probe_64x64_8x8_k16v 64 64 64
PROBE(probe_64x64_8x8_k16v, 64, 64, 8, 8, 16, true, true)
// PROBE probe_64x32_4x4_k16v 64 32 128
PROBE(probe_64x32_4x4_k16v, 64, 32, 4, 4, 16, true, false)
// PROBE probe_128x64_8x4_k16v 128 64 256
PROBE(probe_128x64_8x4_k16v, 128, 64, 8, 4, 16, true, true)
// PROBE probe_128x128_8x8_k8v 128 128 256
PROBE(probe_128x128_8x8_k8v, 128, 128, 8, 8, 8, true, true)
// PROBE probe_32x64_4x4_k32v 32 64 128
PROBE(probe_32x64_4x4_k32v, 32, 64, 4, 4, 32, true, false)

// PROBE probe_reg4_lb2 64 64 256
extern "C" __global__ void __launch_bounds__(256, 2) probe_reg4_lb2(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    reg_gemm<true, 4>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial);
}

// PROBE probe_reg4_g4 64 64 256
extern "C" __global__ void probe_reg4_g4(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    reg_gemm<true, 4>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial);
}
