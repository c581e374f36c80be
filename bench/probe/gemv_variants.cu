// Probe variants (bench/probe/gemv_probe.py): the library's column-warp template
// (`cols_gemm` in crates/cudagraph-nn/src/kernels/gemm.cu, which this file is compiled after)
// under the probe's names, so that the probe measures exactly the library's code.
#define GV(R, CPW)                                                                              \
    extern "C" __global__ void gemv_r##R##c##CPW(int m, int n, int k, const float* A,          \
            const float* B, float* C, const float* bias, int relu, int ks) {                   \
        cols_gemm<R, CPW>(m, n, k, A, B, C, bias, relu, ks);                                    \
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
