// Token sampling and decode bookkeeping (sampling.rs). Compiled as its own module after the
// device-check prologue and philox_draw.cu (rng_draw: the generator's numbers). Everything
// here is deterministic: reductions are integer (counts and fixed-point weights) or a
// fixed-order pairwise choice, and the arithmetic that decides a token uses only correctly
// rounded f32 operations (__f*_rn, no contraction), so the CPU reference
// (nn::sampling::reference) reproduces every choice bit for bit.
//
// One block of SAMP_THREADS threads per row. A value's order key is its f32 bits mapped so
// that unsigned order is float order (-0 counts as +0; NaN is never a candidate). A
// candidate's weight is a fixed-point exp(z - max): samp_weight, 2^32 for the maximum, 0 below
// 2^-32 of it. Top-k and top-p thresholds are found by radix select over the keys (four
// passes of 8-bit digits, a shared histogram of counts or of weights each), ties at the
// threshold are cut by token id (lowest first), and the draw walks the kept weights in token
// id order: the first token whose running weight exceeds floor(r * W) with r a 64-bit Philox
// number and W the kept weight.
#define SAMP_THREADS 1024
#define SAMP_WARPS (SAMP_THREADS / 32)
#define SAMP_BINS 256
#define SAMP_NONE 0x7fffffff

// The order key of a value that is not NaN.
__device__ __forceinline__ unsigned int samp_key(float z) {
    unsigned int b = __float_as_uint(z == 0.0f ? 0.0f : z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The value of an order key.
__device__ __forceinline__ float samp_unkey(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The row's value i: the logit times `t`, the reciprocal of the temperature (within an ulp of
// the division, and cheaper), or the logit when t = 0 (greedy).
__device__ __forceinline__ float samp_z(const float* row, int i, float t) {
    float x = row[i];
    return t > 0.0f ? __fmul_rn(x, t) : x;
}

// Fixed-point exp(z - m) in units of 2^-32 (z <= m, neither NaN; m may be +inf, then the +inf
// values weigh 2^32 and the rest 0): 2^(n + f) with n = floor(t), t = (z - m) * log2(e), and
// 2^f by its degree-7 Taylor polynomial in correctly rounded fused multiply-adds; 0 for t < -32.
__device__ __forceinline__ unsigned long long samp_weight(float z, float m) {
    float e;
    if (isinf(m) && m > 0.0f) e = (z == m) ? 0.0f : __uint_as_float(0xff800000u);
    else e = __fsub_rn(z, m);
    float t = __fmul_rn(e, __uint_as_float(0x3fb8aa3bu));
    if (!(t >= -32.0f)) return 0ull;
    float n = floorf(t);
    float f = __fsub_rn(t, n);
    float p = __uint_as_float(0x377fe5feu);
    p = __fmaf_rn(p, f, __uint_as_float(0x39218489u));
    p = __fmaf_rn(p, f, __uint_as_float(0x3aaec3ffu));
    p = __fmaf_rn(p, f, __uint_as_float(0x3c1d955bu));
    p = __fmaf_rn(p, f, __uint_as_float(0x3d635847u));
    p = __fmaf_rn(p, f, __uint_as_float(0x3e75fdf0u));
    p = __fmaf_rn(p, f, __uint_as_float(0x3f317218u));
    p = __fmaf_rn(p, f, 1.0f);
    unsigned int mant = (unsigned int)__fmul_rn(p, 8388608.0f);
    if (mant > 0xffffffu) mant = 0xffffffu;
    int sh = (int)n + 9;
    unsigned long long w = mant;
    return sh >= 0 ? (w << sh) : (w >> (-sh));
}

struct samp_shared {
    unsigned long long bins[SAMP_BINS];
    unsigned long long warp[SAMP_WARPS];
    unsigned int wkey[SAMP_WARPS];
    int wid[SAMP_WARPS];
    unsigned int prefix;
    unsigned long long above, eq, total, target;
    double pmass;
    int found;
};

// Block-wide exclusive scan of one u64 per thread (thread order); every thread gets the total.
__device__ unsigned long long samp_scan(samp_shared& s, unsigned long long v,
                                        unsigned long long* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long inc = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        unsigned long long o = __shfl_up_sync(0xffffffffu, inc, d);
        if (lane >= d) inc += o;
    }
    __syncthreads();
    if (lane == 31) s.warp[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        unsigned long long w = s.warp[lane];
        unsigned long long wi = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned long long o = __shfl_up_sync(0xffffffffu, wi, d);
            if (lane >= d) wi += o;
        }
        s.warp[lane] = wi - w;
        if (lane == 31) s.total = wi;
    }
    __syncthreads();
    unsigned long long r = s.warp[warp] + inc - v;
    *total = s.total;
    __syncthreads();
    return r;
}

// Whether value (i, z) of the row is a candidate after top-k (key above kk, or equal with an
// id up to ik) and kept by top-p (the same with kp, ip).
__device__ __forceinline__ bool samp_kept(int i, float z, unsigned int kk, int ik, unsigned int kp,
                                          int ip) {
    if (isnan(z)) return false;
    unsigned int k = samp_key(z);
    return (k > kk || (k == kk && i <= ik)) && (k > kp || (k == kp && i <= ip));
}

// Radix select, descending: the largest key K such that Q(key >= K) reaches the target, Q
// summing 1 (mass = false: target `count`) or the weight (mass = true: (double) Q >= p_mass,
// p_mass = top_p * (double) the total weight, from the first level's histogram) over the
// candidates of (kk, ik). Leaves K in s.prefix, Q(key > K) in s.above, Q(key == K) in s.eq
// and, with mass, p_mass in s.pmass.
__device__ void samp_select(samp_shared& s, const float* row, int vocab, float t, float m,
                            bool mass, unsigned long long count, float top_p, unsigned int kk,
                            int ik) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        s.prefix = 0u;
        s.above = 0ull;
    }
    for (int level = 0; level < 4; level++) {
        const int shift = 24 - 8 * level;
        for (int b = threadIdx.x; b < SAMP_BINS; b += SAMP_THREADS) s.bins[b] = 0ull;
        __syncthreads();
        const unsigned int prefix = s.prefix;
        // Whole warps walk the row (lane i of each 32), so that lanes adding to the same bin
        // (most of a row shares a few exponents at the first level) are summed in the warp
        // first and the bin takes one atomic add per warp and digit.
        for (int base = (threadIdx.x >> 5) * 32; base < vocab; base += SAMP_THREADS) {
            const int i = base + lane;
            unsigned int digit = SAMP_BINS;
            unsigned long long q = 0ull;
            if (i < vocab) {
                float z = samp_z(row, i, t);
                if (samp_kept(i, z, kk, ik, 0u, SAMP_NONE)) {
                    unsigned int k = samp_key(z);
                    if (level == 0 || (k >> (shift + 8)) == (prefix >> (shift + 8))) {
                        q = mass ? samp_weight(z, m) : 1ull;
                        if (q) digit = (k >> shift) & 255u;
                    }
                }
            }
            // Past the first level most warps hold nothing under the prefix: skip the match.
            if (!__any_sync(0xffffffffu, digit < SAMP_BINS)) continue;
            const unsigned int peers = __match_any_sync(0xffffffffu, digit);
            if (digit < SAMP_BINS) {
                // Every lane of a group has the same mask and runs the same loop.
                unsigned long long sum = 0ull;
                for (unsigned int left = peers; left; left &= left - 1u)
                    sum += __shfl_sync(peers, q, __ffs(left) - 1);
                if (lane == __ffs(peers) - 1) atomicAdd(&s.bins[digit], sum);
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l holds bins 255 - 8l down to 248 - 8l (descending key order).
            unsigned long long sum = 0ull;
#pragma unroll
            for (int j = 0; j < 8; j++) sum += s.bins[255 - 8 * lane - j];
            unsigned long long inc = sum;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                unsigned long long o = __shfl_up_sync(0xffffffffu, inc, d);
                if (lane >= d) inc += o;
            }
            unsigned long long all = __shfl_sync(0xffffffffu, inc, 31);
            double target = 0.0;
            if (mass && level == 0) {
                target = (double)top_p * (double)all;
                if (lane == 0) s.pmass = target;
            } else if (mass) {
                target = s.pmass;
            }
            const unsigned long long above = s.above;
            bool hit = mass ? ((double)(above + inc) >= target) : (above + inc >= count);
            unsigned int ballot = __ballot_sync(0xffffffffu, hit);
            int first = ballot ? __ffs(ballot) - 1 : 31;
            if (lane == first) {
                unsigned long long c = above + inc - sum;
                int digit = 248 - 8 * lane;
                unsigned long long eq = s.bins[digit];
                for (int j = 0; j < 8; j++) {
                    int b = 255 - 8 * lane - j;
                    unsigned long long q = s.bins[b];
                    bool h = mass ? ((double)(c + q) >= target) : (c + q >= count);
                    if (h) {
                        digit = b;
                        eq = q;
                        break;
                    }
                    c += q;
                }
                s.prefix = prefix | ((unsigned int)digit << shift);
                s.above = c;
                s.eq = eq;
            }
        }
        __syncthreads();
    }
}

// The id of the r-th (1-based) value in id order with key `key` among the candidates of (kk,
// ik): threads own contiguous chunks of the row, an exclusive scan of their counts finds the
// owner, which walks its chunk.
__device__ int samp_tie_cut(samp_shared& s, const float* row, int vocab, float t, unsigned int key,
                            unsigned int kk, int ik, unsigned long long r) {
    const int chunk = (vocab + SAMP_THREADS - 1) / SAMP_THREADS;
    const int lo = min(vocab, (int)threadIdx.x * chunk), hi = min(vocab, lo + chunk);
    unsigned long long n = 0ull;
    for (int i = lo; i < hi; i++) {
        float z = samp_z(row, i, t);
        if (samp_kept(i, z, kk, ik, 0u, SAMP_NONE) && samp_key(z) == key) n++;
    }
    unsigned long long total;
    unsigned long long before = samp_scan(s, n, &total);
    if (threadIdx.x == 0) s.found = SAMP_NONE;
    __syncthreads();
    if (before < r && r <= before + n) {
        unsigned long long c = before;
        for (int i = lo; i < hi; i++) {
            float z = samp_z(row, i, t);
            if (samp_kept(i, z, kk, ik, 0u, SAMP_NONE) && samp_key(z) == key && ++c == r) {
                s.found = i;
                break;
            }
        }
    }
    __syncthreads();
    int id = s.found;
    __syncthreads();
    return id;
}

// One level of the draw. Strips j of 32 consecutive ids (lane l: id 32 j + l) in [s0, s1) are
// split over the warps in contiguous runs of ceil((s1 - s0) / 32) strips; each warp sums the
// kept weights of its run (coalesced reads), warp 0 scans the 32 sums and finds the run that
// holds the target: s.found its warp, s.above the weight before it. On the first level (the
// whole row) the target is floor(r64 * total / 2^64), kept in s.target, and the weight before
// the range is 0; later levels take both from the level before.
__device__ void samp_runs(samp_shared& s, const float* row, int vocab, float t, float m,
                          unsigned int kk, int ik, unsigned int kp, int ip, int s0, int s1,
                          unsigned long long r64, bool first) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = (s1 - s0 + SAMP_WARPS - 1) / SAMP_WARPS;
    const int a = min(s1, s0 + warp * per), e = min(s1, a + per);
    unsigned long long acc = 0ull;
    for (int j = a; j < e; j++) {
        const int i = j * 32 + lane;
        if (i < vocab) {
            const float z = samp_z(row, i, t);
            if (samp_kept(i, z, kk, ik, kp, ip)) acc += samp_weight(z, m);
        }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    __syncthreads();
    if (lane == 0) s.warp[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const unsigned long long w = s.warp[lane];
        unsigned long long inc = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned long long o = __shfl_up_sync(0xffffffffu, inc, d);
            if (lane >= d) inc += o;
        }
        const unsigned long long all = __shfl_sync(0xffffffffu, inc, 31);
        const unsigned long long base = first ? 0ull : s.above;
        const unsigned long long target = first ? __umul64hi(r64, all) : s.target;
        const unsigned int hit = __ballot_sync(0xffffffffu, target - base < inc);
        const int f = hit ? __ffs(hit) - 1 : 31;
        if (lane == f) {
            s.found = f;
            s.above = base + inc - w;
            s.target = target;
        }
    }
    __syncthreads();
}

// Greedy rows. A value's packed order is (key << 32) | (0xffffffff - id): the larger packed
// value is the larger key, the lower id on equal keys; 0 (no value, or NaN) loses to every
// value, -inf included. The maximum of packed values is the greedy choice whatever the order
// of the reduction, so splitting a row over blocks changes no result.
__device__ __forceinline__ unsigned long long samp_pack(float x, int i) {
    return isnan(x) ? 0ull
                    : (((unsigned long long)samp_key(x) << 32) |
                       (unsigned long long)(0xffffffffu - (unsigned int)i));
}

__device__ __forceinline__ unsigned long long samp_umax(unsigned long long a,
                                                        unsigned long long b) {
    return a > b ? a : b;
}

// The token of a greedy row from its packed maximum: token 0 and the report for a row with no
// value above -inf, as the general path.
__device__ __forceinline__ void samp_greedy_done(unsigned long long v, int r, int vocab,
                                                 int* tokens, cg_check* flag,
                                                 unsigned int check) {
    if ((unsigned int)(v >> 32) <= samp_key(__uint_as_float(0xff800000u))) {
        tokens[r] = 0;
        cg_report(flag, check, 0, vocab, (unsigned long long)r);
    } else {
        tokens[r] = (int)(0xffffffffu - (unsigned int)v);
    }
}

// Block b of `split` of greedy row r: the packed maximum of its share of the row. The row is
// read as float4 from its first 16-byte boundary (the up to 3 values before it by block 0, the
// up to 3 after the last whole float4 by the last block); each block takes a contiguous
// range of float4, one per thread per step (coalesced). With split > 1 every block folds its
// maximum into best[r] (atomicMax: order-free) and the block that finishes last (counted in
// done[r]) writes the token and clears best[r] and done[r] for the next call.
__device__ void samp_greedy(const float* row, int vocab, int r, int b, int split,
                            unsigned long long* best, unsigned int* done, int* tokens,
                            cg_check* flag, unsigned int check) {
    __shared__ unsigned long long wbest[SAMP_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int head =
        min(vocab, (int)(((16u - ((unsigned int)(unsigned long long)row & 15u)) & 15u) >> 2));
    const int n4 = (vocab - head) >> 2;
    const int c4 = (n4 + split - 1) / split;
    const int lo = min(n4, b * c4), hi = min(n4, lo + c4);
    const float4* body = reinterpret_cast<const float4*>(row + head);
    unsigned long long m = 0ull;
    for (int j = lo + (int)threadIdx.x; j < hi; j += SAMP_THREADS) {
        const float4 v = __ldg(body + j);
        const int i = head + 4 * j;
        m = samp_umax(m, samp_pack(v.x, i));
        m = samp_umax(m, samp_pack(v.y, i + 1));
        m = samp_umax(m, samp_pack(v.z, i + 2));
        m = samp_umax(m, samp_pack(v.w, i + 3));
    }
    if (b == 0 && (int)threadIdx.x < head)
        m = samp_umax(m, samp_pack(__ldg(row + threadIdx.x), threadIdx.x));
    const int tail = head + 4 * n4 + (int)threadIdx.x;
    if (b == split - 1 && tail < vocab) m = samp_umax(m, samp_pack(__ldg(row + tail), tail));
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = samp_umax(m, __shfl_xor_sync(0xffffffffu, m, d));
    if (lane == 0) wbest[warp] = m;
    __syncthreads();
    if (warp != 0) return;
    m = wbest[lane];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = samp_umax(m, __shfl_xor_sync(0xffffffffu, m, d));
    if (lane != 0) return;
    if (split == 1) {
        samp_greedy_done(m, r, vocab, tokens, flag, check);
        return;
    }
    atomicMax(best + r, m);
    __threadfence();
    if (atomicAdd(done + r, 1u) == (unsigned int)(split - 1)) {
        __threadfence();
        const unsigned long long all = atomicExch(best + r, 0ull);
        done[r] = 0u;
        samp_greedy_done(all, r, vocab, tokens, flag, check);
    }
}

// tokens[r] for rows r < rows (grid: `split` blocks of SAMP_THREADS per row, block
// r * split + b) from logits [rows, vocab]: greedy when temp[r] = 0 (all `split` blocks, see
// samp_greedy; best[r] and done[r] are 0 between calls), else (block 0 of the row alone) the
// temperature / top-k / top-p draw described above with the 64-bit number of Philox counter
// state[1] + offset + r (lanes x: high, y: low word). A row with no value above -inf (all NaN
// or -inf) gets token 0 and is reported (value 0, bound vocab, position the row).
extern "C" __global__ void __launch_bounds__(SAMP_THREADS) sample_rows(
        const float* logits, int rows, int vocab, const float* temp, const unsigned int* topk,
        const float* topp, const unsigned long long* state, unsigned long long offset, int* tokens,
        cg_check* flag, unsigned int check, unsigned long long* best, unsigned int* done,
        int split) {
    CG_PDL_ENTER();
    __shared__ samp_shared s;
    const int r = blockIdx.x / split, b = blockIdx.x - r * split;
    if (r >= rows) return;
    const float* row = logits + (long long)r * vocab;
    // From here on t is 1 / temperature (0: greedy).
    float t = temp[r];
    if (!(t > 0.0f)) {
        samp_greedy(row, vocab, r, b, split, best, done, tokens, flag, check);
        return;
    }
    if (b != 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    t = __fdiv_rn(1.0f, t);
    // Pass 1: the best (key, lowest id) and the number of non-NaN values.
    unsigned int bk = 0u;
    int bi = SAMP_NONE;
    unsigned long long nv = 0ull;
    for (int i = threadIdx.x; i < vocab; i += SAMP_THREADS) {
        float z = samp_z(row, i, t);
        if (isnan(z)) continue;
        nv++;
        unsigned int k = samp_key(z);
        if (k > bk) {
            bk = k;
            bi = i;
        }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        unsigned int ok = __shfl_xor_sync(0xffffffffu, bk, d);
        int oi = __shfl_xor_sync(0xffffffffu, bi, d);
        if (ok > bk || (ok == bk && oi < bi)) {
            bk = ok;
            bi = oi;
        }
    }
    if (lane == 0) {
        s.wkey[warp] = bk;
        s.wid[warp] = bi;
    }
    unsigned long long nvalid;
    samp_scan(s, nv, &nvalid);
    if (warp == 0) {
        bk = s.wkey[lane];
        bi = s.wid[lane];
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) {
            unsigned int ok = __shfl_xor_sync(0xffffffffu, bk, d);
            int oi = __shfl_xor_sync(0xffffffffu, bi, d);
            if (ok > bk || (ok == bk && oi < bi)) {
                bk = ok;
                bi = oi;
            }
        }
        if (lane == 0) {
            s.wkey[0] = bk;
            s.wid[0] = bi;
        }
    }
    __syncthreads();
    bk = s.wkey[0];
    bi = s.wid[0];
    if (bk <= samp_key(__uint_as_float(0xff800000u))) {
        if (threadIdx.x == 0) {
            tokens[r] = 0;
            cg_report(flag, check, 0, vocab, (unsigned long long)r);
        }
        return;
    }
    const float m = samp_unkey(bk);
    // Top-k: the k-th key in descending order, ties cut by id.
    unsigned int kk = 0u;
    int ik = SAMP_NONE;
    const unsigned long long k = topk[r];
    if (k > 0ull && k < nvalid) {
        samp_select(s, row, vocab, t, m, false, k, 1.0f, 0u, SAMP_NONE);
        kk = s.prefix;
        unsigned long long keep = k - s.above, eq = s.eq;
        __syncthreads();
        if (keep < eq) ik = samp_tie_cut(s, row, vocab, t, kk, 0u, SAMP_NONE, keep);
    }
    // Top-p: the smallest prefix in (key descending, id ascending) order whose weight reaches
    // top_p of the candidates' weight; the value that crosses is kept.
    unsigned int kp = 0u;
    int ip = SAMP_NONE;
    const float p = topp[r];
    if (p < 1.0f) {
        samp_select(s, row, vocab, t, m, true, 0ull, p, kk, ik);
        kp = s.prefix;
        unsigned long long above = s.above, eq_mass = s.eq;
        const double p_mass = s.pmass;
        __syncthreads();
        unsigned long long w = samp_weight(samp_unkey(kp), m);
        unsigned long long n_eq = w ? eq_mass / w : 1ull;
        // Kept ties: the t-th (1-based) is kept while (double)(above + (t - 1) w) < p_mass;
        // the first always is. Binary search for the count.
        unsigned long long lo = 1ull, hi = n_eq;
        while (lo < hi) {
            unsigned long long mid = lo + (hi - lo + 1ull) / 2ull;
            if ((double)(above + (mid - 1ull) * w) < p_mass) lo = mid;
            else hi = mid - 1ull;
        }
        if (lo < n_eq) ip = samp_tie_cut(s, row, vocab, t, kp, kk, ik, lo);
    }
    // The draw: token id order over the kept values, narrowed run by run (samp_runs) to one
    // strip of 32 ids, where warp 0's inclusive scan finds the first id whose running weight
    // exceeds the target.
    const uint4 g = rng_draw(state, offset, (unsigned long long)r);
    unsigned long long r64 = ((unsigned long long)g.x << 32) | g.y;
    int s0 = 0, s1 = (vocab + 31) / 32;
    for (bool first = true;; first = false) {
        const int per = (s1 - s0 + SAMP_WARPS - 1) / SAMP_WARPS;
        samp_runs(s, row, vocab, t, m, kk, ik, kp, ip, s0, s1, r64, first);
        s0 += s.found * per;
        s1 = min(s1, s0 + per);
        if (per <= 1) break;
    }
    if (warp == 0) {
        const int i = s0 * 32 + lane;
        unsigned long long q = 0ull;
        if (i < vocab) {
            const float z = samp_z(row, i, t);
            if (samp_kept(i, z, kk, ik, kp, ip)) q = samp_weight(z, m);
        }
        unsigned long long inc = q;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned long long o = __shfl_up_sync(0xffffffffu, inc, d);
            if (lane >= d) inc += o;
        }
        const unsigned long long rel = s.target - s.above;
        const unsigned int hit = __ballot_sync(0xffffffffu, rel < inc);
        if (hit && lane == __ffs(hit) - 1) tokens[r] = i;
    }
}

// One row's sampling settings (a single thread).
extern "C" __global__ void sampling_set(float* temp, unsigned int* topk, float* topp, int row,
                                        float t, unsigned int k, float p) {
    temp[row] = t;
    topk[row] = k;
    topp[row] = p;
}

// A sequence joins row `row`: next position, not finished, nothing generated, limit `limit`,
// its history cleared to -1 (one block).
extern "C" __global__ void decode_start(int* positions, int* finished, int* generated, int* limit,
                                        int* history, int max_new, int row, int position,
                                        int new_tokens) {
    if (threadIdx.x == 0) {
        positions[row] = position;
        finished[row] = new_tokens > 0 ? 0 : 1;
        generated[row] = 0;
        limit[row] = new_tokens;
    }
    for (int j = threadIdx.x; j < max_new; j += blockDim.x)
        history[(long long)row * max_new + j] = -1;
}

// A sequence leaves row `row` (a single thread).
extern "C" __global__ void decode_stop(int* finished, int row) {
    finished[row] = 1;
}

// After sampling, rows r < rows: an unfinished row records tokens[r] at history[r, generated],
// passes it on in ids[r] and its position in pos_out[r], advances, and finishes on an eos id or
// at its limit (n_eos <= DECODE_MAX_EOS). A finished row is left as it is. One block, each
// thread its rows r = threadIdx.x, + blockDim.x, ...; then thread 0 writes live[0]: 1 if a row
// r < rows is unfinished after this step, else 0 (the condition of a WHILE node running
// several steps per launch). Every load of a row is issued before its first store (the buffers
// may alias as far as the compiler knows, so a load after a store would wait for it: a chain
// of dependent global round trips).
#define DECODE_MAX_EOS 4
extern "C" __global__ void decode_advance(const int* tokens, int rows, int* ids, int* pos_out,
                                          int* positions, int* finished, int* generated,
                                          const int* limit, int* history, int max_new,
                                          const int* eos, int n_eos, unsigned* live) {
    CG_PDL_ENTER();
    int ev[DECODE_MAX_EOS];
#pragma unroll
    for (int e = 0; e < DECODE_MAX_EOS; e++) ev[e] = e < n_eos ? eos[e] : 0;
    int any = 0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const int fin = finished[r];
        const int tok = tokens[r];
        const int g = generated[r];
        const int pos = positions[r];
        const int lim = limit[r];
        if (fin) continue;
        bool stop = g + 1 >= lim;
#pragma unroll
        for (int e = 0; e < DECODE_MAX_EOS; e++) stop = stop || (e < n_eos && tok == ev[e]);
        if (g >= 0 && g < max_new) history[(long long)r * max_new + g] = tok;
        ids[r] = tok;
        pos_out[r] = pos;
        positions[r] = pos + 1;
        generated[r] = g + 1;
        if (stop) finished[r] = 1;
        else any = 1;
    }
    any = __syncthreads_or(any);
    if (threadIdx.x == 0) live[0] = any ? 1u : 0u;
}
