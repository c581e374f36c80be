// Philox4x32-10 and the draw of a generator's numbers: device functions only, compiled before
// philox.cu and before sampling.cu (both modules draw the same numbers for the same counter).
//
// A generator's state is two u64 words in device memory: [seed, base]; an op's group g of four
// numbers uses the counter base + offset + g (see philox.cu).

// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011; the constants of the Random123 library).
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// The four numbers of group g of an op at `offset`.
__device__ __forceinline__ uint4 rng_draw(const unsigned long long* state, unsigned long long offset,
                                          unsigned long long g) {
    unsigned long long seed = state[0];
    unsigned long long idx = state[1] + offset + g;
    return philox4x32_10(make_uint4((unsigned int)idx, (unsigned int)(idx >> 32), 0u, 0u),
                         make_uint2((unsigned int)seed, (unsigned int)(seed >> 32)));
}

// 24 random bits as a float in [0, 1) (exact: a 24-bit integer times 2^-24).
__device__ __forceinline__ float rng_unit(unsigned int v) {
    return (float)(v >> 8) * 5.9604644775390625e-8f;
}
