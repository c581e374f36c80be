// The decoder's fused inference kernels (serving::decoder): token (+ position) embedding,
// LayerNorm or RMSNorm over rows picked with a stride (the residual add before it fused), the split of a packed q|k|v product
// with rotary embedding and the key/value cache write, SwiGLU over a packed gate|up product,
// and attention over the cache split along the keys (flash decoding). One template per
// operation instantiated for float, bf16_t and f16_t (compiled after PDL_CUDA, the
// device-check prologue, cast.cu, cluster.cu and rowops.cu, which holds the norm's row and the
// helpers the few-row products share); every kernel begins with CG_PDL_ENTER() (programmatic
// dependent launch: it waits for the previous kernel before touching memory). Values are
// widened to f32, computed in f32 and rounded to nearest even on store; reductions run in a
// fixed order (deterministic). Where Hugging Face's Llama code rounds an intermediate to the
// model's type (RMSNorm's normalised row before the weight, the cos/sin tables and each
// product of the rotary embedding, SiLU's output before the product), so do these kernels
// (dec_rnd: the identity for f32), so that 16-bit results follow the reference
// implementation's; so does the residual add, which rounds the sum of the stream and a
// product already rounded to T.

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

// Row r = blockIdx.x of y ([rows, cols]) = norm of row xr = r·stride + off of x: LayerNorm
// ((x - mean) · rstd · w + b, b may be null; biased variance, two passes) or, with rms = 1,
// RMSNorm (x · rsqrt(mean(x²) + eps) · w). All in f32, rounded once. With a (not null) the
// row of a at xr is first added into x's (the residual add: x[xr] = x[xr] + a[xr], rounded to
// T and written back, as Hugging Face adds a product already rounded to the model's type),
// and the sum is normalised. Rows of whole 16-byte loads that fit the block's registers, in
// 16-byte aligned buffers, are read once with those loads; others element by element, once
// per pass.
template <typename T>
__device__ __forceinline__ void dec_norm_n(T* x, const T* a, const float* __restrict__ w,
                                           const float* __restrict__ b, T* __restrict__ y,
                                           int cols, float eps, int rms, int stride, int off) {
    constexpr int P = 16 / sizeof(T);
    __shared__ float sh[DEC_ROW_THREADS / 32];
    const long long r = blockIdx.x;
    T* xr = x + (r * stride + off) * cols;
    const T* ar = a ? a + (r * stride + off) * cols : nullptr;
    T* yr = y + r * cols;
    const int tid = threadIdx.x;
    const bool aligned =
        (((unsigned long long)x | (unsigned long long)a | (unsigned long long)y) & 15ull) == 0;
    if (aligned && cols % P == 0 && cols <= DEC_ROW_THREADS * DEC_NORM_LOADS * P) {
        dec_norm_row<T>(xr, ar, ar ? xr : nullptr, w, b, yr, cols, eps, rms, sh);
        return;
    }
    if (ar) {
        // Each thread adds the elements it reads in the passes below (same thread, in order).
        for (int c = tid; c < cols; c += DEC_ROW_THREADS)
            xr[c] = from_f32<T>(to_f32(xr[c]) + to_f32(ar[c]));
    }
    float mu = 0.0f;
    if (!rms) {
        float acc = 0.0f;
        for (int c = tid; c < cols; c += DEC_ROW_THREADS) acc += to_f32(xr[c]);
        mu = dec_block_sum(acc, sh) / (float)cols;
    }
    float acc = 0.0f;
    for (int c = tid; c < cols; c += DEC_ROW_THREADS) {
        float d = to_f32(xr[c]) - mu;
        acc += d * d;
    }
    const float rs = 1.0f / sqrtf(dec_block_sum(acc, sh) / (float)cols + eps);
    for (int c = tid; c < cols; c += DEC_ROW_THREADS) {
        float v = rms ? dec_rnd<T>(to_f32(xr[c]) * rs) * w[c] : (to_f32(xr[c]) - mu) * rs * w[c];
        if (b) v += b[c];
        yr[c] = from_f32<T>(v);
    }
}

// The cosine and sine of the angle pos · freq, in f32 and rounded to T (as Hugging Face's
// rotary tables are in the model's type). The product is rounded on its own (__fmul_rn: never
// fused into the argument reduction), so every kernel gets the same bits.
template <typename T>
__device__ __forceinline__ void dec_angle(int pos, float freq, float& cs, float& sn) {
    sincosf(__fmul_rn((float)pos, freq), &sn, &cs);
    cs = dec_rnd<T>(cs);
    sn = dec_rnd<T>(sn);
}

// Rotates the pair (a, c), components j and j + D/2 of a query or key head, by the angle
// whose cosine and sine (from dec_angle) are cs and sn, as apply_rotary_pos_emb does: each
// product rounded on its own (never fused into the sum; the caller rounds the sums on store).
template <typename T>
__device__ __forceinline__ void dec_rotate_cs(float cs, float sn, float& a, float& c) {
    const float ra = dec_rnd<T>(__fmul_rn(a, cs)) - dec_rnd<T>(__fmul_rn(c, sn));
    const float rc = dec_rnd<T>(__fmul_rn(c, cs)) + dec_rnd<T>(__fmul_rn(a, sn));
    a = ra;
    c = rc;
}

// dec_rotate_cs by the angle pos · freq.
template <typename T>
__device__ __forceinline__ void dec_rotate(int pos, float freq, float& a, float& c) {
    float cs, sn;
    dec_angle<T>(pos, freq, cs, sn);
    dec_rotate_cs<T>(cs, sn, a, c);
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
        if (inv_freq && hh < H + Hkv) dec_rotate<T>(p, inv_freq[j], a, c);
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
        y[i] = from_f32<T>(dec_swiglu1<T>(g, u));
    }
}

// ---- Attention over the cache, split along the keys (flash decoding) -------------------------

// Threads (4 warps) of the attention kernel (the launcher uses exactly this), keys a lane group
// loads before using them, valid keys per split in use, and the most splits (the merge keeps
// one weight per split and head in shared memory).
#define DS_THREADS 128
#define DS_WARPS 4
#define DS_INFLIGHT 4
#define DS_SPLIT_KEYS 64
#define DS_MAX_SPLITS 64
#define DS_MAX_CLUSTER 8
#define DS_MAX_D 256
#define DS_NEG_INF __int_as_float(0xff800000)

// Attention of query tokens over the cache, split along the keys: q and out [N, H, D] (N =
// B·Tq tokens), caches [S, Hkv, Tmax, D], pos [N], slot [B]; token n of row b = n / Tq attends
// to positions 0..=pos[n] of slot slot[b] (nothing, and a report, when the slot or position
// is outside the cache: its output is zeros).
//
// Block (n, y, s): the query heads h0 .. h0 + gc (gc ≤ GM) of key/value head y / hg (hg blocks
// share one key/value head when it serves more than GM query heads), over split s of `used`
// equal runs of the valid keys (rounded to 32 keys; `used` ≤ `splits` gives no split fewer
// than DS_SPLIT_KEYS keys, so a short cache is not split at all). Each key and value row is
// read once for all gc heads. The block's threads form KPB lane groups of LPK lanes (P
// elements a load, PPL loads a lane); group k takes the split's keys k, k + KPB, ...
// (DS_INFLIGHT of them loaded, keys and values together, before any is used), sums each key's
// dot products over its lanes and keeps its own running max, sum and p · v per head (online
// softmax, no synchronisation inside the loop). The groups are merged at the end in group
// order. As in flash attention (and so in transformers' 16-bit attention), p is rounded to T
// for the product with v while the softmax sums stay f32. With one split in use the block
// writes out. Otherwise the splits are merged in split order, deterministically: with
// `cluster` (the grid's splits are one thread-block cluster, sm_90+) each block leaves its
// unnormalised sums and (max, sum) in shared memory and, after a cluster barrier, every block
// of the cluster merges a slice of the outputs through distributed shared memory; without,
// each block writes them to part and stat and the last block of (n, y) to finish (count, zero
// on entry and left zero) merges them. f32 arithmetic, rounded once on store.
//
// With `early` (one-token steps only, and only where the launcher's caller promises that no
// kernel still running writes pos, slot, inv_freq or the cache rows below each token's
// position), the block reads its token's position and slot, works out the rotation angles and
// loads its first keys and values before waiting for the previous kernel
// (griddepcontrol.wait), so those loads overlap that kernel's end. The arithmetic is the
// same either way (the same bits).
//
// DC, when not 0, is the head dimension the instance was compiled for (its module's
// DS_HEAD_DIM, which the launcher matches to the shape's); the D argument is then not read.
template <typename T, int P, int PPL, int GM, int DC>
__device__ __forceinline__ void dec_attend_n(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const int* __restrict__ pos, const int* __restrict__ slot, T* __restrict__ out,
    float* __restrict__ part, float* __restrict__ stat, unsigned int* __restrict__ count, int Tq,
    int H, int Hkv, int S, int Tmax, int Darg, float scale, int splits, int fresh, int early,
    int cluster, const float* __restrict__ inv_freq, cg_check* flag, unsigned int check,
    unsigned int slot_check) {
    typedef DsRaw<P * sizeof(T)> Raw;
    const int D = DC > 0 ? DC : Darg;
    __shared__ float red[GM * DS_THREADS * P * PPL];  // KPB·D ≤ DS_THREADS·P·PPL
    __shared__ float gm_[DS_THREADS][GM], gl_[DS_THREADS][GM];  // each group's max and sum
    __shared__ float sm[GM], sl[GM], stot[GM];
    __shared__ float wsplit[GM][DS_MAX_SPLITS];
    __shared__ float pc[GM][DS_MAX_D];  // this split's unnormalised sums (cluster merge)
    __shared__ float sq[GM][DS_MAX_D];
    __shared__ float scs[2][DS_MAX_D / 2];  // cos and sin of each rotation angle, rounded to T
    __shared__ __align__(16) T skv[2][DS_MAX_D];
    __shared__ int last;
    const long long n = blockIdx.x;
    const int G = H / Hkv, hg = (G + GM - 1) / GM;
    const int kvh = blockIdx.y / hg, sub = blockIdx.y % hg;
    const int h0 = kvh * G + sub * GM, gc = min(GM, G - sub * GM);
    const int s = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // Lanes per key: the power of two covering the row's loads, PPL loads a lane.
    const int LP = D / P, need = (LP + PPL - 1) / PPL;
    const int LPK = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : need <= 16 ? 16 : 32;
    const int KPW = 32 / LPK, KPB = DS_WARPS * KPW;
    const int u = lane % LPK, kg = warp * KPW + lane / LPK;
    const int b = (int)(n / Tq), half = D / 2;
    int p = 0, sln = 0, used = 1, k0 = 0, k1 = 0, skip = -1;
    bool slot_ok = false, valid = false;
    long long base = 0;
    Raw kraw[DS_INFLIGHT][PPL], vraw[DS_INFLIGHT][PPL];
    // Where the token's keys are (pos and slot), the split's run [k0, k1) and the key the
    // block takes from the product instead of the cache (skip: the token's own, in a fresh
    // step whose run holds it).
    auto locate = [&]() {
        p = pos[n];
        sln = slot[b];
        slot_ok = sln >= 0 && sln < S;
        valid = slot_ok && p >= 0 && p < Tmax;
        const int L = valid ? p + 1 : 0;
        // Splits in use: no more than one per DS_SPLIT_KEYS valid keys (the others idle).
        used = max(1, min(splits, (L + DS_SPLIT_KEYS - 1) / DS_SPLIT_KEYS));
        const int chunk = (((L + used - 1) / used) + 31) & ~31;
        k0 = min(L, s * chunk);
        k1 = min(L, k0 + chunk);
        skip = fresh && valid && p >= k0 && p < k1 ? p : -1;
        base = ((long long)(slot_ok ? sln : 0) * Hkv + kvh) * Tmax * D;
    };
    // The rotation angles of a fresh step into scs (read after a barrier).
    auto angles = [&]() {
        if (fresh && inv_freq && s < used)
            for (int j = tid; j < half; j += DS_THREADS) dec_angle<T>(p, inv_freq[j], scs[0][j], scs[1][j]);
    };
    // Keys jb + r·KPB + lane / LPK of the group (jb is the same for the whole warp, whose
    // lanes shuffle together), keys and values, DS_INFLIGHT of them; not the skipped one.
    auto load = [&](int jb) {
#pragma unroll
        for (int r = 0; r < DS_INFLIGHT; r++) {
            const int j = jb + r * KPB + lane / LPK;
            const long long row = base + (long long)j * D;
#pragma unroll
            for (int c = 0; c < PPL; c++) {
                const int pk = u + c * LPK;
                if (j < k1 && pk < LP && j != skip) {
                    kraw[r][c] = *reinterpret_cast<const Raw*>(kc + row + pk * P);
                    vraw[r][c] = *reinterpret_cast<const Raw*>(vc + row + pk * P);
                }
            }
        }
    };
    // The token's own key and value (in skv) into the caches at (slot, p), by the first head
    // group's block whose split holds p: once the block is done with everything else, so
    // that no barrier waits for these stores (nothing in this kernel reads them back).
    auto put_own = [&]() {
        if (fresh && skip >= 0 && sub == 0) {
            const long long at = (((long long)sln * Hkv + kvh) * Tmax + p) * D;
            for (int i = tid; i < 2 * D; i += DS_THREADS) {
                T* dst = const_cast<T*>(i < D ? kc : vc);
                dst[at + i % D] = skv[i / D][i % D];
            }
        }
    };
    const int jb0 = warp * KPW;  // relative to k0
    if (early) {
        locate();
        angles();
        if (s < used) load(k0 + jb0);
    }
    CG_PDL_WAIT();
    if (!early) locate();
    if (tid == 0 && blockIdx.y == 0 && s == 0) {
        if (!slot_ok && n % Tq == 0) cg_report(flag, slot_check, sln, S, b);
        if (slot_ok && !valid) cg_report(flag, check, p, Tmax, (unsigned long long)n);
    }
    if (s < used) {
        // One-token steps (fresh): q is the packed q|k|v product [N, H + 2·Hkv, D]. The block
        // rotates its query heads itself (with inv_freq, as dec_qkv does, rounded to T as
        // dec_qkv stores them), and the block whose split holds the token's own position p
        // takes that key (rotated) and value from the product too, into shared memory; the
        // block of the first head group also writes them into the caches at (slot, p), last
        // (put_own). No block reads position p from the caches then, and the bits are those
        // of dec_qkv followed by this kernel. Every load of the product is issued before any
        // is used.
        if (fresh) {
            constexpr int ITEMS = ((GM + 2) * (DS_MAX_D / 2) + DS_THREADS - 1) / DS_THREADS;
            const int heads = H + 2 * Hkv;
            const T* src = q + n * heads * D;
            float a[ITEMS], c[ITEMS];
#pragma unroll
            for (int k = 0; k < ITEMS; k++) {
                const int i = tid + k * DS_THREADS, g = i / half, j = i % half;
                // g < GM: query head h0 + g; g == GM: key head kvh; g == GM + 1: its value head.
                if (i < (GM + 2) * half && (g < GM ? g < gc : skip >= 0)) {
                    const int hh = g < GM ? h0 + g : g == GM ? H + kvh : H + Hkv + kvh;
                    a[k] = to_f32(src[hh * D + j]);
                    c[k] = to_f32(src[hh * D + j + half]);
                }
            }
            if (!early) angles();  // while the product's loads are in flight
            __syncthreads();       // the angles
#pragma unroll
            for (int k = 0; k < ITEMS; k++) {
                const int i = tid + k * DS_THREADS, g = i / half, j = i % half;
                if (i >= (GM + 2) * half || (g < GM ? g >= gc : skip < 0)) continue;
                if (inv_freq && g <= GM) dec_rotate_cs<T>(scs[0][j], scs[1][j], a[k], c[k]);
                if (g < GM) {
                    sq[g][j] = dec_rnd<T>(a[k]);
                    sq[g][j + half] = dec_rnd<T>(c[k]);
                    continue;
                }
                skv[g - GM][j] = from_f32<T>(a[k]);
                skv[g - GM][j + half] = from_f32<T>(c[k]);
            }
            __syncthreads();
        }
        float qr[PPL][GM][P], acc[PPL][GM][P], mr[GM], lr[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) {
            mr[g] = DS_NEG_INF;
            lr[g] = 0.0f;
#pragma unroll
            for (int c = 0; c < PPL; c++) {
                const int pk = u + c * LPK;
                if (pk < LP && g < gc && fresh) {
#pragma unroll
                    for (int e = 0; e < P; e++) qr[c][g][e] = sq[g][pk * P + e];
                } else if (pk < LP && g < gc) {
                    ds_load<T, P>(q + (n * H + h0 + g) * D + pk * P, qr[c][g]);
                } else {
#pragma unroll
                    for (int e = 0; e < P; e++) qr[c][g][e] = 0.0f;
                }
#pragma unroll
                for (int e = 0; e < P; e++) {
                    qr[c][g][e] *= scale;
                    acc[c][g][e] = 0.0f;
                }
            }
        }
        for (int jb = k0 + jb0; jb < k1; jb += DS_INFLIGHT * KPB) {
            if (jb != k0 + jb0 || !early) load(jb);
#pragma unroll
            for (int r = 0; r < DS_INFLIGHT; r++) {
                const int j = jb + r * KPB + lane / LPK;
                if (j == skip) {
#pragma unroll
                    for (int c = 0; c < PPL; c++) {
                        const int pk = u + c * LPK;
                        if (pk < LP) {
                            kraw[r][c] = *reinterpret_cast<const Raw*>(&skv[0][pk * P]);
                            vraw[r][c] = *reinterpret_cast<const Raw*>(&skv[1][pk * P]);
                        }
                    }
                }
                float dot[GM];
#pragma unroll
                for (int g = 0; g < GM; g++) dot[g] = 0.0f;
#pragma unroll
                for (int c = 0; c < PPL; c++) {
                    if (j < k1 && u + c * LPK < LP) {
                        const T* ke = reinterpret_cast<const T*>(&kraw[r][c]);
#pragma unroll
                        for (int e = 0; e < P; e++) {
                            const float kv = to_f32(ke[e]);
#pragma unroll
                            for (int g = 0; g < GM; g++) dot[g] += qr[c][g][e] * kv;
                        }
                    }
                }
#pragma unroll
                for (int g = 0; g < GM; g++)
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1)
                        dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
                if (j < k1) {
                    float w[GM];
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (dot[g] > mr[g]) {  // a new maximum: rescale what came before
                            const float corr = __expf(mr[g] - dot[g]);
                            lr[g] *= corr;
#pragma unroll
                            for (int c = 0; c < PPL; c++)
#pragma unroll
                                for (int e = 0; e < P; e++) acc[c][g][e] *= corr;
                            mr[g] = dot[g];
                        }
                        const float e = __expf(dot[g] - mr[g]);
                        lr[g] += e;
                        w[g] = dec_rnd<T>(e);
                    }
#pragma unroll
                    for (int c = 0; c < PPL; c++) {
                        if (u + c * LPK < LP) {
                            const T* ve = reinterpret_cast<const T*>(&vraw[r][c]);
#pragma unroll
                            for (int e = 0; e < P; e++) {
                                const float vv = to_f32(ve[e]);
#pragma unroll
                                for (int g = 0; g < GM; g++) acc[c][g][e] += w[g] * vv;
                            }
                        }
                    }
                }
            }
        }
        // Merge the groups: the block's max per head, each group's weight exp(m_k - max), the
        // weighted sums added in group order.
#pragma unroll
        for (int c = 0; c < PPL; c++) {
            const int pk = u + c * LPK;
            if (pk < LP) {
#pragma unroll
                for (int g = 0; g < GM; g++)
                    if (g < gc) {
#pragma unroll
                        for (int e = 0; e < P; e++)
                            red[(kg * GM + g) * D + pk * P + e] = acc[c][g][e];
                    }
            }
        }
        if (u == 0) {
#pragma unroll
            for (int g = 0; g < GM; g++) {
                gm_[kg][g] = mr[g];
                gl_[kg][g] = lr[g];
            }
        }
        __syncthreads();
        if (tid < gc) {
            float mx = DS_NEG_INF;
            for (int k = 0; k < KPB; k++) mx = fmaxf(mx, gm_[k][tid]);
            float tot = 0.0f;
            for (int k = 0; k < KPB; k++) {
                const float wk = gl_[k][tid] > 0.0f ? __expf(gm_[k][tid] - mx) : 0.0f;
                gm_[k][tid] = wk;  // now the group's weight
                tot += wk * gl_[k][tid];
            }
            sm[tid] = mx;
            sl[tid] = tot;
        }
        __syncthreads();
        for (int i = tid; i < gc * D; i += DS_THREADS) {
            const int g = i / D, d = i % D;
            float a = 0.0f;
            for (int k = 0; k < KPB; k++) {
                const float wk = gm_[k][g];
                if (wk > 0.0f) a += wk * red[(k * GM + g) * D + d];
            }
            const long long row = n * H + h0 + g;
            if (used == 1) {
                out[row * D + d] = from_f32<T>(sl[g] > 0.0f ? a / sl[g] : 0.0f);
            } else if (cluster) {
                pc[g][d] = a;
            } else {
                part[(row * splits + s) * D + d] = a;
                if (d == 0) {
                    stat[(row * splits + s) * 2] = sm[g];
                    stat[(row * splits + s) * 2 + 1] = sl[g];
                }
            }
        }
    }
    if (used == 1) {  // the same for every block of (n, y)
        put_own();
        return;
    }
    if (cluster) {
        // Every split's sums are in its block's shared memory. Thread g < gc: head g's maximum
        // over the splits that saw keys and each split's weight exp(m_s - max), summed in
        // split order; then each block writes its slice of the gc·D outputs, the splits added
        // in split order. The second barrier keeps every block's shared memory alive until
        // the cluster has read it.
        cg_cluster_sync();
        if (tid < gc) {
            float ms[DS_MAX_CLUSTER], ls[DS_MAX_CLUSTER];
            float mx = DS_NEG_INF;
#pragma unroll
            for (int k = 0; k < DS_MAX_CLUSTER; k++) {
                if (k < used) {
                    ms[k] = cg_dsmem_load(&sm[tid], (unsigned)k);
                    ls[k] = cg_dsmem_load(&sl[tid], (unsigned)k);
                    if (ls[k] > 0.0f) mx = fmaxf(mx, ms[k]);
                }
            }
            float tot = 0.0f;
#pragma unroll
            for (int k = 0; k < DS_MAX_CLUSTER; k++) {
                if (k < used) {
                    const float wk = ls[k] > 0.0f ? __expf(ms[k] - mx) : 0.0f;
                    wsplit[tid][k] = wk;
                    tot += wk * ls[k];
                }
            }
            stot[tid] = tot;
        }
        __syncthreads();
        const int per = (gc * D + (int)gridDim.z - 1) / (int)gridDim.z;
        const int i1 = min(gc * D, (s + 1) * per);
        for (int i = s * per + tid; i < i1; i += DS_THREADS) {
            const int g = i / D, d = i % D;
            float a = 0.0f;
            for (int k = 0; k < used; k++) {
                const float wk = wsplit[g][k];
                if (wk > 0.0f) a += wk * cg_dsmem_load(&pc[g][d], (unsigned)k);
            }
            out[(n * H + h0 + g) * D + d] = from_f32<T>(stot[g] > 0.0f ? a / stot[g] : 0.0f);
        }
        put_own();
        cg_cluster_sync_relaxed();
        return;
    }
    if (s >= used) return;
    __threadfence();
    __syncthreads();
    unsigned int* cnt = count + n * gridDim.y + blockIdx.y;
    if (tid == 0) last = atomicAdd(cnt, 1u) == (unsigned int)(used - 1);
    __syncthreads();
    if (!last) {
        put_own();
        return;
    }
    __threadfence();
    // Warp g: head g's maximum over the splits that saw keys, and each split's weight
    // exp(m_s - max) (0 for an empty split) into shared memory; the total sum in sl[g].
    if (warp < gc) {
        const float* st = stat + (n * H + h0 + warp) * splits * 2;
        float mx = DS_NEG_INF;
        for (int k = lane; k < used; k += 32)
            if (__ldcg(st + 2 * k + 1) > 0.0f) mx = fmaxf(mx, __ldcg(st + 2 * k));
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float tot = 0.0f;
        for (int k = lane; k < used; k += 32) {
            const float lk = __ldcg(st + 2 * k + 1);
            const float wk = lk > 0.0f ? __expf(__ldcg(st + 2 * k) - mx) : 0.0f;
            wsplit[warp][k] = wk;
            tot += wk * lk;
        }
        // Lanes hold splits lane, lane + 32: summed by the same butterfly every time.
        for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
        if (lane == 0) sl[warp] = tot;
    }
    __syncthreads();
    for (int i = tid; i < gc * D; i += DS_THREADS) {
        const int g = i / D, d = i % D;
        const long long row = n * H + h0 + g;
        float a = 0.0f;
        for (int k = 0; k < used; k++) {
            const float wk = wsplit[g][k];
            if (wk > 0.0f) a += wk * __ldcg(part + (row * splits + k) * D + d);
        }
        out[row * D + d] = from_f32<T>(sl[g] > 0.0f ? a / sl[g] : 0.0f);
    }
    if (tid == 0) *cnt = 0u;
    put_own();
}

// dec_attend_NAME_S: P elements a load, PPL loads a lane, GM query heads a block, DC the head
// dimension fixed at compile time (0: the D argument), MINB blocks a multiprocessor the
// compiler must fit (registers). The 16-byte instances ("v") serve 1, 2 and up to 4 query
// heads per key/value head, compiled per head dimension (DS_HEAD_DIM, a module of their own:
// the lane layout, the loops over a row and the shuffles of each dot product are then
// constants); "v4o" is "v4" held to 128 registers a thread, four blocks a multiprocessor
// instead of three, and "v1o" "v1" held to 64, eight blocks, for grids of more blocks than
// the device holds at once; the pair instance ("p") serves head dimensions
// that are not whole 16-byte loads, or rows not aligned to them. They let the next kernel
// launch at once and wait for the previous one inside (after the early loads).
#define DS_VEC_LOADS(T) (sizeof(T) == 4 ? 2 : 1)
#define DEC_ATTEND(T, S, NAME, P, PPL, GM, DC, MINB)                                          \
    extern "C" __global__ void __launch_bounds__(DS_THREADS, MINB) dec_attend_##NAME##_##S(   \
        const T* q, const T* kc, const T* vc, const int* pos, const int* slot, T* out,         \
        float* part, float* stat, unsigned int* count, int Tq, int H, int Hkv, int NS,         \
        int Tmax, int D, float scale, int splits, int fresh, int early, int cluster,           \
        const float* inv_freq, cg_check* flag, unsigned int check, unsigned int slot_check) {  \
        CG_PDL_TRIGGER();                                                                     \
        dec_attend_n<T, P, PPL, GM, DC>(q, kc, vc, pos, slot, out, part, stat, count, Tq, H,   \
                                        Hkv, NS, Tmax, D, scale, splits, fresh, early,         \
                                        cluster, inv_freq, flag, check, slot_check);           \
    }

#ifdef DS_HEAD_DIM
// The attention module of one head dimension and element type (DS_ATTEND_T, suffix
// DS_ATTEND_S): the 16-byte instances only.
#define DEC_ATTEND_FIXED(T, S)                                                                \
    DEC_ATTEND(T, S, v1, 16 / sizeof(T), DS_VEC_LOADS(T), 1, DS_HEAD_DIM, 1)                  \
    DEC_ATTEND(T, S, v2, 16 / sizeof(T), DS_VEC_LOADS(T), 2, DS_HEAD_DIM, 1)                  \
    DEC_ATTEND(T, S, v4, 16 / sizeof(T), DS_VEC_LOADS(T), 4, DS_HEAD_DIM, 1)                  \
    DEC_ATTEND(T, S, v4o, 16 / sizeof(T), DS_VEC_LOADS(T), 4, DS_HEAD_DIM, 4)                 \
    DEC_ATTEND(T, S, v1o, 16 / sizeof(T), DS_VEC_LOADS(T), 1, DS_HEAD_DIM, 8)

DEC_ATTEND_FIXED(DS_ATTEND_T, DS_ATTEND_S)
#else
#define DEC_INSTANCES(T, S)                                                                   \
    extern "C" __global__ void dec_embed_##S(const int* ids, const T* wte, const T* wpe,       \
                                             const int* pos, T* y, int tokens, int dim,        \
                                             int vocab, int npos, cg_check* flag,              \
                                             unsigned int id_check, unsigned int pos_check) {  \
        CG_PDL_ENTER();                                                                       \
        dec_embed_n<T>(ids, wte, wpe, pos, y, tokens, dim, vocab, npos, flag, id_check,       \
                       pos_check);                                                            \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_ROW_THREADS)                             \
        dec_norm_##S(T* x, const T* a, const float* w, const float* b, T* y, int cols,        \
                     float eps, int rms, int stride, int off) {                               \
        CG_PDL_ENTER();                                                                       \
        dec_norm_n<T>(x, a, w, b, y, cols, eps, rms, stride, off);                            \
    }                                                                                         \
    extern "C" __global__ void dec_qkv_##S(const T* qkv, const float* inv_freq, const int* pos, \
                                           const int* slot, T* q_out, T* kc, T* vc, int N,     \
                                           int Tq, int H, int Hkv, int D, int NS, int Tmax,    \
                                           cg_check* flag, unsigned int pos_check,             \
                                           unsigned int slot_check) {                          \
        CG_PDL_ENTER();                                                                       \
        dec_qkv_n<T>(qkv, inv_freq, pos, slot, q_out, kc, vc, N, Tq, H, Hkv, D, NS, Tmax, flag, \
                     pos_check, slot_check);                                                  \
    }                                                                                         \
    extern "C" __global__ void dec_swiglu_##S(const T* gu, T* y, int N, int M) {              \
        CG_PDL_ENTER();                                                                       \
        dec_swiglu_n<T>(gu, y, N, M);                                                         \
    }                                                                                         \
    DEC_ATTEND(T, S, p4, 2, 4, 4, 0, 1)

DEC_INSTANCES(float, f32)
DEC_INSTANCES(bf16_t, bf16)
DEC_INSTANCES(f16_t, f16)
#endif
