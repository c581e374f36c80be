// Causal self-attention for training, over GPT-2's packed projections, forward and backward.
// Compiled after cast.cu (bf16_t / f16_t and the f32 conversions); one template per kernel,
// instantiated for float, bf16_t and f16_t.
//
// Layouts (row-major): qkv [B·T, 3·C] with C = H·D, each row q | k | v, each of them
// [H, D]; out and dout [B·T, C]; lse and delta [B, H, T] f32. Token t of sequence b attends to
// the tokens 0..=t of its sequence, scores q·k · scale, softmax in f32.
//
// Tiles of CA_TILE = 32 rows: a block of (rows, head, sequence) stages its own rows and then,
// one tile at a time, the 32 rows of the other side in (dynamic) shared memory as f32
// (16-byte loads where D is a multiple of 8 / 4 elements and the buffers are aligned, else one
// element at a time), each row padded to ld = 4·odd floats so that lane j reading row j with
// 16-byte loads meets no bank conflict. Warp w takes the block's rows w, w + CA_WARPS, …:
// lane j scores row j of the tile in full (ca_dot, the same function with the same arguments
// in every kernel, so the backward's probabilities come from the bits the forward's
// log-sum-exp saw), one shuffle reduction gives the tile's max and sum, and the lanes then add
// the tile's rows, split over the head dimension (lane + 32·i), in tile order. The forward
// keeps an online softmax in f32 and saves lse = m + log(l). The backward runs in two kernels
// with no atomics: one writes dq per query row over the key tiles (and the row's
// delta = dout · out), the other dk and dv per key row over the query tiles from its own on,
// in order. Every sum runs in a fixed order: the same inputs give the same bits, eager or
// replayed.

#define CA_WARPS 4
#define CA_TILE 32
#define CA_SLOTS 4
#define CA_LD 132
#define CA_FROWS 16
#define CA_BROWS 8
#define CA_NEG_INF __int_as_float(0xff800000)

// The padded row of D floats: 4·k with k = ⌈D/4⌉ made odd (132 at D = 128, CA_LD).
__device__ __forceinline__ int ca_ld(int D) { return 4 * (((D + 3) / 4) | 1); }

// Each kernel's shared rows, sized by the launcher for its D (at most 80 rows of CA_LD floats,
// 42,240 bytes: within the 48 KiB a launch may ask for without opting in).
extern __shared__ __align__(16) float ca_smem[];

// Σ_d q[d]·k[d] over ⌈D/4⌉ float4 groups of two padded shared rows (zero past D): four
// partial sums (d mod 4), added as (s0 + s1) + (s2 + s3).
__device__ __forceinline__ float ca_dot(const float* q, const float* k, int D4) {
    const float4* a = reinterpret_cast<const float4*>(q);
    const float4* b = reinterpret_cast<const float4*>(k);
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll 4
    for (int c = 0; c < D4; c++) {
        const float4 x = a[c], y = b[c];
        s0 = fmaf(x.x, y.x, s0);
        s1 = fmaf(x.y, y.y, s1);
        s2 = fmaf(x.z, y.z, s2);
        s3 = fmaf(x.w, y.w, s3);
    }
    return (s0 + s1) + (s2 + s3);
}

__device__ __forceinline__ float ca_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A butterfly sum: every lane gets the same bits.
__device__ __forceinline__ float ca_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Whether rows of D elements of T at these bases can be read with 16-byte loads.
template <typename T>
__device__ __forceinline__ bool ca_vec(int D, const void* a, const void* b) {
    const unsigned long long bases = (unsigned long long)a | (unsigned long long)b;
    return D % (16 / (int)sizeof(T)) == 0 && (bases & 15ull) == 0;
}

// Columns [D, ld) of n shared rows set to zero (ca_stage writes only [0, D)).
__device__ __forceinline__ void ca_pad(float* sh, int ld, int n, int D) {
    const int w = ld - D;
    for (int i = threadIdx.x; i < n * w; i += blockDim.x) {
        const int r = i / w;
        sh[r * ld + D + (i - r * w)] = 0.0f;
    }
}

// The elements of one 16-byte load as f32 (bit operations on its words: no aliasing).
__device__ __forceinline__ void ca_unpack(uint4 raw, float* f) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
}

template <typename H>
__device__ __forceinline__ void ca_unpack16(uint4 raw, float* f) {
    const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        H lo, hi;
        lo.bits = (unsigned short)(w[i] & 0xffffu);
        hi.bits = (unsigned short)(w[i] >> 16);
        f[2 * i] = to_f32(lo);  // little-endian: the lower address in the low half
        f[2 * i + 1] = to_f32(hi);
    }
}

__device__ __forceinline__ void ca_unpack(uint4 raw, const float*, float* f) { ca_unpack(raw, f); }
__device__ __forceinline__ void ca_unpack(uint4 raw, const bf16_t*, float* f) {
    ca_unpack16<bf16_t>(raw, f);
}
__device__ __forceinline__ void ca_unpack(uint4 raw, const f16_t*, float* f) {
    ca_unpack16<f16_t>(raw, f);
}

// Shared rows [0, n) of stride ld: row r < nv is the global row src + r·gs (D elements) as
// f32, the others zero; columns [0, D) only.
template <typename T>
__device__ __forceinline__ void ca_stage(float* sh, int ld, const T* __restrict__ src,
                                         long long gs, int n, int nv, int D, bool vec) {
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        const int per = D / V;
        for (int i = threadIdx.x; i < n * per; i += blockDim.x) {
            const int r = i / per, c = i - r * per;
            float f[V];
            if (r < nv) {
                ca_unpack(*reinterpret_cast<const uint4*>(src + r * gs + c * V), src, f);
            } else {
#pragma unroll
                for (int j = 0; j < V; j++) f[j] = 0.0f;
            }
            float4* o = reinterpret_cast<float4*>(sh + r * ld + c * V);
#pragma unroll
            for (int j = 0; j < V / 4; j++)
                o[j] = make_float4(f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3]);
        }
    } else {
        for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
            const int r = i / D, d = i - r * D;
            sh[r * ld + d] = r < nv ? to_f32(src[r * gs + d]) : 0.0f;
        }
    }
}

// out[b·T + t, h·D..] = softmax_s≤t(q_t · k_s · scale) · v_s; lse[(b·H + h)·T + t] saved.
// Block (x, h, b) takes the query rows t0 = x·CA_FROWS .. t0 + CA_FROWS (those below T) and
// the key tiles up to its last row.
template <typename T>
__device__ __forceinline__ void causal_fwd_n(const T* __restrict__ qkv, T* __restrict__ out,
                                             float* __restrict__ lse, int T_, int H, int D,
                                             float scale) {
    constexpr int RPW = CA_FROWS / CA_WARPS;
    const int ld = ca_ld(D);
    float* sq = ca_smem;  // CA_FROWS rows, then two tiles: (CA_FROWS + 2·CA_TILE)·ld floats
    float* sk = sq + CA_FROWS * ld;
    float* sv = sk + CA_TILE * ld;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * CA_FROWS;
    const int nq = min(CA_FROWS, T_ - t0);  // ≥ 1: the grid has ⌈T / CA_FROWS⌉ blocks
    const int kend = t0 + nq;               // keys 0..kend
    const int D4 = (D + 3) / 4;
    const long long C = (long long)H * D, C3 = 3 * C;
    const long long seq = (long long)b * T_;
    const T* base = qkv + seq * C3 + (long long)h * D;  // q of token 0; + C: k, + 2C: v
    const bool vec = ca_vec<T>(D, qkv, qkv);
    ca_pad(sq, ld, CA_FROWS, D);
    ca_pad(sk, ld, CA_TILE, D);
    ca_pad(sv, ld, CA_TILE, D);
    ca_stage<T>(sq, ld, base + t0 * C3, C3, CA_FROWS, nq, D, vec);
    float m[RPW], l[RPW], acc[RPW][CA_SLOTS];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        m[i] = CA_NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int s = 0; s < CA_SLOTS; s++) acc[i][s] = 0.0f;
    }
    for (int k0 = 0; k0 < kend; k0 += CA_TILE) {
        __syncthreads();  // the previous tile read by every warp
        const int nk = min(CA_TILE, kend - k0);
        ca_stage<T>(sk, ld, base + C + k0 * C3, C3, CA_TILE, nk, D, vec);
        ca_stage<T>(sv, ld, base + 2 * C + k0 * C3, C3, CA_TILE, nk, D, vec);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + CA_WARPS * i, t = t0 + r;
            if (r >= nq || t < k0) continue;  // the same for the whole warp
            const bool ok = k0 + lane <= t;
            const float sc = ok ? ca_dot(sq + r * ld, sk + lane * ld, D4) * scale : CA_NEG_INF;
            const float mn = fmaxf(m[i], ca_max(sc));  // finite: key k0 ≤ t is scored
            const float corr = expf(m[i] - mn);        // 0 while m is -inf
            const float p = ok ? expf(sc - mn) : 0.0f;
            l[i] = l[i] * corr + ca_sum(p);
            m[i] = mn;
            const int nj = min(CA_TILE, t - k0 + 1);
            float e[CA_SLOTS], o[CA_SLOTS];
#pragma unroll
            for (int s = 0; s < CA_SLOTS; s++) {
                e[s] = 0.0f;
                o[s] = 0.0f;
            }
            int j = 0;
            for (; j + 1 < nj; j += 2) {
                const float w0 = __shfl_sync(0xffffffffu, p, j);
                const float w1 = __shfl_sync(0xffffffffu, p, j + 1);
                const float* v0 = sv + j * ld + lane;
#pragma unroll
                for (int s = 0; s < CA_SLOTS; s++) {
                    if (lane + 32 * s < D) {
                        e[s] = fmaf(w0, v0[32 * s], e[s]);
                        o[s] = fmaf(w1, v0[ld + 32 * s], o[s]);
                    }
                }
            }
            if (j < nj) {
                const float w0 = __shfl_sync(0xffffffffu, p, j);
                const float* v0 = sv + j * ld + lane;
#pragma unroll
                for (int s = 0; s < CA_SLOTS; s++)
                    if (lane + 32 * s < D) e[s] = fmaf(w0, v0[32 * s], e[s]);
            }
#pragma unroll
            for (int s = 0; s < CA_SLOTS; s++) acc[i][s] = acc[i][s] * corr + (e[s] + o[s]);
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        const int r = warp + CA_WARPS * i, t = t0 + r;
        if (r >= nq) continue;
        const float inv = 1.0f / l[i];
        T* orow = out + (seq + t) * C + (long long)h * D;
#pragma unroll
        for (int s = 0; s < CA_SLOTS; s++) {
            const int d = lane + 32 * s;
            if (d < D) orow[d] = from_f32<T>(acc[i][s] * inv);
        }
        if (lane == 0) lse[((long long)b * H + h) * T_ + t] = m[i] + logf(l[i]);
    }
}

// The query part of dqkv for the rows t0 = x·CA_BROWS .. t0 + CA_BROWS of block (x, h, b):
// with p = exp(q·k·scale − lse), dp = dout_t · v_s and delta = dout_t · out_t,
// dq = scale · Σ_s≤t p·(dp − delta)·k_s over the key tiles in order; delta is saved for the
// key kernel.
template <typename T>
__device__ __forceinline__ void causal_bwd_q_n(const T* __restrict__ qkv,
                                               const T* __restrict__ out,
                                               const T* __restrict__ dout,
                                               const float* __restrict__ lse,
                                               float* __restrict__ delta, T* __restrict__ dqkv,
                                               int T_, int H, int D, float scale) {
    constexpr int RPW = CA_BROWS / CA_WARPS;
    const int ld = ca_ld(D);
    float* sq = ca_smem;  // 2·CA_BROWS rows, then two tiles: (2·CA_BROWS + 2·CA_TILE)·ld floats
    float* sdo = sq + CA_BROWS * ld;
    float* sk = sdo + CA_BROWS * ld;
    float* sv = sk + CA_TILE * ld;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * CA_BROWS;
    const int nq = min(CA_BROWS, T_ - t0);  // ≥ 1
    const int kend = t0 + nq;
    const int D4 = (D + 3) / 4;
    const long long C = (long long)H * D, C3 = 3 * C;
    const long long seq = (long long)b * T_;
    const long long stats = ((long long)b * H + h) * T_;
    const T* base = qkv + seq * C3 + (long long)h * D;
    const T* dbase = dout + seq * C + (long long)h * D;
    const bool vec = ca_vec<T>(D, qkv, dout);
    ca_pad(sq, ld, CA_BROWS, D);
    ca_pad(sdo, ld, CA_BROWS, D);
    ca_pad(sk, ld, CA_TILE, D);
    ca_pad(sv, ld, CA_TILE, D);
    ca_stage<T>(sq, ld, base + t0 * C3, C3, CA_BROWS, nq, D, vec);
    ca_stage<T>(sdo, ld, dbase + t0 * C, C, CA_BROWS, nq, D, vec);
    ca_stage<T>(sk, ld, out + (seq + t0) * C + (long long)h * D, C, CA_BROWS, nq, D,
                vec && ca_vec<T>(D, out, out));
    __syncthreads();
    float dl[RPW], lt[RPW], dq[RPW][CA_SLOTS];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        const int r = warp + CA_WARPS * i, t = t0 + r;
        dl[i] = 0.0f;
        lt[i] = 0.0f;
#pragma unroll
        for (int s = 0; s < CA_SLOTS; s++) dq[i][s] = 0.0f;
        if (r >= nq) continue;
        // delta = dout · out as dp = dout · v is formed (out's rows staged in sk): at one
        // token out = v and dp − delta is exactly 0.
        dl[i] = ca_dot(sdo + r * ld, sk + r * ld, D4);
        lt[i] = lse[stats + t];
    }
    for (int k0 = 0; k0 < kend; k0 += CA_TILE) {
        __syncthreads();
        const int nk = min(CA_TILE, kend - k0);
        ca_stage<T>(sk, ld, base + C + k0 * C3, C3, CA_TILE, nk, D, vec);
        ca_stage<T>(sv, ld, base + 2 * C + k0 * C3, C3, CA_TILE, nk, D, vec);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + CA_WARPS * i, t = t0 + r;
            if (r >= nq || t < k0) continue;
            const bool ok = k0 + lane <= t;
            const float sc = ca_dot(sq + r * ld, sk + lane * ld, D4) * scale;
            const float p = ok ? expf(sc - lt[i]) : 0.0f;
            const float dp = ca_dot(sdo + r * ld, sv + lane * ld, D4);
            const float ds = ok ? p * (dp - dl[i]) : 0.0f;
            const int nj = min(CA_TILE, t - k0 + 1);
            float e[CA_SLOTS], o[CA_SLOTS];
#pragma unroll
            for (int s = 0; s < CA_SLOTS; s++) {
                e[s] = 0.0f;
                o[s] = 0.0f;
            }
            int j = 0;
            for (; j + 1 < nj; j += 2) {
                const float w0 = __shfl_sync(0xffffffffu, ds, j);
                const float w1 = __shfl_sync(0xffffffffu, ds, j + 1);
                const float* k = sk + j * ld + lane;
#pragma unroll
                for (int s = 0; s < CA_SLOTS; s++) {
                    if (lane + 32 * s < D) {
                        e[s] = fmaf(w0, k[32 * s], e[s]);
                        o[s] = fmaf(w1, k[ld + 32 * s], o[s]);
                    }
                }
            }
            if (j < nj) {
                const float w0 = __shfl_sync(0xffffffffu, ds, j);
                const float* k = sk + j * ld + lane;
#pragma unroll
                for (int s = 0; s < CA_SLOTS; s++)
                    if (lane + 32 * s < D) e[s] = fmaf(w0, k[32 * s], e[s]);
            }
#pragma unroll
            for (int s = 0; s < CA_SLOTS; s++) dq[i][s] += e[s] + o[s];
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        const int r = warp + CA_WARPS * i, t = t0 + r;
        if (r >= nq) continue;
        T* g = dqkv + (seq + t) * C3 + (long long)h * D;
#pragma unroll
        for (int s = 0; s < CA_SLOTS; s++) {
            const int d = lane + 32 * s;
            if (d < D) g[d] = from_f32<T>(dq[i][s] * scale);
        }
        if (lane == 0) delta[stats + t] = dl[i];
    }
}

// The key and value parts of dqkv for the key rows s0 = x·CA_BROWS .. s0 + CA_BROWS of block
// (x, h, b): over the query tiles from the one holding s0 on, and in each over the query rows
// t ≥ s in order, dv = Σ p·dout_t and dk = scale · Σ p·(dp − delta_t)·q_t.
template <typename T>
__device__ __forceinline__ void causal_bwd_kv_n(const T* __restrict__ qkv,
                                                const T* __restrict__ dout,
                                                const float* __restrict__ lse,
                                                const float* __restrict__ delta,
                                                T* __restrict__ dqkv, int T_, int H, int D,
                                                float scale) {
    constexpr int RPW = CA_BROWS / CA_WARPS;
    const int ld = ca_ld(D);
    float* sk = ca_smem;  // 2·CA_BROWS rows, then two tiles: (2·CA_BROWS + 2·CA_TILE)·ld floats
    float* sv = sk + CA_BROWS * ld;
    float* sq = sv + CA_BROWS * ld;
    float* sdo = sq + CA_TILE * ld;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z;
    const int s0 = blockIdx.x * CA_BROWS;
    const int ns = min(CA_BROWS, T_ - s0);  // ≥ 1
    const int D4 = (D + 3) / 4;
    const long long C = (long long)H * D, C3 = 3 * C;
    const long long seq = (long long)b * T_;
    const long long stats = ((long long)b * H + h) * T_;
    const T* base = qkv + seq * C3 + (long long)h * D;
    const T* dbase = dout + seq * C + (long long)h * D;
    const bool vec = ca_vec<T>(D, qkv, dout);
    ca_pad(sk, ld, CA_BROWS, D);
    ca_pad(sv, ld, CA_BROWS, D);
    ca_pad(sq, ld, CA_TILE, D);
    ca_pad(sdo, ld, CA_TILE, D);
    ca_stage<T>(sk, ld, base + C + s0 * C3, C3, CA_BROWS, ns, D, vec);
    ca_stage<T>(sv, ld, base + 2 * C + s0 * C3, C3, CA_BROWS, ns, D, vec);
    float dk[RPW][CA_SLOTS], dv[RPW][CA_SLOTS];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
#pragma unroll
        for (int s = 0; s < CA_SLOTS; s++) {
            dk[i][s] = 0.0f;
            dv[i][s] = 0.0f;
        }
    }
    for (int q0 = s0 / CA_TILE * CA_TILE; q0 < T_; q0 += CA_TILE) {
        __syncthreads();
        const int nt = min(CA_TILE, T_ - q0);
        ca_stage<T>(sq, ld, base + q0 * C3, C3, CA_TILE, nt, D, vec);
        ca_stage<T>(sdo, ld, dbase + q0 * C, C, CA_TILE, nt, D, vec);
        const int tq = q0 + lane;
        const float lq = tq < T_ ? lse[stats + tq] : 0.0f;
        const float dlq = tq < T_ ? delta[stats + tq] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + CA_WARPS * i, s = s0 + r;
            if (r >= ns || s >= q0 + nt) continue;  // no query row t ≥ s in this tile
            const bool ok = tq < T_ && tq >= s;
            const float sc = ca_dot(sq + lane * ld, sk + r * ld, D4) * scale;
            const float p = ok ? expf(sc - lq) : 0.0f;
            const float dp = ca_dot(sdo + lane * ld, sv + r * ld, D4);
            const float ds = ok ? p * (dp - dlq) : 0.0f;
            float ek[CA_SLOTS], ev[CA_SLOTS];
#pragma unroll
            for (int c = 0; c < CA_SLOTS; c++) {
                ek[c] = 0.0f;
                ev[c] = 0.0f;
            }
            for (int j = max(0, s - q0); j < nt; j++) {
                const float wp = __shfl_sync(0xffffffffu, p, j);
                const float wd = __shfl_sync(0xffffffffu, ds, j);
                const float* qr = sq + j * ld + lane;
                const float* dr = sdo + j * ld + lane;
#pragma unroll
                for (int c = 0; c < CA_SLOTS; c++) {
                    if (lane + 32 * c < D) {
                        ev[c] = fmaf(wp, dr[32 * c], ev[c]);
                        ek[c] = fmaf(wd, qr[32 * c], ek[c]);
                    }
                }
            }
#pragma unroll
            for (int c = 0; c < CA_SLOTS; c++) {
                dk[i][c] += ek[c];
                dv[i][c] += ev[c];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        const int r = warp + CA_WARPS * i, s = s0 + r;
        if (r >= ns) continue;
        T* g = dqkv + (seq + s) * C3 + C + (long long)h * D;
#pragma unroll
        for (int c = 0; c < CA_SLOTS; c++) {
            const int d = lane + 32 * c;
            if (d < D) {
                g[d] = from_f32<T>(dk[i][c] * scale);
                g[d + C] = from_f32<T>(dv[i][c]);
            }
        }
    }
}

#define CA_INSTANCES(T, S)                                                                   \
    extern "C" __global__ void causal_fwd_##S(const T* qkv, T* out, float* lse, int T_,      \
                                              int H, int D, float scale) {                   \
        causal_fwd_n<T>(qkv, out, lse, T_, H, D, scale);                                     \
    }                                                                                        \
    extern "C" __global__ void causal_bwd_q_##S(const T* qkv, const T* out, const T* dout,   \
                                                const float* lse, float* delta, T* dqkv,     \
                                                int T_, int H, int D, float scale) {         \
        causal_bwd_q_n<T>(qkv, out, dout, lse, delta, dqkv, T_, H, D, scale);                \
    }                                                                                        \
    extern "C" __global__ void causal_bwd_kv_##S(const T* qkv, const T* dout,                \
                                                 const float* lse, const float* delta,       \
                                                 T* dqkv, int T_, int H, int D,              \
                                                 float scale) {                              \
        causal_bwd_kv_n<T>(qkv, dout, lse, delta, dqkv, T_, H, D, scale);                    \
    }

CA_INSTANCES(float, f32)
CA_INSTANCES(bf16_t, bf16)
CA_INSTANCES(f16_t, f16)
