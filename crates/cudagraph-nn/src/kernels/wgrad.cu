
// The weight gradient of a convolution with few outputs (OC x C*KH*KW at most 4096: few
// channels, the first layers of a network), where an implicit GEMM's 64 x 64 tiles would be
// mostly padding: dw[o][r] = sum over output pixels q of dy[q, o] * patch[q, r], r = (ci, ki, kj).
// Block z takes output pixels [z * chunk, min((z + 1) * chunk, N*OH*OW)) in tiles of 32: the
// tile's dy (OC x 32) and input patches (R x 32) go through shared memory (rows padded to 33
// against bank conflicts), and each of the 256 threads keeps up to 16 outputs e = tid + 256 * j,
// adding the tile's pixels in order. With one block the sums go to dw itself; otherwise to
// partial[z][OC * R], which conv_igemm_reduce (backward-filter layout) adds in a fixed order.
// Every index fits an int (checked on the host: N*C*H*W, N*OC*OH*OW and the pixel range).
#define WG_TP 32
extern "C" __global__ void conv_wgrad_small(const float* dy, const float* x, float* out, int N,
        int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int S, int P, int chunk) {
    extern __shared__ float wg_smem[];
    const int KK = KH * KW, R = C * KK, OHW = OH * OW, E = OC * R;
    const int Q = N * OHW;
    float* dys = wg_smem;                     // [OC][WG_TP + 1]
    float* xs = dys + OC * (WG_TP + 1);       // [R][WG_TP + 1]
    int* pix = (int*)(xs + R * (WG_TP + 1));  // [WG_TP][4]: dy offset (-1: none), x image, iy0, ix0
    const int tid = threadIdx.x;
    int oj[16], rj[16];
    int nj = 0;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int e = tid + 256 * j;
        oj[j] = e < E ? e / R : 0;
        rj[j] = e < E ? e - oj[j] * R : 0;
        nj += e < E;
    }
    float acc[16];
#pragma unroll
    for (int j = 0; j < 16; j++) acc[j] = 0.0f;
    const int qlo = blockIdx.x * chunk;
    const int qhi = min(qlo + chunk, Q);
    for (int t0 = qlo; t0 < qhi; t0 += WG_TP) {
        if (tid < WG_TP) {
            const int q = t0 + tid;
            if (q < qhi) {
                const int n = q / OHW, rem = q - n * OHW;
                const int oy = rem / OW, ox = rem - oy * OW;
                pix[tid * 4 + 0] = n * OC * OHW + rem;
                pix[tid * 4 + 1] = n * C * H * W;
                pix[tid * 4 + 2] = oy * S - P;
                pix[tid * 4 + 3] = ox * S - P;
            } else {
                pix[tid * 4 + 0] = -1;
            }
        }
        __syncthreads();
        for (int i = tid; i < OC * WG_TP; i += 256) {
            const int o = i / WG_TP, t = i - o * WG_TP;
            const int d = pix[t * 4];
            dys[o * (WG_TP + 1) + t] = d >= 0 ? dy[d + o * OHW] : 0.0f;
        }
        for (int i = tid; i < R * WG_TP; i += 256) {
            const int r = i / WG_TP, t = i - r * WG_TP;
            const int d = pix[t * 4];
            float v = 0.0f;
            if (d >= 0) {
                const int ci = r / KK, kr = r - ci * KK, ki = kr / KW, kj = kr - ki * KW;
                const int iy = pix[t * 4 + 2] + ki, ix = pix[t * 4 + 3] + kj;
                if (iy >= 0 && iy < H && ix >= 0 && ix < W) v = x[pix[t * 4 + 1] + (ci * H + iy) * W + ix];
            }
            xs[r * (WG_TP + 1) + t] = v;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if (j < nj) {
                const float* a = dys + oj[j] * (WG_TP + 1);
                const float* b = xs + rj[j] * (WG_TP + 1);
                float s = acc[j];
#pragma unroll
                for (int t = 0; t < WG_TP; t++) s = fmaf(a[t], b[t], s);
                acc[j] = s;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 16; j++)
        if (j < nj) out[(long)blockIdx.x * E + tid + 256 * j] = acc[j];
}
