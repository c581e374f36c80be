// Copies as a kernel, both addresses 16-byte aligned: `words` 16-byte words by a grid-stride
// loop of uint4 loads and stores, then the last `tail` (< 16) bytes by the first threads of
// block 0. Used for device-to-device copies of up to a few MiB, and for copies between device
// memory and mapped page-locked host memory (its device address), where the driver's copy (a
// copy-engine operation, a copy-engine node in a graph) costs a few microseconds more than a
// kernel launch.
extern "C" __global__ void cg_copy(unsigned long long dst, unsigned long long src,
                                   unsigned long long words, unsigned int tail) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < words; i += step)
        d[i] = s[i];
    if (blockIdx.x == 0 && threadIdx.x < tail) {
        reinterpret_cast<unsigned char*>(dst)[words * 16 + threadIdx.x] =
            reinterpret_cast<const unsigned char*>(src)[words * 16 + threadIdx.x];
    }
}
