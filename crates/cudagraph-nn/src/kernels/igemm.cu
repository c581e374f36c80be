// Implicit-GEMM convolutions (NCHW activations, OIHW weights, fp32): cudagraph's own engine for
// conv forward, backward-data and backward-filter, used when cuDNN is missing or measures slower.
// Compiled as its own NVRTC module (see igemm.rs); launched only from the checked functions there.
//
// Each direction is one matrix product whose operands are gathered on the fly (no im2col buffer):
//   forward         Y[oc][n,p]  = W[oc][c,kh,kw] . X^[c,kh,kw][n,p]      M=OC, N=N*OH*OW, K=C*KH*KW
//   backward-data   dX[c][n,q]  = W'[c][oc,kh,kw] . dY^[oc,kh,kw][n,q]   M=C,  N=N*H*W,   K=OC*KH*KW
//   backward-filter dW[oc][c,r] = dY[oc][n,p] . X^'[n,p][c,r]            M=OC, N=C*KH*KW, K=N*OH*OW
// (p = oh*OW + ow, q = ih*W + iw, r = kh*KW + kw; X^ is the zero-padded patch matrix.)
//
// 256 threads per block; a block computes a BM x BN tile and each thread (BM/16) x (BN/16) outputs
// strided by 16 (conflict-free shared reads, coalesced writes). K advances 16 at a time through
// shared memory while the next step is prefetched into registers. Every thread sums its outputs
// in a fixed K order. With gridDim.z > 1 (split-K) each z writes its raw partial sums to
// partial[z][m][n] and conv_igemm_reduce adds them in z order: results never depend on scheduling.
// Index decoding uses multiply-shift division (FastDiv), valid for dividends in [0, 2^31).

#define IG_IDX ((long)blockIdx.x * blockDim.x + threadIdx.x)
#define IG_BK 16

struct FastDiv {
    unsigned d, mul, shr;
};

// Round-up multiply-shift divisor: q = (x * mul) >> (32 + shr) for 0 <= x < 2^31, d >= 1.
__device__ __forceinline__ FastDiv fast_div_init(int d) {
    FastDiv f;
    f.d = (unsigned)d;
    if (d <= 1) {
        f.mul = 0;
        f.shr = 0;
        return f;
    }
    unsigned l = 32 - __clz(d - 1);  // ceil(log2(d))
    unsigned p = 31 + l;
    f.mul = (unsigned)(((1ull << p) + (unsigned long long)d - 1ull) / (unsigned long long)d);
    f.shr = p - 32;
    return f;
}

__device__ __forceinline__ int fdiv(int x, const FastDiv& f) {
    return f.d <= 1 ? x : (int)(__umulhi((unsigned)x, f.mul) >> f.shr);
}

// OP: 0 forward (a = w, b = x, out = y, bias optional), 1 backward-data (a = w, b = dy,
// out = dx), 2 backward-filter (a = dy, b = x, out = dw).
template <int BM, int BN, int OP>
__device__ __forceinline__ void conv_igemm(const float* __restrict__ src_a,
        const float* __restrict__ src_b, float* __restrict__ out, const float* __restrict__ bias,
        float* __restrict__ partial, int N, int C, int H, int W, int OC, int KH, int KW, int OH,
        int OW, int S, int P, int kchunk) {
    constexpr int TM = BM / 16, TN = BN / 16;
    constexpr int LA = BM / 16;  // A elements each thread loads per K step (BM * 16 / 256)
    constexpr int LB = BN / 16;  // B elements each thread loads per K step
    constexpr int BSTEP = 256 / BN;  // OP 0/1: K rows between one thread's B loads
    __shared__ float As[IG_BK][BM + 1];
    __shared__ float Bs[IG_BK][BN + 1];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int KK = KH * KW, HW = H * W, OHW = OH * OW;
    const int M = OP == 1 ? C : OC;
    const int NC = OP == 0 ? N * OHW : (OP == 1 ? N * HW : C * KK);
    const int K = OP == 0 ? C * KK : (OP == 1 ? OC * KK : N * OHW);
    const FastDiv dKK = fast_div_init(KK), dKW = fast_div_init(KW), dOW = fast_div_init(OW),
                  dOHW = fast_div_init(OHW), dW = fast_div_init(W), dHW = fast_div_init(HW),
                  dS = fast_div_init(S);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int kbeg = blockIdx.z * kchunk;
    const int kend = (long)kbeg + kchunk < (long)K ? kbeg + kchunk : K;

    // OP 0/1: the one B column this thread loads, decoded once.
    const int bj = n0 + tid % BN;
    const bool bcol = bj < NC;
    long bbase = 0;
    int bi0 = 0, bi1 = 0;
    if (OP == 0 && bcol) {
        int n = fdiv(bj, dOHW), p = bj - n * OHW;
        int oh = fdiv(p, dOW), ow = p - oh * OW;
        bbase = (long)n * C * HW;
        bi0 = oh * S - P;
        bi1 = ow * S - P;
    } else if (OP == 1 && bcol) {
        int n = fdiv(bj, dHW), q = bj - n * HW;
        int ih = fdiv(q, dW), iw = q - ih * W;
        bbase = (long)n * OC * OHW;
        bi0 = ih + P;
        bi1 = iw + P;
    }
    // OP 2: this thread's LB B columns (c, kh, kw), decoded once.
    int cxo[LB], ckh[LB], ckw[LB];
    bool cv[LB];
#pragma unroll
    for (int r = 0; r < LB; r++) {
        cxo[r] = 0; ckh[r] = 0; ckw[r] = 0; cv[r] = false;
        if (OP == 2) {
            int j = n0 + ty + 16 * r;
            if (j < NC) {
                int c = fdiv(j, dKK), rr = j - c * KK;
                int kh = fdiv(rr, dKW);
                cxo[r] = c * HW;
                ckh[r] = kh;
                ckw[r] = rr - kh * KW;
                cv[r] = true;
            }
        }
    }

    float ra[LA], rb[LB];
    // Loads the K step starting at kt into ra/rb.
    auto load = [&](int kt) {
        const int k = kt + tx;  // A (all ops) and B of OP 2 take K index kt + tx
        const bool kin = k < kend;
        int a_oc = 0, a_rr = 0, k_n = 0, k_p = 0, k_oh = 0, k_ow = 0;
        if (OP == 1 && kin) {
            a_oc = fdiv(k, dKK);
            a_rr = k - a_oc * KK;
        }
        if (OP == 2 && kin) {
            k_n = fdiv(k, dOHW);
            k_p = k - k_n * OHW;
            k_oh = fdiv(k_p, dOW);
            k_ow = k_p - k_oh * OW;
        }
#pragma unroll
        for (int r = 0; r < LA; r++) {
            const int m = m0 + ty + 16 * r;
            float v = 0.0f;
            if (m < M && kin) {
                if (OP == 0) v = src_a[(long)m * K + k];
                else if (OP == 1) v = src_a[((long)a_oc * C + m) * KK + a_rr];
                else v = src_a[((long)k_n * OC + m) * OHW + k_p];
            }
            ra[r] = v;
        }
#pragma unroll
        for (int r = 0; r < LB; r++) {
            float v = 0.0f;
            if (OP == 2) {
                if (kin && cv[r]) {
                    int ih = k_oh * S - P + ckh[r], iw = k_ow * S - P + ckw[r];
                    if ((unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W)
                        v = src_b[(long)k_n * C * HW + cxo[r] + ih * W + iw];
                }
            } else {
                const int kb = kt + tid / BN + BSTEP * r;
                if (bcol && kb < kend) {
                    int t = fdiv(kb, dKK), rr = kb - t * KK;  // t = c (OP 0) or oc (OP 1)
                    int kh = fdiv(rr, dKW), kw = rr - kh * KW;
                    if (OP == 0) {
                        int ih = bi0 + kh, iw = bi1 + kw;
                        if ((unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W)
                            v = src_b[bbase + (long)t * HW + ih * W + iw];
                    } else {
                        int a = bi0 - kh, b = bi1 - kw;
                        if (a >= 0 && b >= 0) {
                            int oh = fdiv(a, dS), ow = fdiv(b, dS);
                            if (oh * S == a && ow * S == b && oh < OH && ow < OW)
                                v = src_b[bbase + (long)t * OHW + oh * OW + ow];
                        }
                    }
                }
            }
            rb[r] = v;
        }
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;

    if (kbeg < kend) load(kbeg);
    for (int kt = kbeg; kt < kend; kt += IG_BK) {
#pragma unroll
        for (int r = 0; r < LA; r++) As[tx][ty + 16 * r] = ra[r];
#pragma unroll
        for (int r = 0; r < LB; r++) {
            if (OP == 2) Bs[tx][ty + 16 * r] = rb[r];
            else Bs[tid / BN + BSTEP * r][tid % BN] = rb[r];
        }
        __syncthreads();
        if (kt + IG_BK < kend) load(kt + IG_BK);
#pragma unroll
        for (int kk = 0; kk < IG_BK; kk++) {
            float av[TM], bv[TN];
#pragma unroll
            for (int i = 0; i < TM; i++) av[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < TN; j++) bv[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < TN; j++) {
        const int col = n0 + tx + 16 * j;
        if (col >= NC) continue;
        long obase = 0;  // output offset of (m = 0, col)
        long ostride = 0;  // offset step per m
        if (OP == 0) {
            int n = fdiv(col, dOHW);
            obase = (long)n * OC * OHW + (col - n * OHW);
            ostride = OHW;
        } else if (OP == 1) {
            int n = fdiv(col, dHW);
            obase = (long)n * C * HW + (col - n * HW);
            ostride = HW;
        } else {
            obase = col;
            ostride = NC;
        }
#pragma unroll
        for (int i = 0; i < TM; i++) {
            const int m = m0 + ty + 16 * i;
            if (m >= M) continue;
            if (partial) {
                partial[((long)blockIdx.z * M + m) * NC + col] = acc[i][j];
            } else {
                float v = acc[i][j];
                if (OP == 0 && bias) v += bias[m];
                out[obase + (long)m * ostride] = v;
            }
        }
    }
}

#define IGEMM_KERNEL(NAME, BM, BN, OP)                                                         \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* a, const float* b,     \
            float* out, const float* bias, float* partial, int N, int C, int H, int W, int OC,  \
            int KH, int KW, int OH, int OW, int S, int P, int kchunk) {                        \
        conv_igemm<BM, BN, OP>(a, b, out, bias, partial, N, C, H, W, OC, KH, KW, OH, OW, S, P, \
                               kchunk);                                                        \
    }

IGEMM_KERNEL(conv_igemm_fwd_64x64, 64, 64, 0)
IGEMM_KERNEL(conv_igemm_fwd_32x128, 32, 128, 0)
IGEMM_KERNEL(conv_igemm_fwd_128x32, 128, 32, 0)
IGEMM_KERNEL(conv_igemm_bwd_data_64x64, 64, 64, 1)
IGEMM_KERNEL(conv_igemm_bwd_data_32x128, 32, 128, 1)
IGEMM_KERNEL(conv_igemm_bwd_data_128x32, 128, 32, 1)
IGEMM_KERNEL(conv_igemm_bwd_filter_64x64, 64, 64, 2)
IGEMM_KERNEL(conv_igemm_bwd_filter_32x128, 32, 128, 2)
IGEMM_KERNEL(conv_igemm_bwd_filter_128x32, 128, 32, 2)

// Sums the split-K partials partial[z][m][n] (z = 0 .. splits-1) and writes them to the
// convolution's output layout (with the bias for the forward direction). Block (blockDim.x
// outputs) x (blockDim.y groups of splits): thread (tx, ty) adds z = ty, ty + G, ... in order,
// then thread (tx, 0) adds the G group sums in order — a fixed order, so results never depend on
// scheduling, and few outputs with many splits (a weight gradient reduced over 512 splits) still
// spread over many threads.
extern "C" __global__ void conv_igemm_reduce(const float* partial, int splits, float* out,
        const float* bias, int op, int N, int C, int H, int W, int OC, int KH, int KW, int OH,
        int OW) {
    __shared__ float group_sum[256];
    const int KK = KH * KW, HW = H * W, OHW = OH * OW;
    const int M = op == 1 ? C : OC;
    const int NC = op == 0 ? N * OHW : (op == 1 ? N * HW : C * KK);
    const long total = (long)M * NC;
    const int G = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const long e = (long)blockIdx.x * blockDim.x + tx;
    float s = 0.0f;
    if (e < total) {
#pragma unroll 4
        for (int z = ty; z < splits; z += G) s += partial[(long)z * total + e];
    }
    if (G > 1) {
        group_sum[ty * blockDim.x + tx] = s;
        __syncthreads();
        if (ty != 0) return;
        s = 0.0f;
        for (int g = 0; g < G; g++) s += group_sum[g * blockDim.x + tx];
    }
    if (e >= total) return;
    const int m = (int)(e / NC), col = (int)(e - (long)m * NC);
    if (op == 0) {
        int n = col / OHW;
        if (bias) s += bias[m];
        out[((long)n * OC + m) * OHW + (col - n * OHW)] = s;
    } else if (op == 1) {
        int n = col / HW;
        out[((long)n * C + m) * HW + (col - n * HW)] = s;
    } else {
        out[e] = s;
    }
}
