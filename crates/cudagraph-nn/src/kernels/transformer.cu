// The transformer layers' elementwise and normalisation kernels: LayerNorm, RMSNorm, GELU
// (erf and tanh), SiLU, SwiGLU, rotary position embeddings and embedding lookup, forward and
// backward. One template per operation instantiated for float, bf16_t and f16_t (compiled
// after cast.cu: its types and its to_f32 / from_f32 conversions). Values are widened to f32,
// computed in f32 and rounded to nearest even once on store. Every reduction runs in a fixed
// order (per-thread strided sums, warp shuffles, then the warps in order): the same inputs give
// the same bits on every run, eager or replayed.

#define TF_LOOP(i, n)                                                                      \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// Threads of the row kernels (one block per row); the launchers use exactly this.
#define TF_ROW_THREADS 256

// The sum of every thread's v over a block of TF_ROW_THREADS threads in a fixed order: a
// butterfly of shuffles within each warp (every lane gets the same bits), then the warps'
// sums added in warp order by every thread; every thread gets the total. sh holds at least
// TF_ROW_THREADS / 32 floats; the block must not be inside a divergent branch.
__device__ __forceinline__ float tf_block_sum(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = sh[0];
#pragma unroll
    for (int w = 1; w < TF_ROW_THREADS / 32; w++) total += sh[w];
    __syncthreads();  // sh free for the next sum
    return total;
}

// ---- LayerNorm ----------------------------------------------------------------------------

// Rows (one warp each) per block of ln_fwd; the launcher uses TF_ROW_THREADS threads.
#define TF_LN_ROWS (TF_ROW_THREADS / 32)

// A butterfly sum over the warp: every lane gets the same bits.
__device__ __forceinline__ float tf_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// y[r, :] = (x[r, :] - mean) · rstd · w + b for row r = blockIdx.x · TF_LN_ROWS + warp of
// x: [rows, cols] (rows past the end do nothing); mean[r] and rstd[r] = 1 / sqrt(var + eps)
// are saved (biased variance, two passes). Lane l sums columns l, l + 32, … in order, then a
// butterfly of shuffles: a fixed order. b may be null (no bias).
template <typename T>
__device__ __forceinline__ void ln_fwd_n(const T* x, const float* w, const float* b, T* y,
                                         float* mean, float* rstd, int rows, int cols,
                                         float eps) {
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TF_LN_ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;  // the whole warp
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float acc = 0.0f;
    for (int c = lane; c < cols; c += 32) acc += to_f32(xr[c]);
    const float mu = tf_warp_sum(acc) / (float)cols;
    acc = 0.0f;
    for (int c = lane; c < cols; c += 32) {
        float d = to_f32(xr[c]) - mu;
        acc += d * d;
    }
    const float var = tf_warp_sum(acc) / (float)cols;
    const float rs = 1.0f / sqrtf(var + eps);
    for (int c = lane; c < cols; c += 32) {
        float v = (to_f32(xr[c]) - mu) * rs * w[c];
        if (b) v += b[c];
        yr[c] = from_f32<T>(v);
    }
    if (lane == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

// dx[r, :] = rstd · (g - mean(g) - xhat · mean(g · xhat)) with g = dy · w and
// xhat = (x - mean) · rstd, for row r = blockIdx.x. With centered = 0 (RMSNorm) mean is not
// read, xhat = x · rstd and the mean(g) term is dropped.
template <typename T>
__device__ __forceinline__ void norm_bwd_dx_n(const T* dy, const T* x, const float* w,
                                              const float* mean, const float* rstd, T* dx,
                                              int cols, int centered) {
    __shared__ float sh[TF_ROW_THREADS];
    const long long r = blockIdx.x;
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    const float mu = centered ? mean[r] : 0.0f;
    const float rs = rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int c = threadIdx.x; c < cols; c += TF_ROW_THREADS) {
        float g = to_f32(dyr[c]) * w[c];
        float xh = (to_f32(xr[c]) - mu) * rs;
        sg += g;
        sgx += g * xh;
    }
    const float mg = centered ? tf_block_sum(sg, sh) / (float)cols : 0.0f;
    const float mgx = tf_block_sum(sgx, sh) / (float)cols;
    for (int c = threadIdx.x; c < cols; c += TF_ROW_THREADS) {
        float g = to_f32(dyr[c]) * w[c];
        float xh = (to_f32(xr[c]) - mu) * rs;
        dxr[c] = from_f32<T>(rs * (g - mg - xh * mgx));
    }
}

// dw[c] = Σ_r dy[r, c] · xhat[r, c] and (db non-null) db[c] = Σ_r dy[r, c], in f32. A block
// of 256 threads covers 32 columns: thread (lane, group) sums rows group, group + 8, … in
// order, then the 8 partial sums of a column are added in a fixed order (deterministic).
template <typename T>
__device__ __forceinline__ void norm_bwd_wb_n(const T* dy, const T* x, const float* mean,
                                              const float* rstd, float* dw, float* db,
                                              int rows, int cols, int centered) {
    __shared__ float pw[8][32];
    __shared__ float pb[8][32];
    const int lane = threadIdx.x & 31, group = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    float aw = 0.0f, ab = 0.0f;
    if (c < cols) {
        for (int r = group; r < rows; r += 8) {
            long long i = (long long)r * cols + c;
            float g = to_f32(dy[i]);
            float mu = centered ? mean[r] : 0.0f;
            aw += g * (to_f32(x[i]) - mu) * rstd[r];
            ab += g;
        }
    }
    pw[group][lane] = aw;
    pb[group][lane] = ab;
    __syncthreads();
    if (group == 0 && c < cols) {
        float sw = 0.0f, sb = 0.0f;
        for (int k = 0; k < 8; k++) {
            sw += pw[k][lane];
            sb += pb[k][lane];
        }
        dw[c] = sw;
        if (db) db[c] = sb;
    }
}

// ---- RMSNorm (Llama) ------------------------------------------------------------------------

// y[r, :] = x · rsqrt(mean(x²) + eps) · w for row r = blockIdx.x, all in f32, rounded once;
// rstd[r] is saved.
template <typename T>
__device__ __forceinline__ void rms_fwd_n(const T* x, const float* w, T* y, float* rstd,
                                          int cols, float eps) {
    __shared__ float sh[TF_ROW_THREADS];
    const long long r = blockIdx.x;
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < cols; c += TF_ROW_THREADS) {
        float v = to_f32(xr[c]);
        acc += v * v;
    }
    const float ms = tf_block_sum(acc, sh) / (float)cols;
    const float rs = 1.0f / sqrtf(ms + eps);
    for (int c = threadIdx.x; c < cols; c += TF_ROW_THREADS)
        yr[c] = from_f32<T>(to_f32(xr[c]) * rs * w[c]);
    if (threadIdx.x == 0) rstd[r] = rs;
}

// ---- Activations ---------------------------------------------------------------------------

#define TF_SQRT_2_OVER_PI 0.7978845608028654f
#define TF_INV_SQRT_2 0.7071067811865476f
#define TF_INV_SQRT_2PI 0.3989422804014327f

// GELU: exact x · Φ(x) = x/2 · (1 + erf(x/√2)), or (tanh_approx) PyTorch's
// x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³))).
__device__ __forceinline__ float tf_gelu(float x, int tanh_approx) {
    if (tanh_approx) {
        float u = TF_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(u));
    }
    return 0.5f * x * (1.0f + erff(x * TF_INV_SQRT_2));
}

// d gelu / dx.
__device__ __forceinline__ float tf_gelu_grad(float x, int tanh_approx) {
    if (tanh_approx) {
        float x2 = x * x;
        float u = TF_SQRT_2_OVER_PI * (x + 0.044715f * x2 * x);
        float t = tanhf(u);
        float du = TF_SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x2);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
    }
    float cdf = 0.5f * (1.0f + erff(x * TF_INV_SQRT_2));
    float pdf = TF_INV_SQRT_2PI * expf(-0.5f * x * x);
    return cdf + x * pdf;
}

__device__ __forceinline__ float tf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// gelu of the elements of one 32-bit word (one f32 or two 16-bit values, the lower address
// in the low half), each as the scalar path computes it.
__device__ __forceinline__ unsigned int tf_gelu_word(unsigned int w, const float*, int ta) {
    return __float_as_uint(tf_gelu(__uint_as_float(w), ta));
}

template <typename H>
__device__ __forceinline__ unsigned int tf_gelu_word16(unsigned int w, int ta) {
    H lo, hi;
    lo.bits = (unsigned short)(w & 0xffffu);
    hi.bits = (unsigned short)(w >> 16);
    const unsigned int a = from_f32<H>(tf_gelu(to_f32(lo), ta)).bits;
    const unsigned int b = from_f32<H>(tf_gelu(to_f32(hi), ta)).bits;
    return a | (b << 16);
}

__device__ __forceinline__ unsigned int tf_gelu_word(unsigned int w, const bf16_t*, int ta) {
    return tf_gelu_word16<bf16_t>(w, ta);
}

__device__ __forceinline__ unsigned int tf_gelu_word(unsigned int w, const f16_t*, int ta) {
    return tf_gelu_word16<f16_t>(w, ta);
}

// With x and y both 16-byte aligned, groups of 16 bytes (4 f32 or 8 16-bit values) move with
// one load and one store, the last n mod (16 / sizeof(T)) elements one at a time; each element
// gets the same bits either way.
template <typename T>
__device__ __forceinline__ void gelu_fwd_n(const T* x, T* y, long long n, int tanh_approx) {
    constexpr int V = 16 / sizeof(T);
    const bool vec = (((unsigned long long)x | (unsigned long long)y) & 15ull) == 0;
    const long long groups = vec ? n / V : 0;
    TF_LOOP(i, groups) {
        uint4 r = reinterpret_cast<const uint4*>(x)[i];
        r.x = tf_gelu_word(r.x, x, tanh_approx);
        r.y = tf_gelu_word(r.y, x, tanh_approx);
        r.z = tf_gelu_word(r.z, x, tanh_approx);
        r.w = tf_gelu_word(r.w, x, tanh_approx);
        reinterpret_cast<uint4*>(y)[i] = r;
    }
    TF_LOOP(i, n - groups * V) {
        const long long k = groups * V + i;
        y[k] = from_f32<T>(tf_gelu(to_f32(x[k]), tanh_approx));
    }
}

template <typename T>
__device__ __forceinline__ void gelu_bwd_n(const T* dy, const T* x, T* dx, long long n,
                                           int tanh_approx) {
    TF_LOOP(i, n) dx[i] = from_f32<T>(to_f32(dy[i]) * tf_gelu_grad(to_f32(x[i]), tanh_approx));
}

// SiLU x · σ(x); its derivative σ(x) · (1 + x · (1 - σ(x))).
template <typename T>
__device__ __forceinline__ void silu_fwd_n(const T* x, T* y, long long n) {
    TF_LOOP(i, n) {
        float v = to_f32(x[i]);
        y[i] = from_f32<T>(v * tf_sigmoid(v));
    }
}

template <typename T>
__device__ __forceinline__ void silu_bwd_n(const T* dy, const T* x, T* dx, long long n) {
    TF_LOOP(i, n) {
        float v = to_f32(x[i]);
        float s = tf_sigmoid(v);
        dx[i] = from_f32<T>(to_f32(dy[i]) * s * (1.0f + v * (1.0f - s)));
    }
}

// SwiGLU y = silu(gate) · up; dgate = dy · up · silu'(gate), dup = dy · silu(gate).
template <typename T>
__device__ __forceinline__ void swiglu_fwd_n(const T* gate, const T* up, T* y, long long n) {
    TF_LOOP(i, n) {
        float g = to_f32(gate[i]);
        y[i] = from_f32<T>(g * tf_sigmoid(g) * to_f32(up[i]));
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd_n(const T* dy, const T* gate, const T* up, T* dgate,
                                             T* dup, long long n) {
    TF_LOOP(i, n) {
        float g = to_f32(gate[i]);
        float s = tf_sigmoid(g);
        float d = to_f32(dy[i]);
        dgate[i] = from_f32<T>(d * to_f32(up[i]) * s * (1.0f + g * (1.0f - s)));
        dup[i] = from_f32<T>(d * g * s);
    }
}

// ---- Rotary position embeddings ------------------------------------------------------------

// x, y: [tokens, heads, head_dim]; pos: [tokens] (i32); inv_freq: [rot / 2]. Element pair k
// (k < rot / 2) of each (token, head) is rotated by the angle pos · inv_freq[k] (the product in
// f32, as Hugging Face's): every_two = 0 pairs (k, k + rot/2) ("rotate_half", Llama and
// GPT-NeoX), every_two = 1 pairs (2k, 2k + 1) ("rotate_every_two", GPT-J). Components past
// rot are copied. inverse = 1 rotates by minus the angle (the backward). One thread per
// (token, head, k) with k < head_dim / 2: threads k ≥ rot / 2 copy the two components
// rot + 2 (k - rot/2) and the one after it.
template <typename T>
__device__ __forceinline__ void rope_n(const T* x, T* y, const int* pos, const float* inv_freq,
                                       int tokens, int heads, int head_dim, int rot,
                                       int every_two, int inverse) {
    const int half_d = head_dim / 2, half_r = rot / 2;
    TF_LOOP(i, (long long)tokens * heads * half_d) {
        const int k = (int)(i % half_d);
        const long long row = i / half_d;  // token · heads + head
        const int t = (int)(row / heads);
        const long long base = row * head_dim;
        if (k >= half_r) {
            const long long j = base + rot + 2 * (k - half_r);
            y[j] = x[j];
            y[j + 1] = x[j + 1];
            continue;
        }
        const float angle = (float)pos[t] * inv_freq[k];
        float sn, cs;
        sincosf(angle, &sn, &cs);
        if (inverse) sn = -sn;
        const long long ia = every_two ? base + 2 * k : base + k;
        const long long ib = every_two ? ia + 1 : ia + half_r;
        const float a = to_f32(x[ia]), b = to_f32(x[ib]);
        y[ia] = from_f32<T>(a * cs - b * sn);
        y[ib] = from_f32<T>(b * cs + a * sn);
    }
}

// ---- Embedding -----------------------------------------------------------------------------

// y[t, c] = w[ids[t], c] for t < tokens, c < dim; an id outside [0, vocab) gives a row of
// zeros (no read outside w).
template <typename T>
__device__ __forceinline__ void embed_fwd_n(const int* ids, const T* w, T* y, int tokens,
                                            int dim, int vocab) {
    TF_LOOP(i, (long long)tokens * dim) {
        const int t = (int)(i / dim), c = (int)(i % dim);
        const int id = ids[t];
        y[i] = (id >= 0 && id < vocab) ? w[(long long)id * dim + c] : from_f32<T>(0.0f);
    }
}

// dw[ids[t], c] = Σ_{t' : ids[t'] = ids[t]} dy[t', c] into an f32 gradient the caller zeroed:
// one thread per (t, c); only the first token with its id writes, summing every such token in
// order (no atomics, no sort: deterministic). Ids outside [0, vocab) are skipped.
// The chain of each token's id through the batch, for the embedding backward: links[2t] =
// the next token u > t with the same id (-1 at the last), links[2t + 1] = 1 when t is its id's
// first token. One thread per token, the ids compared in shared-memory tiles: O(tokens²)
// integer compares, no float work.
#define EMB_TILE 256
extern "C" __global__ void embed_links(const int* ids, int* links, int tokens) {
    __shared__ int tile[EMB_TILE];
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int id = t < tokens ? ids[t] : 0;
    int next = -1, first = 1;
    for (int base = 0; base < tokens; base += EMB_TILE) {
        __syncthreads();
        if (base + (int)threadIdx.x < tokens) tile[threadIdx.x] = ids[base + threadIdx.x];
        __syncthreads();
        const int n = min(EMB_TILE, tokens - base);
        for (int j = 0; j < n; j++) {
            const int u = base + j;
            if (tile[j] != id || u == t) continue;
            if (u < t) first = 0;
            else if (next < 0) next = u;
        }
    }
    if (t < tokens) {
        links[2 * t] = next;
        links[2 * t + 1] = first;
    }
}

// dw[id, c] = sum of dy[u, c] over the tokens u with that id, in token order (the same bits as
// a sequential sum), one thread per (token, column) of each id's first token, walking the id's
// chain of tokens; ids outside [0, vocab) give nothing.
template <typename T>
__device__ __forceinline__ void embed_bwd_n(const int* ids, const int* links, const T* dy,
                                            float* dw, int tokens, int dim, int vocab) {
    TF_LOOP(i, (long long)tokens * dim) {
        const int t = (int)(i / dim), c = (int)(i % dim);
        const int id = ids[t];
        if (id < 0 || id >= vocab || !links[2 * t + 1]) continue;
        float acc = 0.0f;
        for (int u = t; u >= 0; u = links[2 * u]) acc += to_f32(dy[(long long)u * dim + c]);
        dw[(long long)id * dim + c] = acc;
    }
}

#define TF_INSTANCES(T, S)                                                                   \
    extern "C" __global__ void ln_fwd_##S(const T* x, const float* w, const float* b, T* y,   \
                                          float* mean, float* rstd, int rows, int cols,       \
                                          float eps) {                                        \
        ln_fwd_n<T>(x, w, b, y, mean, rstd, rows, cols, eps);                                \
    }                                                                                        \
    extern "C" __global__ void norm_bwd_dx_##S(const T* dy, const T* x, const float* w,      \
                                               const float* mean, const float* rstd, T* dx,  \
                                               int cols, int centered) {                     \
        norm_bwd_dx_n<T>(dy, x, w, mean, rstd, dx, cols, centered);                          \
    }                                                                                        \
    extern "C" __global__ void norm_bwd_wb_##S(const T* dy, const T* x, const float* mean,   \
                                               const float* rstd, float* dw, float* db,      \
                                               int rows, int cols, int centered) {           \
        norm_bwd_wb_n<T>(dy, x, mean, rstd, dw, db, rows, cols, centered);                   \
    }                                                                                        \
    extern "C" __global__ void rms_fwd_##S(const T* x, const float* w, T* y, float* rstd,    \
                                           int cols, float eps) {                            \
        rms_fwd_n<T>(x, w, y, rstd, cols, eps);                                              \
    }                                                                                        \
    extern "C" __global__ void gelu_fwd_##S(const T* x, T* y, long long n, int tanh_approx) { \
        gelu_fwd_n<T>(x, y, n, tanh_approx);                                                 \
    }                                                                                        \
    extern "C" __global__ void gelu_bwd_##S(const T* dy, const T* x, T* dx, long long n,     \
                                            int tanh_approx) {                               \
        gelu_bwd_n<T>(dy, x, dx, n, tanh_approx);                                            \
    }                                                                                        \
    extern "C" __global__ void silu_fwd_##S(const T* x, T* y, long long n) {                 \
        silu_fwd_n<T>(x, y, n);                                                              \
    }                                                                                        \
    extern "C" __global__ void silu_bwd_##S(const T* dy, const T* x, T* dx, long long n) {   \
        silu_bwd_n<T>(dy, x, dx, n);                                                         \
    }                                                                                        \
    extern "C" __global__ void swiglu_fwd_##S(const T* gate, const T* up, T* y,              \
                                              long long n) {                                 \
        swiglu_fwd_n<T>(gate, up, y, n);                                                     \
    }                                                                                        \
    extern "C" __global__ void swiglu_bwd_##S(const T* dy, const T* gate, const T* up,       \
                                              T* dgate, T* dup, long long n) {               \
        swiglu_bwd_n<T>(dy, gate, up, dgate, dup, n);                                        \
    }                                                                                        \
    extern "C" __global__ void rope_##S(const T* x, T* y, const int* pos,                    \
                                        const float* inv_freq, int tokens, int heads,        \
                                        int head_dim, int rot, int every_two, int inverse) { \
        rope_n<T>(x, y, pos, inv_freq, tokens, heads, head_dim, rot, every_two, inverse);    \
    }                                                                                        \
    extern "C" __global__ void embed_fwd_##S(const int* ids, const T* w, T* y, int tokens,   \
                                             int dim, int vocab) {                           \
        embed_fwd_n<T>(ids, w, y, tokens, dim, vocab);                                       \
    }                                                                                        \
    extern "C" __global__ void embed_bwd_##S(const int* ids, const int* links, const T* dy,  \
                                             float* dw, int tokens, int dim, int vocab) {    \
        embed_bwd_n<T>(ids, links, dy, dw, tokens, dim, vocab);                              \
    }

TF_INSTANCES(float, f32)
TF_INSTANCES(bf16_t, bf16)
TF_INSTANCES(f16_t, f16)
