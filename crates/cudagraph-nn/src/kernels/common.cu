// Shared by every NN kernel (compiled as one module with the other .cu files of this folder).
// IDX is 64-bit: grids of more than 2^32 threads index correctly.
#define IDX ((long)blockIdx.x * blockDim.x + threadIdx.x)

// ReLU as torch.relu: NaN passes through (fmaxf would turn it into 0).
__device__ __forceinline__ float relu_f(float v) { return (v > 0.0f || v != v) ? v : 0.0f; }

// Block-wide sum (blockDim.x a power of two, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float s[1024];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
        __syncthreads();
    }
    float r = s[0];
    __syncthreads();
    return r;
}
