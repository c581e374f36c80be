// Few-row products in the forward layout, y[r, j] = act(alpha·Σ_p x[r, p]·w[j, p] + beta·c[r, j]
// + bias[j]) for r < m ≤ M, x: [m, k] and w: [n, k] row-major of T (bf16 or f16), y and c the
// same buffer of O (T or f32), bias: [n] of O. Compiled after PDL_CUDA, cast.cu (bf16_t,
// f16_t, to_f32, from_f32) and rowops.cu (the decoder's norm row and SwiGLU). Programmatic
// dependent launch: every kernel first lets the next kernel launch (CG_PDL_TRIGGER), then
// waits for the previous kernel and its memory (CG_PDL_WAIT) before touching memory — except,
// with `early` set, each lane's first GV_UNROLL vectors of its weight row, loaded before the
// wait: the launcher sets it only for weights no earlier work writes (a
// loaded model's), so the weight stream of one product starts while the previous kernel is
// still finishing. The sums are the same either way.
//
// Two kernels: the lane kernel (gemv_S_mM, below: FMAs, M ≤ 16 rows) and its tensor-core
// variant (gemv_mma_S_tNT, at the end: mma.sync, up to 8·NT rows), with the same arguments,
// extents and epilogue; and the lane kernel on rows it normalises or gates itself
// (gemv_norm_S_mM, gemv_swiglu_S_mM, M ≤ 4), in between.
//
// A block of the lane kernel is GV_WARPS warps; `ks` of them (1, 2, 4 or 8) share one column j, each summing its
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

// The epilogue of y[at] (column jj) from the sum s: alpha·s, + beta·y[at] (read only with
// beta_on), + bias[jj] (ep ≠ 0), ReLU (ep 2) or GELU (ep 3), one rounding to O.
template <typename O>
__device__ __forceinline__ void gv_store(O* y, const O* bias, long long at, int jj, float s,
                                         float alpha, float beta, int beta_on, int ep) {
    float v = alpha * s;
    if (beta_on) v += beta * to_f32(y[at]);
    if (ep != 0) v += to_f32(bias[jj]);
    if (ep == 2) v = fmaxf(v, 0.0f);
    if (ep == 3) v = gv_gelu(v);
    y[at] = from_f32<O>(v);
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

// x's 16 bytes at p: from global memory through the read-only path, or (XS) from anywhere
// (the rows a fused kernel keeps in shared memory).
template <bool XS>
__device__ __forceinline__ GvVec gv_load_x(const void* p) {
    if (!XS) return gv_load(p);
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    GvVec v;
    v.u[0] = q.x;
    v.u[1] = q.y;
    v.u[2] = q.z;
    v.u[3] = q.w;
    return v;
}

// Nothing to do once the previous kernel is done (the plain products).
struct GvNoPrologue {
    __device__ __forceinline__ void operator()() const {}
};

// pro() runs once the previous kernel is done (after the first weight loads with `early`),
// before x is read.
template <typename T, typename O, int M, bool XS, typename Pro>
__device__ __forceinline__ void gemv_nt(const T* __restrict__ x, const T* __restrict__ w,
                                        O* y, const O* bias, int m, int n, int k,
                                        int ks, float alpha, float beta, int beta_on, int ep,
                                        int early, Pro pro) {
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
    pro();
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
                        gv_widen(gv_load_x<XS>(x + (long long)r * k + 8 * vu), xf, T());
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
            gv_store(y, bias, at, jj, s, alpha, beta, beta_on, ep);
        }
    }
}

#define GV_KERNEL(T, O, S, M)                                                                  \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                \
        gemv_##S##_m##M(const T* x, const T* w, O* y, const O* bias, int m, int n, int k,      \
                        int ks, float alpha, float beta, int beta_on, int ep, int early) {     \
        CG_PDL_TRIGGER();                                                                      \
        if (!early) CG_PDL_WAIT();                                                             \
        gemv_nt<T, O, M, false>(x, w, y, bias, m, n, k, ks, alpha, beta, beta_on, ep, early,  \
                                GvNoPrologue());                                               \
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

// ---- The lane kernel on rows it computes itself ---------------------------------------------
//
// gemv_norm_S_mM and gemv_swiglu_S_mM: the lane kernel's product (same split ks, same sums,
// same epilogue) of m ≤ M rows that each block first computes into shared memory (m·k of T,
// the launch's dynamic shared memory) instead of reading x: the decoder's norm of rows
// r·stride + off of x, with the residual add of a (rowops.cu dec_norm_row_staged: the bits of
// decoder.cu's norm kernel; block 0 alone writes the sums to xw when it is not null), or
// SwiGLU of a packed gate|up row gu [m, 2k] (the bits of decoder.cu's SwiGLU kernel). So one
// launch does the work of two with the same results. The rows are computed after the PDL
// wait, while the lane's first weight loads (with `early`) are in flight, with one vector of
// the row live a thread. Every block computes the rows again, so the launcher takes products
// whose blocks all fit the device at once (one wave), where the launch saved is worth more
// than the rows' recomputation: measured on the H100 the fused kernels held 48 (norm) and 53
// (SwiGLU) registers a thread against the plain kernel's 32, five and four blocks a
// multiprocessor instead of eight, which cost a third of a long weight stream's rate.
//
// Extents (checked by the launcher): as the lane kernel's, with x, a and xw ≥ ((m - 1)·stride
// + off + 1)·k, nw and nb ≥ k, gu ≥ 2·m·k; k ≤ DEC_ROW_THREADS · DEC_NORM_LOADS · 8 for the
// norm; every pointer 16-byte aligned; xw and y overlap no buffer the kernel reads.

#define GV_NORM_KERNEL(T, O, S, M)                                                             \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32) gemv_norm_##S##_m##M(          \
        const T* x, const T* a, T* xw, const float* nw, const float* nb, int stride, int off,  \
        float eps, int rms, const T* w, O* y, const O* bias, int m, int n, int k, int ks,      \
        float alpha, float beta, int beta_on, int ep, int early) {                             \
        extern __shared__ __align__(16) unsigned char gv_rows[];                               \
        __shared__ float sh[DEC_ROW_THREADS / 32];                                             \
        T* xs = reinterpret_cast<T*>(gv_rows);                                                 \
        CG_PDL_TRIGGER();                                                                      \
        if (!early) CG_PDL_WAIT();                                                             \
        T* sum = blockIdx.x == 0 ? xw : nullptr;                                               \
        auto pro = [&]() {                                                                     \
            for (int r = 0; r < m; r++) {                                                      \
                const long long at = ((long long)r * stride + off) * k;                        \
                dec_norm_row_staged<T>(x + at, a ? a + at : nullptr, sum ? sum + at : nullptr, \
                                       nw, nb, xs + (long long)r * k, k, eps, rms, sh);        \
            }                                                                                  \
            __syncthreads();                                                                   \
        };                                                                                     \
        gemv_nt<T, O, M, true>(xs, w, y, bias, m, n, k, ks, alpha, beta, beta_on, ep, early,   \
                               pro);                                                           \
    }

#define GV_SWIGLU_KERNEL(T, S, M)                                                              \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32) gemv_swiglu_##S##_m##M(        \
        const T* gu, const T* w, T* y, const T* bias, int m, int n, int k, int ks,             \
        float alpha, float beta, int beta_on, int ep, int early) {                             \
        extern __shared__ __align__(16) unsigned char gv_rows[];                               \
        T* xs = reinterpret_cast<T*>(gv_rows);                                                 \
        CG_PDL_TRIGGER();                                                                      \
        if (!early) CG_PDL_WAIT();                                                             \
        auto pro = [&]() {                                                                     \
            const int nv = k / 8;                                                              \
            for (int i = threadIdx.x; i < m * nv; i += blockDim.x) {                           \
                const int r = i / nv, c = (i % nv) * 8;                                        \
                float g[8], u[8];                                                              \
                ds_load<T, 8>(gu + (long long)r * 2 * k + c, g);                               \
                ds_load<T, 8>(gu + (long long)r * 2 * k + k + c, u);                           \
                for (int e = 0; e < 8; e++) g[e] = dec_swiglu1<T>(g[e], u[e]);                 \
                ds_store<T, 8>(xs + (long long)r * k + c, g);                                  \
            }                                                                                  \
            __syncthreads();                                                                   \
        };                                                                                     \
        gemv_nt<T, T, M, true>(xs, w, y, bias, m, n, k, ks, alpha, beta, beta_on, ep, early,   \
                               pro);                                                           \
    }

#define GV_FUSED_ROWS(T, O, S)                                                                 \
    GV_NORM_KERNEL(T, O, S, 1)                                                                 \
    GV_NORM_KERNEL(T, O, S, 2)                                                                 \
    GV_NORM_KERNEL(T, O, S, 4)

GV_FUSED_ROWS(bf16_t, bf16_t, bf16_bf16)
GV_FUSED_ROWS(bf16_t, float, bf16_f32)
GV_FUSED_ROWS(f16_t, f16_t, f16_f16)
GV_FUSED_ROWS(f16_t, float, f16_f32)
GV_SWIGLU_KERNEL(bf16_t, bf16_bf16, 1)
GV_SWIGLU_KERNEL(bf16_t, bf16_bf16, 2)
GV_SWIGLU_KERNEL(bf16_t, bf16_bf16, 4)
GV_SWIGLU_KERNEL(f16_t, f16_f16, 1)
GV_SWIGLU_KERNEL(f16_t, f16_f16, 2)
GV_SWIGLU_KERNEL(f16_t, f16_f16, 4)

// ---- The tensor-core variant (engine gemv-mma:KS) ---------------------------------------------
//
// The same product and epilogue on mma.sync m16n8k16 (f32 accumulation): a warp's tile is 16
// columns j of y (16 weight rows, the A operand) by NT·8 rows of x (the B operand, NT tiles of
// 8; rows past m are zeros). Its depth runs in chunks of 32: lane l (g = l / 4, q = l % 4) loads
// the 16 bytes at depth 8q of weight rows g and g + 8 and of x's row g of each tile, and feeds
// them to two mma steps whose k slots 2q, 2q+1, 2q+8, 2q+9 hold depths 8q + 4s .. 8q + 4s + 3
// (step s): A and B use the same slots for the same depths, so the dot products are the
// product's, in another order of the depth. GM_UNROLL chunks of weights are loaded before any
// is used (with `early`, the first ones before the PDL wait). `ks` warps split a tile's depth
// into contiguous chunk ranges; their accumulators meet in shared memory and are summed in
// warp order, then the epilogue as above. Deterministic: the mma and the sums run in a fixed
// order. x's rows are read by every tile (L1: 16·NT bytes a lane per 32 bytes of weights),
// several chunks' worth at once; NT is 1, 2, 4 or 8 (up to 64 rows).

#define GM_UNROLL 4

template <typename T>
__device__ __forceinline__ void gm_mma(float* d, unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void gm_mma<bf16_t>(float* d, unsigned a0, unsigned a1, unsigned a2,
                                               unsigned a3, unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void gm_mma<f16_t>(float* d, unsigned a0, unsigned a1, unsigned a2,
                                              unsigned a3, unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ GvVec gm_zero() {
    GvVec v;
    v.u[0] = v.u[1] = v.u[2] = v.u[3] = 0u;
    return v;
}

// Chunks c .. c + GM_UNROLL (below c1) of the lane's two weight rows, at depth 32·c + 8q
// (zeros past k).
template <typename T>
__device__ __forceinline__ void gm_fetch(GvVec* wa, GvVec* wb, const T* w0, const T* w1, int c,
                                         int c1, int k, int q) {
#pragma unroll
    for (int u = 0; u < GM_UNROLL; u++) {
        const int cu = c + u, kk = 32 * cu + 8 * q;
        const bool in = cu < c1 && kk < k;
        wa[u] = in ? gv_load(w0 + kk) : gm_zero();
        wb[u] = in ? gv_load(w1 + kk) : gm_zero();
    }
}

template <typename T, typename O, int NT>
__device__ __forceinline__ void gemv_mma_nt(const T* __restrict__ x, const T* __restrict__ w,
                                            O* y, const O* bias, int m, int n, int k, int ks,
                                            float alpha, float beta, int beta_on, int ep,
                                            int early) {
    __shared__ float red[GV_WARPS][NT][4][32];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int tiles = GV_WARPS / ks;  // 16-column tiles per block
    const int j0 = (blockIdx.x * tiles + warp / ks) * 16;
    const int slice = warp % ks;
    const int nc = (k + 31) >> 5;  // chunks of 32
    const int c0 = (int)((long long)nc * slice / ks);
    const int c1 = j0 < n ? (int)((long long)nc * (slice + 1) / ks) : c0;
    // Weight rows past n are read as row n - 1; their results are not stored.
    const T* w0 = w + (long long)min(j0 + g, n - 1) * k;
    const T* w1 = w + (long long)min(j0 + g + 8, n - 1) * k;
    GvVec wa[GM_UNROLL], wb[GM_UNROLL];
    gm_fetch(wa, wb, w0, w1, c0, c1, k, q);
    if (early) CG_PDL_WAIT();
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[t][i] = 0.0f;
    // x's vectors of XU chunks (NT·XU 16-byte vectors a lane) are loaded before their mma
    // steps, branch-free — rows past m and depths past k clamped to real ones (in bounds) and
    // their vectors zeroed — so that the loads of every tile of those chunks are in flight
    // together instead of one after another (a chain of L2 round trips at 32 and 64 rows).
    constexpr int XU = NT > 4 ? GM_UNROLL / 2 : GM_UNROLL;
    for (int c = c0; c < c1; c += GM_UNROLL) {
#pragma unroll
        for (int h = 0; h < GM_UNROLL; h += XU) {
            GvVec xv[XU][NT];
#pragma unroll
            for (int u = 0; u < XU; u++) {
                const int kk = 32 * (c + h + u) + 8 * q;
                const bool kin = c + h + u < c1 && kk < k;
                const long long kc = min(kk, k - 8);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const int r = 8 * t + g;
                    const GvVec v = gv_load(x + (long long)min(r, m - 1) * k + kc);
                    xv[u][t] = kin && r < m ? v : gm_zero();
                }
            }
#pragma unroll
            for (int u = 0; u < XU; u++) {
                if (c + h + u < c1) {
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        if (8 * t < m) {  // the same for the whole warp
                            gm_mma<T>(acc[t], wa[h + u].u[0], wb[h + u].u[0], wa[h + u].u[1],
                                      wb[h + u].u[1], xv[u][t].u[0], xv[u][t].u[1]);
                            gm_mma<T>(acc[t], wa[h + u].u[2], wb[h + u].u[2], wa[h + u].u[3],
                                      wb[h + u].u[3], xv[u][t].u[2], xv[u][t].u[3]);
                        }
                    }
                }
            }
        }
        if (c + GM_UNROLL < c1) gm_fetch(wa, wb, w0, w1, c + GM_UNROLL, c1, k, q);
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][t][i][lane] = acc[t][i];
    __syncthreads();
    // Output (row r of x, column jl of the block): tile jl / 16 of the block, its weight row
    // jr = jl % 16 is accumulator row jr; lane (jr % 8)·4 + (r % 8) / 2 holds it in register
    // (jr / 8)·2 + r % 2 of x tile r / 8.
    const int width = tiles * 16;
    for (int i = threadIdx.x; i < width * m; i += blockDim.x) {
        const int jl = i % width, r = i / width;
        const int jj = blockIdx.x * width + jl;
        if (jj >= n) continue;
        const int tl = jl >> 4, jr = jl & 15, t = r >> 3, cr = r & 7;
        const int ln = (jr & 7) * 4 + (cr >> 1), reg = (jr >> 3) * 2 + (cr & 1);
        float s = 0.0f;
        for (int p = 0; p < ks; p++) s += red[tl * ks + p][t][reg][ln];
        gv_store(y, bias, (long long)r * n + jj, jj, s, alpha, beta, beta_on, ep);
    }
}

#define GM_KERNEL(T, O, S, NT)                                                                 \
    extern "C" __global__ void __launch_bounds__(GV_WARPS * 32)                                \
        gemv_mma_##S##_t##NT(const T* x, const T* w, O* y, const O* bias, int m, int n, int k, \
                             int ks, float alpha, float beta, int beta_on, int ep, int early) { \
        CG_PDL_TRIGGER();                                                                      \
        if (!early) CG_PDL_WAIT();                                                             \
        gemv_mma_nt<T, O, NT>(x, w, y, bias, m, n, k, ks, alpha, beta, beta_on, ep, early);    \
    }

#define GM_TILES(T, O, S)                                                                      \
    GM_KERNEL(T, O, S, 1)                                                                      \
    GM_KERNEL(T, O, S, 2)                                                                      \
    GM_KERNEL(T, O, S, 4)                                                                      \
    GM_KERNEL(T, O, S, 8)

GM_TILES(bf16_t, bf16_t, bf16_bf16)
GM_TILES(bf16_t, float, bf16_f32)
GM_TILES(f16_t, f16_t, f16_f16)
GM_TILES(f16_t, float, f16_f32)
