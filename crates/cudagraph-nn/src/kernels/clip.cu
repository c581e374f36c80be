// Gradient clipping by global L2 norm (PyTorch's clip_grad_norm_) on the device, in three
// launches with no host read: per-chunk sums of squares (multi-tensor, one partial per chunk),
// one block that adds the partials in a fixed order and computes the norm and the clipping
// factor, and a multi-tensor scale that reads the factor. Sums are in double, in a fixed order
// (the same bits on every run, eager or replayed). Compiled after mt_table.cu in the
// cudagraph_nn_amp module; launched only from the checked functions in amp.rs.

// Block-wide sum in double for MT_BLOCK threads (a multiple of 32), returned to every thread:
// a butterfly in each warp, then warp 0 adds the warp totals the same way (fixed order).
__device__ double clip_block_sum(double v) {
    __shared__ double s[33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double w = lane < nw ? s[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
        if (lane == 0) s[32] = w;
    }
    __syncthreads();
    const double r = s[32];
    __syncthreads();  // s is reused by the next call
    return r;
}

__device__ __forceinline__ double clip_sq(float x) {
    const double d = (double)x;
    return d * d;
}

// partial[base + c] = Σ g² over chunk c of the table (every chunk of the table, once).
template <int CAP>
__device__ void clip_partials_body(const MtTable<1, CAP>& t, double* partial, long long base, int chunk) {
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        const float* g = t.p[0][i];
        const long long vend = mt_aligned16(g) ? start + ((end - start) & ~3ll) : start;
        double acc = 0.0;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(g + j);
            acc += clip_sq(v.x) + clip_sq(v.y) + clip_sq(v.z) + clip_sq(v.w);
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) acc += clip_sq(g[j]);
        acc = clip_block_sum(acc);  // uniform: every thread of the block is in this loop
        if (threadIdx.x == 0) partial[base + c] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) clip_partials_s(const __grid_constant__ MtTable<1, CAP_S> t,
        double* partial, long long base, int chunk) {
    clip_partials_body(t, partial, base, chunk);
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) clip_partials_l(const __grid_constant__ MtTable<1, CAP_L> t,
        double* partial, long long base, int chunk) {
    clip_partials_body(t, partial, base, chunk);
}

// One block: norm[0] = sqrt(Σ partial[0..parts)), coef[0] = min(1, max_norm / (norm + 1e-6))
// in f32 as PyTorch computes it (a NaN norm gives a NaN factor: torch.clamp keeps NaN).
extern "C" __global__ void __launch_bounds__(MT_BLOCK) clip_total(const double* partial, long long parts,
        float* norm, float* coef, float max_norm) {
    double acc = 0.0;
    for (long long i = threadIdx.x; i < parts; i += blockDim.x) acc += partial[i];
    acc = clip_block_sum(acc);
    if (threadIdx.x == 0) {
        const float total = (float)sqrt(acc);
        float c = max_norm / (total + 1e-6f);
        if (c > 1.0f) c = 1.0f;
        norm[0] = total;
        coef[0] = c;
    }
}

// g *= coef[0] for every element of every tensor; nothing at all when the factor is 1.
template <int CAP>
__device__ void clip_scale_body(const MtTable<1, CAP>& t, const float* coef, int chunk) {
    const float k = coef[0];
    if (k == 1.0f) return;
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        float* g = t.p[0][i];
        const long long vend = mt_aligned16(g) ? start + ((end - start) & ~3ll) : start;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            float4 v = *reinterpret_cast<float4*>(g + j);
            v.x *= k; v.y *= k; v.z *= k; v.w *= k;
            *reinterpret_cast<float4*>(g + j) = v;
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) g[j] *= k;
    }
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) clip_scale_s(const __grid_constant__ MtTable<1, CAP_S> t,
        const float* coef, int chunk) {
    clip_scale_body(t, coef, chunk);
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) clip_scale_l(const __grid_constant__ MtTable<1, CAP_L> t,
        const float* coef, int chunk) {
    clip_scale_body(t, coef, chunk);
}
