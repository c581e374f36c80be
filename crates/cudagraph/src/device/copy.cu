// Device-to-device copies of whole 16-byte words (both addresses 16-byte aligned): a grid-stride
// loop of uint4 loads and stores. Used for copies of up to a few MiB, where the driver's copy
// (a copy-engine operation) costs more than a kernel launch.
extern "C" __global__ void cg_copy16(unsigned long long dst, unsigned long long src,
                                     unsigned long long words) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < words; i += step)
        d[i] = s[i];
}

// Copies between device memory and mapped page-locked host memory (its device address), both
// addresses 16-byte aligned: `words` 16-byte words as above, then the last `tail` (< 16) bytes
// by the first threads of block 0. A kernel node in a graph costs a few microseconds less than
// the driver's copy-engine node for the small transfers of a request's inputs and outputs.
extern "C" __global__ void cg_copy_mapped(unsigned long long dst, unsigned long long src,
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
