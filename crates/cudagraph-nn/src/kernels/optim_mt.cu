// Multi-tensor optimizer kernels (PyTorch's multi_tensor_apply design, one launch for all
// parameters of a step) and the learning-rate schedule node. Compiled as their own NVRTC
// module; launched only from the checked functions in optim_mt.rs.
//
// Every launch gets a by-value table of up to CAP tensors: their pointers, element counts, and
// the prefix sums of their chunk counts. The grid strides over the chunks of all tensors; a
// block finds its chunk's tensor by binary search over the prefix sums (uniform across the
// block, so the parameter-space reads broadcast). Inside a chunk, 16-byte loads when every
// pointer of the tensor is 16-byte aligned (chunks start at multiples of 4 elements), then a
// scalar tail.
//
// Hyperparameters are read from a small device buffer (hp) so that a captured step follows
// values set between replays. The optimizer's counters live in `state`: [0] steps completed,
// [1] a ticket. The last block of a launch (the one that draws the final ticket) advances the
// counters after every block has read them, so one launch both uses and increments them.

#define MT_BLOCK 256

#define HP_LR 0
#define HP_BASE_LR 1
#define HP_BETA1 2
#define HP_BETA2 3
#define HP_EPS 4
#define HP_WD 5
#define HP_MOMENTUM 6

#define ST_STEP 0
#define ST_TICKET 1

#define CAP_S 64
#define CAP_L 512

template <int D, int CAP>
struct MtTable {
    float* p[D][CAP];
    long long n[CAP];
    unsigned int chunk0[CAP + 1];  // chunk0[i]: first chunk of tensor i; chunk0[count]: total
    unsigned int slot[CAP];        // index into the per-tensor step counters (Adam)
    int count;
};

// The Rust side lays the table out as 8·((D + 2)·CAP + 1) bytes (CAP even).
static_assert(sizeof(MtTable<3, CAP_S>) == 8 * (5 * CAP_S + 1), "sgd table layout");
static_assert(sizeof(MtTable<3, CAP_L>) == 8 * (5 * CAP_L + 1), "sgd table layout");
static_assert(sizeof(MtTable<4, CAP_S>) == 8 * (6 * CAP_S + 1), "adam table layout");
static_assert(sizeof(MtTable<4, CAP_L>) == 8 * (6 * CAP_L + 1), "adam table layout");

template <int D, int CAP>
__device__ __forceinline__ int mt_tensor_of(const MtTable<D, CAP>& t, unsigned int c) {
    int lo = 0, hi = t.count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (t.chunk0[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ __forceinline__ bool mt_aligned16(const void* p) {
    return (((unsigned long long)p) & 15ull) == 0ull;
}

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

// ---- SGD (momentum, weight decay; dampening 0, nesterov off: PyTorch's defaults) ----

__device__ __forceinline__ void sgd_elem(float& w, float g, float* b, float lr, float mom, float wd) {
    float d = g + wd * w;
    if (b != 0) { float nb = mom * (*b) + d; *b = nb; d = nb; }
    w = w - lr * d;
}

template <int CAP>
__device__ void sgd_body(const MtTable<3, CAP>& t, const float* hp, unsigned int* state, int chunk, int advance) {
    const float lr = hp[HP_LR], mom = hp[HP_MOMENTUM], wd = hp[HP_WD];
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        float* w = t.p[0][i];
        const float* g = t.p[1][i];
        float* buf = t.p[2][i];
        const bool vec = mt_aligned16(w) && mt_aligned16(g) && mt_aligned16(buf);
        const long long vend = vec ? start + ((end - start) & ~3ll) : start;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            float4 wv = *reinterpret_cast<float4*>(w + j);
            const float4 gv = *reinterpret_cast<const float4*>(g + j);
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
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) {
            float wj = w[j];
            sgd_elem(wj, g[j], buf != 0 ? buf + j : 0, lr, mom, wd);
            w[j] = wj;
        }
    }
    // No block of an SGD launch reads the step count (only later kernels do: the schedule), so
    // one thread advances it without waiting for the others: no ticket, no fence, two memory
    // round trips fewer than mt_finish.
    if (advance && blockIdx.x == 0 && threadIdx.x == 0) state[ST_STEP] += 1u;
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) sgd_mt_s(const __grid_constant__ MtTable<3, CAP_S> t,
        const float* hp, unsigned int* state, int chunk, int advance) {
    sgd_body(t, hp, state, chunk, advance);
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) sgd_mt_l(const __grid_constant__ MtTable<3, CAP_L> t,
        const float* hp, unsigned int* state, int chunk, int advance) {
    sgd_body(t, hp, state, chunk, advance);
}

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

template <int CAP>
__device__ void adam_body(const MtTable<4, CAP>& t, const float* hp, unsigned int* state, unsigned int* steps,
        int chunk, int advance, int decoupled) {
    const float lr = hp[HP_LR], b1 = hp[HP_BETA1], b2 = hp[HP_BETA2], eps = hp[HP_EPS], wd = hp[HP_WD];
    const unsigned int total = t.chunk0[t.count];
    for (unsigned int c = blockIdx.x; c < total; c += gridDim.x) {
        const int i = mt_tensor_of(t, c);
        const long long n = t.n[i];
        const long long start = (long long)(c - t.chunk0[i]) * chunk;
        const long long end = min(n, start + (long long)chunk);
        float* w = t.p[0][i];
        const float* g = t.p[1][i];
        float* m = t.p[2][i];
        float* v = t.p[3][i];
        // This step's number for this tensor (its counter is advanced after the launch).
        const float step = (float)(steps[t.slot[i]] + 1u);
        const float bc1 = 1.0f - powf(b1, step);
        const float bc2_sqrt = sqrtf(1.0f - powf(b2, step));
        const float step_size = lr / bc1;
        const bool vec = mt_aligned16(w) && mt_aligned16(g) && mt_aligned16(m) && mt_aligned16(v);
        const long long vend = vec ? start + ((end - start) & ~3ll) : start;
        for (long long j = start + 4ll * threadIdx.x; j < vend; j += 4ll * blockDim.x) {
            float4 wv = *reinterpret_cast<float4*>(w + j);
            const float4 gv = *reinterpret_cast<const float4*>(g + j);
            float4 mv = *reinterpret_cast<float4*>(m + j);
            float4 vv = *reinterpret_cast<float4*>(v + j);
            adam_elem(wv.x, gv.x, mv.x, vv.x, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            adam_elem(wv.y, gv.y, mv.y, vv.y, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            adam_elem(wv.z, gv.z, mv.z, vv.z, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            adam_elem(wv.w, gv.w, mv.w, vv.w, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            *reinterpret_cast<float4*>(w + j) = wv;
            *reinterpret_cast<float4*>(m + j) = mv;
            *reinterpret_cast<float4*>(v + j) = vv;
        }
        for (long long j = vend + threadIdx.x; j < end; j += blockDim.x) {
            float wj = w[j], mj = m[j], vj = v[j];
            adam_elem(wj, g[j], mj, vj, lr, b1, b2, eps, wd, step_size, bc2_sqrt, decoupled);
            w[j] = wj; m[j] = mj; v[j] = vj;
        }
    }
    mt_finish(t, state, steps, advance);
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) adam_mt_s(const __grid_constant__ MtTable<4, CAP_S> t,
        const float* hp, unsigned int* state, unsigned int* steps, int chunk, int advance, int decoupled) {
    adam_body(t, hp, state, steps, chunk, advance, decoupled);
}

extern "C" __global__ void __launch_bounds__(MT_BLOCK) adam_mt_l(const __grid_constant__ MtTable<4, CAP_L> t,
        const float* hp, unsigned int* state, unsigned int* steps, int chunk, int advance, int decoupled) {
    adam_body(t, hp, state, steps, chunk, advance, decoupled);
}

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
