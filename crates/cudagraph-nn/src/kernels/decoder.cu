// The decoder's fused inference kernels (serving::decoder): token (+ position) embedding,
// LayerNorm or RMSNorm over rows picked with a stride, the split of a packed q|k|v product
// with rotary embedding and the key/value cache write, SwiGLU over a packed gate|up product,
// and attention over the cache with the keys spread over the threads (decode). One template
// per operation instantiated for float, bf16_t and f16_t (compiled after the device-check
// prologue and cast.cu). Values are widened to f32, computed in f32 and rounded to nearest
// even on store; reductions run in a fixed order (deterministic). Where Hugging Face's Llama
// code rounds an intermediate to the model's type (RMSNorm's normalised row before the weight,
// the cos/sin tables and each product of the rotary embedding, SiLU's output before the
// product), so do these kernels (dec_rnd: the identity for f32), so that 16-bit results
// follow the reference implementation's.

// x rounded to T and widened back (the identity for float).
template <typename T>
__device__ __forceinline__ float dec_rnd(float x) {
    return to_f32(from_f32<T>(x));
}

#define DEC_LOOP(i, n)                                                                     \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// Threads of the norm kernel (one block per row); the launcher uses exactly this.
#define DEC_ROW_THREADS 256

__device__ __forceinline__ float dec_block_sum(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = DEC_ROW_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    float total = sh[0];
    __syncthreads();
    return total;
}

// y[t, c] = wte[ids[t], c] (+ wpe[pos[t], c] when wpe is not null), summed in f32 and rounded
// once. An id outside [0, vocab) or (with wpe) a position outside [0, npos) is reported
// through the check record and gives a row of zeros: no read outside the tables.
template <typename T>
__device__ __forceinline__ void dec_embed_n(const int* __restrict__ ids, const T* __restrict__ wte,
                                            const T* __restrict__ wpe, const int* __restrict__ pos,
                                            T* __restrict__ y, int tokens, int dim, int vocab,
                                            int npos, cg_check* flag, unsigned int id_check,
                                            unsigned int pos_check) {
    DEC_LOOP(i, (long long)tokens * dim) {
        const int t = (int)(i / dim), c = (int)(i % dim);
        const int id = ids[t];
        bool ok = id >= 0 && id < vocab;
        if (!ok && c == 0) cg_report(flag, id_check, id, vocab, (unsigned long long)t);
        int p = 0;
        if (wpe) {
            p = pos[t];
            if (p < 0 || p >= npos) {
                if (ok && c == 0) cg_report(flag, pos_check, p, npos, (unsigned long long)t);
                ok = false;
            }
        }
        float v = 0.0f;
        if (ok) {
            v = to_f32(wte[(long long)id * dim + c]);
            if (wpe) v += to_f32(wpe[(long long)p * dim + c]);
        }
        y[i] = from_f32<T>(v);
    }
}

// Row r = blockIdx.x of y ([rows, cols]) = norm of row r·stride + off of x: LayerNorm
// ((x - mean) · rstd · w + b, b may be null; biased variance, two passes) or, with rms = 1,
// RMSNorm (x · rsqrt(mean(x²) + eps) · w). All in f32, rounded once.
template <typename T>
__device__ __forceinline__ void dec_norm_n(const T* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ b, T* __restrict__ y,
                                           int cols, float eps, int rms, int stride, int off) {
    __shared__ float sh[DEC_ROW_THREADS];
    const long long r = blockIdx.x;
    const T* xr = x + (r * stride + off) * cols;
    T* yr = y + r * cols;
    float mu = 0.0f;
    if (!rms) {
        float acc = 0.0f;
        for (int c = threadIdx.x; c < cols; c += DEC_ROW_THREADS) acc += to_f32(xr[c]);
        mu = dec_block_sum(acc, sh) / (float)cols;
    }
    float acc = 0.0f;
    for (int c = threadIdx.x; c < cols; c += DEC_ROW_THREADS) {
        float d = to_f32(xr[c]) - mu;
        acc += d * d;
    }
    const float rs = 1.0f / sqrtf(dec_block_sum(acc, sh) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += DEC_ROW_THREADS) {
        // RMSNorm as LlamaRMSNorm: the normalised value in the model's type, then the weight.
        float v = rms ? dec_rnd<T>(to_f32(xr[c]) * rs) * w[c] : (to_f32(xr[c]) - mu) * rs * w[c];
        if (b) v += b[c];
        yr[c] = from_f32<T>(v);
    }
}

// The packed product qkv [N, H + 2·Hkv, D] (N = B·Tq tokens; heads 0..H are queries, then Hkv
// keys, then Hkv values) split into q_out [N, H, D] and the caches [S, Hkv, Tmax, D] at
// (slot[b], position pos[n]) for token n of row b = n / Tq. With inv_freq (not null) queries
// and keys are rotated ("rotate_half": component j pairs with j + D/2, angle pos · inv_freq[j],
// the product in f32). One thread per (token, head, j < D/2). A slot outside [0, S) or a
// position outside [0, Tmax) is reported and that token's keys and values are not written.
template <typename T>
__device__ __forceinline__ void dec_qkv_n(const T* __restrict__ qkv,
                                          const float* __restrict__ inv_freq,
                                          const int* __restrict__ pos,
                                          const int* __restrict__ slot, T* __restrict__ q_out,
                                          T* __restrict__ kc, T* __restrict__ vc, int N, int Tq,
                                          int H, int Hkv, int D, int S, int Tmax,
                                          cg_check* flag, unsigned int pos_check,
                                          unsigned int slot_check) {
    const int half = D / 2, heads = H + 2 * Hkv;
    DEC_LOOP(i, (long long)N * heads * half) {
        const int j = (int)(i % half);
        const long long r = i / half;
        const int hh = (int)(r % heads);
        const long long n = r / heads;
        const int b = (int)(n / Tq);
        const int p = pos[n];
        const T* src = qkv + r * D;
        float a = to_f32(src[j]), c = to_f32(src[j + half]);
        if (inv_freq && hh < H + Hkv) {
            // As apply_rotary_pos_emb: cos and sin in the model's type, each product rounded,
            // the sum rounded on store.
            float sn, cs;
            sincosf((float)p * inv_freq[j], &sn, &cs);
            cs = dec_rnd<T>(cs);
            sn = dec_rnd<T>(sn);
            const float ra = dec_rnd<T>(a * cs) - dec_rnd<T>(c * sn);
            const float rc = dec_rnd<T>(c * cs) + dec_rnd<T>(a * sn);
            a = ra;
            c = rc;
        }
        if (hh < H) {
            T* dst = q_out + (n * H + hh) * D;
            dst[j] = from_f32<T>(a);
            dst[j + half] = from_f32<T>(c);
            continue;
        }
        const int sl = slot[b];
        if (sl < 0 || sl >= S) {
            if (j == 0 && hh == H && n % Tq == 0) cg_report(flag, slot_check, sl, S, b);
            continue;
        }
        if (p < 0 || p >= Tmax) {
            if (j == 0 && hh == H) cg_report(flag, pos_check, p, Tmax, (unsigned long long)n);
            continue;
        }
        const int kvh = hh < H + Hkv ? hh - H : hh - H - Hkv;
        T* cache = hh < H + Hkv ? kc : vc;
        T* dst = cache + (((long long)sl * Hkv + kvh) * Tmax + p) * D;
        dst[j] = from_f32<T>(a);
        dst[j + half] = from_f32<T>(c);
    }
}

// y[r, c] = silu(gu[r, c]) · gu[r, M + c] for r < N, c < M (gu [N, 2M]: gate | up).
template <typename T>
__device__ __forceinline__ void dec_swiglu_n(const T* __restrict__ gu, T* __restrict__ y, int N,
                                             int M) {
    DEC_LOOP(i, (long long)N * M) {
        const long long r = i / M;
        const int c = (int)(i % M);
        const float g = to_f32(gu[r * 2 * M + c]);
        const float u = to_f32(gu[r * 2 * M + M + c]);
        y[i] = from_f32<T>(dec_rnd<T>(g / (1.0f + expf(-g))) * u);
    }
}

// ---- Attention over the cache, one query token and head per block ----------------------------

// Threads of the attention kernel (the launcher uses exactly this) and keys per chunk.
#define DA_THREADS 256
#define DA_CHUNK 1024
#define DA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float dec_block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = DA_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    float m = sh[0];
    __syncthreads();
    return m;
}

// As attend_kv (attention.cu), same layouts and checks, with the keys spread over the threads
// instead of the head dimension: q [B, Tq, H, D], caches [S, Hkv, Tmax, D], pos [B, Tq], slot
// [B]; block (h, tq, b) attends to positions 0..=p of slot slot[b]. Keys go in chunks of
// DA_CHUNK: every thread scores whole keys (q in shared memory), the block takes the chunk's
// max (a running max over chunks rescales the sums, online softmax), then thread (g, d) with
// d = tid % D and g = tid / D < G = DA_THREADS / D sums w · v over the chunk's keys g, g + G,
// ... for component d; the G partial sums are added in a fixed order at the end
// (deterministic). f32 throughout, rounded once. D <= 256.
template <typename T>
__device__ __forceinline__ void dec_attend_n(const T* __restrict__ q, const T* __restrict__ kc,
                                             const T* __restrict__ vc, const int* __restrict__ pos,
                                             const int* __restrict__ slot, T* __restrict__ out,
                                             int Tq, int H, int Hkv, int S, int Tmax, int D,
                                             float scale, cg_check* flag, unsigned int check,
                                             unsigned int slot_check) {
    __shared__ float sq[256];
    __shared__ float sw[DA_CHUNK];
    __shared__ float sred[DA_THREADS];
    const int h = blockIdx.x, tq = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x;
    const int kvh = h / (H / Hkv);
    const long long qrow = (((long long)b * Tq + tq) * H + h) * D;
    const int p = pos[(long long)b * Tq + tq];
    const int sl = slot[b];
    const bool slot_ok = sl >= 0 && sl < S;
    const bool valid = slot_ok && p >= 0 && p < Tmax;
    if (!slot_ok && tid == 0 && tq == 0 && h == 0) cg_report(flag, slot_check, sl, S, b);
    if (slot_ok && !valid && tid == 0)
        cg_report(flag, check, p, Tmax, (unsigned long long)b * Tq + tq);
    for (int d = tid; d < D; d += DA_THREADS) sq[d] = to_f32(q[qrow + d]) * scale;
    __syncthreads();
    const int G = DA_THREADS / D;
    const int g = tid / D, dd = tid % D;
    const bool active = g < G;
    const long long base = ((long long)(slot_ok ? sl : 0) * Hkv + kvh) * Tmax * D;
    const int last = valid ? p : -1;
    float m = DA_NEG_INF, acc = 0.0f, l = 0.0f;
    for (int c0 = 0; c0 <= last; c0 += DA_CHUNK) {
        const int n = min(DA_CHUNK, last + 1 - c0);
        float mx = DA_NEG_INF;
        for (int j = tid; j < n; j += DA_THREADS) {
            const T* kr = kc + base + (long long)(c0 + j) * D;
            float s = 0.0f;
#pragma unroll 8
            for (int d = 0; d < D; d++) s += sq[d] * to_f32(kr[d]);
            sw[j] = s;
            mx = fmaxf(mx, s);
        }
        const float mn = fmaxf(m, dec_block_max(mx, sred));
        const float corr = __expf(m - mn);  // 0 when m is -inf
        for (int j = tid; j < n; j += DA_THREADS) sw[j] = __expf(sw[j] - mn);
        __syncthreads();
        acc *= corr;
        l *= corr;
        if (active) {
            const T* vr = vc + base + (long long)c0 * D + dd;
#pragma unroll 4
            for (int j = g; j < n; j += G) {
                const float w = sw[j];
                acc += w * to_f32(vr[(long long)j * D]);
                l += w;
            }
        }
        m = mn;
        __syncthreads();
    }
    sred[tid] = active ? acc : 0.0f;
    if (active && dd == 0) sw[g] = l;
    __syncthreads();
    if (tid < D) {
        float a = 0.0f, ll = 0.0f;
        for (int k = 0; k < G; k++) {
            a += sred[k * D + tid];
            ll += sw[k];
        }
        out[qrow + tid] = from_f32<T>(ll > 0.0f ? a / ll : 0.0f);
    }
}

#define DEC_INSTANCES(T, S)                                                                   \
    extern "C" __global__ void dec_embed_##S(const int* ids, const T* wte, const T* wpe,       \
                                             const int* pos, T* y, int tokens, int dim,        \
                                             int vocab, int npos, cg_check* flag,              \
                                             unsigned int id_check, unsigned int pos_check) {  \
        dec_embed_n<T>(ids, wte, wpe, pos, y, tokens, dim, vocab, npos, flag, id_check,       \
                       pos_check);                                                            \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_ROW_THREADS)                             \
        dec_norm_##S(const T* x, const float* w, const float* b, T* y, int cols, float eps,   \
                     int rms, int stride, int off) {                                          \
        dec_norm_n<T>(x, w, b, y, cols, eps, rms, stride, off);                               \
    }                                                                                         \
    extern "C" __global__ void dec_qkv_##S(const T* qkv, const float* inv_freq, const int* pos, \
                                           const int* slot, T* q_out, T* kc, T* vc, int N,     \
                                           int Tq, int H, int Hkv, int D, int NS, int Tmax,    \
                                           cg_check* flag, unsigned int pos_check,             \
                                           unsigned int slot_check) {                          \
        dec_qkv_n<T>(qkv, inv_freq, pos, slot, q_out, kc, vc, N, Tq, H, Hkv, D, NS, Tmax, flag, \
                     pos_check, slot_check);                                                  \
    }                                                                                         \
    extern "C" __global__ void dec_swiglu_##S(const T* gu, T* y, int N, int M) {              \
        dec_swiglu_n<T>(gu, y, N, M);                                                         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) dec_attend_##S(                  \
        const T* q, const T* kc, const T* vc, const int* pos, const int* slot, T* out, int Tq, \
        int H, int Hkv, int NS, int Tmax, int D, float scale, cg_check* flag,                 \
        unsigned int check, unsigned int slot_check) {                                        \
        dec_attend_n<T>(q, kc, vc, pos, slot, out, Tq, H, Hkv, NS, Tmax, D, scale, flag, check, \
                        slot_check);                                                          \
    }

DEC_INSTANCES(float, f32)
DEC_INSTANCES(bf16_t, bf16)
DEC_INSTANCES(f16_t, f16)
