// Raw CUDA C++ baseline for `cudagraph bench chain`: the same kernel, launch shape and timing
// method (iterations back to back, synchronise, wall time, median of samples), once with
// eager <<<>>> launches and once with a stream-captured graph; on sm_90+ also with programmatic
// dependent launch (cudaLaunchKernelEx with cudaLaunchAttributeProgrammaticStreamSerialization,
// eager and stream-captured into programmatic edges), the kernel starting with
// griddepcontrol.launch_dependents + griddepcontrol.wait as `cudagraph bench chain --pdl` does.
// Built on the GPU machine:
//     nvcc -O3 -arch=sm_90 bench/raw/chain.cu -o raw_chain && ./raw_chain 100000 7
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { \
    fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(err_)); exit(1); } } while (0)

extern "C" __global__ void chain_step(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.999f + 0.001f;
}

extern "C" __global__ void chain_step_pdl(float* x, int n) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.999f + 0.001f;
}

static const int N = 128;

static void launch_pdl(float* x, cudaStream_t s) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1);
    config.blockDim = dim3(N);
    config.dynamicSmemBytes = 0;
    config.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    cudaLaunchKernelEx(&config, chain_step_pdl, x, N);
}

template <typename F>
double time_us(cudaStream_t s, int iters, int repeats, F body) {
    std::vector<double> v;
    for (int r = 0; r < repeats; r++) {
        CHECK(cudaStreamSynchronize(s));
        auto t = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; i++) body();
        CHECK(cudaStreamSynchronize(s));
        v.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count() / iters);
    }
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int main(int argc, char** argv) {
    int launches = argc > 1 ? atoi(argv[1]) : 100000;
    int repeats = argc > 2 ? atoi(argv[2]) : 7;
    int ks[] = {1, 10, 100, 1000};
    float* x;
    CHECK(cudaMalloc(&x, N * sizeof(float)));
    CHECK(cudaMemset(x, 0, N * sizeof(float)));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    bool pdl = p.major >= 9;
    printf("{\"benchmark\":\"chain-raw-cuda\",\"device\":\"%s\",\"rows\":[", p.name);
    for (int ki = 0; ki < 4; ki++) {
        int k = ks[ki];
        int iters = std::max(100, launches / k);
        auto chain = [&]() { for (int j = 0; j < k; j++) chain_step<<<1, N, 0, s>>>(x, N); };
        chain();
        CHECK(cudaGetLastError());
        double eager = time_us(s, iters, repeats, chain);
        cudaGraph_t g;
        cudaGraphExec_t e;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        chain();
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&e, g, 0));
        CHECK(cudaGraphUpload(e, s));
        CHECK(cudaGraphLaunch(e, s));
        double graph = time_us(s, iters, repeats, [&]() { cudaGraphLaunch(e, s); });
        CHECK(cudaGetLastError());
        printf("%s{\"kernels\":%d,\"iterations\":%d,\"eager_us_per_iter\":%.4f,\"graph_us_per_iter\":%.4f,"
               "\"eager_us_per_kernel\":%.4f,\"graph_us_per_kernel\":%.4f",
               ki ? "," : "", k, iters, eager, graph, eager / k, graph / k);
        CHECK(cudaGraphExecDestroy(e));
        CHECK(cudaGraphDestroy(g));
        if (pdl) {
            auto chain_pdl = [&]() { for (int j = 0; j < k; j++) launch_pdl(x, s); };
            chain_pdl();
            CHECK(cudaGetLastError());
            double eager_pdl = time_us(s, iters, repeats, chain_pdl);
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            chain_pdl();
            CHECK(cudaStreamEndCapture(s, &g));
            CHECK(cudaGraphInstantiate(&e, g, 0));
            CHECK(cudaGraphUpload(e, s));
            CHECK(cudaGraphLaunch(e, s));
            double graph_pdl = time_us(s, iters, repeats, [&]() { cudaGraphLaunch(e, s); });
            CHECK(cudaGetLastError());
            printf(",\"eager_pdl_us_per_kernel\":%.4f,\"graph_pdl_us_per_kernel\":%.4f",
                   eager_pdl / k, graph_pdl / k);
            CHECK(cudaGraphExecDestroy(e));
            CHECK(cudaGraphDestroy(g));
        }
        printf("}");
    }
    printf("]}\n");
    return 0;
}
