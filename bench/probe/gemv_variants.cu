// Probe variants (bench/probe/gemv_probe.py): few-row products in the forward layout,
// C[m x n] = act(A[m x k] . B[n x k]^T + bias), k a multiple of 4, 16-byte aligned operands.
// A block has W warps (blockDim.x / 32); warp w takes the group of CPW columns
// blockIdx.x * (W / ks) + w / ks and the 128-wide K chunks w % ks, w % ks + ks, ... of it, for
// the R rows blockIdx.y * R ...; each lane reads 4 consecutive k of a chunk (float4). A lane's
// V = R * CPW sums are reduce-scattered over the warp (halving at offsets 16, 8, ... while
// values remain, then added over the remaining offsets), so no lane handles more than V / 2
// shuffles per step; the ks warps of a group then add their sums in shared memory in warp
// order. Every sum runs in a fixed order.

template <int HALF, int OFF, int V>
__device__ __forceinline__ void gv_rs(float (&v)[V], int lane) {
    const bool hi = (lane & OFF) != 0;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        const float send = hi ? v[i] : v[i + HALF];
        const float keep = hi ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
}

// After the halving steps lane l holds value gv_index(l) of V; lanes that differ only in the
// bits below 32 / V hold the same value once the remaining offsets are added.
template <int V>
__device__ __forceinline__ int gv_index(int lane) {
    int idx = 0;
    if (V >= 2 && (lane & 16)) idx += V / 2;
    if (V >= 4 && (lane & 8)) idx += V / 4;
    if (V >= 8 && (lane & 4)) idx += V / 8;
    if (V >= 16 && (lane & 2)) idx += V / 16;
    if (V >= 32 && (lane & 1)) idx += V / 32;
    return idx;
}

template <int V>
__device__ __forceinline__ float gv_reduce(float (&v)[V], int lane) {
    if constexpr (V >= 2) gv_rs<V / 2, 16, V>(v, lane);
    if constexpr (V >= 4) gv_rs<V / 4, 8, V>(v, lane);
    if constexpr (V >= 8) gv_rs<V / 8, 4, V>(v, lane);
    if constexpr (V >= 16) gv_rs<V / 16, 2, V>(v, lane);
    if constexpr (V >= 32) gv_rs<V / 32, 1, V>(v, lane);
    float s = v[0];
#pragma unroll
    for (int o = 16 / V; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

template <int R, int CPW>
__device__ __forceinline__ void gemv_cols(int m, int n, int k, const float* __restrict__ A,
        const float* __restrict__ B, float* __restrict__ C, const float* __restrict__ bias,
        int relu, int ks) {
    constexpr int V = R * CPW;
    __shared__ float part[16][V];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = (int)(blockDim.x >> 5) / ks, grp = warp / ks, slice = warp - grp * ks;
    const int col0 = (blockIdx.x * groups + grp) * CPW, row0 = blockIdx.y * R;
    const int idx = gv_index<V>(lane);
    const int row = row0 + idx / CPW, col = col0 + idx % CPW;
    const float bc = bias != nullptr && col < n ? __ldg(bias + col) : 0.0f;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float v[V];
#pragma unroll
    for (int i = 0; i < V; i++) v[i] = 0.0f;
    const int chunks = (k + 127) / 128;
#pragma unroll 4
    for (int ch = slice; ch < chunks; ch += ks) {
        const int kk = ch * 128 + lane * 4;
        const bool in = kk < k;
        float4 b[CPW];
#pragma unroll
        for (int c = 0; c < CPW; c++)
            b[c] = in && col0 + c < n ? __ldg(reinterpret_cast<const float4*>(B + (long)(col0 + c) * k + kk)) : zero;
#pragma unroll
        for (int i = 0; i < R; i++) {
            const float4 a = in && row0 + i < m ? __ldg(reinterpret_cast<const float4*>(A + (long)(row0 + i) * k + kk)) : zero;
#pragma unroll
            for (int c = 0; c < CPW; c++) {
                float s = v[i * CPW + c];
                s = fmaf(a.x, b[c].x, s);
                s = fmaf(a.y, b[c].y, s);
                s = fmaf(a.z, b[c].z, s);
                s = fmaf(a.w, b[c].w, s);
                v[i * CPW + c] = s;
            }
        }
    }
    float s = gv_reduce<V>(v, lane);
    const bool writer = (lane & (32 / V - 1)) == 0;
    if (ks > 1) {
        if (writer) part[warp][idx] = s;
        __syncthreads();
        if (slice != 0) return;
        s = 0.0f;
        for (int z = 0; z < ks; z++) s += part[warp + z][idx];
    }
    if (!writer || row >= m || col >= n) return;
    const float o = s + (bias ? bc : 0.0f);
    C[(long)row * n + col] = relu ? fmaxf(o, 0.0f) : o;
}

#define GV(R, CPW)                                                                              \
    extern "C" __global__ void gemv_r##R##c##CPW(int m, int n, int k, const float* A,          \
            const float* B, float* C, const float* bias, int relu, int ks) {                   \
        gemv_cols<R, CPW>(m, n, k, A, B, C, bias, relu, ks);                                    \
    }
GV(1, 1)
GV(1, 2)
GV(1, 4)
GV(2, 1)
GV(2, 2)
GV(4, 1)
GV(4, 2)
GV(8, 1)
GV(8, 2)
#undef GV
