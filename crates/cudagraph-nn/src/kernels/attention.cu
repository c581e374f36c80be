// Attention over a key/value cache, for decoding and prefill: each query token attends to the
// cache positions 0..=its own position (causal), with grouped-query heads. Compiled after
// cast.cu (bf16_t / f16_t and the f32 conversions) and the device-check prologue.
//
// Layouts (row-major): q and out [B, Tq, H, D] (B rows of Tq tokens); k_cache and v_cache
// [S, Hkv, Tmax, D] (S sequence slots); pos [B, Tq] i32, the absolute position of each query
// token (its key and value already in the cache); slot [B] i32, the cache slot of each row
// (null: row b is slot b, and B <= S). Positions and slots live in device memory, so one
// captured decode step stays valid as the sequences grow. A slot outside [0, S) or a position
// outside [0, Tmax) is reported through the stream's check record and the query attends to
// nothing (its output is zero): no read outside the cache.
//
// One block of ATT_WARPS warps per (query token, head): each warp takes every ATT_WARPS-th key,
// its lanes split the head dimension (D <= 32 * ATT_SLOTS), a shuffle sum gives the score, and
// an online softmax keeps a running max, sum and weighted value per warp in f32; the warps are
// combined at the end in a fixed order (deterministic).

#define ATT_WARPS 4
#define ATT_SLOTS 8
#define ATT_NEG_INF __int_as_float(0xff800000)

template <typename T>
__device__ __forceinline__ void attend_kv(const T* __restrict__ q, const T* __restrict__ kc,
                                          const T* __restrict__ vc, const int* __restrict__ pos,
                                          const int* __restrict__ slot, T* __restrict__ out,
                                          int B, int Tq, int H, int Hkv, int S, int Tmax, int D,
                                          float scale, cg_check* flag, unsigned int check,
                                          unsigned int slot_check) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][32 * ATT_SLOTS];
    const int h = blockIdx.x, tq = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kvh = h / (H / Hkv);
    const long long qrow = (((long long)b * Tq + tq) * H + h) * D;
    int p = pos[(long long)b * Tq + tq];
    const int sl = slot ? slot[b] : b;
    const bool slot_ok = sl >= 0 && sl < S;
    bool valid = slot_ok && p >= 0 && p < Tmax;
    if (!slot_ok && threadIdx.x == 0 && tq == 0 && h == 0) cg_report(flag, slot_check, sl, S, b);
    if (slot_ok && !valid && threadIdx.x == 0)
        cg_report(flag, check, p, Tmax, (unsigned long long)b * Tq + tq);
    float qv[ATT_SLOTS], acc[ATT_SLOTS];
#pragma unroll
    for (int i = 0; i < ATT_SLOTS; i++) {
        int d = lane + 32 * i;
        qv[i] = d < D ? to_f32(q[qrow + d]) * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = ATT_NEG_INF, l = 0.0f;
    const long long base = ((long long)(slot_ok ? sl : 0) * Hkv + kvh) * Tmax * D;
    const int last = valid ? p : -1;
    for (int t = warp; t <= last; t += ATT_WARPS) {
        const T* kr = kc + base + (long long)t * D;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_SLOTS; i++) {
            int d = lane + 32 * i;
            if (d < D) s += qv[i] * to_f32(kr[d]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        float mn = fmaxf(m, s);
        float corr = __expf(m - mn);  // 0 when m is -inf
        float w = __expf(s - mn);
        l = l * corr + w;
        const T* vr = vc + base + (long long)t * D;
#pragma unroll
        for (int i = 0; i < ATT_SLOTS; i++) {
            int d = lane + 32 * i;
            float v = d < D ? to_f32(vr[d]) : 0.0f;
            acc[i] = acc[i] * corr + w * v;
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_SLOTS; i++) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float mm = ATT_NEG_INF;
        for (int w = 0; w < ATT_WARPS; w++) mm = fmaxf(mm, sm_m[w]);
        float ll = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) ll += sm_m[w] == ATT_NEG_INF ? 0.0f : sm_l[w] * __expf(sm_m[w] - mm);
#pragma unroll
        for (int i = 0; i < ATT_SLOTS; i++) {
            int d = lane + 32 * i;
            if (d >= D) continue;
            float a = 0.0f;
            for (int w = 0; w < ATT_WARPS; w++)
                if (sm_m[w] != ATT_NEG_INF) a += sm_acc[w][d] * __expf(sm_m[w] - mm);
            out[qrow + d] = from_f32<T>(ll > 0.0f ? a / ll : 0.0f);
        }
    }
}

// k_cache[slot[b], kvh, pos[b, t], :] = k_new[b, t, kvh, :] (and the same for v), one thread
// per element; a slot outside [0, S) or a position outside [0, Tmax) is reported and its row
// skipped.
template <typename T>
__device__ __forceinline__ void kv_append_n(const T* __restrict__ kn, const T* __restrict__ vn,
                                            T* __restrict__ kc, T* __restrict__ vc,
                                            const int* __restrict__ pos,
                                            const int* __restrict__ slot, int B, int Tq, int Hkv,
                                            int S, int Tmax, int D, cg_check* flag,
                                            unsigned int check, unsigned int slot_check) {
    const long long n = (long long)B * Tq * Hkv * D;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int d = (int)(i % D);
        long long r = i / D;
        int kvh = (int)(r % Hkv);
        long long bt = r / Hkv;  // b * Tq + t
        int b = (int)(bt / Tq);
        int p = pos[bt];
        const int sl = slot ? slot[b] : b;
        if (sl < 0 || sl >= S) {
            if (d == 0 && kvh == 0 && bt % Tq == 0) cg_report(flag, slot_check, sl, S, b);
            continue;
        }
        if (p < 0 || p >= Tmax) {
            if (d == 0 && kvh == 0) cg_report(flag, check, p, Tmax, (unsigned long long)bt);
            continue;
        }
        long long dst = (((long long)sl * Hkv + kvh) * Tmax + p) * D + d;
        kc[dst] = kn[i];
        vc[dst] = vn[i];
    }
}

#define ATT_INSTANCES(T, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attend_kv_##S(               \
        const T* q, const T* kc, const T* vc, const int* pos, const int* slot, T* out, int B,   \
        int Tq, int H, int Hkv, int NS, int Tmax, int D, float scale, cg_check* flag,           \
        unsigned int check, unsigned int slot_check) {                                          \
        attend_kv<T>(q, kc, vc, pos, slot, out, B, Tq, H, Hkv, NS, Tmax, D, scale, flag, check, \
                     slot_check);                                                               \
    }                                                                                           \
    extern "C" __global__ void kv_append_##S(const T* kn, const T* vn, T* kc, T* vc,           \
                                             const int* pos, const int* slot, int B, int Tq,    \
                                             int Hkv, int NS, int Tmax, int D, cg_check* flag,  \
                                             unsigned int check, unsigned int slot_check) {     \
        kv_append_n<T>(kn, vn, kc, vc, pos, slot, B, Tq, Hkv, NS, Tmax, D, flag, check,         \
                       slot_check);                                                             \
    }

ATT_INSTANCES(float, f32)
ATT_INSTANCES(bf16_t, bf16)
ATT_INSTANCES(f16_t, f16)
