// The multi-tensor table shared by the fused optimizers (optim_mt.cu) and the loss-scaling and
// clipping passes (scaler.cu, clip.cu): PyTorch's multi_tensor_apply design, one launch for
// many tensors. Built on the host by optim_mt.rs (`build_tables`), passed by value.
//
// Every launch gets a table of up to CAP tensors: D pointers each, their element counts, and
// the prefix sums of their chunk counts. The grid strides over the chunks of all tensors; a
// block finds its chunk's tensor by binary search over the prefix sums (uniform across the
// block, so the parameter-space reads broadcast). Inside a chunk, 16-byte loads when every
// pointer of the tensor is 16-byte aligned (chunks start at multiples of 4 elements), then a
// scalar tail.

#define MT_BLOCK 256

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
static_assert(sizeof(MtTable<1, CAP_S>) == 8 * (3 * CAP_S + 1), "depth-1 table layout");
static_assert(sizeof(MtTable<1, CAP_L>) == 8 * (3 * CAP_L + 1), "depth-1 table layout");
static_assert(sizeof(MtTable<3, CAP_S>) == 8 * (5 * CAP_S + 1), "pure sgd table layout");
static_assert(sizeof(MtTable<3, CAP_L>) == 8 * (5 * CAP_L + 1), "pure sgd table layout");
static_assert(sizeof(MtTable<4, CAP_S>) == 8 * (6 * CAP_S + 1), "sgd table layout");
static_assert(sizeof(MtTable<4, CAP_L>) == 8 * (6 * CAP_L + 1), "sgd table layout");
static_assert(sizeof(MtTable<5, CAP_S>) == 8 * (7 * CAP_S + 1), "adam table layout");
static_assert(sizeof(MtTable<5, CAP_L>) == 8 * (7 * CAP_L + 1), "adam table layout");

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

__device__ __forceinline__ bool mt_aligned8(const void* p) {
    return (((unsigned long long)p) & 7ull) == 0ull;
}

// Slots of a GradScaler's device buffer (`amp`): the scale, then one found-inf flag per
// optimizer stepped between two updates (0.0 or 1.0, as PyTorch's found_inf tensors).
#define AMP_SCALE 0
#define AMP_FOUND 1

// The reciprocal of the scale as PyTorch's GradScaler computes it
// (`scale.double().reciprocal().float()`): exact for the powers of two a scaler produces.
__device__ __forceinline__ float amp_inv_scale(const float* amp) {
    return (float)(1.0 / (double)amp[AMP_SCALE]);
}
