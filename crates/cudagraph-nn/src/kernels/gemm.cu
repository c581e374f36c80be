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
    const float* b = partial ? nullptr : bias;
    const float bj[2] = {bias_at(b, col0 + tx * 2, n), bias_at(b, col0 + tx * 2 + 1, n)};
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
                C[(long)i * n + j] = tiled_epilogue(acc[di][dj], alpha, beta, C + (long)i * n + j, bias, bj[dj], relu);
            }
        }
}

// The register-blocked kernels' end (64 x 64 outputs per block, G groups of 64 threads each
// holding an 8 x 8 tile: rows ty*4.. and 32+ty*4.., columns tx*4.. and 32+tx*4..): the G
// partial tiles summed into smem[0 .. 4096) (row stride 64) through two 4096-float regions, in
// a fixed order: groups [half, 2 half) onto [0, half), two at a time, halving (for G = 8,
// ((g0 + g4) + (g2 + g6)) + ((g1 + g5) + (g3 + g7))). Every thread of the block calls it after
// a barrier that ended its other uses of smem (8192 floats at least).
template <int G>
__device__ __forceinline__ void reg_sum_groups(float* smem, float (&acc)[8][8], int g, int tx, int ty) {
    auto put = [&](int h) {
#pragma unroll
        for (int x = 0; x < 8; x++) {
            float* row = smem + h * 4096 + ((x / 4) * 32 + ty * 4 + x % 4) * 64;
            *reinterpret_cast<float4*>(row + tx * 4) = make_float4(acc[x][0], acc[x][1], acc[x][2], acc[x][3]);
            *reinterpret_cast<float4*>(row + 32 + tx * 4) = make_float4(acc[x][4], acc[x][5], acc[x][6], acc[x][7]);
        }
    };
    auto add = [&](int h) {
#pragma unroll
        for (int x = 0; x < 8; x++) {
            const float* row = smem + h * 4096 + ((x / 4) * 32 + ty * 4 + x % 4) * 64;
            float4 u = *reinterpret_cast<const float4*>(row + tx * 4);
            float4 v = *reinterpret_cast<const float4*>(row + 32 + tx * 4);
            acc[x][0] += u.x; acc[x][1] += u.y; acc[x][2] += u.z; acc[x][3] += u.w;
            acc[x][4] += v.x; acc[x][5] += v.y; acc[x][6] += v.z; acc[x][7] += v.w;
        }
    };
#pragma unroll
    for (int half = G / 2; half >= 1; half /= 2) {
#pragma unroll
        for (int base = 0; base < half; base += 2) {
            if (g >= half + base && g < half + base + 2 && g < 2 * half) put(g - half - base);
            __syncthreads();
            if (g >= base && g < base + 2 && g < half) add(g - base);
            __syncthreads();
        }
    }
    // Each thread of group 0 writes back exactly the elements it read: no barrier before.
    if (g == 0) put(0);
    __syncthreads();
}

// Writes the block's 64 x 64 sums (smem, row stride 64) coalesced: raw to partial[z] when
// splitting K, else through the epilogue into C; rows < m and columns < n only.
__device__ __forceinline__ void reg_store(const float* sum, int threads, int m, int n, float alpha,
        float beta, float* C, const float* bias, float bj, int relu, float* partial) {
    const int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
#pragma unroll 4
    for (int e = threadIdx.x; e < 4096; e += threads) {
        int i = row0 + e / 64, j = col0 + e % 64;
        float v = sum[e];
        if (i < m && j < n && partial) {
            partial[((long)blockIdx.z * m + i) * n + j] = v;
        } else if (i < m && j < n) {
            C[(long)i * n + j] = tiled_epilogue(v, alpha, beta, C + (long)i * n + j, bias, bj, relu);
        }
    }
}

// Register-blocked SGEMM for the mid-size products (every layout; sgemm_tiled's arguments and
// split-K contract): a block of 64 * G threads owns 64 x 64 outputs and is G K groups of 64
// threads. K runs in steps of 32 through two shared buffers (the next step loaded into
// registers while the current one is multiplied; one barrier per step); group g multiplies rows
// g*32/G.. of each step into an 8 x 8 register tile per thread (rows ty*4.. and 32+ty*4..,
// columns tx*4.. and 32+tx*4..: float4 reads a warp serves in one pass), so every scheduler
// has G/2 warps with 64 independent sums each even when the grid gives a multiprocessor a
// single block. The G partial tiles are then summed in shared memory in a fixed order (the
// upper half of the groups onto the lower half, halving: for G = 8,
// ((g0 + g4) + (g2 + g6)) + ((g1 + g5) + (g3 + g7))) and written coalesced with the epilogue.
// Results are fixed by the shape and the split, not by scheduling.
// VEC: operands read as float4 along their contiguous dimension (lda and ldb multiples of 4,
// 16-byte aligned bases; the launcher checks), else scalar loads (any layout and size).
template <bool VEC, int G>
__device__ __forceinline__ void reg_gemm(int m, int n, int k, float alpha,
        const float* __restrict__ A, int lda, int ta, const float* __restrict__ B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    constexpr int BM = 64, BN = 64, BK = 32, LD = 68, THREADS = 64 * G, PG = BK / G;
    constexpr int LS = BM * BK / THREADS;        // scalar loads per operand and thread
    constexpr int LV = LS / 4;                   // float4 loads per operand and thread
    __shared__ __align__(16) float smem[2 * 2 * BK * LD];
    float* const As = smem;                      // [buf][p][i], row stride LD
    float* const Bs = smem + 2 * BK * LD;        // [buf][p][j]
    const int tid = threadIdx.x, g = tid / 64, t = tid % 64, tx = t % 8, ty = t / 8;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int kbeg = blockIdx.z * kc, kend = min(k, kbeg + kc);
    // reg_store's column for this thread: col0 + tid % 64 (THREADS is a multiple of 64).
    const float bj = bias_at(partial ? nullptr : bias, col0 + tid % 64, n);
    float ra[LS], rb[LS];
    // VEC element e of a step: along K (ta = 0: row e / 8, k (e % 8) * 4) or along the rows
    // (ta = 1: k e / 16, row (e % 16) * 4); B likewise. Scalar element e: consecutive e along
    // the contiguous dimension.
    auto load = [&](int p0) {
        if (VEC) {
#pragma unroll
            for (int r = 0; r < LV; r++) {
                int e = tid + r * THREADS;
                int i = ta ? (e % 16) * 4 : e / 8, p = ta ? e / 16 : (e % 8) * 4;
                int gi = row0 + i, gp = p0 + p;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (gi < m && gp < kend)
                    v = *reinterpret_cast<const float4*>(ta ? A + (long)gp * lda + gi : A + (long)gi * lda + gp);
                ra[4 * r] = v.x; ra[4 * r + 1] = v.y; ra[4 * r + 2] = v.z; ra[4 * r + 3] = v.w;
                int j = tb ? e / 8 : (e % 16) * 4, q = tb ? (e % 8) * 4 : e / 16;
                int gj = col0 + j, gq = p0 + q;
                float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (gj < n && gq < kend)
                    w = *reinterpret_cast<const float4*>(tb ? B + (long)gj * ldb + gq : B + (long)gq * ldb + gj);
                rb[4 * r] = w.x; rb[4 * r + 1] = w.y; rb[4 * r + 2] = w.z; rb[4 * r + 3] = w.w;
            }
        } else {
#pragma unroll
            for (int r = 0; r < LS; r++) {
                int e = tid + r * THREADS;
                int i = ta ? e % BM : e / BK, p = ta ? e / BM : e % BK;
                int gi = row0 + i, gp = p0 + p;
                ra[r] = (gi < m && gp < kend) ? (ta ? A[(long)gp * lda + gi] : A[(long)gi * lda + gp]) : 0.0f;
                int j = tb ? e / BK : e % BN, q = tb ? e % BK : e / BN;
                int gj = col0 + j, gq = p0 + q;
                rb[r] = (gj < n && gq < kend) ? (tb ? B[(long)gj * ldb + gq] : B[(long)gq * ldb + gj]) : 0.0f;
            }
        }
    };
    auto store = [&](int buf) {
        float* as = As + buf * BK * LD;
        float* bs = Bs + buf * BK * LD;
        if (VEC) {
#pragma unroll
            for (int r = 0; r < LV; r++) {
                int e = tid + r * THREADS;
                int i = ta ? (e % 16) * 4 : e / 8, p = ta ? e / 16 : (e % 8) * 4;
                if (ta) {
                    *reinterpret_cast<float4*>(as + p * LD + i) = make_float4(ra[4 * r], ra[4 * r + 1], ra[4 * r + 2], ra[4 * r + 3]);
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) as[(p + c) * LD + i] = ra[4 * r + c];
                }
                int j = tb ? e / 8 : (e % 16) * 4, q = tb ? (e % 8) * 4 : e / 16;
                if (!tb) {
                    *reinterpret_cast<float4*>(bs + q * LD + j) = make_float4(rb[4 * r], rb[4 * r + 1], rb[4 * r + 2], rb[4 * r + 3]);
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) bs[(q + c) * LD + j] = rb[4 * r + c];
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < LS; r++) {
                int e = tid + r * THREADS;
                int i = ta ? e % BM : e / BK, p = ta ? e / BM : e % BK;
                as[p * LD + i] = ra[r];
                int j = tb ? e / BK : e % BN, q = tb ? e % BK : e / BN;
                bs[q * LD + j] = rb[r];
            }
        }
    };
    float acc[8][8];
#pragma unroll
    for (int x = 0; x < 8; x++)
#pragma unroll
        for (int y = 0; y < 8; y++) acc[x][y] = 0.0f;
    if (kbeg < kend) {
        load(kbeg);
        store(0);
    }
    __syncthreads();
    int buf = 0;
    for (int p0 = kbeg; p0 < kend; p0 += BK) {
        const bool more = p0 + BK < kend;
        if (more) load(p0 + BK);
        const float* as = As + buf * BK * LD + g * PG * LD;
        const float* bs = Bs + buf * BK * LD + g * PG * LD;
#pragma unroll
        for (int p = 0; p < PG; p++) {
            float4 a0 = *reinterpret_cast<const float4*>(as + p * LD + ty * 4);
            float4 a1 = *reinterpret_cast<const float4*>(as + p * LD + 32 + ty * 4);
            float4 b0 = *reinterpret_cast<const float4*>(bs + p * LD + tx * 4);
            float4 b1 = *reinterpret_cast<const float4*>(bs + p * LD + 32 + tx * 4);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int x = 0; x < 8; x++)
#pragma unroll
                for (int y = 0; y < 8; y++) acc[x][y] = fmaf(a[x], b[y], acc[x][y]);
        }
        if (more) store(buf ^ 1);
        // The buffer just read is written again two steps on, after this barrier.
        __syncthreads();
        buf ^= 1;
    }
    // The loop's last barrier ended every read of the operand buffers.
    reg_sum_groups<G>(smem, acc, g, tx, ty);
    reg_store(smem, THREADS, m, n, alpha, beta, C, bias, bj, relu, partial);
}

// Eight K groups (512 threads, at most 128 registers each); scalar loads: any layout, size and
// alignment.
extern "C" __global__ void __launch_bounds__(512, 1) sgemm_reg(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    reg_gemm<false, 8>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial);
}

// The same with float4 loads: lda and ldb multiples of 4, A and B 16-byte aligned.
extern "C" __global__ void __launch_bounds__(512, 1) sgemm_reg4(int m, int n, int k, float alpha,
        const float* A, int lda, int ta, const float* B, int ldb, int tb,
        float beta, float* C, const float* bias, int relu, int kc, float* partial) {
    reg_gemm<true, 8>(m, n, k, alpha, A, lda, ta, B, ldb, tb, beta, C, bias, relu, kc, partial);
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
    // The column this thread finishes at the end (col0 + threadIdx.x % 32), its bias loaded now.
    const float bj = bias_at(bias, col0 + threadIdx.x % 32, n);
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
            if (bias) v += bj;
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
    const float b = bias_at(bias, (int)(e % n), n);
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s += partial[z * mn + e];
    C[e] = tiled_epilogue(s, alpha, beta, C + e, bias, b, relu);
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
    // The two columns this lane finishes (see idx below), their bias loaded now.
    const int cb = col0 + (lane & 1) * 2;
    const float b0 = bias_at(bias, cb, n), b1 = bias_at(bias, cb + 1, n);
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
        float o = s0 + (bias ? b0 : 0.0f);
        C[(long)row * n + col] = relu ? relu_f(o) : o;
    }
    if (col + 1 < n) {
        float o = s1 + (bias ? b1 : 0.0f);
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
    // The column this lane finishes (col0 + idx % 4, idx below), its bias loaded now.
    const float bc = bias_at(bias, col0 + (R == 8 ? lane : lane >> 1) % 4, n);
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
    const float o = s0 + (bias ? bc : 0.0f);
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

// The column-warp kernels for few rows (the forward layout, as sgemm_nt_rows: C[m x n] =
// act(A[m x k] . B[n x k]^T + bias), k a multiple of 4, A and B 16-byte aligned). A block has W
// warps (blockDim.x / 32, at most 16); warp w takes the CPW columns of group
// blockIdx.x * (W / ks) + w / ks, the R rows blockIdx.y * R ..., and the 128-wide K chunks
// w % ks, w % ks + ks, ... of them, each lane 4 consecutive k of a chunk (float4 loads, several
// chunks in flight). A lane's V = R * CPW sums are reduce-scattered over the warp — halving at
// offsets 16, 8, ... while values remain, then added over the remaining offsets — so the warp
// finishes with log2(32) shuffle steps of at most V / 2 values, no shared memory and no barrier
// unless ks > 1, where the ks warps of a group add their sums in shared memory in warp order.
// Fewer rows and columns per warp than sgemm_nt_rows4/8 (R = 1 or 2 for a single row): the
// latency-bound small-batch products finish sooner (H100, docs/engines.md). Every sum
// runs in a fixed order: results never depend on scheduling.
template <int HALF, int OFF, int V>
__device__ __forceinline__ void cols_rs(float (&v)[V], int lane) {
    const bool hi = (lane & OFF) != 0;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        const float send = hi ? v[i] : v[i + HALF];
        const float keep = hi ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
}

// The value of V a lane holds after cols_reduce's halving steps (bits 4, 3, ... of the lane
// pick the upper half at offsets 16, 8, ...).
template <int V>
__device__ __forceinline__ int cols_index(int lane) {
    int idx = 0;
    if (V >= 2 && (lane & 16)) idx += V / 2;
    if (V >= 4 && (lane & 8)) idx += V / 4;
    if (V >= 8 && (lane & 4)) idx += V / 8;
    if (V >= 16 && (lane & 2)) idx += V / 16;
    if (V >= 32 && (lane & 1)) idx += V / 32;
    return idx;
}

// The warp's sum of value cols_index(lane), in every lane (lanes that differ only in the bits
// below 32 / V hold the same one).
template <int V>
__device__ __forceinline__ float cols_reduce(float (&v)[V], int lane) {
    if constexpr (V >= 2) cols_rs<V / 2, 16, V>(v, lane);
    if constexpr (V >= 4) cols_rs<V / 4, 8, V>(v, lane);
    if constexpr (V >= 8) cols_rs<V / 8, 4, V>(v, lane);
    if constexpr (V >= 16) cols_rs<V / 16, 2, V>(v, lane);
    if constexpr (V >= 32) cols_rs<V / 32, 1, V>(v, lane);
    float s = v[0];
#pragma unroll
    for (int o = 16 / V; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

template <int R, int CPW>
__device__ __forceinline__ void cols_gemm(int m, int n, int k, const float* __restrict__ A,
        const float* __restrict__ B, float* __restrict__ C, const float* __restrict__ bias,
        int relu, int ks) {
    constexpr int V = R * CPW;
    static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "R * CPW: a power of two up to 32");
    __shared__ float part[16][V];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = (int)(blockDim.x >> 5) / ks, grp = warp / ks, slice = warp - grp * ks;
    const int col0 = (blockIdx.x * groups + grp) * CPW, row0 = blockIdx.y * R;
    const int idx = cols_index<V>(lane);
    const int row = row0 + idx / CPW, col = col0 + idx % CPW;
    const float bc = bias_at(bias, col, n);
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
    float s = cols_reduce<V>(v, lane);
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
    C[(long)row * n + col] = relu ? relu_f(o) : o;
}

// One kernel per (R, CPW), written out (the PDL rewriter reads kernel names from the source).
extern "C" __global__ void sgemm_nt_cols_r1c1(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<1, 1>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r1c2(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<1, 2>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r2c1(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<2, 1>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r2c2(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<2, 2>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r4c1(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<4, 1>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r4c2(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<4, 2>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r8c1(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<8, 1>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r8c2(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<8, 2>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r16c1(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<16, 1>(m, n, k, A, B, C, bias, relu, ks);
}
extern "C" __global__ void sgemm_nt_cols_r16c2(int m, int n, int k,
        const float* A, const float* B, float* C, const float* bias, int relu, int ks) {
    cols_gemm<16, 2>(m, n, k, A, B, C, bias, relu, ks);
}
