// Half-precision convolution helpers (module cudagraph_nn_conv_lowp): layout transposes
// between NCHW and NHWC (and OIHW and OHWI weights), widening to f32 on the way where asked;
// the bias and ReLU after a convolution that did not fuse them; and direct convolutions in all
// three directions — the engine of last resort, for shapes no cuDNN engine takes —, every sum
// in f32.
//
// Compiled after cast.cu, whose bf16_t / f16_t types and to_f32 / from_f32 conversions it uses
// (the NVRTC compile has no include path): narrowing rounds to nearest even (inf past the
// largest finite value, canonical NaN 0x7FFF), widening is exact. Same-type "conversions" are
// bit copies, so a transpose moves bits.

template <typename From, typename To>
__device__ __forceinline__ To convert(From x) { return from_f32<To>(to_f32(x)); }
template <> __device__ __forceinline__ bf16_t convert<bf16_t, bf16_t>(bf16_t x) { return x; }
template <> __device__ __forceinline__ f16_t convert<f16_t, f16_t>(f16_t x) { return x; }
template <> __device__ __forceinline__ float convert<float, float>(float x) { return x; }

// ---------------------------------------------------------------------------------------------
// Transposes: dst[b][j][i] = src[b][i][j] for b < batches, i < rows, j < cols (a batch of
// rows × cols matrices). NCHW → NHWC is (batches, rows, cols) = (N, C, H·W); NHWC → NCHW is
// (N, H·W, C); OIHW → OHWI is (O, I, KH·KW) and back (O, KH·KW, I). Blocks of 32 × 8 threads
// move 32 × 32 tiles through shared memory; blockIdx.x strides over the tiles of a matrix,
// blockIdx.y over the batch (both loops uniform across a block, so the barriers are safe).

template <typename From, typename To>
__device__ __forceinline__ void transpose_batch(const From* __restrict__ src,
                                                To* __restrict__ dst, long long batches,
                                                int rows, int cols) {
    __shared__ From tile[32][33];
    const long long row_tiles = ((long long)rows + 31) / 32;
    const long long col_tiles = ((long long)cols + 31) / 32;
    const long long tiles = row_tiles * col_tiles;
    const long long plane = (long long)rows * cols;
    for (long long b = blockIdx.y; b < batches; b += gridDim.y) {
        const From* s = src + b * plane;
        To* d = dst + b * plane;
        for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
            const long long r0 = (t / col_tiles) * 32;
            const long long c0 = (t % col_tiles) * 32;
            for (int k = threadIdx.y; k < 32; k += 8) {
                long long r = r0 + k, c = c0 + threadIdx.x;
                if (r < rows && c < cols) tile[k][threadIdx.x] = s[r * cols + c];
            }
            __syncthreads();
            for (int k = threadIdx.y; k < 32; k += 8) {
                long long c = c0 + k, r = r0 + threadIdx.x;
                if (r < rows && c < cols) d[c * rows + r] = convert<From, To>(tile[threadIdx.x][k]);
            }
            __syncthreads();
        }
    }
}

// Each reads src and writes dst at b·rows·cols + (an index below rows·cols) only.
extern "C" __global__ void lowp_transpose_bf16_bf16(const bf16_t* src, bf16_t* dst,
                                                    long long batches, int rows, int cols) {
    transpose_batch<bf16_t, bf16_t>(src, dst, batches, rows, cols);
}
extern "C" __global__ void lowp_transpose_f16_f16(const f16_t* src, f16_t* dst,
                                                  long long batches, int rows, int cols) {
    transpose_batch<f16_t, f16_t>(src, dst, batches, rows, cols);
}
extern "C" __global__ void lowp_transpose_bf16_f32(const bf16_t* src, float* dst,
                                                   long long batches, int rows, int cols) {
    transpose_batch<bf16_t, float>(src, dst, batches, rows, cols);
}
extern "C" __global__ void lowp_transpose_f16_f32(const f16_t* src, float* dst,
                                                  long long batches, int rows, int cols) {
    transpose_batch<f16_t, float>(src, dst, batches, rows, cols);
}
extern "C" __global__ void lowp_transpose_f32_f32(const float* src, float* dst,
                                                  long long batches, int rows, int cols) {
    transpose_batch<float, float>(src, dst, batches, rows, cols);
}

// ---------------------------------------------------------------------------------------------
// Channel padding for few-channel inputs: dst[b][p][k] (NHWC with `pad` channels) = src's
// channel k of (b, p) for k < c, 0 for c <= k < pad; src is [b][c][p] (src_nhwc = 0: NCHW
// activations, OIHW weights) or [b][p][c] (NHWC, OHWI), b < batches, p < inner. One thread per
// (b, p), items = batches · inner; c <= pad <= 8 (the launcher checks).

template <typename T>
__device__ __forceinline__ void pad_channels_n(const T* __restrict__ src, T* __restrict__ dst,
                                               long long items, long long inner, int c,
                                               int pad, int src_nhwc) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < items;
         i += stride) {
        long long b = i / inner, p = i - b * inner;
        T* d = dst + i * pad;
        for (int k = 0; k < pad; k++) {
            T v;
            v.bits = 0;
            if (k < c) v = src_nhwc ? src[i * c + k] : src[(b * c + k) * inner + p];
            d[k] = v;
        }
    }
}

extern "C" __global__ void lowp_pad_channels_bf16(const bf16_t* src, bf16_t* dst,
                                                  long long items, long long inner, int c,
                                                  int pad, int src_nhwc) {
    pad_channels_n<bf16_t>(src, dst, items, inner, c, pad, src_nhwc);
}
extern "C" __global__ void lowp_pad_channels_f16(const f16_t* src, f16_t* dst, long long items,
                                                 long long inner, int c, int pad,
                                                 int src_nhwc) {
    pad_channels_n<f16_t>(src, dst, items, inner, c, pad, src_nhwc);
}

// ---------------------------------------------------------------------------------------------
// y[i] = relu?(y[i] + bias[c]) for i < n, computed in f32 and rounded once; c = (i / inner) %
// channels (NCHW: inner = H·W; NHWC: inner = 1). `bias` may be null (no addition). A NaN stays
// NaN through the ReLU.

template <typename T>
__device__ __forceinline__ void bias_act_n(T* __restrict__ y, const T* __restrict__ bias,
                                           long long n, long long inner, int channels,
                                           int relu) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = to_f32(y[i]);
        if (bias) v += to_f32(bias[(i / inner) % channels]);
        if (relu && v < 0.0f) v = 0.0f;
        y[i] = from_f32<T>(v);
    }
}

// The same over groups of eight elements moved as one 16-byte load and store (y 16-byte
// aligned, n a multiple of 8, and every group in one channel — NCHW with inner a multiple of
// 8 — or in eight consecutive channels — NHWC, inner 1, with channels a multiple of 8; the
// launcher checks all of it). One division per group, the same f32 sums and rounding as
// bias_act_n, so both give the same bits.
template <typename T>
struct alignas(16) Vec8 {
    T x[8];
};

template <typename T>
__device__ __forceinline__ void bias_act_8(T* __restrict__ y, const T* __restrict__ bias,
                                           long long groups, long long inner, int channels,
                                           int relu) {
    long long stride = (long long)gridDim.x * blockDim.x;
    Vec8<T>* y8 = reinterpret_cast<Vec8<T>*>(y);
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups;
         g += stride) {
        Vec8<T> v = y8[g];
        long long i = g * 8;
        // NHWC: channels c0 .. c0 + 7; NCHW: one channel c0 for all eight.
        int c0 = (int)((i / inner) % channels);
        int step = inner == 1 ? 1 : 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float f = to_f32(v.x[k]);
            if (bias) f += to_f32(bias[c0 + k * step]);
            if (relu && f < 0.0f) f = 0.0f;
            v.x[k] = from_f32<T>(f);
        }
        y8[g] = v;
    }
}

extern "C" __global__ void lowp_bias_act8_bf16(bf16_t* y, const bf16_t* bias, long long groups,
                                               long long inner, int channels, int relu) {
    bias_act_8<bf16_t>(y, bias, groups, inner, channels, relu);
}
extern "C" __global__ void lowp_bias_act8_f16(f16_t* y, const f16_t* bias, long long groups,
                                              long long inner, int channels, int relu) {
    bias_act_8<f16_t>(y, bias, groups, inner, channels, relu);
}

extern "C" __global__ void lowp_bias_act_bf16(bf16_t* y, const bf16_t* bias, long long n,
                                              long long inner, int channels, int relu) {
    bias_act_n<bf16_t>(y, bias, n, inner, channels, relu);
}
extern "C" __global__ void lowp_bias_act_f16(f16_t* y, const f16_t* bias, long long n,
                                             long long inner, int channels, int relu) {
    bias_act_n<f16_t>(y, bias, n, inner, channels, relu);
}

// ---------------------------------------------------------------------------------------------
// Direct convolutions. Activations [N, C, H, W] (nhwc = 0) or [N, H, W, C] (nhwc = 1), weights
// [K, C, R, S] or [K, R, S, C], outputs [N, K, OH, OW] or [N, OH, OW, K]; cross-correlation with
// stride, zero padding and dilation equal along both axes. Products and sums in f32 (fmaf, in
// a fixed order), one rounding into the output. Every input index is checked against the
// image, every output index is below the output's element count (the launchers check the
// buffers hold those counts and that h + 2·pad, w + 2·pad fit an int).

__device__ __forceinline__ long long act_at(int nhwc, int n, int c, int h, int w, int C, int H,
                                            int W) {
    return nhwc ? (((long long)n * H + h) * W + w) * C + c
                : (((long long)n * C + c) * H + h) * W + w;
}

__device__ __forceinline__ long long wt_at(int nhwc, int k, int c, int r, int s, int C, int R,
                                           int S) {
    return nhwc ? (((long long)k * R + r) * S + s) * C + c
                : (((long long)k * C + c) * R + r) * S + s;
}

// Splits a flat index of an activation-shaped tensor [n, c, h, w] (in its layout) into parts.
__device__ __forceinline__ void act_parts(int nhwc, long long i, int C, int H, int W, int& n,
                                          int& c, int& h, int& w) {
    if (nhwc) {
        c = (int)(i % C);
        i /= C;
        w = (int)(i % W);
        i /= W;
        h = (int)(i % H);
        n = (int)(i / H);
    } else {
        w = (int)(i % W);
        i /= W;
        h = (int)(i % H);
        i /= H;
        c = (int)(i % C);
        n = (int)(i / C);
    }
}

// One thread per output element y[n, k, oh, ow] (grid-stride).
template <typename T>
__device__ __forceinline__ void direct_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                           T* __restrict__ y, int N, int C, int H, int W, int K,
                                           int R, int S, int OH, int OW, int stride, int pad,
                                           int dil, int nhwc) {
    const long long total = (long long)N * K * OH * OW;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        int n, k, oh, ow;
        act_parts(nhwc, i, K, OH, OW, n, k, oh, ow);
        float acc = 0.0f;
        for (int c = 0; c < C; ++c) {
            for (int r = 0; r < R; ++r) {
                int ih = oh * stride - pad + r * dil;
                if (ih < 0 || ih >= H) continue;
                for (int s = 0; s < S; ++s) {
                    int iw = ow * stride - pad + s * dil;
                    if (iw < 0 || iw >= W) continue;
                    acc = fmaf(to_f32(x[act_at(nhwc, n, c, ih, iw, C, H, W)]),
                               to_f32(w[wt_at(nhwc, k, c, r, s, C, R, S)]), acc);
                }
            }
        }
        y[i] = from_f32<T>(acc);
    }
}

// One thread per input-gradient element dx[n, c, ih, iw] (gather form, grid-stride).
template <typename T>
__device__ __forceinline__ void direct_bwd_data(const T* __restrict__ dy,
                                                const T* __restrict__ w, T* __restrict__ dx,
                                                int N, int C, int H, int W, int K, int R, int S,
                                                int OH, int OW, int stride, int pad, int dil,
                                                int nhwc) {
    const long long total = (long long)N * C * H * W;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        int n, c, ih, iw;
        act_parts(nhwc, i, C, H, W, n, c, ih, iw);
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            for (int r = 0; r < R; ++r) {
                int th = ih + pad - r * dil;
                if (th < 0 || th % stride != 0) continue;
                int oh = th / stride;
                if (oh >= OH) continue;
                for (int s = 0; s < S; ++s) {
                    int tw = iw + pad - s * dil;
                    if (tw < 0 || tw % stride != 0) continue;
                    int ow = tw / stride;
                    if (ow >= OW) continue;
                    acc = fmaf(to_f32(dy[act_at(nhwc, n, k, oh, ow, K, OH, OW)]),
                               to_f32(w[wt_at(nhwc, k, c, r, s, C, R, S)]), acc);
                }
            }
        }
        dx[i] = from_f32<T>(acc);
    }
}

// One warp per weight-gradient element dw[k, c, r, s] (grid-stride over warps): its lanes
// take every 32nd (n, oh, ow), then the warp adds its lanes in a fixed tree, so the result
// does not depend on scheduling. Blocks must be a whole number of warps.
template <typename T, typename O>
__device__ __forceinline__ void direct_bwd_filter(const T* __restrict__ dy,
                                                  const T* __restrict__ x, O* __restrict__ dw,
                                                  int N, int C, int H, int W, int K, int R,
                                                  int S, int OH, int OW, int stride, int pad,
                                                  int dil, int nhwc) {
    const long long total = (long long)K * C * R * S;
    const long long pixels = (long long)N * OH * OW;
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; e < total;
         e += warps) {
        int k, c, r, s;
        // The weight's own layout: KCRS, or KRSC (c fastest).
        act_parts(nhwc, e, C, R, S, k, c, r, s);
        float acc = 0.0f;
        for (long long j = lane; j < pixels; j += 32) {
            int ow = (int)(j % OW);
            long long t = j / OW;
            int oh = (int)(t % OH);
            int n = (int)(t / OH);
            int ih = oh * stride - pad + r * dil;
            int iw = ow * stride - pad + s * dil;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            acc = fmaf(to_f32(dy[act_at(nhwc, n, k, oh, ow, K, OH, OW)]),
                       to_f32(x[act_at(nhwc, n, c, ih, iw, C, H, W)]), acc);
        }
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        if (lane == 0) dw[e] = from_f32<O>(acc);
    }
}

#define LOWP_DIRECT_ARGS                                                                    \
    int N, int C, int H, int W, int K, int R, int S, int OH, int OW, int stride, int pad,  \
        int dil, int nhwc
#define LOWP_DIRECT_PASS N, C, H, W, K, R, S, OH, OW, stride, pad, dil, nhwc

extern "C" __global__ void lowp_conv_fwd_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y,
                                              LOWP_DIRECT_ARGS) {
    direct_fwd<bf16_t>(x, w, y, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_fwd_f16(const f16_t* x, const f16_t* w, f16_t* y,
                                             LOWP_DIRECT_ARGS) {
    direct_fwd<f16_t>(x, w, y, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_bwd_data_bf16(const bf16_t* dy, const bf16_t* w,
                                                   bf16_t* dx, LOWP_DIRECT_ARGS) {
    direct_bwd_data<bf16_t>(dy, w, dx, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_bwd_data_f16(const f16_t* dy, const f16_t* w, f16_t* dx,
                                                  LOWP_DIRECT_ARGS) {
    direct_bwd_data<f16_t>(dy, w, dx, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_bwd_filter_bf16_bf16(const bf16_t* dy, const bf16_t* x,
                                                          bf16_t* dw, LOWP_DIRECT_ARGS) {
    direct_bwd_filter<bf16_t, bf16_t>(dy, x, dw, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_bwd_filter_f16_f16(const f16_t* dy, const f16_t* x,
                                                        f16_t* dw, LOWP_DIRECT_ARGS) {
    direct_bwd_filter<f16_t, f16_t>(dy, x, dw, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_bwd_filter_bf16_f32(const bf16_t* dy, const bf16_t* x,
                                                         float* dw, LOWP_DIRECT_ARGS) {
    direct_bwd_filter<bf16_t, float>(dy, x, dw, LOWP_DIRECT_PASS);
}
extern "C" __global__ void lowp_conv_bwd_filter_f16_f32(const f16_t* dy, const f16_t* x,
                                                        float* dw, LOWP_DIRECT_ARGS) {
    direct_bwd_filter<f16_t, float>(dy, x, dw, LOWP_DIRECT_PASS);
}
