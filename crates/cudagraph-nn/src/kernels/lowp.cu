// Elementwise kernels and reductions on bf16 and f16 tensors, one template per operation
// instantiated per 16-bit type. Compiled after cast.cu (its bf16_t / f16_t types and the
// to_f32 / from_f32 conversions, rounding to nearest even): every value is widened to f32,
// computed in f32 and rounded once on store, as PyTorch's bf16/f16 elementwise kernels do.
// Every kernel strides over the grid, so any grid covers every element.

#define LOWP_LOOP(i, n)                                                                    \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// a[i] = a[i] + b[i] (gradient accumulation).
template <typename T>
__device__ __forceinline__ void add_inplace_n(T* a, const T* b, long long n) {
    LOWP_LOOP(i, n) a[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

// y[i] = max(x[i], 0), NaN kept (as torch.relu).
template <typename T>
__device__ __forceinline__ void relu_fwd_n(const T* x, T* y, long long n) {
    LOWP_LOOP(i, n) {
        float v = to_f32(x[i]);
        y[i] = from_f32<T>(v > 0.0f || v != v ? v : 0.0f);
    }
}

// dx[i] = dy[i] where y[i] > 0 (y is the ReLU output), else 0.
template <typename T>
__device__ __forceinline__ void relu_bwd_n(const T* dy, const T* y, T* dx, long long n) {
    LOWP_LOOP(i, n) dx[i] = from_f32<T>(to_f32(y[i]) > 0.0f ? to_f32(dy[i]) : 0.0f);
}

// db[c] = Σ_r dy[r, c] for one column per block: each thread sums rows threadIdx.x,
// threadIdx.x + blockDim.x, … in f32, then a fixed-order tree over the block (deterministic).
template <typename T, typename O>
__device__ __forceinline__ void col_sum_n(const T* dy, O* db, int rows, int cols) {
    __shared__ float part[256];
    const int c = blockIdx.x;
    float acc = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += to_f32(dy[(long long)r * cols + c]);
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) db[c] = from_f32<O>(part[0]);
}

// Max pooling over planes as maxpool_fwd in pool.cu (the same rule: start at -inf, take a
// value that is greater or NaN; idx keeps the argmax), values compared in f32 and stored as
// they are (no rounding).
template <typename T>
__device__ __forceinline__ void maxpool_fwd_n(const T* x, T* y, int* idx, int planes, int H, int W,
                                              int K, int S, int OH, int OW) {
    LOWP_LOOP(i, (long long)planes * OH * OW) {
        int ow = (int)(i % OW);
        long long t = i / OW;
        int oh = (int)(t % OH);
        int p = (int)(t / OH);
        float best = __int_as_float(0xff800000);
        int arg = (p * H + oh * S) * W + ow * S;
        for (int a = 0; a < K; a++)
            for (int b = 0; b < K; b++) {
                int h = oh * S + a, w = ow * S + b;
                if (h < H && w < W) {
                    int j = (p * H + h) * W + w;
                    float v = to_f32(x[j]);
                    if (v > best || v != v) { best = v; arg = j; }
                }
            }
        y[i] = x[arg];
        idx[i] = arg;
    }
}

// dx[idx[i]] += dy[i] into an f32 gradient (zeroed by the caller; cast to T afterwards).
template <typename T>
__device__ __forceinline__ void maxpool_bwd_n(const T* dy, const int* idx, float* dx, long long n,
                                              long long n_in) {
    LOWP_LOOP(i, n) {
        long long j = idx[i];
        j = j < 0 ? 0 : (j >= n_in ? n_in - 1 : j);
        atomicAdd(&dx[j], to_f32(dy[i]));
    }
}

#define LOWP_INSTANCES(T, S)                                                                 \
    extern "C" __global__ void add_inplace_##S(T* a, const T* b, long long n) {              \
        add_inplace_n<T>(a, b, n);                                                           \
    }                                                                                        \
    extern "C" __global__ void relu_fwd_##S(const T* x, T* y, long long n) {                 \
        relu_fwd_n<T>(x, y, n);                                                              \
    }                                                                                        \
    extern "C" __global__ void relu_bwd_##S(const T* dy, const T* y, T* dx, long long n) {   \
        relu_bwd_n<T>(dy, y, dx, n);                                                         \
    }                                                                                        \
    extern "C" __global__ void col_sum_##S(const T* dy, T* db, int rows, int cols) {         \
        col_sum_n<T, T>(dy, db, rows, cols);                                                 \
    }                                                                                        \
    extern "C" __global__ void col_sum_wide_##S(const T* dy, float* db, int rows, int cols) { \
        col_sum_n<T, float>(dy, db, rows, cols);                                             \
    }                                                                                        \
    extern "C" __global__ void maxpool_fwd_##S(const T* x, T* y, int* idx, int planes, int H, \
                                               int W, int K, int S_, int OH, int OW) {       \
        maxpool_fwd_n<T>(x, y, idx, planes, H, W, K, S_, OH, OW);                            \
    }                                                                                        \
    extern "C" __global__ void maxpool_bwd_##S(const T* dy, const int* idx, float* dx,       \
                                               long long n, long long n_in) {                \
        maxpool_bwd_n<T>(dy, idx, dx, n, n_in);                                              \
    }

LOWP_INSTANCES(bf16_t, bf16)
LOWP_INSTANCES(f16_t, f16)
