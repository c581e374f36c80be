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
            if (i < m && j < n) C[(long)i * n + j] = tiled_epilogue(acc[x][y], alpha, beta, C + (long)i * n + j, bias, bias_at(bias, j, n), relu);
        }
}

#define PROBE(name, BM, BN, TM, TN, BK, VEC, STR) \
extern "C" __global__ void name(int m, int n, int k, float alpha, const float* A, int lda, int ta, \
        const float* B, int ldb, int tb, float beta, float* C, const float* bias, int relu, int kc, float* partial) { \
    pg<BM, BN, TM, TN, BK, VEC, STR>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu); }

// (not probed) probe_64x64_4x4_k16 64 64 256
PROBE(probe_64x64_4x4_k16, 64, 64, 4, 4, 16, false, false)
// (not probed) probe_64x64_4x4_k16v 64 64 256
PROBE(probe_64x64_4x4_k16v, 64, 64, 4, 4, 16, true, false)
// (not probed) probe_64x64_4x4_k32v 64 64 256
PROBE(probe_64x64_4x4_k32v, 64, 64, 4, 4, 32, true, false)
// PROBE probe_64x64_8x4_k16v 64 64 128
PROBE(probe_64x64_8x4_k16v, 64, 64, 8, 4, 16, true, true)
// (not probed) probe_64x64_8x8_k16v 64 64 64
PROBE(probe_64x64_8x8_k16v, 64, 64, 8, 8, 16, true, true)
// (not probed) probe_64x32_4x4_k16v 64 32 128
PROBE(probe_64x32_4x4_k16v, 64, 32, 4, 4, 16, true, false)
// (not probed) probe_128x64_8x4_k16v 128 64 256
PROBE(probe_128x64_8x4_k16v, 128, 64, 8, 4, 16, true, true)
// (not probed) probe_128x128_8x8_k8v 128 128 256
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

// Independent K groups: group g (64 threads) streams its own K range [g*kg, (g+1)*kg) through
// private double-buffered shared memory (BKG deep), synchronising only its own two warps
// (named barrier 1 + g); one block barrier before the fixed-order reduction of reg_gemm.
template <bool VEC, int G, int BKG>
__device__ __forceinline__ void regi_gemm(int m, int n, int k, float alpha,
        const float* __restrict__ A, int lda, int ta, const float* __restrict__ B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    constexpr int BM = 64, BN = 64, LD = 68, THREADS = 64 * G, STAGE = BKG * LD;
    constexpr int LS = BM * BKG / 64, LV = LS / 4;
    __shared__ __align__(16) float smem[(G * 4 * STAGE > 2 * BM * BN) ? G * 4 * STAGE : 2 * BM * BN];
    const int tid = threadIdx.x, g = tid / 64, t = tid % 64, tx = t % 8, ty = t / 8;
    float* const As = smem + g * 4 * STAGE;
    float* const Bs = As + 2 * STAGE;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int kbeg = blockIdx.z * kc, kend = min(k, kbeg + kc);
    const int kg = ((kend - kbeg + G - 1) / G + BKG - 1) / BKG * BKG;
    const int gb = kbeg + g * kg, ge = min(kend, gb + kg);
    float ra[LS], rb[LS];
    auto bar = [&]() { asm volatile("bar.sync %0, 64;" :: "r"(1 + g) : "memory"); };
    auto load = [&](int p0) {
        if (VEC) {
#pragma unroll
            for (int r = 0; r < LV; r++) {
                int e = t + r * 64;
                int i = ta ? (e % 16) * 4 : e / (BKG / 4), p = ta ? e / 16 : (e % (BKG / 4)) * 4;
                int gi = row0 + i, gp = p0 + p;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (gi < m && gp < ge)
                    v = *reinterpret_cast<const float4*>(ta ? A + (long)gp * lda + gi : A + (long)gi * lda + gp);
                ra[4 * r] = v.x; ra[4 * r + 1] = v.y; ra[4 * r + 2] = v.z; ra[4 * r + 3] = v.w;
                int j = tb ? e / (BKG / 4) : (e % 16) * 4, q = tb ? (e % (BKG / 4)) * 4 : e / 16;
                int gj = col0 + j, gq = p0 + q;
                float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (gj < n && gq < ge)
                    w = *reinterpret_cast<const float4*>(tb ? B + (long)gj * ldb + gq : B + (long)gq * ldb + gj);
                rb[4 * r] = w.x; rb[4 * r + 1] = w.y; rb[4 * r + 2] = w.z; rb[4 * r + 3] = w.w;
            }
        } else {
#pragma unroll
            for (int r = 0; r < LS; r++) {
                int e = t + r * 64;
                int i = ta ? e % BM : e / BKG, p = ta ? e / BM : e % BKG;
                int gi = row0 + i, gp = p0 + p;
                ra[r] = (gi < m && gp < ge) ? (ta ? A[(long)gp * lda + gi] : A[(long)gi * lda + gp]) : 0.0f;
                int j = tb ? e / BKG : e % BN, q = tb ? e % BKG : e / BN;
                int gj = col0 + j, gq = p0 + q;
                rb[r] = (gj < n && gq < ge) ? (tb ? B[(long)gj * ldb + gq] : B[(long)gq * ldb + gj]) : 0.0f;
            }
        }
    };
    auto store = [&](int buf) {
        float* as = As + buf * STAGE;
        float* bs = Bs + buf * STAGE;
        if (VEC) {
#pragma unroll
            for (int r = 0; r < LV; r++) {
                int e = t + r * 64;
                int i = ta ? (e % 16) * 4 : e / (BKG / 4), p = ta ? e / 16 : (e % (BKG / 4)) * 4;
                if (ta) {
                    *reinterpret_cast<float4*>(as + p * LD + i) = make_float4(ra[4 * r], ra[4 * r + 1], ra[4 * r + 2], ra[4 * r + 3]);
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) as[(p + c) * LD + i] = ra[4 * r + c];
                }
                int j = tb ? e / (BKG / 4) : (e % 16) * 4, q = tb ? (e % (BKG / 4)) * 4 : e / 16;
                if (!tb) {
                    *reinterpret_cast<float4*>(bs + q * LD + j) = make_float4(rb[4 * r], rb[4 * r + 1], rb[4 * r + 2], rb[4 * r + 3]);
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) bs[(q + c) * LD + j] = rb[4 * r + c];
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < LS; r++) {
                int e = t + r * 64;
                int i = ta ? e % BM : e / BKG, p = ta ? e / BM : e % BKG;
                as[p * LD + i] = ra[r];
                int j = tb ? e / BKG : e % BN, q = tb ? e % BKG : e / BN;
                bs[q * LD + j] = rb[r];
            }
        }
    };
    float acc[8][8];
#pragma unroll
    for (int x = 0; x < 8; x++)
#pragma unroll
        for (int y = 0; y < 8; y++) acc[x][y] = 0.0f;
    if (gb < ge) {
        load(gb);
        store(0);
    }
    bar();
    int buf = 0;
    for (int p0 = gb; p0 < ge; p0 += BKG) {
        const bool more = p0 + BKG < ge;
        if (more) load(p0 + BKG);
        const float* as = As + buf * STAGE;
        const float* bs = Bs + buf * STAGE;
#pragma unroll
        for (int p = 0; p < BKG; p++) {
            float4 a0 = *reinterpret_cast<const float4*>(as + p * LD + ty * 4);
            float4 a1 = *reinterpret_cast<const float4*>(as + p * LD + 32 + ty * 4);
            float4 b0 = *reinterpret_cast<const float4*>(bs + p * LD + tx * 4);
            float4 b1 = *reinterpret_cast<const float4*>(bs + p * LD + 32 + tx * 4);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int x = 0; x < 8; x++)
#pragma unroll
                for (int y = 0; y < 8; y++) acc[x][y] = fmaf(a[x], b[y], acc[x][y]);
        }
        if (more) store(buf ^ 1);
        bar();
        buf ^= 1;
    }
    __syncthreads();
    reg_sum_groups<G>(smem, acc, g, tx, ty);
    // The library's reg_store takes this thread's bias (column blockIdx.x * 64 + tid % 64).
    reg_store(smem, THREADS, m, n, alpha, beta, C, bias,
              bias_at(partial ? nullptr : bias, blockIdx.x * 64 + threadIdx.x % 64, n), relu, partial);
}

#define PROBEI(name, LB, VEC, G, BKG) \
extern "C" __global__ void LB name(int m, int n, int k, float alpha, const float* A, int lda, int ta, \
        const float* B, int ldb, int tb, float beta, float* C, const float* bias, int relu, int kc, float* partial) { \
    regi_gemm<VEC, G, BKG>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial); }

// PROBE probe_ind_g8_k4 64 64 512
PROBEI(probe_ind_g8_k4, __launch_bounds__(512, 1), true, 8, 4)
// PROBE probe_ind_g4_k8 64 64 256
PROBEI(probe_ind_g4_k8, , true, 4, 8)
// PROBE probe_ind_g4_k8_lb2 64 64 256
PROBEI(probe_ind_g4_k8_lb2, __launch_bounds__(256, 2), true, 4, 8)
// PROBE probe_ind_g4_k4 64 64 256
PROBEI(probe_ind_g4_k4, , true, 4, 4)
// PROBE probe_ind_g2_k16 64 64 128
PROBEI(probe_ind_g2_k16, , true, 2, 16)
