// Counter-based random numbers (Philox4x32-10) and dropout. Compiled as its own module, after
// cudagraph's PDL_CUDA: every kernel starts with CG_PDL_ENTER(), so it may be launched with
// programmatic dependent launch (it touches no memory before the previous kernel is done).
//
// A generator's state is two u64 words in device memory: [seed, base]. An op that draws
// numbers was given an offset when it was issued; its group g (four numbers) uses the counter
// base + offset + g, so the numbers depend on (seed, base, offset) only — the same eagerly and
// in every replay of a graph, and fresh after rng_advance moved the base. Compiled after
// philox_draw.cu (philox4x32_10, rng_draw, rng_unit).
#define RIDX ((long)blockIdx.x * blockDim.x + threadIdx.x)

// in: n records of 6 words (counter[4], key[2]); out: n records of 4 words.
extern "C" __global__ void philox_raw(const unsigned int* in, unsigned int* out, long n) {
    CG_PDL_ENTER();
    long i = RIDX;
    if (i < n) {
        const unsigned int* p = in + 6 * i;
        uint4 r = philox4x32_10(make_uint4(p[0], p[1], p[2], p[3]), make_uint2(p[4], p[5]));
        out[4 * i] = r.x;
        out[4 * i + 1] = r.y;
        out[4 * i + 2] = r.z;
        out[4 * i + 3] = r.w;
    }
}

// out[i] = the i-th 32-bit number of the op (group i / 4, lane i % 4), i < n.
extern "C" __global__ void rng_bits(const unsigned long long* state, unsigned long long offset,
                                    unsigned int* out, long n) {
    CG_PDL_ENTER();
    long g = RIDX;
    if (4 * g < n) {
        uint4 r = rng_draw(state, offset, g);
        unsigned int v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (4 * g + k < n) out[4 * g + k] = v[k];
    }
}

// out[i] = low + scale * u, u uniform in [0, 1), one fused multiply-add (bit-exact on the CPU
// with f32::mul_add).
extern "C" __global__ void rng_uniform(const unsigned long long* state, unsigned long long offset,
                                       float* out, long n, float low, float scale) {
    CG_PDL_ENTER();
    long g = RIDX;
    if (4 * g < n) {
        uint4 r = rng_draw(state, offset, g);
        unsigned int v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (4 * g + k < n) out[4 * g + k] = __fmaf_rn(scale, rng_unit(v[k]), low);
    }
}

// out[i] = mean + std * z, z standard normal by Box-Muller on lane pairs (0, 1) and (2, 3):
// u1 in (0, 1] from the first lane, u2 in [0, 1) from the second.
extern "C" __global__ void rng_normal(const unsigned long long* state, unsigned long long offset,
                                      float* out, long n, float mean, float std) {
    CG_PDL_ENTER();
    long g = RIDX;
    if (4 * g < n) {
        uint4 r = rng_draw(state, offset, g);
        unsigned int v[4] = {r.x, r.y, r.z, r.w};
        float z[4];
#pragma unroll
        for (int k = 0; k < 4; k += 2) {
            float u1 = ((float)(v[k] >> 8) + 1.0f) * 5.9604644775390625e-8f;
            float u2 = rng_unit(v[k + 1]);
            float rad = sqrtf(-2.0f * logf(u1));
            float s, c;
            sincospif(2.0f * u2, &s, &c);
            z[k] = rad * c;
            z[k + 1] = rad * s;
        }
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (4 * g + k < n) out[4 * g + k] = __fmaf_rn(std, z[k], mean);
    }
}

// Dropout: element i is kept when its 24 random bits are >= threshold (= p * 2^24), then
// y = x * scale (scale = 1 / (1 - p)); dropped elements are 0. Bit i of the mask is 1 for kept.
// One thread per group of four elements; eight neighbouring threads (aligned, in one warp: the
// block size is a multiple of 32) assemble one 32-bit mask word. Every thread of the block
// takes part in the shuffles, also past the end.
extern "C" __global__ void dropout_fwd(const unsigned long long* state, unsigned long long offset,
                                       const float* x, float* y, unsigned int* mask, long n,
                                       unsigned int threshold, float scale) {
    CG_PDL_ENTER();
    long g = RIDX;
    long i0 = 4 * g;
    unsigned int nibble = 0;
    if (i0 < n) {
        uint4 r = rng_draw(state, offset, g);
        unsigned int v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            long i = i0 + k;
            if (i < n) {
                bool keep = (v[k] >> 8) >= threshold;
                y[i] = keep ? x[i] * scale : 0.0f;
                nibble |= (keep ? 1u : 0u) << k;
            }
        }
    }
    unsigned int word = nibble << (4 * (threadIdx.x & 7));
    word |= __shfl_xor_sync(0xffffffffu, word, 1);
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
    word |= __shfl_xor_sync(0xffffffffu, word, 4);
    if ((threadIdx.x & 7) == 0 && i0 < n) mask[g >> 3] = word;
}

// dx = dy * scale where the mask bit is set, else 0.
extern "C" __global__ void dropout_bwd(const float* dy, const unsigned int* mask, float* dx, long n,
                                       float scale) {
    CG_PDL_ENTER();
    long i = RIDX;
    if (i < n) dx[i] = ((mask[i >> 5] >> (i & 31)) & 1u) ? dy[i] * scale : 0.0f;
}

// base += by: every later draw uses fresh counters.
extern "C" __global__ void rng_advance(unsigned long long* state, unsigned long long by) {
    CG_PDL_ENTER();
    state[1] += by;
}
