// Loss scaling on the device (PyTorch's GradScaler, torch.amp): the scale, the found-inf flags
// and the growth tracker live in device memory, so a whole training step with its scaler
// captures into one graph. Compiled after mt_table.cu (the table and the `amp` slots) in the
// cudagraph_nn_amp module; launched only from the checked functions in amp.rs.

__device__ __forceinline__ bool amp_nonfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// y[i] = x[i] · s[0] for i < n (the scaled loss and its backward); with x null, y[i] = s[0]
// (the backward from an implicit gradient of one). Grid-stride: any grid covers every element.
extern "C" __global__ void amp_scale(const float* x, float* y, const float* s, long long n) {
    const float v = s[0];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = x != 0 ? x[i] * v : v;
}

// PyTorch's _amp_foreach_non_finite_check_and_unscale_: amp[AMP_FOUND + found] = 1 when any
// element of any tensor is inf or NaN (checked before unscaling, as PyTorch does); with
// `unscale`, each element is multiplied by 1/scale in place (left as it is when 1/scale is 1).
// Without `unscale` the pass only reads: the check before a fused optimizer step, which
// unscales the gradients itself as it loads them.
template <int CAP>
__device__ void amp_unscale_body(const MtTable<1, CAP>& t, float* amp, int found, int unscale, int chunk) {
    const float inv = amp_inv_scale(amp);
    const bool write = unscale != 0 && inv != 1.0f;
    bool bad = false;
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        float* g = t.p[0][i];
        const long long vend = mt_aligned16(g) ? start + ((end - start) & ~3ll) : start;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            float4 v = *reinterpret_cast<const float4*>(g + j);
            bad = bad || amp_nonfinite(v.x) || amp_nonfinite(v.y) || amp_nonfinite(v.z) || amp_nonfinite(v.w);
            if (write) {
                v.x *= inv; v.y *= inv; v.z *= inv; v.w *= inv;
                *reinterpret_cast<float4*>(g + j) = v;
            }
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) {
            const float v = g[j];
            bad = bad || amp_nonfinite(v);
            if (write) g[j] = v * inv;
        }
    }
    // Every thread that saw one writes the same value: a benign race, as in PyTorch.
    if (bad) amp[AMP_FOUND + found] = 1.0f;
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) amp_unscale_s(const __grid_constant__ MtTable<1, CAP_S> t,
        float* amp, int found, int unscale, int chunk) {
    amp_unscale_body(t, amp, found, unscale, chunk);
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) amp_unscale_l(const __grid_constant__ MtTable<1, CAP_L> t,
        float* amp, int found, int unscale, int chunk) {
    amp_unscale_body(t, amp, found, unscale, chunk);
}

// PyTorch's _amp_update_scale_, one thread: with any of the `slots` found-inf flags set, the
// scale backs off and the tracker restarts; otherwise the tracker counts the good step and,
// at `interval`, the scale grows (unless it would become infinite) and the tracker restarts.
// The factors are doubles and the products are rounded to f32 once, as PyTorch computes them.
extern "C" __global__ void amp_update(float* amp, unsigned int* tracker, int slots, double growth,
        double backoff, unsigned int interval) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float found = 0.0f;
    for (int k = 0; k < slots; k++) found += amp[AMP_FOUND + k];
    const float scale = amp[AMP_SCALE];
    if (found != 0.0f) {
        amp[AMP_SCALE] = (float)((double)scale * backoff);
        tracker[0] = 0u;
    } else {
        const unsigned int successful = tracker[0] + 1u;
        if (successful == interval) {
            const float grown = (float)((double)scale * growth);
            if (!amp_nonfinite(grown)) amp[AMP_SCALE] = grown;
            tracker[0] = 0u;
        } else {
            tracker[0] = successful;
        }
    }
}
