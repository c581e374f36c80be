// Multi-tensor optimizer kernels (PyTorch's multi_tensor_apply design, one launch for all
// parameters of a step) and the learning-rate schedule node. Compiled as their own NVRTC
// module after cast.cu (the f32 -> bf16/f16 rounding of the 16-bit model copies) and
// mt_table.cu (the table, the GradScaler's slots); launched only from the checked functions
// in optim_mt.rs.
//
// Hyperparameters are read from a small device buffer (hp) so that a captured step follows
// values set between replays. The optimizer's counters live in `state`: [0] steps completed,
// [1] a ticket. The last block of a launch (the one that draws the final ticket) advances the
// counters after every block has read them, so one launch both uses and increments them.
//
// Loss scaling (a GradScaler's `amp` buffer, or null): when amp[AMP_FOUND + found] is set, an
// earlier pass found an inf or NaN among the gradients and every block returns at once, so
// nothing changes (parameters, moments, step counts: PyTorch's skipped step). With `unscale`,
// each gradient is multiplied by 1/scale as it is loaded and written back unscaled (as
// PyTorch's fused optimizers do with grad_scale).
//
// 16-bit copies (KIND 1: bf16, 2: f16; 0: none): the last pointer of each tensor is its model
// copy, written with the new parameter value rounded to nearest even by cast.cu's from_f32,
// so the copy has the bits kernels::cast would give the master.

#define HP_LR 0
#define HP_BASE_LR 1
#define HP_BETA1 2
#define HP_BETA2 3
#define HP_EPS 4
#define HP_WD 5
#define HP_MOMENTUM 6

#define ST_STEP 0
#define ST_TICKET 1

// After all of a block's work: the block that draws the last ticket advances the per-tensor
// step counters of this table (when `steps` is given), the optimizer's step count (when
// `advance`), and resets the ticket for the next launch.
template <int D, int CAP>
__device__ void mt_finish(const MtTable<D, CAP>& t, unsigned int* state, unsigned int* steps, int advance) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned int ticket = atomicAdd(&state[ST_TICKET], 1u);
        last = (ticket == gridDim.x - 1) ? 1 : 0;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        if (steps != 0)
            for (int i = threadIdx.x; i < t.count; i += blockDim.x) steps[t.slot[i]] += 1u;
        if (threadIdx.x == 0) {
            if (advance) state[ST_STEP] += 1u;
            state[ST_TICKET] = 0u;
        }
    }
}

// ---- 16-bit model copies ----

template <int KIND> __device__ __forceinline__ unsigned int copy_bits(float w);
template <> __device__ __forceinline__ unsigned int copy_bits<0>(float) { return 0u; }
template <> __device__ __forceinline__ unsigned int copy_bits<1>(float w) { return from_f32<bf16_t>(w).bits; }
template <> __device__ __forceinline__ unsigned int copy_bits<2>(float w) { return from_f32<f16_t>(w).bits; }

// c[j] = w rounded (nothing without a copy).
template <int KIND>
__device__ __forceinline__ void copy_store(float* c, long long j, float w) {
    if (KIND != 0) reinterpret_cast<unsigned short*>(c)[j] = (unsigned short)copy_bits<KIND>(w);
}

// c[j..j+4) = w rounded, one 8-byte store (c 8-byte aligned, j a multiple of 4).
template <int KIND>
__device__ __forceinline__ void copy_store4(float* c, long long j, float4 w) {
    if (KIND != 0) {
        uint2 v;
        v.x = copy_bits<KIND>(w.x) | (copy_bits<KIND>(w.y) << 16);
        v.y = copy_bits<KIND>(w.z) | (copy_bits<KIND>(w.w) << 16);
        *reinterpret_cast<uint2*>(reinterpret_cast<unsigned short*>(c) + j) = v;
    }
}

// Whether the scaler found an inf or NaN gradient (the step is skipped).
__device__ __forceinline__ bool amp_skip(const float* amp, int found) {
    return amp != 0 && amp[AMP_FOUND + found] != 0.0f;
}

__device__ __forceinline__ void unscale4(float4& g, float inv) {
    g.x *= inv; g.y *= inv; g.z *= inv; g.w *= inv;
}

// ---- SGD (momentum, weight decay; dampening 0, nesterov off: PyTorch's defaults) ----

__device__ __forceinline__ void sgd_elem(float& w, float g, float* b, float lr, float mom, float wd) {
    float d = g + wd * w;
    if (b != 0) { float nb = mom * (*b) + d; *b = nb; d = nb; }
    w = w - lr * d;
}

// Table depth 4: parameter, gradient, momentum buffer (or null), 16-bit copy (or null).
template <int CAP, int KIND>
__device__ void sgd_body(const MtTable<4, CAP>& t, const float* hp, unsigned int* state, const float* amp,
        int found, int unscale, int chunk, int advance) {
    if (amp_skip(amp, found)) return;
    const float inv = unscale ? amp_inv_scale(amp) : 1.0f;
    const float lr = hp[HP_LR], mom = hp[HP_MOMENTUM], wd = hp[HP_WD];
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        float* w = t.p[0][i];
        float* g = t.p[1][i];
        float* buf = t.p[2][i];
        float* cp = t.p[3][i];
        const bool vec = mt_aligned16(w) && mt_aligned16(g) && mt_aligned16(buf) && (KIND == 0 || mt_aligned8(cp));
        const long long vend = vec ? start + ((end - start) & ~3ll) : start;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            float4 wv = *reinterpret_cast<float4*>(w + j);
            float4 gv = *reinterpret_cast<const float4*>(g + j);
            if (unscale) {
                unscale4(gv, inv);
                *reinterpret_cast<float4*>(g + j) = gv;
            }
            if (buf != 0) {
                float4 bv = *reinterpret_cast<float4*>(buf + j);
                sgd_elem(wv.x, gv.x, &bv.x, lr, mom, wd);
                sgd_elem(wv.y, gv.y, &bv.y, lr, mom, wd);
                sgd_elem(wv.z, gv.z, &bv.z, lr, mom, wd);
                sgd_elem(wv.w, gv.w, &bv.w, lr, mom, wd);
                *reinterpret_cast<float4*>(buf + j) = bv;
            } else {
                sgd_elem(wv.x, gv.x, 0, lr, mom, wd);
                sgd_elem(wv.y, gv.y, 0, lr, mom, wd);
                sgd_elem(wv.z, gv.z, 0, lr, mom, wd);
                sgd_elem(wv.w, gv.w, 0, lr, mom, wd);
            }
            *reinterpret_cast<float4*>(w + j) = wv;
            copy_store4<KIND>(cp, j, wv);
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) {
            float wj = w[j], gj = g[j];
            if (unscale) {
                gj *= inv;
                g[j] = gj;
            }
            sgd_elem(wj, gj, buf != 0 ? buf + j : 0, lr, mom, wd);
            w[j] = wj;
            copy_store<KIND>(cp, j, wj);
        }
    }
    // No block of an SGD launch reads the step count (only later kernels do: the schedule), so
    // one thread advances it without waiting for the others: no ticket, no fence, two memory
    // round trips fewer than mt_finish.
    if (advance && blockIdx.x == 0 && threadIdx.x == 0) state[ST_STEP] += 1u;
}

#define SGD_KERNEL(NAME, CAP, KIND)                                                                  \
    extern "C" __global__ void __launch_bounds__(MT_BLOCK) NAME(const __grid_constant__ MtTable<4, CAP> t, \
            const float* hp, unsigned int* state, const float* amp, int found, int unscale, int chunk,     \
            int advance) {                                                                           \
        sgd_body<CAP, KIND>(t, hp, state, amp, found, unscale, chunk, advance);                      \
    }

SGD_KERNEL(sgd_mt_s, CAP_S, 0)
SGD_KERNEL(sgd_mt_l, CAP_L, 0)
SGD_KERNEL(sgd_mt_s_bf16, CAP_S, 1)
SGD_KERNEL(sgd_mt_l_bf16, CAP_L, 1)
SGD_KERNEL(sgd_mt_s_f16, CAP_S, 2)
SGD_KERNEL(sgd_mt_l_f16, CAP_L, 2)

// ---- Adam / AdamW (PyTorch's fused update; per-tensor step counts, capturable) ----

__device__ __forceinline__ void adam_elem(float& w, float g, float& m, float& v, float lr, float b1, float b2,
        float eps, float wd, float step_size, float bc2_sqrt, int decoupled) {
    if (decoupled) w = w - lr * wd * w;  // AdamW: param.mul_(1 - lr * weight_decay)
    else g = g + wd * w;                 // Adam: grad = grad.add(param, alpha=weight_decay)
    m = b1 * m + (1.0f - b1) * g;
    v = b2 * v + (1.0f - b2) * g * g;
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    w = w - step_size * m / denom;
}

// Table depth 5: parameter, gradient, first and second moments, 16-bit copy (or null).
template <int CAP, int KIND>
__device__ void adam_body(const MtTable<5, CAP>& t, const float* hp, unsigned int* state, unsigned int* steps,
        const float* amp, int found, int unscale, int chunk, int advance, int decoupled) {
    // Uniform over the grid: either every block returns here (nothing changes, the counters
    // included, and the ticket stays 0) or none does.
    if (amp_skip(amp, found)) return;
    const float inv = unscale ? amp_inv_scale(amp) : 1.0f;
    const float lr = hp[HP_LR], b1 = hp[HP_BETA1], b2 = hp[HP_BETA2], eps = hp[HP_EPS], wd = hp[HP_WD];
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        float* w = t.p[0][i];
        float* g = t.p[1][i];
        float* m = t.p[2][i];
        float* v = t.p[3][i];
        float* cp = t.p[4][i];
        // This step's number for this tensor (its counter is advanced after the launch).
        const float step = (float)(steps[t.slot[i]] + 1u);
        const float bc1 = 1.0f - powf(b1, step);
        const float bc2_sqrt = sqrtf(1.0f - powf(b2, step));
        const float step_size = lr / bc1;
        const bool vec = mt_aligned16(w) && mt_aligned16(g) && mt_aligned16(m) && mt_aligned16(v)
            && (KIND == 0 || mt_aligned8(cp));
        const long long vend = vec ? start + ((end - start) & ~3ll) : start;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            float4 wv = *reinterpret_cast<float4*>(w + j);
            float4 gv = *reinterpret_cast<const float4*>(g + j);
            float4 mv = *reinterpret_cast<float4*>(m + j);
            float4 vv = *reinterpret_cast<float4*>(v + j);
            if (unscale) {
                unscale4(gv, inv);
                *reinterpret_cast<float4*>(g + j) = gv;
            }
            adam_elem(wv.x, gv.x, mv.x, vv.x, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            adam_elem(wv.y, gv.y, mv.y, vv.y, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            adam_elem(wv.z, gv.z, mv.z, vv.z, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            adam_elem(wv.w, gv.w, mv.w, vv.w, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            *reinterpret_cast<float4*>(w + j) = wv;
            *reinterpret_cast<float4*>(m + j) = mv;
            *reinterpret_cast<float4*>(v + j) = vv;
            copy_store4<KIND>(cp, j, wv);
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) {
            float wj = w[j], gj = g[j], mj = m[j], vj = v[j];
            if (unscale) {
                gj *= inv;
                g[j] = gj;
            }
            adam_elem(wj, gj, mj, vj, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            w[j] = wj; m[j] = mj; v[j] = vj;
            copy_store<KIND>(cp, j, wj);
        }
    }
    mt_finish(t, state, steps, advance);
}

#define ADAM_KERNEL(NAME, CAP, KIND)                                                                 \
    extern "C" __global__ void __launch_bounds__(MT_BLOCK) NAME(const __grid_constant__ MtTable<5, CAP> t, \
            const float* hp, unsigned int* state, unsigned int* steps, const float* amp, int found,        \
            int unscale, int chunk, int advance, int decoupled) {                                    \
        adam_body<CAP, KIND>(t, hp, state, steps, amp, found, unscale, chunk, advance, decoupled);   \
    }

ADAM_KERNEL(adam_mt_s, CAP_S, 0)
ADAM_KERNEL(adam_mt_l, CAP_L, 0)
ADAM_KERNEL(adam_mt_s_bf16, CAP_S, 1)
ADAM_KERNEL(adam_mt_l_bf16, CAP_L, 1)
ADAM_KERNEL(adam_mt_s_f16, CAP_S, 2)
ADAM_KERNEL(adam_mt_l_f16, CAP_L, 2)

// ---- Pure 16-bit parameters (no f32 master) ----
// The parameter and its gradient are stored in T (bf16_t or f16_t); the moments or momentum
// buffers are f32. Each element: w and g widened (exact), the f32 update of the kernels above
// (the same sgd_elem / adam_elem), the new w rounded once to nearest even by cast.cu's
// from_f32 (the bits kernels::cast gives). With `unscale`, the unscaled gradient is written
// back rounded to T. Scalar loops: 2-byte loads, coalesced across a warp.

// Table depth 3: parameter (T), gradient (T), momentum buffer (f32, or null).
template <typename T, int CAP>
__device__ void sgd_pure_body(const MtTable<3, CAP>& t, const float* hp, unsigned int* state, const float* amp,
        int found, int unscale, int chunk, int advance) {
    if (amp_skip(amp, found)) return;
    const float inv = unscale ? amp_inv_scale(amp) : 1.0f;
    const float lr = hp[HP_LR], mom = hp[HP_MOMENTUM], wd = hp[HP_WD];
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        T* w = reinterpret_cast<T*>(t.p[0][i]);
        T* g = reinterpret_cast<T*>(t.p[1][i]);
        float* buf = t.p[2][i];
        for (long long j = start + threadIdx.x; j < end; j += blockDim.x) {
            float wj = to_f32(w[j]), gj = to_f32(g[j]);
            if (unscale) {
                gj *= inv;
                g[j] = from_f32<T>(gj);
            }
            sgd_elem(wj, gj, buf != 0 ? buf + j : 0, lr, mom, wd);
            w[j] = from_f32<T>(wj);
        }
    }
    if (advance && blockIdx.x == 0 && threadIdx.x == 0) state[ST_STEP] += 1u;
}

#define SGD_PURE_KERNEL(NAME, CAP, T)                                                                \
    extern "C" __global__ void __launch_bounds__(MT_BLOCK) NAME(const __grid_constant__ MtTable<3, CAP> t, \
            const float* hp, unsigned int* state, const float* amp, int found, int unscale, int chunk,     \
            int advance) {                                                                           \
        sgd_pure_body<T, CAP>(t, hp, state, amp, found, unscale, chunk, advance);                    \
    }

SGD_PURE_KERNEL(sgd_pure_mt_s_bf16, CAP_S, bf16_t)
SGD_PURE_KERNEL(sgd_pure_mt_l_bf16, CAP_L, bf16_t)
SGD_PURE_KERNEL(sgd_pure_mt_s_f16, CAP_S, f16_t)
SGD_PURE_KERNEL(sgd_pure_mt_l_f16, CAP_L, f16_t)

// Table depth 4: parameter (T), gradient (T), first and second moments (f32).
template <typename T, int CAP>
__device__ void adam_pure_body(const MtTable<4, CAP>& t, const float* hp, unsigned int* state, unsigned int* steps,
        const float* amp, int found, int unscale, int chunk, int advance, int decoupled) {
    if (amp_skip(amp, found)) return;
    const float inv = unscale ? amp_inv_scale(amp) : 1.0f;
    const float lr = hp[HP_LR], b1 = hp[HP_BETA1], b2 = hp[HP_BETA2], eps = hp[HP_EPS], wd = hp[HP_WD];
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        T* w = reinterpret_cast<T*>(t.p[0][i]);
        T* g = reinterpret_cast<T*>(t.p[1][i]);
        float* m = t.p[2][i];
        float* v = t.p[3][i];
        const float step = (float)(steps[t.slot[i]] + 1u);
        const float bc1 = 1.0f - powf(b1, step);
        const float bc2_sqrt = sqrtf(1.0f - powf(b2, step));
        const float step_size = lr / bc1;
        for (long long j = start + threadIdx.x; j < end; j += blockDim.x) {
            float wj = to_f32(w[j]), gj = to_f32(g[j]), mj = m[j], vj = v[j];
            if (unscale) {
                gj *= inv;
                g[j] = from_f32<T>(gj);
            }
            adam_elem(wj, gj, mj, vj, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            w[j] = from_f32<T>(wj);
            m[j] = mj;
            v[j] = vj;
        }
    }
    mt_finish(t, state, steps, advance);
}

#define ADAM_PURE_KERNEL(NAME, CAP, T)                                                               \
    extern "C" __global__ void __launch_bounds__(MT_BLOCK) NAME(const __grid_constant__ MtTable<4, CAP> t, \
            const float* hp, unsigned int* state, unsigned int* steps, const float* amp, int found,        \
            int unscale, int chunk, int advance, int decoupled) {                                    \
        adam_pure_body<T, CAP>(t, hp, state, steps, amp, found, unscale, chunk, advance, decoupled); \
    }

ADAM_PURE_KERNEL(adam_pure_mt_s_bf16, CAP_S, bf16_t)
ADAM_PURE_KERNEL(adam_pure_mt_l_bf16, CAP_L, bf16_t)
ADAM_PURE_KERNEL(adam_pure_mt_s_f16, CAP_S, f16_t)
ADAM_PURE_KERNEL(adam_pure_mt_l_f16, CAP_L, f16_t)

// ---- Learning-rate schedule: hp[LR] = schedule(hp[BASE_LR], steps completed) ----
// Evaluated in double, with the same operations as the host (`Schedule::lr` in schedule.rs).

#define SCHED_TERMS 4
#define SCHED_PHASES 8

struct SchedTerm {
    unsigned int kind;    // 0 factor a; 1 step (size a, gamma b); 2 exponential (gamma a);
                          // 3 cosine (t_max a, eta_min b); 4 linear (start a, end b, iters c)
    unsigned int origin;  // the term's own step 0
    double a, b, c;
};

struct SchedPhase {
    unsigned int start;   // first step of the phase
    unsigned int nterms;
    SchedTerm term[SCHED_TERMS];
};

struct SchedProgram {
    unsigned int nphases;
    unsigned int pad;
    SchedPhase phase[SCHED_PHASES];
};

static_assert(sizeof(SchedTerm) == 32, "schedule term layout");
static_assert(sizeof(SchedPhase) == 8 + 32 * SCHED_TERMS, "schedule phase layout");
static_assert(sizeof(SchedProgram) == 8 + (8 + 32 * SCHED_TERMS) * SCHED_PHASES, "schedule layout");

// base^k for an integer k >= 0 by squaring (the host does the same operations).
__device__ double sched_ipow(double base, unsigned int k) {
    double r = 1.0;
    while (k != 0u) {
        if (k & 1u) r *= base;
        base *= base;
        k >>= 1;
    }
    return r;
}

__device__ double sched_apply(const SchedTerm& term, double lr, unsigned int step) {
    const unsigned int t = step >= term.origin ? step - term.origin : 0u;
    switch (term.kind) {
    case 0: return lr * term.a;
    case 1: return lr * sched_ipow(term.b, t / (unsigned int)term.a);
    case 2: return lr * sched_ipow(term.a, t);
    case 3: return term.b + (lr - term.b) * (1.0 + cos(3.141592653589793 * (double)t / term.a)) / 2.0;
    case 4: {
        const double k = (double)(t < (unsigned int)term.c ? t : (unsigned int)term.c);
        return lr * (term.a + (term.b - term.a) * k / term.c);
    }
    default: return lr;
    }
}

extern "C" __global__ void lr_schedule(const __grid_constant__ SchedProgram prog, float* hp, const unsigned int* state) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const unsigned int step = state[ST_STEP];
    unsigned int ph = 0;
    for (unsigned int i = 1; i < prog.nphases && i < SCHED_PHASES; i++)
        if (prog.phase[i].start <= step) ph = i;
    double lr = (double)hp[HP_BASE_LR];
    const SchedPhase& p = prog.phase[ph];
    for (unsigned int k = 0; k < p.nterms && k < SCHED_TERMS; k++) lr = sched_apply(p.term[k], lr, step);
    hp[HP_LR] = (float)lr;
}
