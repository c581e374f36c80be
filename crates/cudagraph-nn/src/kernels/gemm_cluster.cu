// Split-K without a reduce node (sm_90+): `sgemm_tiled`'s product, K split into S ranges of
// whole 32-wide tiles taken by the S blocks of one thread-block cluster (grid z = S, cluster
// 1 x 1 x S, so the block of split z is the cluster's block of rank z). Each block leaves its
// 32 x 32 partial tile in shared memory; after a cluster barrier the block of rank 0 reads the
// S tiles through distributed shared memory, sums them in rank order starting from 0 — the
// order of splitk_reduce, so the result equals sgemm_tiled with S splits bit for bit — applies
// the epilogue and writes C; a second barrier keeps the other blocks' shared memory alive
// until it has read it. One kernel, no scratch buffer, deterministic.

// cg_cluster_sync and cg_dsmem_load come from cluster.cu.

__device__ __forceinline__ void tiled_cluster(int splits, int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc) {
    __shared__ float As[32][33];
    __shared__ float Bs[32][33];
    __shared__ float part[32 * 32];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int row0 = blockIdx.y * 32, col0 = blockIdx.x * 32;
    int kbeg = blockIdx.z * kc;
    const float* b = blockIdx.z == 0 ? bias : nullptr;
    const float bj[2] = {bias_at(b, col0 + tx * 2, n), bias_at(b, col0 + tx * 2 + 1, n)};
    float acc[2][2];
    tiled_tile(m, n, min(k, kbeg + kc), A, lda, ta, B, ldb, tb, row0, col0, kbeg, As, Bs, acc);
#pragma unroll
    for (int di = 0; di < 2; di++)
#pragma unroll
        for (int dj = 0; dj < 2; dj++) part[(ty * 2 + di) * 32 + tx * 2 + dj] = acc[di][dj];
    cg_cluster_sync();
    if (blockIdx.z == 0) {
#pragma unroll
        for (int di = 0; di < 2; di++)
#pragma unroll
            for (int dj = 0; dj < 2; dj++) {
                int o = (ty * 2 + di) * 32 + tx * 2 + dj;
                int i = row0 + ty * 2 + di, j = col0 + tx * 2 + dj;
                float s = 0.0f;
                for (int z = 0; z < splits; z++) s += cg_dsmem_load(part + o, (unsigned)z);
                if (i < m && j < n)
                    C[(long)i * n + j] = tiled_epilogue(s, alpha, beta, C + (long)i * n + j, bias, bj[dj], relu);
            }
    }
    cg_cluster_sync();
}

#define CG_TILED_CLUSTER(S)                                                                     \
    extern "C" __global__ void __cluster_dims__(1, 1, S) sgemm_tiled_cluster##S(int m, int n,  \
            int k, float alpha, const float* A, int lda, int ta, const float* B, int ldb, int tb, \
            float beta, float* C, const float* bias, int relu, int kc) {                       \
        CG_PDL_ENTER();                                                                         \
        tiled_cluster(S, m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc);      \
    }
CG_TILED_CLUSTER(2)
CG_TILED_CLUSTER(4)
CG_TILED_CLUSTER(8)
#undef CG_TILED_CLUSTER

// The forward layout `C = epilogue(alpha * A . B^T + beta * C)`, A [m x k] and B [n x k]
// row-major with leading dimension k, k a multiple of 4 and both 16-byte aligned: the product
// of small-batch Linear layers. The tiled kernel above moves 8 KB per block per K step and
// waits a memory latency for each; this one streams 128-wide K chunks with float4 loads (32 KB
// per block in flight) into padded shared memory, so a block's whole K range is a chunk or
// two. A block owns 32 x 32 outputs, each thread four of them (rows ty and ty + 16, columns tx
// and tx + 16: the float4 reads of shared memory are free of bank conflicts), each summed as
// two sums in increasing k (even and odd 4-wide groups) added at the end. K splits into S
// ranges of whole chunks across the S blocks of a cluster (grid z = S), reduced through
// distributed shared memory by rank 0 in rank order starting from 0, as above; S = 1 needs no
// cluster.
#define NT_LD 132
template <int S>
__device__ __forceinline__ void nt_chunks(int m, int n, int k, float alpha, const float* A,
        const float* B, float beta, float* C, const float* bias, int relu, int kc) {
    __shared__ __align__(16) float As[32 * NT_LD];
    __shared__ __align__(16) float Bs[32 * NT_LD];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int row0 = blockIdx.y * 32, col0 = blockIdx.x * 32;
    const int kbeg = blockIdx.z * kc, kend = min(k, kbeg + kc);
    // The bias of this thread's two columns (tx and tx + 16), for the block that writes C.
    const float* bw = S == 1 || blockIdx.z == 0 ? bias : nullptr;
    const float bj[2] = {bias_at(bw, col0 + tx, n), bias_at(bw, col0 + tx + 16, n)};
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 ra[4], rb[4];
    // Element e = thread + 256 r of a chunk: row e / 32 of the tile, k offset 4 (e % 32); a
    // warp reads 512 contiguous bytes of one row. kend is a multiple of 4 (k and kc are), so a
    // float4 is wholly inside [kbeg, kend) or wholly outside.
#define NT_LOAD(C0)                                                                            \
    _Pragma("unroll") for (int r = 0; r < 4; r++) {                                            \
        const int e = threadIdx.x + 256 * r, row = e / 32, gk = (C0) + 4 * (e % 32);          \
        ra[r] = (row0 + row < m && gk < kend)                                                  \
                    ? __ldg(reinterpret_cast<const float4*>(A + (long)(row0 + row) * k + gk)) \
                    : zero;                                                                    \
        rb[r] = (col0 + row < n && gk < kend)                                                  \
                    ? __ldg(reinterpret_cast<const float4*>(B + (long)(col0 + row) * k + gk)) \
                    : zero;                                                                    \
    }
    // Eight independent sums per thread (the four outputs, each over even and odd 4-wide K
    // groups of the chunk), added at the end: twice the chains the FMA pipes can overlap.
    float acc2[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    NT_LOAD(kbeg)
    for (int c0 = kbeg; c0 < kend; c0 += 128) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int e = threadIdx.x + 256 * r, row = e / 32, q = e % 32;
            *reinterpret_cast<float4*>(As + row * NT_LD + 4 * q) = ra[r];
            *reinterpret_cast<float4*>(Bs + row * NT_LD + 4 * q) = rb[r];
        }
        __syncthreads();
        if (c0 + 128 < kend) {
            NT_LOAD(c0 + 128)
        }
#pragma unroll 4
        for (int kk = 0; kk < 128; kk += 8) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int kq = kk + 4 * h;
                const float4 a0 = *reinterpret_cast<const float4*>(As + ty * NT_LD + kq);
                const float4 a1 = *reinterpret_cast<const float4*>(As + (ty + 16) * NT_LD + kq);
                const float4 b0 = *reinterpret_cast<const float4*>(Bs + tx * NT_LD + kq);
                const float4 b1 = *reinterpret_cast<const float4*>(Bs + (tx + 16) * NT_LD + kq);
                float* c = acc2[h];
                c[0] = fmaf(a0.x, b0.x, c[0]); c[0] = fmaf(a0.y, b0.y, c[0]); c[0] = fmaf(a0.z, b0.z, c[0]); c[0] = fmaf(a0.w, b0.w, c[0]);
                c[1] = fmaf(a0.x, b1.x, c[1]); c[1] = fmaf(a0.y, b1.y, c[1]); c[1] = fmaf(a0.z, b1.z, c[1]); c[1] = fmaf(a0.w, b1.w, c[1]);
                c[2] = fmaf(a1.x, b0.x, c[2]); c[2] = fmaf(a1.y, b0.y, c[2]); c[2] = fmaf(a1.z, b0.z, c[2]); c[2] = fmaf(a1.w, b0.w, c[2]);
                c[3] = fmaf(a1.x, b1.x, c[3]); c[3] = fmaf(a1.y, b1.y, c[3]); c[3] = fmaf(a1.z, b1.z, c[3]); c[3] = fmaf(a1.w, b1.w, c[3]);
            }
        }
        __syncthreads();
    }
#undef NT_LOAD
    const float acc[4] = {acc2[0][0] + acc2[1][0], acc2[0][1] + acc2[1][1], acc2[0][2] + acc2[1][2],
                          acc2[0][3] + acc2[1][3]};
    if (S > 1) {
        // The partial tile in As (free after the loop's last barrier).
#pragma unroll
        for (int o = 0; o < 4; o++) As[(ty + 16 * (o / 2)) * 32 + tx + 16 * (o % 2)] = acc[o];
        cg_cluster_sync();
    }
    if (S == 1 || blockIdx.z == 0) {
#pragma unroll
        for (int o = 0; o < 4; o++) {
            const int i = row0 + ty + 16 * (o / 2), j = col0 + tx + 16 * (o % 2);
            float s = acc[o];
            if (S > 1) {
                s = 0.0f;
                for (int z = 0; z < S; z++)
                    s += cg_dsmem_load(As + (ty + 16 * (o / 2)) * 32 + tx + 16 * (o % 2), (unsigned)z);
            }
            if (i < m && j < n)
                C[(long)i * n + j] = tiled_epilogue(s, alpha, beta, C + (long)i * n + j, bias, bj[o % 2], relu);
        }
    }
    if (S > 1) cg_cluster_sync();
}

#define CG_NT_CLUSTER(S)                                                                        \
    extern "C" __global__ void __cluster_dims__(1, 1, S) sgemm_nt_chunks##S(int m, int n,      \
            int k, float alpha, const float* A, const float* B, float beta, float* C,           \
            const float* bias, int relu, int kc) {                                              \
        CG_PDL_ENTER();                                                                         \
        nt_chunks<S>(m, n, k, alpha, A, B, beta, C, bias, relu, kc);                            \
    }
extern "C" __global__ void sgemm_nt_chunks1(int m, int n, int k, float alpha, const float* A,
        const float* B, float beta, float* C, const float* bias, int relu, int kc) {
    CG_PDL_ENTER();
    nt_chunks<1>(m, n, k, alpha, A, B, beta, C, bias, relu, kc);
}
CG_NT_CLUSTER(2)
CG_NT_CLUSTER(4)
CG_NT_CLUSTER(8)
#undef CG_NT_CLUSTER
#undef NT_LD
