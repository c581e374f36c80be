// Casts between f32 and the 16-bit floats bf16 and f16, one template instantiated per pair.
//
// The conversions are integer bit operations, not the intrinsics of <cuda_bf16.h> and
// <cuda_fp16.h>: the NVRTC compile has no include path, and integer code gives the same bits
// on every architecture. They implement what __float2bfloat16_rn / __float2half_rn and
// __bfloat162float / __half2float do on the device:
// - narrowing rounds to nearest, ties to even; a value past the largest finite one (after
//   rounding) becomes ±inf; values below the smallest subnormal round to ±0 or to it; the
//   sign of zero is kept;
// - a NaN becomes the canonical NaN 0x7FFF (as the device instructions give);
// - widening is exact (every bf16 and f16 value is an f32 value), NaN payloads kept.

struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }

__device__ __forceinline__ float to_f32(bf16_t x) {
    return __uint_as_float((unsigned int)x.bits << 16);
}

__device__ __forceinline__ float to_f32(f16_t x) {
    unsigned int h = x.bits;
    unsigned int sign = (h & 0x8000u) << 16;
    unsigned int exp = (h >> 10) & 0x1fu;
    unsigned int man = h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf, NaN
    if (exp != 0u) return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
    if (man == 0u) return __uint_as_float(sign);  // ±0
    // Subnormal: man · 2^-24, exact in f32 (an integer below 2^10 times a power of two).
    float v = (float)man * 5.9604644775390625e-8f;
    return __uint_as_float(sign | __float_as_uint(v));
}

template <typename To> __device__ __forceinline__ To from_f32(float x);

template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }

template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = 0x7fffu;
        return r;
    }
    // Round to nearest even on the 16 bits dropped; a carry moves into the exponent, past the
    // largest finite value to inf (0x7f80 / 0xff80). Cannot overflow 32 bits: u ≤ 0xff800000.
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}

template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
    unsigned int u = __float_as_uint(x);
    unsigned int sign = (u >> 16) & 0x8000u;
    unsigned int a = u & 0x7fffffffu;
    f16_t r;
    if (a > 0x7f800000u) {
        r.bits = 0x7fffu;
        return r;
    }
    if (a >= 0x477ff000u) {
        // ≥ 65520 (halfway between 65504, the largest finite f16, and 2^16): rounds to inf.
        r.bits = (unsigned short)(sign | 0x7c00u);
        return r;
    }
    int exp = (int)(a >> 23) - 127 + 15;  // the f16 biased exponent
    unsigned int man = a & 0x7fffffu;
    unsigned int out;
    if (exp >= 1) {
        // Normal: keep 10 of the 23 mantissa bits; a carry out of the mantissa moves into the
        // exponent (at most to 0x7bff + 1 = 0x7c00, excluded above).
        out = ((unsigned int)exp << 10) | (man >> 13);
        unsigned int rest = man & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (out & 1u))) out += 1u;
    } else if (exp >= -10) {
        // Subnormal result: the full significand (hidden bit included) shifted right by
        // 14 - exp ∈ [14, 24]; rounding up from the largest subnormal gives the smallest normal.
        unsigned int sig = man | 0x800000u;
        unsigned int shift = (unsigned int)(14 - exp);
        out = sig >> shift;
        unsigned int rest = sig & ((1u << shift) - 1u);
        unsigned int halfway = 1u << (shift - 1u);
        if (rest > halfway || (rest == halfway && (out & 1u))) out += 1u;
    } else {
        // Below 2^-25, half the smallest subnormal: ±0.
        out = 0u;
    }
    r.bits = (unsigned short)(sign | out);
    return r;
}

// Four elements moved as one load and one store (16 bytes of f32, 8 of a 16-bit type).
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
    T x[4];
};

// dst[i] = src[i] converted, for i < n (grid-stride: any grid covers every element). With vec
// (both addresses aligned to four elements, checked by the launcher) groups of four move as
// one load and one store each, then the tail element by element.
template <typename From, typename To>
__device__ __forceinline__ void cast_n(const From* __restrict__ src, To* __restrict__ dst,
                                       long long n, int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (vec) {
        long long groups = n / 4;
        const Vec4<From>* s4 = reinterpret_cast<const Vec4<From>*>(src);
        Vec4<To>* d4 = reinterpret_cast<Vec4<To>*>(dst);
        for (long long g = t; g < groups; g += stride) {
            Vec4<From> a = s4[g];
            Vec4<To> b;
#pragma unroll
            for (int k = 0; k < 4; k++) b.x[k] = from_f32<To>(to_f32(a.x[k]));
            d4[g] = b;
        }
        done = groups * 4;
    }
    for (long long i = done + t; i < n; i += stride) {
        dst[i] = from_f32<To>(to_f32(src[i]));
    }
}

// Each reads src[i] and writes dst[i] for i < n only.
extern "C" __global__ void cast_f32_bf16(const float* src, bf16_t* dst, long long n, int vec) {
    cast_n<float, bf16_t>(src, dst, n, vec);
}
extern "C" __global__ void cast_f32_f16(const float* src, f16_t* dst, long long n, int vec) {
    cast_n<float, f16_t>(src, dst, n, vec);
}
extern "C" __global__ void cast_bf16_f32(const bf16_t* src, float* dst, long long n, int vec) {
    cast_n<bf16_t, float>(src, dst, n, vec);
}
extern "C" __global__ void cast_f16_f32(const f16_t* src, float* dst, long long n, int vec) {
    cast_n<f16_t, float>(src, dst, n, vec);
}

// The transpose of a row-major matrix, elements of E moved as they are:
// dst[c * rows + r] = src[r * cols + c] for r < rows, c < cols. A block of 32 × 8 threads moves
// 32 × 32 tiles through shared memory, so that both the reads and the writes are runs of 32
// consecutive elements: grid column x takes the tile rows 32x.., grid rows stride over the tile
// columns.
template <typename E>
__device__ __forceinline__ void transpose_n(const E* __restrict__ src, E* __restrict__ dst,
                                            long long rows, int cols) {
    __shared__ E tile[32][33];
    long long r0 = (long long)blockIdx.x * 32;
    int tx = threadIdx.x, ty = threadIdx.y;
    for (int c0 = blockIdx.y * 32; c0 < cols; c0 += gridDim.y * 32) {
        for (int j = ty; j < 32; j += 8) {
            long long r = r0 + j;
            int c = c0 + tx;
            if (r < rows && c < cols) tile[j][tx] = src[r * cols + c];
        }
        __syncthreads();
        for (int j = ty; j < 32; j += 8) {
            int c = c0 + j;
            long long r = r0 + tx;
            if (c < cols && r < rows) dst[(long long)c * rows + r] = tile[tx][j];
        }
        __syncthreads();
    }
}

// Each reads src[r * cols + c] and writes dst[c * rows + r] for r < rows, c < cols only.
extern "C" __global__ void transpose_b2(const unsigned short* src, unsigned short* dst,
                                        long long rows, int cols) {
    transpose_n<unsigned short>(src, dst, rows, cols);
}
extern "C" __global__ void transpose_b4(const unsigned int* src, unsigned int* dst,
                                        long long rows, int cols) {
    transpose_n<unsigned int>(src, dst, rows, cols);
}
