// Tiled SGEMM for the small, latency-bound products of small-batch work (cuBLAS launches too
// few blocks there): C[m x n] = alpha * op(A) op(B) + beta * C (+ bias[j]) (ReLU), row-major.
// op(A)(i, p) = ta ? A[p * lda + i] : A[i * lda + p]; op(B)(p, j) = tb ? B[j * ldb + p] : B[p * ldb + j].
// 256 threads, 32 x 32 outputs per block (2 x 2 per thread), K in steps of 32 through shared
// memory, loads coalesced along whichever dimension is contiguous. Sums run in a fixed order.
// Split-K: blockIdx.z takes K range [z * kc, (z + 1) * kc); with `partial` set, raw sums go to
// partial[z][i][j] and splitk_reduce applies the epilogue (a fixed summation order: results do
// not depend on scheduling). The tile loop and the epilogue are in gemm_tile.cu; on sm_90+
// gemm_cluster.cu reduces the same splits inside a thread-block cluster instead.
extern "C" __global__ void sgemm_tiled(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    __shared__ float As[32][33];
    __shared__ float Bs[32][33];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int row0 = blockIdx.y * 32, col0 = blockIdx.x * 32;
    int kbeg = blockIdx.z * kc;
    float acc[2][2];
    tiled_tile(m, n, min(k, kbeg + kc), A, lda, ta, B, ldb, tb, row0, col0, kbeg, As, Bs, acc);
#pragma unroll
    for (int di = 0; di < 2; di++)
#pragma unroll
        for (int dj = 0; dj < 2; dj++) {
            int i = row0 + ty * 2 + di, j = col0 + tx * 2 + dj;
            if (i < m && j < n && partial) {
                partial[((long)blockIdx.z * m + i) * n + j] = acc[di][dj];
            } else if (i < m && j < n) {
                C[(long)i * n + j] = tiled_epilogue(acc[di][dj], alpha, beta, C + (long)i * n + j, bias, j, relu);
            }
        }
}

// Register-blocked SGEMM for the mid-size products (every layout, the same arguments and
// split-K contract as sgemm_tiled): a block of 256 threads owns BM x BN outputs, each thread a
// TM x TN register tile (rows ty*TM.., columns tx*TN..), K in steps of 16 through two shared
// buffers (the next step loaded into registers while the current one is multiplied, one
// barrier per step). Operands are read with scalar loads coalesced along whichever dimension
// is contiguous (any alignment, any size); each sum runs over k in increasing order, so results
// are fixed by the shape and the split, not by scheduling.
template <int BM, int BN, int TM, int TN>
__device__ __forceinline__ void reg_gemm(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    constexpr int BK = 16;
    constexpr int THREADS = (BM / TM) * (BN / TN);
    constexpr int LA = BM * BK / THREADS, LB = BN * BK / THREADS;
    static_assert(THREADS == 256, "256 threads per block");
    static_assert(TM % 4 == 0 && TN % 4 == 0, "float4 reads of the register tiles");
    // Row strides padded by 4 floats: float4-aligned rows, fewer bank conflicts on the stores.
    __shared__ __align__(16) float As[2][BK][BM + 4];
    __shared__ __align__(16) float Bs[2][BK][BN + 4];
    const int tid = threadIdx.x;
    const int tx = tid % (BN / TN), ty = tid / (BN / TN);
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int kbeg = blockIdx.z * kc, kend = min(k, kbeg + kc);
    float ra[LA], rb[LB];
    // Element e of a K step: A's (i, p) and B's (p, j), consecutive e along the contiguous
    // dimension of each operand.
    auto load = [&](int p0) {
#pragma unroll
        for (int r = 0; r < LA; r++) {
            int e = tid + r * THREADS;
            int i = ta ? e % BM : e / BK, p = ta ? e / BM : e % BK;
            int gi = row0 + i, gp = p0 + p;
            ra[r] = (gi < m && gp < kend) ? (ta ? A[(long)gp * lda + gi] : A[(long)gi * lda + gp]) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < LB; r++) {
            int e = tid + r * THREADS;
            int j = tb ? e / BK : e % BN, p = tb ? e % BK : e / BN;
            int gj = col0 + j, gp = p0 + p;
            rb[r] = (gj < n && gp < kend) ? (tb ? B[(long)gj * ldb + gp] : B[(long)gp * ldb + gj]) : 0.0f;
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int r = 0; r < LA; r++) {
            int e = tid + r * THREADS;
            int i = ta ? e % BM : e / BK, p = ta ? e / BM : e % BK;
            As[buf][p][i] = ra[r];
        }
#pragma unroll
        for (int r = 0; r < LB; r++) {
            int e = tid + r * THREADS;
            int j = tb ? e / BK : e % BN, p = tb ? e % BK : e / BN;
            Bs[buf][p][j] = rb[r];
        }
    };
    float acc[TM][TN];
#pragma unroll
    for (int a = 0; a < TM; a++)
#pragma unroll
        for (int b = 0; b < TN; b++) acc[a][b] = 0.0f;
    if (kbeg < kend) {
        load(kbeg);
        store(0);
        __syncthreads();
    }
    int buf = 0;
    for (int p0 = kbeg; p0 < kend; p0 += BK) {
        const bool more = p0 + BK < kend;
        if (more) load(p0 + BK);
#pragma unroll
        for (int p = 0; p < BK; p++) {
            float a[TM], b[TN];
#pragma unroll
            for (int v = 0; v < TM; v += 4) {
                float4 t = *reinterpret_cast<const float4*>(&As[buf][p][ty * TM + v]);
                a[v] = t.x; a[v + 1] = t.y; a[v + 2] = t.z; a[v + 3] = t.w;
            }
#pragma unroll
            for (int v = 0; v < TN; v += 4) {
                float4 t = *reinterpret_cast<const float4*>(&Bs[buf][p][tx * TN + v]);
                b[v] = t.x; b[v + 1] = t.y; b[v + 2] = t.z; b[v + 3] = t.w;
            }
#pragma unroll
            for (int x = 0; x < TM; x++)
#pragma unroll
                for (int y = 0; y < TN; y++) acc[x][y] = fmaf(a[x], b[y], acc[x][y]);
        }
        if (more) store(buf ^ 1);
        // The buffer just read is written again two steps on, after this barrier.
        __syncthreads();
        buf ^= 1;
    }
#pragma unroll
    for (int x = 0; x < TM; x++)
#pragma unroll
        for (int y = 0; y < TN; y++) {
            int i = row0 + ty * TM + x, j = col0 + tx * TN + y;
            if (i < m && j < n && partial) {
                partial[((long)blockIdx.z * m + i) * n + j] = acc[x][y];
            } else if (i < m && j < n) {
                C[(long)i * n + j] = tiled_epilogue(acc[x][y], alpha, beta, C + (long)i * n + j, bias, j, relu);
            }
        }
}

// 64 x 64 outputs per block, 4 x 4 per thread.
extern "C" __global__ void sgemm_reg64(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    reg_gemm<64, 64, 4, 4>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial);
}

// 128 x 64 outputs per block, 8 x 4 per thread.
extern "C" __global__ void sgemm_reg128(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    reg_gemm<128, 64, 8, 4>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial);
}

// The forward layout only: C[m x n] = act(A[m x k] . B[n x k]^T + bias), A and B row-major
// with leading dimension k. One kernel, no reduce node: a block owns 32 x 32 outputs and its 8
// warps split K; each warp streams 32-wide K chunks of its slice through private shared memory
// (next chunk prefetched into registers), each lane keeps a 4 x 8 register tile, and the 8
// partial tiles are summed in shared memory in a fixed order at the end.
extern "C" __global__ void sgemm_nt_warpk(int m, int n, int k, const float* A, const float* B,
        float* C, const float* bias, int relu) {
    // Per warp: A and B chunks of [16 k][33] (one pad column against bank conflicts); the same
    // memory then holds the 8 partial 32 x 32 tiles for the final sum.
    __shared__ float smem[8 * 1056];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int row0 = blockIdx.y * 32, col0 = blockIdx.x * 32;
    float* As = smem + warp * 1056;
    float* Bs = smem + warp * 1056 + 528;
    // K slice of this warp, in chunks of 16.
    int per = ((k + 7) / 8 + 15) / 16 * 16;
    int kb = warp * per, ke = min(k, kb + per);
    int ri = lane / 4, cj = lane % 4;      // rows ri*4..+3, cols cj*8..+7
    float acc[4][8];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 8; b++) acc[a][b] = 0.0f;
    // Each chunk: 16 k x 32 rows of A and 16 k x 32 cols of B = 512 + 512 floats, 16 + 16 per lane.
    float ra[16], rb[16];
#pragma unroll
    for (int r = 0; r < 16; r++) {
        int e = lane + 32 * r;             // 0..511: row = e / 16, kk = e % 16
        int i = e / 16, kk = e % 16;
        int gk = kb + kk;
        ra[r] = (row0 + i < m && gk < ke) ? A[(long)(row0 + i) * k + gk] : 0.0f;
        rb[r] = (col0 + i < n && gk < ke) ? B[(long)(col0 + i) * k + gk] : 0.0f;
    }
    for (int k0 = kb; k0 < ke; k0 += 16) {
#pragma unroll
        for (int r = 0; r < 16; r++) {
            int e = lane + 32 * r;
            int i = e / 16, kk = e % 16;
            As[kk * 33 + i] = ra[r];
            Bs[kk * 33 + i] = rb[r];
        }
        __syncwarp();
        int k1 = k0 + 16;
        if (k1 < ke) {
#pragma unroll
            for (int r = 0; r < 16; r++) {
                int e = lane + 32 * r;
                int i = e / 16, kk = e % 16;
                int gk = k1 + kk;
                ra[r] = (row0 + i < m && gk < ke) ? A[(long)(row0 + i) * k + gk] : 0.0f;
                rb[r] = (col0 + i < n && gk < ke) ? B[(long)(col0 + i) * k + gk] : 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            float av[4], bv[8];
#pragma unroll
            for (int a = 0; a < 4; a++) av[a] = As[kk * 33 + ri * 4 + a];
#pragma unroll
            for (int b = 0; b < 8; b++) bv[b] = Bs[kk * 33 + cj * 8 + b];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 8; b++) acc[a][b] += av[a] * bv[b];
        }
        __syncwarp();
    }
    __syncthreads();
    // Partial tiles of the 8 warps, then a fixed-order sum.
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 8; b++) smem[warp * 1024 + (ri * 4 + a) * 32 + cj * 8 + b] = acc[a][b];
    __syncthreads();
    for (int o = threadIdx.x; o < 1024; o += 256) {
        int i = row0 + o / 32, j = col0 + o % 32;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) v += smem[w * 1024 + o];
        if (i < m && j < n) {
            if (bias) v += bias[j];
            if (relu) v = relu_f(v);
            C[(long)i * n + j] = v;
        }
    }
}

extern "C" __global__ void splitk_reduce(const float* partial, int splits, float* C, int m, int n,
        float alpha, float beta, const float* bias, int relu) {
    long e = IDX;
    long mn = (long)m * n;
    if (e >= mn) return;
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s += partial[z * mn + e];
    C[e] = tiled_epilogue(s, alpha, beta, C + e, bias, (int)(e % n), relu);
}

// The few-rows kernels' butterfly reduce-scatter over a warp's 32 lanes (the lane sums `v` and
// its `lane` in scope): at offset OFF the lane with that bit set keeps the upper HALF values,
// adding its partner's copy of them.
#define ROWS_RS(HALF, OFF)                                                    \
    {                                                                         \
        const bool hi = (lane & (OFF)) != 0;                                  \
        _Pragma("unroll") for (int i = 0; i < (HALF); i++) {                  \
            const float send = hi ? v[i] : v[i + (HALF)];                     \
            const float keep = hi ? v[i + (HALF)] : v[i];                     \
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, (OFF));          \
        }                                                                     \
    }

// The forward layout for few rows (m up to a few dozen: small-batch inference), one kernel, no
// reduce node: C[m x n] = act(A[m x k] . B[n x k]^T + bias), A and B row-major with leading
// dimension k, k a multiple of 4 and both 16-byte aligned (float4 loads). A block covers 16 rows
// (blockIdx.y) and 8 / ks groups of 4 columns; each group's ks warps split K into 128-wide
// chunks taken round-robin, the 32 lanes of a warp each taking 4 consecutive k of a chunk, so a
// warp streams 4 rows of B as 512-byte coalesced reads and feeds every A load to 16 FMAs. Each
// lane then holds 16 x 4 partial sums over its k; a butterfly reduce-scatter (62 shuffles)
// leaves every lane two finished sums, and the ks warps of a group add theirs in shared memory
// in warp order. Every sum runs in a fixed order: results never depend on scheduling.
extern "C" __global__ void sgemm_nt_rows(int m, int n, int k, const float* A, const float* B,
        float* C, const float* bias, int relu, int ks) {
    __shared__ float part[8][64];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int groups = 8 / ks;
    const int grp = warp / ks, slice = warp - grp * ks;
    const int col0 = (blockIdx.x * groups + grp) * 4;
    const int row0 = blockIdx.y * 16;
    float v[64];  // v[i * 4 + c]: row row0 + i, column col0 + c
#pragma unroll
    for (int i = 0; i < 64; i++) v[i] = 0.0f;
    const int chunks = (k + 127) / 128;
    for (int ch = slice; ch < chunks; ch += ks) {
        const int kk = ch * 128 + lane * 4;
        if (kk < k) {
            float4 b[4];
#pragma unroll
            for (int c = 0; c < 4; c++)
                b[c] = col0 + c < n ? __ldg(reinterpret_cast<const float4*>(B + (long)(col0 + c) * k + kk))
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int i = 0; i < 16; i++) {
                if (row0 + i < m) {
                    const float4 a = __ldg(reinterpret_cast<const float4*>(A + (long)(row0 + i) * k + kk));
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        float s = v[i * 4 + c];
                        s = fmaf(a.x, b[c].x, s);
                        s = fmaf(a.y, b[c].y, s);
                        s = fmaf(a.z, b[c].z, s);
                        s = fmaf(a.w, b[c].w, s);
                        v[i * 4 + c] = s;
                    }
                }
            }
        }
    }
    // Reduce-scatter over the 32 lanes: at offset o the lane with bit o set keeps the upper half.
    ROWS_RS(32, 16)
    ROWS_RS(16, 8)
    ROWS_RS(8, 4)
    ROWS_RS(4, 2)
    ROWS_RS(2, 1)
    // v[0], v[1] now hold the sums of flat index idx and idx + 1 (same row, columns c, c + 1).
    const int idx = ((lane >> 4) & 1) * 32 + ((lane >> 3) & 1) * 16 + ((lane >> 2) & 1) * 8 +
                    ((lane >> 1) & 1) * 4 + (lane & 1) * 2;
    float s0 = v[0], s1 = v[1];
    if (ks > 1) {
        part[warp][idx] = s0;
        part[warp][idx + 1] = s1;
        __syncthreads();
        if (slice != 0) return;
        s0 = 0.0f;
        s1 = 0.0f;
        for (int z = 0; z < ks; z++) {
            s0 += part[warp + z][idx];
            s1 += part[warp + z][idx + 1];
        }
    }
    const int row = row0 + idx / 4, col = col0 + idx % 4;
    if (row >= m) return;
    if (col < n) {
        float o = s0 + (bias ? bias[col] : 0.0f);
        C[(long)row * n + col] = relu ? relu_f(o) : o;
    }
    if (col + 1 < n) {
        float o = s1 + (bias ? bias[col + 1] : 0.0f);
        C[(long)row * n + col + 1] = relu ? relu_f(o) : o;
    }
}

// The few-rows kernel for at most R = 8 or 4 rows per block (batch-8 and batch-1 inference,
// where the product is a pass over the weights): the layout and fixed-order sums of
// sgemm_nt_rows with 4·R sums per lane instead of 64 (room for more warps per
// multiprocessor), and each warp loads two of its 128-wide K chunks (ch, ch + ks) before it
// uses either, so twice as many weight loads are in flight. The chunks are still added in the
// order ch, ch + ks, ch + 2·ks, ...; loads past k or n read nothing and add zeros. The
// butterfly reduce-scatter leaves one sum per lane (R = 8) or one per lane pair (R = 4, whose
// last step adds the pair: a + b and b + a are the same bits). A block has max(8, ks) warps:
// with ks = 16 it is one group of four columns whose 16 warps split K (long K, few columns,
// where 8 warps per group left most multiprocessors idle).
template <int R>
__device__ __forceinline__ void rows_few(int m, int n, int k, const float* __restrict__ A,
        const float* __restrict__ B, float* __restrict__ C, const float* __restrict__ bias,
        int relu, int ks) {
    __shared__ float part[16][4 * R];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int groups = (blockDim.x / 32) / ks;
    const int grp = warp / ks, slice = warp - grp * ks;
    const int col0 = (blockIdx.x * groups + grp) * 4;
    const int row0 = blockIdx.y * R;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float v[4 * R];  // v[i * 4 + c]: row row0 + i, column col0 + c
#pragma unroll
    for (int i = 0; i < 4 * R; i++) v[i] = 0.0f;
    const int chunks = (k + 127) / 128;
    for (int ch = slice; ch < chunks; ch += 2 * ks) {
        const int kk0 = ch * 128 + lane * 4, kk1 = kk0 + ks * 128;
        const bool has0 = kk0 < k, has1 = ch + ks < chunks && kk1 < k;
        float4 b0[4], b1[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const float* bc = B + (long)(col0 + c) * k;
            const bool col = col0 + c < n;
            b0[c] = col && has0 ? __ldg(reinterpret_cast<const float4*>(bc + kk0)) : zero;
            b1[c] = col && has1 ? __ldg(reinterpret_cast<const float4*>(bc + kk1)) : zero;
        }
#pragma unroll
        for (int i = 0; i < R; i++) {
            if (row0 + i < m) {
                const float* ar = A + (long)(row0 + i) * k;
                const float4 a0 = has0 ? __ldg(reinterpret_cast<const float4*>(ar + kk0)) : zero;
                const float4 a1 = has1 ? __ldg(reinterpret_cast<const float4*>(ar + kk1)) : zero;
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    float s = v[i * 4 + c];
                    s = fmaf(a0.x, b0[c].x, s);
                    s = fmaf(a0.y, b0[c].y, s);
                    s = fmaf(a0.z, b0[c].z, s);
                    s = fmaf(a0.w, b0[c].w, s);
                    s = fmaf(a1.x, b1[c].x, s);
                    s = fmaf(a1.y, b1[c].y, s);
                    s = fmaf(a1.z, b1[c].z, s);
                    s = fmaf(a1.w, b1[c].w, s);
                    v[i * 4 + c] = s;
                }
            }
        }
    }
    int idx;
    bool writer = true;
    if constexpr (R == 8) {
        ROWS_RS(16, 16)
        ROWS_RS(8, 8)
        ROWS_RS(4, 4)
        ROWS_RS(2, 2)
        ROWS_RS(1, 1)
        idx = lane;  // bit o of the lane picked the upper half at offset o: lane 16·b4 + ... + b0
    } else {
        ROWS_RS(8, 16)
        ROWS_RS(4, 8)
        ROWS_RS(2, 4)
        ROWS_RS(1, 2)
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
        idx = lane >> 1;
        writer = (lane & 1) == 0;
    }
    float s0 = v[0];
    if (ks > 1) {
        if (writer) part[warp][idx] = s0;
        __syncthreads();
        if (slice != 0) return;
        s0 = 0.0f;
        for (int z = 0; z < ks; z++) s0 += part[warp + z][idx];
    }
    const int row = row0 + idx / 4, col = col0 + idx % 4;
    if (!writer || row >= m || col >= n) return;
    const float o = s0 + (bias ? bias[col] : 0.0f);
    C[(long)row * n + col] = relu ? relu_f(o) : o;
}
#undef ROWS_RS

extern "C" __global__ void sgemm_nt_rows8(int m, int n, int k, const float* A,
        const float* B, float* C, const float* bias, int relu, int ks) {
    rows_few<8>(m, n, k, A, B, C, bias, relu, ks);
}

extern "C" __global__ void sgemm_nt_rows4(int m, int n, int k, const float* A,
        const float* B, float* C, const float* bias, int relu, int ks) {
    rows_few<4>(m, n, k, A, B, C, bias, relu, ks);
}
