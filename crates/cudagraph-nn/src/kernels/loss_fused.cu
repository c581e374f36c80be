// Loss kernels with the gradient computed in the forward pass (their own NVRTC module, after
// DEVICE_CHECK_CUDA and common.cu; launched only from losses.rs).
//
// Cross-entropy is row-parallel: one warp per row (up to 1024 classes) or one block per row,
// an online max/sum of exp in one read of the row (eight loads in flight per thread, folded in
// a batch at a time), and the unit gradient (softmax - onehot) / rows written in a second
// read. The mean over rows is deterministic: each
// row's loss goes to row_loss[r] and one block sums them in a fixed order (sum_scaled); small
// problems run in a single block that does both (one node). Few wide rows (fewer rows than
// multiprocessors) are split into chunks across blocks: statistics per chunk, then per row the
// chunks merged in a fixed order, each row's loss and (when asked) the gradient per chunk,
// then the mean as above (sum_scaled).
//
// MSE: one pass computes the per-block partial sums of (p - t)^2 and, when asked, the unit
// gradient 2·scale·(p - t); one block then sums the partials in a fixed order (or a single
// block writes the loss directly). Backward multiplies the saved gradient by dloss in place.

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ bool lf_aligned16(const void* p) {
    return (((unsigned long long)p) & 15ull) == 0ull;
}

// Folds U values into the running max m and running sum s of exp(z - m) over the values seen:
// one rescale per batch. Values of -inf (masked logits, or the padding of a last batch) add 0
// (exp(-inf - m) = 0 once m is finite); while every value so far is -inf, m stays -inf and
// nothing is added (exp(-inf - -inf) would be NaN).
template <int U>
__device__ __forceinline__ void ms_add_batch(float& m, float& s, const float (&x)[U]) {
    float mx = x[0];
#pragma unroll
    for (int u = 1; u < U; u++) mx = fmaxf(mx, x[u]);
    if (mx > m) { s *= expf(m - mx); m = mx; }
    if (m == NEG_INF) return;
    float t = 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++) t += expf(x[u] - m);
    s += t;
}

// The running max and sum of exp over zr[c] for c = first, first + step, ... < end, eight
// loads in flight before they are folded in: a row's elements are independent, and taking them
// one at a time would wait a memory latency per element. The last one to seven are one more
// batch of eight, the missing ones -inf (one latency, not one per element). The order is fixed
// by (first, end, step): the same bits on every run. Indices read stay below end.
__device__ __forceinline__ void ms_scan(const float* __restrict__ zr, int first, int end,
        int step, float& m, float& s) {
    int c = first;
    for (; c + 7 * step < end; c += 8 * step) {
        float x[8];
#pragma unroll
        for (int u = 0; u < 8; u++) x[u] = zr[c + u * step];
        ms_add_batch<8>(m, s, x);
    }
    if (c < end) {
        float x[8];
#pragma unroll
        for (int u = 0; u < 8; u++) x[u] = c + u * step < end ? zr[c + u * step] : NEG_INF;
        ms_add_batch<8>(m, s, x);
    }
}

// grad[c] = (softmax - onehot(t)) * inv_rows over c = first, first + step, ... < end, four
// loads in flight (the last one to three as one more batch). softmax = exp(z - m) / s (DIV)
// or exp(z - m) * inv_s.
template <bool DIV>
__device__ __forceinline__ void ce_grad_scan(const float* __restrict__ zr, float* __restrict__ gr,
        int first, int end, int step, float m, float s, int t, float inv_rows) {
    const float inv_s = 1.0f / s;
    for (int c = first; c < end; c += 4 * step) {
        float x[4];
#pragma unroll
        for (int u = 0; u < 4; u++) x[u] = c + u * step < end ? zr[c + u * step] : 0.0f;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int cu = c + u * step;
            if (cu < end) {
                const float e = DIV ? expf(x[u] - m) / s : expf(x[u] - m) * inv_s;
                gr[cu] = (e - (cu == t ? 1.0f : 0.0f)) * inv_rows;
            }
        }
    }
}

__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
    if (s2 == 0.0f && m2 == NEG_INF) return;
    if (s == 0.0f && m == NEG_INF) { m = m2; s = s2; return; }
    const float mm = fmaxf(m, m2);
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

// One row's target, clamped into [0, cols) and reported when outside (by the caller's lane).
__device__ __forceinline__ int ce_clamp_target(int t, int r, int cols, bool report,
        cg_check* flag, unsigned int check) {
    if (t < 0 || t >= cols) {
        if (report) cg_report(flag, check, t, cols, r);
        t = min(max(t, 0), cols - 1);
    }
    return t;
}

// A group of `lanes` lanes per row (a power of two up to 32; a warp holds 32 / lanes rows):
// 32 for rows of hundreds of classes, fewer for narrow rows so that a single block covers more
// rows in one pass. With `loss` set (a single block), the block also writes the mean;
// otherwise each row's loss goes to row_loss[r]. With lanes = 32 the merge order is the one of
// a warp per row.
extern "C" __global__ void __launch_bounds__(1024) ce_fwd_warp(const float* z, const int* tgt, float* grad, float* row_loss,
        float* loss, int rows, int cols, float inv_rows, int lanes, cg_check* flag, unsigned int check) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const int per_warp = 32 / lanes, sub = lane & (lanes - 1), head = lane & ~(lanes - 1);
    float acc = 0.0f;
    const long long step = (long long)gridDim.x * wpb * per_warp;
    for (long long rb = ((long long)blockIdx.x * wpb + warp) * per_warp; rb < rows; rb += step) {
        const long long r = rb + lane / lanes;
        const bool valid = r < rows;
        const float* zr = z + (valid ? r : 0ll) * cols;
        // The target's load is issued before the scan and used after it (clamping it first
        // would wait for it before the row's loads start).
        const int t_raw = valid ? tgt[r] : 0;
        float m = NEG_INF, s = 0.0f;
        if (valid) ms_scan(zr, sub, cols, lanes, m, s);
        for (int o = lanes >> 1; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
            ms_merge(m, s, m2, s2);
        }
        // Lanes merged in different orders: use the group's first lane's result everywhere.
        m = __shfl_sync(0xffffffffu, m, head);
        s = __shfl_sync(0xffffffffu, s, head);
        if (valid) {
            const int t = ce_clamp_target(t_raw, (int)r, cols, sub == 0, flag, check);
            if (grad != 0) ce_grad_scan<true>(zr, grad + r * cols, sub, cols, lanes, m, s, t, inv_rows);
            if (sub == 0) {
                // The row was just read: its target logit is a cache hit.
                const float l = logf(s) + m - zr[t];
                if (row_loss != 0) row_loss[r] = l;
                acc += l;
            }
        }
    }
    if (loss != 0) {
        acc = block_sum(acc);
        if (threadIdx.x == 0) loss[0] = acc * inv_rows;
    }
}

// One block per row (1024 threads), for wide rows (tens of thousands of classes). `lanes` is
// not used (the argument list is ce_fwd_warp's).
extern "C" __global__ void __launch_bounds__(1024) ce_fwd_block(const float* z, const int* tgt, float* grad, float* row_loss,
        float* loss, int rows, int cols, float inv_rows, int lanes, cg_check* flag, unsigned int check) {
    __shared__ float wm[32], ws[32];
    __shared__ float row_m, row_s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    float acc = 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* zr = z + (long long)r * cols;
        // The target's load is issued before the scan and used after it.
        const int t_raw = tgt[r];
        float m = NEG_INF, s = 0.0f;
        ms_scan(zr, threadIdx.x, cols, blockDim.x, m, s);
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
            ms_merge(m, s, m2, s2);
        }
        if (lane == 0) { wm[warp] = m; ws[warp] = s; }
        __syncthreads();
        if (warp == 0) {
            // The warps' statistics merged by a butterfly of warp 0's lanes (5 steps, not 31
            // merges in sequence); lanes past the warps hold empty statistics.
            float bm = lane < nw ? wm[lane] : NEG_INF, bs = lane < nw ? ws[lane] : 0.0f;
            for (int o = 16; o > 0; o >>= 1) {
                const float m2 = __shfl_xor_sync(0xffffffffu, bm, o);
                const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
                ms_merge(bm, bs, m2, s2);
            }
            if (lane == 0) { row_m = bm; row_s = bs; }
        }
        __syncthreads();
        m = row_m; s = row_s;
        const int t = ce_clamp_target(t_raw, r, cols, threadIdx.x == 0, flag, check);
        if (grad != 0)
            ce_grad_scan<true>(zr, grad + (long long)r * cols, threadIdx.x, cols, blockDim.x, m, s, t, inv_rows);
        if (threadIdx.x == 0) {
            const float l = logf(s) + m - zr[t];
            if (row_loss != 0) row_loss[r] = l;
            acc += l;
        }
        __syncthreads();  // wm/ws/row_m are reused by the next row
    }
    if (loss != 0) {
        acc = block_sum(acc);
        if (threadIdx.x == 0) loss[0] = acc * inv_rows;
    }
}

// Split rows (few wide rows: fewer rows than multiprocessors). Block b = r * chunks + k reads
// chunk k of row r (chunk length ceil(cols / chunks)) and writes its running max and sum of
// exp to pm[b], ps[b]; the block whose chunk holds row r's target writes that logit to zt[r]
// (block k = 0 reports a target outside [0, cols), which is clamped). A row's chunks (at most
// 32) are merged by lanes in a fixed butterfly order (ce_row_stats): every reader of a row's
// statistics gets the same bits (deterministic).
__device__ __forceinline__ void ce_chunk(int cols, int chunks, int k, int& lo, int& hi) {
    const int len = (cols + chunks - 1) / chunks;
    lo = min(k * len, cols);
    hi = min(lo + len, cols);
}

// Row r's statistics merged by a group of g lanes (g a power of two, chunks <= g <= 32, the
// group aligned within its warp; called by whole warps): lane j < chunks of the group holds
// chunk j, a butterfly over offsets g/2 .. 1 merges them, and every lane of the group gets the
// group's first lane's result. The bits are those of the 32-lane butterfly (g = 32): there,
// offsets >= g only merge lanes that hold nothing yet, and a merge is symmetric (a + b = b + a).
__device__ __forceinline__ void ce_row_stats(const float* pm, const float* ps, int r, bool valid,
        int chunks, int g, float& m, float& s) {
    const int lane = threadIdx.x & 31, j = lane & (g - 1);
    m = NEG_INF; s = 0.0f;
    if (valid && j < chunks) { m = pm[r * chunks + j]; s = ps[r * chunks + j]; }
    for (int o = g >> 1; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, m2, s2);
    }
    m = __shfl_sync(0xffffffffu, m, lane - j);
    s = __shfl_sync(0xffffffffu, s, lane - j);
}

extern "C" __global__ void __launch_bounds__(256) ce_split_stats(const float* z, const int* tgt,
        int rows, int cols, int chunks, float* pm, float* ps, float* zt, cg_check* flag,
        unsigned int check) {
    __shared__ float wm[8], ws[8];
    const int b = blockIdx.x, r = b / chunks, k = b - r * chunks;
    if (r >= rows) return;
    int lo, hi;
    ce_chunk(cols, chunks, k, lo, hi);
    const float* zr = z + (long long)r * cols;
    // The target's load is issued before the scan and used after it (no latency of its own).
    const int t_raw = threadIdx.x == 0 ? tgt[r] : 0;
    float m = NEG_INF, s = 0.0f;
    ms_scan(zr, lo + threadIdx.x, hi, blockDim.x, m, s);
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { wm[warp] = m; ws[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        // The block's warps merged by a butterfly of warp 0's lanes (5 steps, not 7 merges in
        // sequence); lanes past the warps hold empty statistics.
        const int nw = (int)(blockDim.x >> 5);
        float bm = lane < nw ? wm[lane] : NEG_INF, bs = lane < nw ? ws[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, bm, o);
            const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
            ms_merge(bm, bs, m2, s2);
        }
        if (lane == 0) {
            pm[b] = bm; ps[b] = bs;
            // The chunk was just read: its target logit is a cache hit.
            const int t = ce_clamp_target(t_raw, r, cols, k == 0, flag, check);
            if (t >= lo && t < hi) zt[r] = zr[t];
        }
    }
}

// Block b = r * per_row + k (per_row = chunks with a gradient, else 1): merges row r's chunk
// statistics (warp 0), writes grad = (softmax - onehot) / rows over chunk k when `grad` is
// set, and (k = 0) the row's loss into row_loss[r].
extern "C" __global__ void __launch_bounds__(256) ce_split_finish(const float* z, const int* tgt, float* grad,
        const float* pm, const float* ps, const float* zt, float* row_loss, int rows, int cols,
        int chunks, int per_row, float inv_rows) {
    __shared__ float row_m, row_s;
    const int b = blockIdx.x, r = b / per_row, k = b - r * per_row;
    if (r >= rows) return;
    if (threadIdx.x < 32) {
        // The target logit's load is issued before the merge and used after it.
        const float z_t = threadIdx.x == 0 && k == 0 ? zt[r] : 0.0f;
        float m, s;
        ce_row_stats(pm, ps, r, true, chunks, 32, m, s);
        if (threadIdx.x == 0) {
            row_m = m; row_s = s;
            if (k == 0) row_loss[r] = logf(s) + m - z_t;
        }
    }
    if (grad == 0) return;
    __syncthreads();
    const int t = min(max(tgt[r], 0), cols - 1);  // reported by ce_split_stats
    int lo, hi;
    ce_chunk(cols, chunks, k, lo, hi);
    ce_grad_scan<false>(z + (long long)r * cols, grad + (long long)r * cols, lo + threadIdx.x, hi,
        blockDim.x, row_m, row_s, t, inv_rows);
}

// The forward pass of ce_split_finish and sum_scaled in one block of 1024 threads, for few rows
// (at most CE_FUSED_ROWS): a group of g lanes (the next power of two >= chunks) merges a row's
// chunk statistics, so one pass covers 32 · 32 / g rows, and keeps its loss in shared memory;
// then the mean is taken exactly as
// sum_scaled takes it with its 256 threads (thread i adds rows i, i + 256, ... in order, then
// block_sum: the other warps add exact zeros), so the loss is bit for bit the one the
// two-kernel path (used with a gradient) computes.
#define CE_FUSED_ROWS 256
extern "C" __global__ void __launch_bounds__(1024) ce_split_mean(const float* pm, const float* ps,
        const float* zt, float* out, int rows, int chunks, float scale) {
    __shared__ float row_loss[CE_FUSED_ROWS];
    int g = 1;
    while (g < chunks) g <<= 1;
    const int lane = threadIdx.x & 31, per_warp = 32 / g;
    const int first = (threadIdx.x >> 5) * per_warp + lane / g;
    // Whole warps iterate together (the butterfly's shuffles take every lane).
    for (int r0 = 0; r0 < rows; r0 += (blockDim.x >> 5) * per_warp) {
        const int r = r0 + first;
        const bool writes = r < rows && (lane & (g - 1)) == 0;
        // The target logit's load is issued before the merge and used after it.
        const float z_t = writes ? zt[r] : 0.0f;
        float m, s;
        ce_row_stats(pm, ps, r, r < rows, chunks, g, m, s);
        if (writes) row_loss[r] = logf(s) + m - z_t;
    }
    __syncthreads();
    float acc = 0.0f;
    if (threadIdx.x < 256)
        for (int i = threadIdx.x; i < rows; i += 256) acc += row_loss[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[0] = scale * acc;
}

// out[0] = scale * (sum of v[0..count)), one block, fixed order.
extern "C" __global__ void __launch_bounds__(1024) sum_scaled(const float* v, int count, float* out, float scale) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += v[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[0] = scale * acc;
}

__device__ __forceinline__ float mse_one(float p, float t, float* g, float two_scale) {
    const float d = p - t;
    if (g != 0) *g = two_scale * d;
    return d * d;
}

// Partial sums of (p - t)^2 per block (into partial[blockIdx.x], or scale * sum into loss[0]
// when `loss` is set and the grid is one block); grad[i] = 2·scale·(p[i] - t[i]) when given.
extern "C" __global__ void __launch_bounds__(1024) mse_fwd(const float* p, const float* t, float* grad, float* partial, float* loss,
        long long n, float scale) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float two_scale = 2.0f * scale;
    const bool vec = lf_aligned16(p) && lf_aligned16(t) && lf_aligned16(grad);
    const long long n4 = vec ? n / 4 : 0;
    float acc = 0.0f;
    for (long long i = first; i < n4; i += stride) {
        const float4 a = reinterpret_cast<const float4*>(p)[i];
        const float4 b = reinterpret_cast<const float4*>(t)[i];
        const float4 d = make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
        acc += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
        if (grad != 0)
            reinterpret_cast<float4*>(grad)[i] =
                make_float4(two_scale * d.x, two_scale * d.y, two_scale * d.z, two_scale * d.w);
    }
    for (long long i = n4 * 4 + first; i < n; i += stride)
        acc += mse_one(p[i], t[i], grad != 0 ? grad + i : 0, two_scale);
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
        if (loss != 0) loss[0] = scale * acc;
        else partial[blockIdx.x] = acc;
    }
}

// g[i] *= s[0] for i < n (a loss's saved unit gradient times the upstream gradient).
extern "C" __global__ void scale_by(float* g, const float* s, long long n) {
    const float k = s[0];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = lf_aligned16(g) ? n / 4 : 0;
    for (long long i = first; i < n4; i += stride) {
        float4 v = reinterpret_cast<float4*>(g)[i];
        v.x *= k; v.y *= k; v.z *= k; v.w *= k;
        reinterpret_cast<float4*>(g)[i] = v;
    }
    for (long long i = n4 * 4 + first; i < n; i += stride) g[i] *= k;
}
