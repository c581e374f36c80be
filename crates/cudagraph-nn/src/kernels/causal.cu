// Causal self-attention for training, over GPT-2's packed projections, forward and backward.
// Compiled after cast.cu (bf16_t / f16_t and the f32 conversions); one template per kernel,
// instantiated for float, bf16_t and f16_t.
//
// Layouts (row-major): qkv [B·T, 3·C] with C = H·D, each row q | k | v, each of them
// [H, D]; out and dout [B·T, C]; lse and delta [B, H, T] f32. Token t of sequence b attends to
// the tokens 0..=t of its sequence, scores q·k · scale, softmax in f32.
//
// One warp per (row, head, sequence): its lanes split the head dimension (D ≤ 32·CA_SLOTS),
// a butterfly shuffle gives every lane the same dot product (the same bits in every lane and
// in every kernel that forms it: the forward, and both backward kernels recompute the
// probabilities from the saved row log-sum-exp). The forward keeps an online softmax in f32
// and saves lse = m + log(l). The backward runs in two kernels with no atomics: one warp per
// query row writes dq (and the row's delta = dout · out), then one warp per key row walks the
// later query rows in order for dk and dv. Every sum runs in a fixed order: the same inputs
// give the same bits, eager or replayed.

#define CA_WARPS 4
#define CA_SLOTS 4
#define CA_NEG_INF __int_as_float(0xff800000)

// a · row over the head dimension; a holds this lane's components lane + 32·i.
template <typename T>
__device__ __forceinline__ float ca_dot(const float* a, const T* __restrict__ row, int lane,
                                        int D) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) {
        int d = lane + 32 * i;
        if (d < D) s += a[i] * to_f32(row[d]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

template <typename T>
__device__ __forceinline__ void ca_load(float* a, const T* __restrict__ row, int lane, int D) {
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) {
        int d = lane + 32 * i;
        a[i] = d < D ? to_f32(row[d]) : 0.0f;
    }
}

// out[b·T + t, h·D..] = softmax_s≤t(q_t · k_s · scale) · v_s; lse[(b·H + h)·T + t] saved.
// Warp w of block (x, h, b) takes row t = x·CA_WARPS + w (rows past T do nothing).
template <typename T>
__device__ __forceinline__ void causal_fwd_n(const T* __restrict__ qkv, T* __restrict__ out,
                                             float* __restrict__ lse, int T_, int H, int D,
                                             float scale) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * CA_WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    if (t >= T_) return;
    const long long C = (long long)H * D, C3 = 3 * C;
    const long long seq = (long long)b * T_;
    float qv[CA_SLOTS], acc[CA_SLOTS];
    ca_load(qv, qkv + (seq + t) * C3 + (long long)h * D, lane, D);
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) acc[i] = 0.0f;
    float m = CA_NEG_INF, l = 0.0f;
    for (int s = 0; s <= t; s++) {
        const T* kr = qkv + (seq + s) * C3 + C + (long long)h * D;
        const T* vr = kr + C;
        const float sc = ca_dot(qv, kr, lane, D) * scale;
        const float mn = fmaxf(m, sc);
        const float corr = expf(m - mn);  // 0 while m is -inf
        const float w = expf(sc - mn);
        l = l * corr + w;
#pragma unroll
        for (int i = 0; i < CA_SLOTS; i++) {
            int d = lane + 32 * i;
            if (d < D) acc[i] = acc[i] * corr + w * to_f32(vr[d]);
        }
        m = mn;
    }
    const float inv = 1.0f / l;
    T* orow = out + (seq + t) * C + (long long)h * D;
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) {
        int d = lane + 32 * i;
        if (d < D) orow[d] = from_f32<T>(acc[i] * inv);
    }
    if (lane == 0) lse[((long long)b * H + h) * T_ + t] = m + logf(l);
}

// The query part of dqkv for row t (warp as in the forward): with p = exp(q·k·scale − lse),
// dp = dout_t · v_s and delta = dout_t · out_t, dq = scale · Σ_s≤t p·(dp − delta)·k_s; delta
// is saved for the key kernel.
template <typename T>
__device__ __forceinline__ void causal_bwd_q_n(const T* __restrict__ qkv,
                                               const T* __restrict__ out,
                                               const T* __restrict__ dout,
                                               const float* __restrict__ lse,
                                               float* __restrict__ delta, T* __restrict__ dqkv,
                                               int T_, int H, int D, float scale) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * CA_WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    if (t >= T_) return;
    const long long C = (long long)H * D, C3 = 3 * C;
    const long long seq = (long long)b * T_;
    const long long stat = ((long long)b * H + h) * T_ + t;
    float qv[CA_SLOTS], dov[CA_SLOTS], dq[CA_SLOTS];
    ca_load(qv, qkv + (seq + t) * C3 + (long long)h * D, lane, D);
    ca_load(dov, dout + (seq + t) * C + (long long)h * D, lane, D);
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) dq[i] = 0.0f;
    const float dl = ca_dot(dov, out + (seq + t) * C + (long long)h * D, lane, D);
    const float lt = lse[stat];
    for (int s = 0; s <= t; s++) {
        const T* kr = qkv + (seq + s) * C3 + C + (long long)h * D;
        const float p = expf(ca_dot(qv, kr, lane, D) * scale - lt);
        const float dp = ca_dot(dov, kr + C, lane, D);
        const float ds = p * (dp - dl);
#pragma unroll
        for (int i = 0; i < CA_SLOTS; i++) {
            int d = lane + 32 * i;
            if (d < D) dq[i] += ds * to_f32(kr[d]);
        }
    }
    T* g = dqkv + (seq + t) * C3 + (long long)h * D;
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) {
        int d = lane + 32 * i;
        if (d < D) g[d] = from_f32<T>(dq[i] * scale);
    }
    if (lane == 0) delta[stat] = dl;
}

// The key and value parts of dqkv for key row s = x·CA_WARPS + w: over the query rows
// t = s, s + 1, …, T − 1 in order, dv = Σ p·dout_t and dk = scale · Σ p·(dp − delta_t)·q_t.
template <typename T>
__device__ __forceinline__ void causal_bwd_kv_n(const T* __restrict__ qkv,
                                                const T* __restrict__ dout,
                                                const float* __restrict__ lse,
                                                const float* __restrict__ delta,
                                                T* __restrict__ dqkv, int T_, int H, int D,
                                                float scale) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int s = blockIdx.x * CA_WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    if (s >= T_) return;
    const long long C = (long long)H * D, C3 = 3 * C;
    const long long seq = (long long)b * T_;
    const long long stats = ((long long)b * H + h) * T_;
    float kv[CA_SLOTS], vv[CA_SLOTS], dk[CA_SLOTS], dv[CA_SLOTS];
    const T* kr = qkv + (seq + s) * C3 + C + (long long)h * D;
    ca_load(kv, kr, lane, D);
    ca_load(vv, kr + C, lane, D);
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) {
        dk[i] = 0.0f;
        dv[i] = 0.0f;
    }
    for (int t = s; t < T_; t++) {
        const T* qr = qkv + (seq + t) * C3 + (long long)h * D;
        const T* dor = dout + (seq + t) * C + (long long)h * D;
        const float p = expf(ca_dot(kv, qr, lane, D) * scale - lse[stats + t]);
        const float dp = ca_dot(vv, dor, lane, D);
        const float ds = p * (dp - delta[stats + t]);
#pragma unroll
        for (int i = 0; i < CA_SLOTS; i++) {
            int d = lane + 32 * i;
            if (d < D) {
                dv[i] += p * to_f32(dor[d]);
                dk[i] += ds * to_f32(qr[d]);
            }
        }
    }
    T* g = dqkv + (seq + s) * C3 + C + (long long)h * D;
#pragma unroll
    for (int i = 0; i < CA_SLOTS; i++) {
        int d = lane + 32 * i;
        if (d < D) {
            g[d] = from_f32<T>(dk[i] * scale);
            g[d + C] = from_f32<T>(dv[i]);
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
