// Direct convolution, NCHW, one thread per output element.
extern "C" __global__ void conv2d_fwd(const float* x, const float* w, const float* b, float* y,
        int N, int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int stride, int pad) {
    long i = IDX;
    long total = (long)N * OC * OH * OW;
    if (i >= total) return;
    int ow = i % OW; long t = i / OW;
    int oh = t % OH; t /= OH;
    int oc = t % OC; int n = t / OC;
    float acc = b ? b[oc] : 0.0f;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < KH; kh++) {
            int ih = oh * stride - pad + kh;
            if (ih < 0 || ih >= H) continue;
            for (int kw = 0; kw < KW; kw++) {
                int iw = ow * stride - pad + kw;
                if (iw < 0 || iw >= W) continue;
                acc += x[(((long)n * C + c) * H + ih) * W + iw] * w[((oc * C + c) * KH + kh) * KW + kw];
            }
        }
    y[i] = acc;
}

// Fast path for C*KH*KW <= 32 (e.g. 3 channels, 3x3): one thread per output pixel keeps its
// input patch in registers and produces every output channel; weights live in shared memory
// (read as broadcasts), and each channel's writes are coalesced across the warp. The patch is
// loaded before the weights are copied and the block waits at its barrier, so the two memory
// round trips overlap. KH = KW = 0: sizes from the arguments; otherwise compile-time sizes
// (no integer division per tap), instantiated below for 1x1, 3x3 and 5x5.
template <int KH_, int KW_>
__device__ __forceinline__ void conv_fwd_small_body(const float* x, const float* w, const float* b, float* y,
        int N, int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int stride, int pad) {
    extern __shared__ float sw[];
    if (KH_ > 0) { KH = KH_; KW = KW_; }
    const int ckk = C * KH * KW;
    const long i = IDX;
    const bool live = i < (long)N * OH * OW;
    int ow = 0, oh = 0, n = 0;
    if (live) {
        ow = i % OW; long t = i / OW;
        oh = t % OH; n = t / OH;
    }
    float xv[32];
#pragma unroll
    for (int j = 0; j < 32; j++) {
        float v = 0.0f;
        if (live && j < ckk) {
            int kw = j % KW; int r = j / KW;
            int kh = r % KH; int c = r / KH;
            int ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
            if (ih >= 0 && ih < H && iw >= 0 && iw < W) v = x[(((long)n * C + c) * H + ih) * W + iw];
        }
        xv[j] = v;
    }
    for (int j = threadIdx.x; j < OC * ckk; j += blockDim.x) sw[j] = w[j];
    __syncthreads();
    if (!live) return;
    long plane = (long)OH * OW;
    long base = (long)n * OC * plane + (long)oh * OW + ow;
    for (int oc = 0; oc < OC; oc++) {
        float acc = b ? b[oc] : 0.0f;
        const float* wr = sw + oc * ckk;
#pragma unroll
        for (int j = 0; j < 32; j++) if (j < ckk) acc += wr[j] * xv[j];
        y[base + oc * plane] = acc;
    }
}

#define CONV_SMALL_PARAMS const float* x, const float* w, const float* b, float* y, \
        int N, int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int stride, int pad
#define CONV_SMALL_ARGS x, w, b, y, N, C, H, W, OC, KH, KW, OH, OW, stride, pad
extern "C" __global__ void conv2d_fwd_small(CONV_SMALL_PARAMS) {
    conv_fwd_small_body<0, 0>(CONV_SMALL_ARGS);
}
extern "C" __global__ void conv2d_fwd_small_k1(CONV_SMALL_PARAMS) {
    conv_fwd_small_body<1, 1>(CONV_SMALL_ARGS);
}
extern "C" __global__ void conv2d_fwd_small_k3(CONV_SMALL_PARAMS) {
    conv_fwd_small_body<3, 3>(CONV_SMALL_ARGS);
}
extern "C" __global__ void conv2d_fwd_small_k5(CONV_SMALL_PARAMS) {
    conv_fwd_small_body<5, 5>(CONV_SMALL_ARGS);
}

// dx: one thread per input element, gathering from the outputs it touched.
extern "C" __global__ void conv2d_bwd_input(const float* dy, const float* w, float* dx,
        int N, int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int stride, int pad) {
    long i = IDX;
    long total = (long)N * C * H * W;
    if (i >= total) return;
    int iw = i % W; long t = i / W;
    int ih = t % H; t /= H;
    int c = t % C; int n = t / C;
    float acc = 0.0f;
    for (int oc = 0; oc < OC; oc++)
        for (int kh = 0; kh < KH; kh++) {
            int a = ih + pad - kh;
            if (a < 0 || a % stride) continue;
            int oh = a / stride;
            if (oh >= OH) continue;
            for (int kw = 0; kw < KW; kw++) {
                int bq = iw + pad - kw;
                if (bq < 0 || bq % stride) continue;
                int ow = bq / stride;
                if (ow >= OW) continue;
                acc += dy[(((long)n * OC + oc) * OH + oh) * OW + ow] * w[((oc * C + c) * KH + kh) * KW + kw];
            }
        }
    dx[i] = acc;
}

// dw: one block per weight element, reducing over N * OH * OW.
extern "C" __global__ void conv2d_bwd_weight(const float* dy, const float* x, float* dw,
        int N, int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int stride, int pad) {
    int widx = blockIdx.x;
    int kw = widx % KW; int t = widx / KW;
    int kh = t % KH; t /= KH;
    int c = t % C; int oc = t / C;
    float acc = 0.0f;
    long total = (long)N * OH * OW;
    for (long j = threadIdx.x; j < total; j += blockDim.x) {
        int ow = j % OW; long u = j / OW;
        int oh = u % OH; int n = u / OH;
        int ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
        if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
        acc += dy[(((long)n * OC + oc) * OH + oh) * OW + ow] * x[(((long)n * C + c) * H + ih) * W + iw];
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) dw[widx] = acc;
}
