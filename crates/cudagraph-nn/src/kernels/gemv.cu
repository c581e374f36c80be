// Few-row products in the forward layout, y[r, j] = act(alpha·Σ_p x[r, p]·w[j, p] + beta·c[r, j]
// + bias[j]) for r < m ≤ M, x: [m, k] and w: [n, k] row-major of T (bf16 or f16), y and c the
// same buffer of O (T or f32), bias: [n] of O. Compiled after PDL_CUDA and cast.cu (bf16_t,
// f16_t, to_f32, from_f32). Programmatic dependent launch: every kernel first lets the next
// kernel launch (CG_PDL_TRIGGER), then waits for the previous kernel and its memory
// (CG_PDL_WAIT) before touching memory — except, with `early` set, each lane's first
// GV_UNROLL vectors of its weight row, loaded before the wait: the launcher sets it only for
// weights no earlier work writes (a loaded model's), so the weight stream of one product
// starts while the previous kernel is still finishing. The sums are the same either way.
//
// A block is GV_WARPS warps; `ks` of them (1, 2, 4 or 8) share one column j, each summing its
// own contiguous range of k in 8-element vectors (16 bytes): lane l takes the range's vectors
// l, l + 32, l + 64, ..., GV_UNROLL of them loaded before any is used, so that several loads of
// the weight row are in flight per lane. The rows of x are read with the same 16-byte loads (the
// same k positions for every column: they stay in L1). Sums in f32 in a fixed order: each lane
// its vectors in order, then a butterfly over the warp's lanes, then the ks warps of the column
// in warp order through shared memory; the epilogue in f32 and one rounding to O on store. The
// results do not depend on timing (replays equal eager runs bit for bit).
//
// Extents (checked by the launcher): x ≥ m·k, w ≥ n·k, y ≥ m·n, bias ≥ n when not null;
// k a multiple of 8, x and w 16-byte aligned; 1 ≤ m ≤ M; ks divides GV_WARPS; n·k and m·n are
// indexed as long long. With beta_on = 0, c is never read (it may hold anything, NaN included).
// ep: 0 none, 1 bias, 2 bias + ReLU, 3 bias + GELU (tanh approximation).

#define GV_WARPS 8
#define GV_UNROLL 4

struct alignas(16) GvVec {
    unsigned int u[4];
};

// Eight 16-bit values packed in a GvVec, widened to f32 (exactly).
__device__ __forceinline__ void gv_widen(const GvVec& v, float* f, bf16_t) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(v.u[i] << 16);
        f[2 * i + 1] = __uint_as_float(v.u[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float gv_f16(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void gv_widen(const GvVec& v, float* f, f16_t) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = gv_f16((unsigned short)(v.u[i] & 0xffffu));
        f[2 * i + 1] = gv_f16((unsigned short)(v.u[i] >> 16));
    }
}

__device__ __forceinline__ GvVec gv_load(const void* p) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    GvVec v;
    v.u[0] = q.x;
    v.u[1] = q.y;
    v.u[2] = q.z;
    v.u[3] = q.w;
    return v;
}

// cuBLASLt's GELU: 0.5·v·(1 + tanh(√(2/π)·(v + 0.044715·v³))).
__device__ __forceinline__ float gv_gelu(float v) {
    return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

// Lane `v`'s vectors v, v + 32, ..., GV_UNROLL of them below v1, of the weight row wr.
template <typename T>
__device__ __forceinline__ void gv_fetch(GvVec* wv, const T* wr, int v, int v1) {
#pragma unroll
    for (int u = 0; u < GV_UNROLL; u++) {
        const int vu = v + 32 * u;
        if (vu < v1) wv[u] = gv_load(wr + 8 * vu);
    }
}

template <typename T, typename O, int M>
__device__ __forceinline__ void gemv_nt(const T* __restrict__ x, const T* __restrict__ w,
                                        O* y, const O* bias, int m, int n, int k,
                                        int ks, float alpha, float beta, int beta_on, int ep,
                                        int early) {
    __shared__ float red[GV_WARPS * M];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int cols = GV_WARPS / ks;  // columns per block
    const int j = blockIdx.x * cols + warp / ks;
    const int slice = warp % ks;
    const int nv = k >> 3;  // 8-element vectors per row
    // This warp's vectors [v0, v1) of the row; none for a column past n.
    const int v0 = (int)((long long)nv * slice / ks);
    const int v1 = j < n ? (int)((long long)nv * (slice + 1) / ks) : v0;
    const T* wr = w + (long long)(j < n ? j : 0) * k;
    const int step = 32 * GV_UNROLL;
    GvVec wv[GV_UNROLL];
    gv_fetch(wv, wr, v0 + lane, v1);
    if (early) CG_PDL_WAIT();
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; r++) acc[r] = 0.0f;
    for (int v = v0 + lane; v < v1; v += step) {
#pragma unroll
        for (int u = 0; u < GV_UNROLL; u++) {
            const int vu = v + 32 * u;
            if (vu < v1) {
                float wf[8];
                gv_widen(wv[u], wf, T());
#pragma unroll
                for (int r = 0; r < M; r++) {
                    if (r < m) {
                        float xf[8];
                        gv_widen(gv_load(x + (long long)r * k + 8 * vu), xf, T());
                        float s = acc[r];
#pragma unroll
                        for (int e = 0; e < 8; e++) s = fmaf(wf[e], xf[e], s);
                        acc[r] = s;
                    }
                }
            }
        }
        if (v + step < v1) gv_fetch(wv, wr, v + step, v1);
    }
#pragma unroll
    for (int r = 0; r < M; r++) {
        float s = acc[r];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) red[warp * M + r] = s;
    }
    __syncthreads();
    // Thread t finishes row t % M of the block's column t / M.
    const int t = threadIdx.x;
    if (t < cols * M) {
        const int c = t / M;
        const int r = t % M;
        const int jj = blockIdx.x * cols + c;
        if (jj < n && r < m) {
            float s = 0.0f;
            for (int q = 0; q < ks; q++) s += red[(c * ks + q) * M + r];
            const long long at = (long long)r * n + jj;
            float v = alpha * s;
            if (beta_on) v += beta * to_f32(y[at]);
            if (ep != 0) v += to_f32(bias[jj]);
            if (ep == 2) v = fmaxf(v, 0.0f);
            if (ep == 3) v = gv_gelu(v);
            y[at] = from_f32<O>(v);
        }
    }
}

#define GV_KERNEL(T, O, S, M)                                                                  \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                \
        gemv_##S##_m##M(const T* x, const T* w, O* y, const O* bias, int m, int n, int k,      \
                        int ks, float alpha, float beta, int beta_on, int ep, int early) {     \
        CG_PDL_TRIGGER();                                                                      \
        if (!early) CG_PDL_WAIT();                                                             \
        gemv_nt<T, O, M>(x, w, y, bias, m, n, k, ks, alpha, beta, beta_on, ep, early);         \
    }

#define GV_ROWS(T, O, S)                                                                       \
    GV_KERNEL(T, O, S, 1)                                                                      \
    GV_KERNEL(T, O, S, 2)                                                                      \
    GV_KERNEL(T, O, S, 4)                                                                      \
    GV_KERNEL(T, O, S, 8)                                                                      \
    GV_KERNEL(T, O, S, 16)

GV_ROWS(bf16_t, bf16_t, bf16_bf16)
GV_ROWS(bf16_t, float, bf16_f32)
GV_ROWS(f16_t, f16_t, f16_f16)
GV_ROWS(f16_t, float, f16_f32)
