// Row helpers shared by the decoder module (decoder.cu) and the few-row products (gemv.cu):
// rounding to the model's type, a deterministic block sum, vector loads and stores, SwiGLU of
// one element and the register path of the decoder's norm (one row a block of DEC_ROW_THREADS
// threads). Both modules compute these the same way, so a product that normalises its own
// input rows gives the bits of the norm kernel followed by the product. Compiled after cast.cu
// (to_f32, from_f32).

// x rounded to T and widened back (the identity for float).
template <typename T>
__device__ __forceinline__ float dec_rnd(float x) {
    return to_f32(from_f32<T>(x));
}

#define DEC_LOOP(i, n)                                                                     \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// Threads of the norm kernel (one block per row); the launcher uses exactly this.
#define DEC_ROW_THREADS 256
// 16-byte loads a thread of the norm kernel keeps in registers (rows of up to
// DEC_ROW_THREADS · DEC_NORM_LOADS · 16 bytes are read once).
#define DEC_NORM_LOADS 4

// The block's sum of v: each warp's by shuffles, then the warps' in warp order (every thread
// gets the same value; deterministic).
__device__ __forceinline__ float dec_block_sum(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < DEC_ROW_THREADS / 32; k++) total += sh[k];
    __syncthreads();
    return total;
}

// Raw storage of B bytes, for one vector load.
template <int B> struct DsRaw;
template <> struct DsRaw<16> { uint4 v; };
template <> struct DsRaw<8> { uint2 v; };
template <> struct DsRaw<4> { unsigned int v; };

// P elements of T at p (P·sizeof(T) bytes, aligned to that) widened to f32.
template <typename T, int P>
__device__ __forceinline__ void ds_load(const T* __restrict__ p, float* f) {
    const DsRaw<P * sizeof(T)> r = *reinterpret_cast<const DsRaw<P * sizeof(T)>*>(p);
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < P; i++) f[i] = to_f32(e[i]);
}

// P floats rounded to T and stored at p (P·sizeof(T) bytes, aligned to that).
template <typename T, int P>
__device__ __forceinline__ void ds_store(T* __restrict__ p, const float* f) {
    DsRaw<P * sizeof(T)> r;
    T* e = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int i = 0; i < P; i++) e[i] = from_f32<T>(f[i]);
    *reinterpret_cast<DsRaw<P * sizeof(T)>*>(p) = r;
}

// The norm's steps for one vector of P elements of a row, shared by dec_norm_row and
// dec_norm_row_staged so that both compute the same bits. dec_norm_load: vector k of xr into
// v, with ar (not null) its vector of ar added and rounded to T, the sum written to xw when
// that is not null; returns acc plus the P values, added in order. dec_norm_dev: acc plus the
// squared deviations from mu. dec_norm_out: the normalised values with the weight w (and the
// bias b, which may be null; LayerNorm) or, with rms, as LlamaRMSNorm: the normalised value in
// the model's type, then the weight; the bias is added in one fused multiply-add wherever
// this runs. o may be v.
template <typename T, int P>
__device__ __forceinline__ float dec_norm_load(const T* xr, const T* ar, T* xw, int k, float* v,
                                              float acc) {
    ds_load<T, P>(xr + k * P, v);
    if (ar) {
        float t[P];
        ds_load<T, P>(ar + k * P, t);
#pragma unroll
        for (int e = 0; e < P; e++) v[e] = dec_rnd<T>(v[e] + t[e]);
        if (xw) ds_store<T, P>(xw + k * P, v);
    }
#pragma unroll
    for (int e = 0; e < P; e++) acc += v[e];
    return acc;
}

template <int P>
__device__ __forceinline__ float dec_norm_dev(const float* v, float mu, float acc) {
#pragma unroll
    for (int e = 0; e < P; e++) {
        const float d = v[e] - mu;
        acc = fmaf(d, d, acc);
    }
    return acc;
}

template <typename T, int P>
__device__ __forceinline__ void dec_norm_out(const float* v, int k, float mu, float rs,
                                             const float* __restrict__ w,
                                             const float* __restrict__ b, int rms, float* o) {
#pragma unroll
    for (int e = 0; e < P; e++) {
        const int c = k * P + e;
        if (rms) {
            o[e] = dec_rnd<T>(v[e] * rs) * w[c];
        } else {
            const float s = (v[e] - mu) * rs;
            o[e] = b ? fmaf(s, w[c], b[c]) : s * w[c];
        }
    }
}

// One row of the decoder's norm (dec_norm_n in decoder.cu), by a block of exactly
// DEC_ROW_THREADS threads: yr = norm of xr (LayerNorm with the bias b, which may be null, or
// RMSNorm with rms = 1) with the weight w. With ar (not null) the row of ar is first added into
// xr's, rounded to T; the sum is written to xw when it is not null (xw may be xr: each thread
// writes only the elements it read) and normalised. Every pointer 16-byte aligned, cols a
// multiple of P = 16 / sizeof(T) and at most DEC_ROW_THREADS · DEC_NORM_LOADS · P (each
// thread keeps its loads in registers). yr may be shared memory. Every thread of the block
// must call it (block sums); sh holds DEC_ROW_THREADS / 32 floats.
template <typename T>
__device__ __forceinline__ void dec_norm_row(const T* xr, const T* ar, T* xw,
                                             const float* __restrict__ w,
                                             const float* __restrict__ b, T* yr, int cols,
                                             float eps, int rms, float* sh) {
    constexpr int P = 16 / sizeof(T);
    const int tid = threadIdx.x;
    const int nv = cols / P;
    float v[DEC_NORM_LOADS][P];
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < DEC_NORM_LOADS; i++) {
        const int k = tid + i * DEC_ROW_THREADS;
        if (k < nv) acc = dec_norm_load<T, P>(xr, ar, xw, k, v[i], acc);
    }
    const float mu = rms ? 0.0f : dec_block_sum(acc, sh) / (float)cols;
    acc = 0.0f;
#pragma unroll
    for (int i = 0; i < DEC_NORM_LOADS; i++)
        if (tid + i * DEC_ROW_THREADS < nv) acc = dec_norm_dev<P>(v[i], mu, acc);
    const float rs = 1.0f / sqrtf(dec_block_sum(acc, sh) / (float)cols + eps);
#pragma unroll
    for (int i = 0; i < DEC_NORM_LOADS; i++) {
        const int k = tid + i * DEC_ROW_THREADS;
        if (k < nv) {
            float o[P];
            dec_norm_out<T, P>(v[i], k, mu, rs, w, b, rms, o);
            ds_store<T, P>(yr + k * P, o);
        }
    }
}

// dec_norm_row's arithmetic with the row staged in yr instead of registers: each thread the
// same elements (k = tid + i·DEC_ROW_THREADS, i < DEC_NORM_LOADS), the same steps in the same
// order and the same block sums, so the same bits (the staged values are values of T, stored
// and read back exactly). One vector of the row live at a time: for kernels that keep other
// loads in flight meanwhile (few registers, full occupancy). yr is the block's own (shared
// memory); each thread reads back only what it wrote.
template <typename T>
__device__ __forceinline__ void dec_norm_row_staged(const T* xr, const T* ar, T* xw,
                                                    const float* __restrict__ w,
                                                    const float* __restrict__ b, T* yr,
                                                    int cols, float eps, int rms, float* sh) {
    constexpr int P = 16 / sizeof(T);
    const int tid = threadIdx.x;
    const int nv = cols / P;
    float acc = 0.0f;
#pragma unroll 1
    for (int i = 0; i < DEC_NORM_LOADS; i++) {
        const int k = tid + i * DEC_ROW_THREADS;
        if (k < nv) {
            float v[P];
            acc = dec_norm_load<T, P>(xr, ar, xw, k, v, acc);
            ds_store<T, P>(yr + k * P, v);
        }
    }
    const float mu = rms ? 0.0f : dec_block_sum(acc, sh) / (float)cols;
    acc = 0.0f;
#pragma unroll 1
    for (int i = 0; i < DEC_NORM_LOADS; i++) {
        const int k = tid + i * DEC_ROW_THREADS;
        if (k < nv) {
            float v[P];
            ds_load<T, P>(yr + k * P, v);
            acc = dec_norm_dev<P>(v, mu, acc);
        }
    }
    const float rs = 1.0f / sqrtf(dec_block_sum(acc, sh) / (float)cols + eps);
#pragma unroll 1
    for (int i = 0; i < DEC_NORM_LOADS; i++) {
        const int k = tid + i * DEC_ROW_THREADS;
        if (k < nv) {
            float v[P];
            ds_load<T, P>(yr + k * P, v);
            dec_norm_out<T, P>(v, k, mu, rs, w, b, rms, v);
            ds_store<T, P>(yr + k * P, v);
        }
    }
}

// SwiGLU of one element as Hugging Face's Llama MLP: silu(g), rounded to T, times u (the
// caller rounds the result on store).
template <typename T>
__device__ __forceinline__ float dec_swiglu1(float g, float u) {
    return dec_rnd<T>(g / (1.0f + expf(-g))) * u;
}
