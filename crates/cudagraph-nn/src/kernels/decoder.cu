// The decoder's fused inference kernels (serving::decoder): token (+ position) embedding,
// LayerNorm or RMSNorm over rows picked with a stride, the split of a packed q|k|v product
// with rotary embedding and the key/value cache write, SwiGLU over a packed gate|up product,
// and attention over the cache in tiles of keys split over blocks (flash-decoding). One template
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

// Threads of the norm kernel (one block per row); the launcher uses exactly this. A row of up to
// DEC_ROW_PER elements a thread (8192 columns) is held in registers and read once.
#define DEC_ROW_THREADS 256
#define DEC_ROW_WARPS (DEC_ROW_THREADS / 32)
#define DEC_ROW_PER 32

// The sum of v over a warp (xor butterfly: every lane gets the same bits).
__device__ __forceinline__ float dec_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the norm block: one shuffle reduction per warp, the DEC_ROW_WARPS warp sums
// exchanged through sh and added in warp order by every thread. Each call needs its own sh (no
// __syncthreads after the reads).
__device__ __forceinline__ float dec_block_sum(float v, float* sh) {
    v = dec_warp_sum(v);
    if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < DEC_ROW_WARPS; w++) total += sh[w];
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
// RMSNorm (x · rsqrt(mean(x²) + eps) · w). All in f32, rounded once. A row of at most
// DEC_ROW_THREADS · DEC_ROW_PER columns is read once into registers (thread t keeps columns
// t + DEC_ROW_THREADS·i); a wider one is read once per pass.
template <typename T>
__device__ __forceinline__ float dec_norm_one(float x, float mu, float rs, const float* __restrict__ w,
                                              const float* __restrict__ b, int c, int rms) {
    // RMSNorm as LlamaRMSNorm: the normalised value in the model's type, then the weight.
    float v = rms ? dec_rnd<T>(x * rs) * w[c] : (x - mu) * rs * w[c];
    if (b) v += b[c];
    return v;
}

template <typename T>
__device__ __forceinline__ void dec_norm_n(const T* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ b, T* __restrict__ y,
                                           int cols, float eps, int rms, int stride, int off) {
    __shared__ float sh_mu[DEC_ROW_WARPS], sh_var[DEC_ROW_WARPS];
    const long long r = blockIdx.x;
    const T* xr = x + (r * stride + off) * cols;
    T* yr = y + r * cols;
    const int tid = threadIdx.x;
    if (cols <= DEC_ROW_THREADS * DEC_ROW_PER) {
        float v[DEC_ROW_PER];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < DEC_ROW_PER; i++) {
            const int c = tid + i * DEC_ROW_THREADS;
            v[i] = c < cols ? to_f32(xr[c]) : 0.0f;
            acc += v[i];
        }
        const float mu = rms ? 0.0f : dec_block_sum(acc, sh_mu) / (float)cols;
        acc = 0.0f;
#pragma unroll
        for (int i = 0; i < DEC_ROW_PER; i++) {
            const int c = tid + i * DEC_ROW_THREADS;
            const float d = v[i] - mu;
            if (c < cols) acc += d * d;
        }
        const float rs = 1.0f / sqrtf(dec_block_sum(acc, sh_var) / (float)cols + eps);
#pragma unroll
        for (int i = 0; i < DEC_ROW_PER; i++) {
            const int c = tid + i * DEC_ROW_THREADS;
            if (c < cols) yr[c] = from_f32<T>(dec_norm_one<T>(v[i], mu, rs, w, b, c, rms));
        }
        return;
    }
    float mu = 0.0f;
    if (!rms) {
        float acc = 0.0f;
        for (int c = tid; c < cols; c += DEC_ROW_THREADS) acc += to_f32(xr[c]);
        mu = dec_block_sum(acc, sh_mu) / (float)cols;
    }
    float acc = 0.0f;
    for (int c = tid; c < cols; c += DEC_ROW_THREADS) {
        const float d = to_f32(xr[c]) - mu;
        acc += d * d;
    }
    const float rs = 1.0f / sqrtf(dec_block_sum(acc, sh_var) / (float)cols + eps);
    for (int c = tid; c < cols; c += DEC_ROW_THREADS)
        yr[c] = from_f32<T>(dec_norm_one<T>(to_f32(xr[c]), mu, rs, w, b, c, rms));
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

// ---- Attention over the cache: tiles of 32 keys, split along the keys (flash-decoding) -------

// Warps of the attention block (the launcher uses exactly DA_THREADS threads for both kernels)
// and the head components a lane keeps (head dimension <= DA_MAXD).
#define DA_WARPS 4
#define DA_THREADS (32 * DA_WARPS)
#define DA_SLOTS 8
#define DA_MAXD (32 * DA_SLOTS)
#define DA_NEG_INF __int_as_float(0xff800000)

// Word k of a 16-byte load, and element `hi` of a word holding one float or two 16-bit values.
__device__ __forceinline__ unsigned int dec_word(const uint4& r, int k) {
    return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w;
}
template <typename T>
__device__ __forceinline__ float dec_part(unsigned int w, int hi);
template <>
__device__ __forceinline__ float dec_part<float>(unsigned int w, int) {
    return __uint_as_float(w);
}
template <>
__device__ __forceinline__ float dec_part<bf16_t>(unsigned int w, int hi) {
    bf16_t e;
    e.bits = (unsigned short)(hi ? w >> 16 : w & 0xffffu);
    return to_f32(e);
}
template <>
__device__ __forceinline__ float dec_part<f16_t>(unsigned int w, int hi) {
    f16_t e;
    e.bits = (unsigned short)(hi ? w >> 16 : w & 0xffffu);
    return to_f32(e);
}

// The dot product of the f32 query sq (shared) with the key row kr of D elements: 16-byte loads
// when vec (D a multiple of 16 bytes' elements, kr 16-byte aligned), else one element at a time.
template <typename T>
__device__ __forceinline__ float dec_dot(const float* sq, const T* __restrict__ kr, int D,
                                         bool vec) {
    float dot = 0.0f;
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        const uint4* kv = reinterpret_cast<const uint4*>(kr);
        for (int c = 0; c < D / V; c++) {
            const uint4 raw = __ldg(kv + c);
#pragma unroll
            for (int i = 0; i < V; i++)
                dot += sq[c * V + i] * dec_part<T>(dec_word(raw, i / (V / 4)), i % (V / 4));
        }
    } else {
        for (int d = 0; d < D; d++) dot += sq[d] * to_f32(kr[d]);
    }
    return dot;
}

// As attend_kv (attention.cu), same layouts and checks: q [B, Tq, H, D], caches
// [S, Hkv, Tmax, D], pos [B, Tq], slot [B]; the query of head h of token tq of row b attends to
// positions 0..=p of slot slot[b]. Block (h + H·split, tq, b) takes the keys
// [split·chunk, min((split + 1)·chunk, p + 1)) (none: the block ends at once). Each of the
// DA_WARPS warps takes every DA_WARPS-th tile of 32 keys: lane j scores key j of the tile whole
// (16-byte loads of its key row against the scaled query in shared memory), one shuffle max and
// one shuffle sum give the tile's softmax statistics (online softmax: a running max rescales the
// sums), then the lanes add the tile's weighted value rows split over the head dimension
// (component lane + 32·i, coalesced rows). The warps are combined in warp order. With
// splits = 1 the block writes the normalised output; else its partial (max, sum of weights,
// unnormalised sum of values) to part[((b·Tq + tq)·H + h)·splits + split] (rows of D + 2
// floats; an empty split writes max = -inf), which dec_attend_combine adds in split order.
// f32 throughout, rounded once on store; deterministic. D <= DA_MAXD.
template <typename T>
__device__ __forceinline__ void dec_attend_n(const T* __restrict__ q, const T* __restrict__ kc,
                                             const T* __restrict__ vc, const int* __restrict__ pos,
                                             const int* __restrict__ slot, float* __restrict__ part,
                                             T* __restrict__ out, int Tq, int H, int Hkv, int S,
                                             int Tmax, int D, int chunk, int splits, float scale,
                                             cg_check* flag, unsigned int check,
                                             unsigned int slot_check) {
    __shared__ __align__(16) float sq[DA_MAXD];
    __shared__ float sm_m[DA_WARPS], sm_l[DA_WARPS];
    __shared__ float sm_acc[DA_WARPS][DA_MAXD];
    const int h = blockIdx.x % H, split = blockIdx.x / H;
    const int tq = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const long long bt = (long long)b * Tq + tq;
    const long long r = bt * H + h;
    const int p = pos[bt];
    const int sl = slot[b];
    const bool slot_ok = sl >= 0 && sl < S;
    const bool valid = slot_ok && p >= 0 && p < Tmax;
    if (tid == 0 && h == 0 && split == 0) {
        if (!slot_ok && tq == 0) cg_report(flag, slot_check, sl, S, b);
        if (slot_ok && !valid) cg_report(flag, check, p, Tmax, (unsigned long long)bt);
    }
    const int k0 = split * chunk;
    const int k1 = valid ? min(k0 + chunk, p + 1) : 0;
    if (k0 >= k1) {
        // Nothing to attend to (block-uniform): an empty partial, or zeros.
        if (splits > 1) {
            if (tid == 0) {
                float* pr = part + (r * splits + split) * (long long)(D + 2);
                pr[0] = DA_NEG_INF;
                pr[1] = 0.0f;
            }
        } else {
            for (int d = tid; d < D; d += DA_THREADS) out[r * D + d] = from_f32<T>(0.0f);
        }
        return;
    }
    for (int d = tid; d < D; d += DA_THREADS) sq[d] = to_f32(q[r * D + d]) * scale;
    __syncthreads();
    const int kvh = h / (H / Hkv);
    const long long base = ((long long)sl * Hkv + kvh) * Tmax * D;
    constexpr int V = 16 / sizeof(T);
    // Row starts are multiples of D elements from kc: 16-byte aligned when kc is and V | D.
    const bool vec = D % V == 0 && (reinterpret_cast<unsigned long long>(kc) & 15ull) == 0;
    float acc[DA_SLOTS];
#pragma unroll
    for (int i = 0; i < DA_SLOTS; i++) acc[i] = 0.0f;
    float m = DA_NEG_INF, l = 0.0f;
    for (int tile = k0 + warp * 32; tile < k1; tile += DA_WARPS * 32) {
        const int key = tile + lane;
        const bool in = key < k1;
        const float s = in ? dec_dot<T>(sq, kc + base + (long long)key * D, D, vec) : DA_NEG_INF;
        float tm = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
        const float mn = fmaxf(m, tm);      // finite: key `tile` < k1 is scored
        const float corr = __expf(m - mn);  // 0 while m is -inf
        const float pj = in ? __expf(s - mn) : 0.0f;
        l = l * corr + dec_warp_sum(pj);
#pragma unroll
        for (int i = 0; i < DA_SLOTS; i++) acc[i] *= corr;
        const int nk = min(32, k1 - tile);
        const T* vr = vc + base + (long long)tile * D + lane;
#pragma unroll 4
        for (int j = 0; j < nk; j++) {
            const float wj = __shfl_sync(0xffffffffu, pj, j);
            const T* vj = vr + (long long)j * D;
#pragma unroll
            for (int i = 0; i < DA_SLOTS; i++)
                if (lane + 32 * i < D) acc[i] += wj * to_f32(vj[32 * i]);
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DA_SLOTS; i++) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    // Warp 0 scored key k0: the block's max is finite and its sum of weights at least 1.
    float mm = DA_NEG_INF;
#pragma unroll
    for (int w = 0; w < DA_WARPS; w++) mm = fmaxf(mm, sm_m[w]);
    float f[DA_WARPS];
    float ll = 0.0f;
#pragma unroll
    for (int w = 0; w < DA_WARPS; w++) {
        f[w] = sm_m[w] == DA_NEG_INF ? 0.0f : __expf(sm_m[w] - mm);
        ll += sm_l[w] * f[w];
    }
    float* pr = splits > 1 ? part + (r * splits + split) * (long long)(D + 2) : nullptr;
    if (pr && tid == 0) {
        pr[0] = mm;
        pr[1] = ll;
    }
    for (int d = tid; d < D; d += DA_THREADS) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < DA_WARPS; w++) a += sm_acc[w][d] * f[w];
        if (pr)
            pr[2 + d] = a;
        else
            out[r * D + d] = from_f32<T>(ll > 0.0f ? a / ll : 0.0f);
    }
}

// The splits partials of block (h, tq, b)'s query row added in split order (the empty ones,
// max = -inf, skipped) and normalised: out [B, Tq, H, D], part as dec_attend_n writes it.
template <typename T>
__device__ __forceinline__ void dec_attend_combine_n(const float* __restrict__ part,
                                                     T* __restrict__ out, int Tq, int H, int D,
                                                     int splits) {
    const long long r = ((long long)blockIdx.z * Tq + blockIdx.y) * H + blockIdx.x;
    const long long row = D + 2;
    const float* pr = part + r * splits * row;
    float mm = DA_NEG_INF;
    for (int s = 0; s < splits; s++) mm = fmaxf(mm, pr[s * row]);
    float ll = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float ms = pr[s * row];
        if (ms != DA_NEG_INF) ll += pr[s * row + 1] * __expf(ms - mm);
    }
    for (int d = threadIdx.x; d < D; d += DA_THREADS) {
        float a = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float ms = pr[s * row];
            if (ms != DA_NEG_INF) a += pr[s * row + 2 + d] * __expf(ms - mm);
        }
        out[r * D + d] = from_f32<T>(ll > 0.0f ? a / ll : 0.0f);
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
        const T* q, const T* kc, const T* vc, const int* pos, const int* slot, float* part,    \
        T* out, int Tq, int H, int Hkv, int NS, int Tmax, int D, int chunk, int splits,         \
        float scale, cg_check* flag, unsigned int check, unsigned int slot_check) {            \
        dec_attend_n<T>(q, kc, vc, pos, slot, part, out, Tq, H, Hkv, NS, Tmax, D, chunk, splits, \
                        scale, flag, check, slot_check);                                      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(DA_THREADS)                                  \
        dec_attend_combine_##S(const float* part, T* out, int Tq, int H, int D, int splits) {  \
        dec_attend_combine_n<T>(part, out, Tq, H, D, splits);                                 \
    }

DEC_INSTANCES(float, f32)
DEC_INSTANCES(bf16_t, bf16)
DEC_INSTANCES(f16_t, f16)
