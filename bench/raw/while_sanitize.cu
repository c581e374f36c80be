// Raw CUDA C++ check of compute-sanitizer inside WHILE conditional-node bodies (issue 8): the
// pattern cudagraph uses (a WHILE node added to a stream capture with cudaGraphAddNode, its body
// captured on a second stream with cudaStreamBeginCaptureToGraph, a kernel in the body calling
// cudaGraphSetConditional), with two plainly correct kernels in the body: an in-place scale and
// a block reduction through shared memory with __syncthreads. The same kernels also run in a
// plain captured graph (no conditional node) as the control. If memcheck or synccheck report
// errors here, they report them for correct code inside WHILE bodies, not for cudagraph's.
// Built and run on the GPU machine:
//     nvcc -O2 -arch=sm_90 -rdc=true bench/raw/while_sanitize.cu -lcudadevrt -o while_sanitize
//     ./while_sanitize && compute-sanitizer --tool memcheck ./while_sanitize
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
    exit(1); } } while (0)

static const int N = 1 << 20;
static const int BLOCK = 256;
static const int ITERS = 5;

__global__ void scale(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.5f + 1.0f;
}

__global__ void block_sums(const float* x, float* out, int n) {
    __shared__ float s[BLOCK];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int w = BLOCK / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] += s[0];
}

__global__ void set_counter(int* counter, int v) { *counter = v; }

__global__ void loop_next(cudaGraphConditionalHandle h, int* counter) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        int c = --*counter;
        cudaGraphSetConditional(h, c > 0 ? 1 : 0);
    }
}

static void body(cudaStream_t s, float* x, float* out) {
    scale<<<N / BLOCK, BLOCK, 0, s>>>(x, N);
    block_sums<<<N / BLOCK, BLOCK, 0, s>>>(x, out, N);
    CHECK(cudaGetLastError());
}

// Replays `g` once and checks x and out against the host arithmetic of `iters` iterations.
static int run_and_check(cudaGraph_t g, cudaStream_t s, float* x, float* out, int iters,
                         const char* what) {
    CHECK(cudaMemset(x, 0, N * sizeof(float)));
    CHECK(cudaMemset(out, 0, (N / BLOCK) * sizeof(float)));
    cudaGraphExec_t e;
    CHECK(cudaGraphInstantiate(&e, g, 0));
    CHECK(cudaGraphLaunch(e, s));
    CHECK(cudaStreamSynchronize(s));
    std::vector<float> hx(N), ho(N / BLOCK);
    CHECK(cudaMemcpy(hx.data(), x, N * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ho.data(), out, ho.size() * sizeof(float), cudaMemcpyDeviceToHost));
    float v = 0.0f, sum = 0.0f;
    for (int i = 0; i < iters; i++) {
        v = v * 0.5f + 1.0f;
        sum += v * BLOCK;
    }
    int bad = 0;
    for (int i = 0; i < N; i++) bad += hx[i] != v;
    for (size_t b = 0; b < ho.size(); b++) bad += ho[b] != sum;
    printf("%s: %d iterations, %s\n", what, iters, bad ? "WRONG" : "right results");
    CHECK(cudaGraphExecDestroy(e));
    return bad;
}

int main() {
    float *x, *out;
    int* counter;
    CHECK(cudaMalloc(&x, N * sizeof(float)));
    CHECK(cudaMalloc(&out, (N / BLOCK) * sizeof(float)));
    CHECK(cudaMalloc(&counter, sizeof(int)));
    cudaStream_t s, s2;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    int bad = 0;

    // Control: the body's kernels ITERS times in a plain captured graph.
    {
        cudaGraph_t g;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < ITERS; i++) body(s, x, out);
        CHECK(cudaStreamEndCapture(s, &g));
        bad += run_and_check(g, s, x, out, ITERS, "plain graph");
        CHECK(cudaGraphDestroy(g));
    }

    // The same kernels as the body of a WHILE node that runs ITERS times.
    {
        cudaGraph_t g;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        set_counter<<<1, 1, 0, s>>>(counter, ITERS);
        cudaStreamCaptureStatus st;
        const cudaGraphNode_t* deps;
        size_t ndeps;
        cudaGraph_t capturing;
#if CUDART_VERSION >= 13000
        CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &capturing, &deps, nullptr, &ndeps));
#else
        CHECK(cudaStreamGetCaptureInfo_v3(s, &st, nullptr, &capturing, &deps, nullptr, &ndeps));
#endif
        cudaGraphConditionalHandle h;
        CHECK(cudaGraphConditionalHandleCreate(&h, capturing, 1, cudaGraphCondAssignDefault));
        cudaGraphNodeParams p = {};
        p.type = cudaGraphNodeTypeConditional;
        p.conditional.handle = h;
        p.conditional.type = cudaGraphCondTypeWhile;
        p.conditional.size = 1;
        cudaGraphNode_t node;
#if CUDART_VERSION >= 13000
        CHECK(cudaGraphAddNode(&node, capturing, deps, nullptr, ndeps, &p));
        CHECK(cudaStreamUpdateCaptureDependencies(s, &node, nullptr, 1,
                                                  cudaStreamSetCaptureDependencies));
#else
        CHECK(cudaGraphAddNode_v2(&node, capturing, deps, nullptr, ndeps, &p));
        CHECK(cudaStreamUpdateCaptureDependencies_v2(s, &node, nullptr, 1,
                                                     cudaStreamSetCaptureDependencies));
#endif
        cudaGraph_t bodyg = p.conditional.phGraph_out[0];
        CHECK(cudaStreamBeginCaptureToGraph(s2, bodyg, nullptr, nullptr, 0,
                                            cudaStreamCaptureModeGlobal));
        body(s2, x, out);
        loop_next<<<1, 32, 0, s2>>>(h, counter);
        CHECK(cudaStreamEndCapture(s2, &bodyg));
        CHECK(cudaStreamEndCapture(s, &g));
        bad += run_and_check(g, s, x, out, ITERS, "WHILE body");
        CHECK(cudaGraphDestroy(g));
    }
    printf("%s\n", bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
