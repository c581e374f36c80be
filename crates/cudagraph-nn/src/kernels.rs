//! The NN layer's own CUDA kernels (elementwise, reductions, losses, optimizers, conv, pooling),
//! compiled once per device with NVRTC (and cached on disk by the core), plus the per-device
//! context [`Nn`] that holds them with the cuBLAS handle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudagraph::{Device, Function};

use crate::blas::Blas;
use crate::error::Result;

pub const SOURCE: &str = r#"
#define IDX (blockIdx.x * blockDim.x + threadIdx.x)

// Block-wide sum (blockDim.x a power of two, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float s[1024];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
        __syncthreads();
    }
    float r = s[0];
    __syncthreads();
    return r;
}

// Tiled SGEMM for the small, latency-bound products of small-batch work (cuBLAS launches too
// few blocks there): C[m x n] = alpha * op(A) op(B) + beta * C (+ bias[j]) (ReLU), row-major.
// op(A)(i, p) = ta ? A[p * lda + i] : A[i * lda + p]; op(B)(p, j) = tb ? B[j * ldb + p] : B[p * ldb + j].
// 256 threads, 32 x 32 outputs per block (2 x 2 per thread), K in steps of 32 through shared
// memory, loads coalesced along whichever dimension is contiguous. Sums run in a fixed order.
// Split-K: blockIdx.z takes K range [z * kc, (z + 1) * kc); with `partial` set, raw sums go to
// partial[z][i][j] and splitk_reduce applies the epilogue (a fixed summation order: results do
// not depend on scheduling).
extern "C" __global__ void sgemm_tiled(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    __shared__ float As[32][33];
    __shared__ float Bs[32][33];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int row0 = blockIdx.y * 32, col0 = blockIdx.x * 32;
    float c00 = 0.0f, c01 = 0.0f, c10 = 0.0f, c11 = 0.0f;
    int kbeg = blockIdx.z * kc;
    int kend = min(k, kbeg + kc);
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
    float acc[2][2] = {{c00, c01}, {c10, c11}};
#pragma unroll
    for (int di = 0; di < 2; di++)
#pragma unroll
        for (int dj = 0; dj < 2; dj++) {
            int i = row0 + ty * 2 + di, j = col0 + tx * 2 + dj;
            if (i < m && j < n && partial) {
                partial[((long)blockIdx.z * m + i) * n + j] = acc[di][dj];
            } else if (i < m && j < n) {
                float v = alpha * acc[di][dj];
                if (beta != 0.0f) v += beta * C[(long)i * n + j];
                if (bias) v += bias[j];
                if (relu) v = fmaxf(v, 0.0f);
                C[(long)i * n + j] = v;
            }
        }
}

// The forward layout only: C[m x n] = act(A[m x k] . B[n x k]^T + bias), A and B row-major
// with leading dimension k. One kernel, no reduce node: a block owns 32 x 32 outputs and its 8
// warps split K; each warp streams 32-wide K chunks of its slice through private shared memory
// (next chunk prefetched into registers), each lane keeps a 4 x 8 register tile, and the 8
// partial tiles are summed in shared memory in a fixed order at the end.
extern "C" __global__ void sgemm_nt_warpk(int m, int n, int k, const float* A, const float* B,
        float* C, const float* bias, int relu) {
    // Per warp: A and B chunks of [16 k][33] (one pad column against bank conflicts); the same
    // memory then holds the 8 partial 32 x 32 tiles for the final sum.
    __shared__ float smem[8 * 1056];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int row0 = blockIdx.y * 32, col0 = blockIdx.x * 32;
    float* As = smem + warp * 1056;
    float* Bs = smem + warp * 1056 + 528;
    // K slice of this warp, in chunks of 16.
    int per = ((k + 7) / 8 + 15) / 16 * 16;
    int kb = warp * per, ke = min(k, kb + per);
    int ri = lane / 4, cj = lane % 4;      // rows ri*4..+3, cols cj*8..+7
    float acc[4][8];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 8; b++) acc[a][b] = 0.0f;
    // Each chunk: 16 k x 32 rows of A and 16 k x 32 cols of B = 512 + 512 floats, 16 + 16 per lane.
    float ra[16], rb[16];
#pragma unroll
    for (int r = 0; r < 16; r++) {
        int e = lane + 32 * r;             // 0..511: row = e / 16, kk = e % 16
        int i = e / 16, kk = e % 16;
        int gk = kb + kk;
        ra[r] = (row0 + i < m && gk < ke) ? A[(long)(row0 + i) * k + gk] : 0.0f;
        rb[r] = (col0 + i < n && gk < ke) ? B[(long)(col0 + i) * k + gk] : 0.0f;
    }
    for (int k0 = kb; k0 < ke; k0 += 16) {
#pragma unroll
        for (int r = 0; r < 16; r++) {
            int e = lane + 32 * r;
            int i = e / 16, kk = e % 16;
            As[kk * 33 + i] = ra[r];
            Bs[kk * 33 + i] = rb[r];
        }
        __syncwarp();
        int k1 = k0 + 16;
        if (k1 < ke) {
#pragma unroll
            for (int r = 0; r < 16; r++) {
                int e = lane + 32 * r;
                int i = e / 16, kk = e % 16;
                int gk = k1 + kk;
                ra[r] = (row0 + i < m && gk < ke) ? A[(long)(row0 + i) * k + gk] : 0.0f;
                rb[r] = (col0 + i < n && gk < ke) ? B[(long)(col0 + i) * k + gk] : 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            float av[4], bv[8];
#pragma unroll
            for (int a = 0; a < 4; a++) av[a] = As[kk * 33 + ri * 4 + a];
#pragma unroll
            for (int b = 0; b < 8; b++) bv[b] = Bs[kk * 33 + cj * 8 + b];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 8; b++) acc[a][b] += av[a] * bv[b];
        }
        __syncwarp();
    }
    __syncthreads();
    // Partial tiles of the 8 warps, then a fixed-order sum.
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 8; b++) smem[warp * 1024 + (ri * 4 + a) * 32 + cj * 8 + b] = acc[a][b];
    __syncthreads();
    for (int o = threadIdx.x; o < 1024; o += 256) {
        int i = row0 + o / 32, j = col0 + o % 32;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) v += smem[w * 1024 + o];
        if (i < m && j < n) {
            if (bias) v += bias[j];
            if (relu) v = fmaxf(v, 0.0f);
            C[(long)i * n + j] = v;
        }
    }
}

extern "C" __global__ void splitk_reduce(const float* partial, int splits, float* C, int m, int n,
        float alpha, float beta, const float* bias, int relu) {
    long e = IDX;
    long mn = (long)m * n;
    if (e >= mn) return;
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s += partial[z * mn + e];
    float v = alpha * s;
    if (beta != 0.0f) v += beta * C[e];
    if (bias) v += bias[e % n];
    if (relu) v = fmaxf(v, 0.0f);
    C[e] = v;
}

extern "C" __global__ void bias_act(float* y, const float* b, int rows, int cols, int relu) {
    long i = IDX;
    if (i < (long)rows * cols) {
        float v = y[i] + b[i % cols];
        y[i] = relu ? fmaxf(v, 0.0f) : v;
    }
}

extern "C" __global__ void relu_fwd(const float* x, float* y, long n) {
    long i = IDX;
    if (i < n) y[i] = fmaxf(x[i], 0.0f);
}

// dx = dy where y > 0 (y is the ReLU output).
extern "C" __global__ void relu_bwd(const float* dy, const float* y, float* dx, long n) {
    long i = IDX;
    if (i < n) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

extern "C" __global__ void add_inplace(float* a, const float* b, long n) {
    long i = IDX;
    if (i < n) a[i] += b[i];
}

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
extern "C" __global__ void ce_fwd(const float* logits, const int* tgt, float* probs, float* loss, int rows, int cols) {
    float acc = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const float* z = logits + (long)r * cols;
        float m = z[0];
        for (int c = 1; c < cols; c++) m = fmaxf(m, z[c]);
        float s = 0.0f;
        for (int c = 0; c < cols; c++) s += expf(z[c] - m);
        for (int c = 0; c < cols; c++) probs[(long)r * cols + c] = expf(z[c] - m) / s;
        acc += logf(s) + m - z[tgt[r]];
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) loss[0] = acc / rows;
}

extern "C" __global__ void ce_bwd(const float* probs, const int* tgt, const float* dloss, float* dz, int rows, int cols) {
    long i = IDX;
    if (i < (long)rows * cols) {
        int r = i / cols, c = i % cols;
        dz[i] = (probs[i] - (c == tgt[r] ? 1.0f : 0.0f)) * dloss[0] / rows;
    }
}

// SGD with momentum and weight decay (PyTorch's update; the momentum buffer starts at zero,
// which equals PyTorch's first-step copy when dampening is 0).
extern "C" __global__ void sgd_step(float* w, const float* g, float* buf, long n, float lr, float momentum, float wd) {
    long i = IDX;
    if (i < n) {
        float d = g[i] + wd * w[i];
        if (momentum != 0.0f) { buf[i] = momentum * buf[i] + d; d = buf[i]; }
        w[i] -= lr * d;
    }
}

extern "C" __global__ void step_inc(float* step) { step[0] += 1.0f; }

// Adam / AdamW with the step count on the device (PyTorch's capturable=True).
extern "C" __global__ void adam_step(float* w, const float* g, float* m, float* v, const float* step, long n,
                                     float lr, float b1, float b2, float eps, float wd, int decoupled) {
    long i = IDX;
    if (i < n) {
        float t = step[0];
        float gi = g[i];
        if (decoupled) w[i] -= lr * wd * w[i]; else gi += wd * w[i];
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        float mh = m[i] / (1.0f - powf(b1, t));
        float vh = v[i] / (1.0f - powf(b2, t));
        w[i] -= lr * mh / (sqrtf(vh) + eps);
    }
}

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
// (read as broadcasts), and each channel's writes are coalesced across the warp.
extern "C" __global__ void conv2d_fwd_small(const float* x, const float* w, const float* b, float* y,
        int N, int C, int H, int W, int OC, int KH, int KW, int OH, int OW, int stride, int pad) {
    extern __shared__ float sw[];
    int ckk = C * KH * KW;
    for (int j = threadIdx.x; j < OC * ckk; j += blockDim.x) sw[j] = w[j];
    __syncthreads();
    long i = IDX;
    if (i >= (long)N * OH * OW) return;
    int ow = i % OW; long t = i / OW;
    int oh = t % OH; int n = t / OH;
    float xv[32];
#pragma unroll
    for (int j = 0; j < 32; j++) {
        float v = 0.0f;
        if (j < ckk) {
            int kw = j % KW; int r = j / KW;
            int kh = r % KH; int c = r / KH;
            int ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
            if (ih >= 0 && ih < H && iw >= 0 && iw < W) v = x[(((long)n * C + c) * H + ih) * W + iw];
        }
        xv[j] = v;
    }
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

// Max pooling over planes (N*C of them), window K, stride S; idx keeps the argmax.
extern "C" __global__ void maxpool_fwd(const float* x, float* y, int* idx, int planes, int H, int W, int K, int S, int OH, int OW) {
    long i = IDX;
    if (i >= (long)planes * OH * OW) return;
    int ow = i % OW; long t = i / OW;
    int oh = t % OH; int p = t / OH;
    float best = -3.402823466e38f; int arg = 0;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++) {
            int h = oh * S + a, w = ow * S + b;
            if (h < H && w < W) {
                int j = (p * H + h) * W + w;
                if (x[j] > best) { best = x[j]; arg = j; }
            }
        }
    y[i] = best; idx[i] = arg;
}

extern "C" __global__ void maxpool_bwd(const float* dy, const int* idx, float* dx, long n) {
    long i = IDX;
    if (i < n) atomicAdd(&dx[idx[i]], dy[i]);
}
"#;

/// The NN kernels of one device.
pub struct Kernels {
    pub sgemm_tiled: Function,
    pub splitk_reduce: Function,
    pub sgemm_nt_warpk: Function,
    pub bias_act: Function,
    pub relu_fwd: Function,
    pub relu_bwd: Function,
    pub add_inplace: Function,
    pub col_sum: Function,
    pub channel_sum: Function,
    pub mse_partial: Function,
    pub sum_partials: Function,
    pub mse_bwd: Function,
    pub ce_fwd: Function,
    pub ce_bwd: Function,
    pub sgd_step: Function,
    pub step_inc: Function,
    pub adam_step: Function,
    pub conv2d_fwd: Function,
    pub conv2d_fwd_small: Function,
    pub conv2d_bwd_input: Function,
    pub conv2d_bwd_weight: Function,
    pub maxpool_fwd: Function,
    pub maxpool_bwd: Function,
}

/// Per-device NN context: kernels and the cuBLAS handle. Created on first use.
pub struct Nn {
    pub k: Kernels,
    pub blas: Blas,
}

type Registry = Mutex<HashMap<usize, (Device, Arc<Nn>)>>;

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Nn {
    /// The context of `device` (keyed by its allocator, so each `Device::open` gets its own).
    pub fn get(device: &Device) -> Result<Arc<Nn>> {
        let key = Arc::as_ptr(device.allocator()) as usize;
        let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, nn)) = r.get(&key) {
            return Ok(nn.clone());
        }
        let m = device.compile("cudagraph_nn", SOURCE)?;
        let f = |name: &str| m.function(name);
        let k = Kernels {
            sgemm_tiled: f("sgemm_tiled")?,
            splitk_reduce: f("splitk_reduce")?,
            sgemm_nt_warpk: f("sgemm_nt_warpk")?,
            bias_act: f("bias_act")?,
            relu_fwd: f("relu_fwd")?,
            relu_bwd: f("relu_bwd")?,
            add_inplace: f("add_inplace")?,
            col_sum: f("col_sum")?,
            channel_sum: f("channel_sum")?,
            mse_partial: f("mse_partial")?,
            sum_partials: f("sum_partials")?,
            mse_bwd: f("mse_bwd")?,
            ce_fwd: f("ce_fwd")?,
            ce_bwd: f("ce_bwd")?,
            sgd_step: f("sgd_step")?,
            step_inc: f("step_inc")?,
            adam_step: f("adam_step")?,
            conv2d_fwd: f("conv2d_fwd")?,
            conv2d_fwd_small: f("conv2d_fwd_small")?,
            conv2d_bwd_input: f("conv2d_bwd_input")?,
            conv2d_bwd_weight: f("conv2d_bwd_weight")?,
            maxpool_fwd: f("maxpool_fwd")?,
            maxpool_bwd: f("maxpool_bwd")?,
        };
        let nn = Arc::new(Nn {
            k,
            blas: Blas::new(device)?,
        });
        // The registry holds a Device clone so the key (allocator address) stays unique.
        r.insert(key, (device.clone(), nn.clone()));
        Ok(nn)
    }
}
