// Raw CUDA C++ check of compute-sanitizer inside WHILE conditional-node bodies (issue 8): the
// pattern cudagraph uses (a WHILE node added to a stream capture with cudaGraphAddNode, its body
// captured on a second stream with cudaStreamBeginCaptureToGraph, a kernel in the body calling
// cudaGraphSetConditional), with two plainly correct kernels in the body: an in-place scale and
// a block reduction through shared memory with __syncthreads. The same kernels also run in a
// plain captured graph (no conditional node) as the control. If memcheck or synccheck report
// errors here, they report them for correct code inside WHILE bodies, not for cudagraph's.
// With the argument `pdl`: the test programmatic_edges_inside_a_loop_body (gpu_graphfeat.rs)
// instead: a WHILE body of 4 programmatic (PDL) launches of a chain step, run 5 times, against
// the same 20 launches made eagerly, plus the count of programmatic edges in the body (3).
// With the argument `reuse`: whether the tools check WHILE bodies against a stale table of
// allocations: a WHILE graph on a 512-byte buffer, which is then freed; a 2 MiB buffer that
// gets the same base address (tried a few times; printed); a WHILE graph writing its first
// 64 KiB (past the old 512 bytes), then the same kernel in a plain graph for comparison.
// With the argument `ptx`: whether the failures of cudagraph's WHILE tests under the tools come
// from how it sets the condition: a counted WHILE loop built as cudagraph builds it, with its
// own condition kernels (PTX loaded with cuModuleLoadData, no cudadevrt), 3 rounds, each with
// cond NULL (repeat) and with a condition buffer (while_loop_capped); see run_ptx.
// Built and run on the GPU machine (`bash bench/device.sh while-sanitize` runs every tool on each):
//     nvcc -O2 -arch=sm_90 -rdc=true bench/raw/while_sanitize.cu -lcudadevrt -lcuda \
//         -o while_sanitize
//     ./while_sanitize && compute-sanitizer --tool memcheck ./while_sanitize [pdl|reuse|ptx]
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
    exit(1); } } while (0)
#define CU_CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { \
    const char *n_ = "?", *m_ = "?"; cuGetErrorName(r_, &n_); cuGetErrorString(r_, &m_); \
    fprintf(stderr, "%s:%d %s failed: %s (%s)\n", __FILE__, __LINE__, #x, n_, m_); \
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

// The graph `s` is capturing into, and the capture's current dependencies.
static cudaGraph_t capture_graph(cudaStream_t s, const cudaGraphNode_t** deps, size_t* ndeps) {
    cudaStreamCaptureStatus st;
    cudaGraph_t capturing;
#if CUDART_VERSION >= 13000
    CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &capturing, deps, nullptr, ndeps));
#else
    CHECK(cudaStreamGetCaptureInfo_v3(s, &st, nullptr, &capturing, deps, nullptr, ndeps));
#endif
    return capturing;
}

// Adds a WHILE node on `h` after the current dependencies of the capture on `s`, makes it the
// stream's only dependency and starts capturing the node's body on `s2`.
static cudaGraph_t add_while_node(cudaStream_t s, cudaStream_t s2, cudaGraphConditionalHandle h) {
    const cudaGraphNode_t* deps;
    size_t ndeps;
    cudaGraph_t capturing = capture_graph(s, &deps, &ndeps);
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
    return bodyg;
}

// Adds to the capture on `s` what a counted loop of cudagraph adds (a kernel that sets the
// counter, then a WHILE node after it) and starts capturing the node's body on `s2`; the
// caller records the body, then ends it with end_while_body.
static cudaGraph_t begin_while_body(cudaStream_t s, cudaStream_t s2, int* counter, int iters,
                                    cudaGraphConditionalHandle* h) {
    set_counter<<<1, 1, 0, s>>>(counter, iters);
    CHECK(cudaGetLastError());
    const cudaGraphNode_t* deps;
    size_t ndeps;
    CHECK(cudaGraphConditionalHandleCreate(h, capture_graph(s, &deps, &ndeps), 1,
                                           cudaGraphCondAssignDefault));
    return add_while_node(s, s2, *h);
}

// Ends the body: the kernel that counts an iteration and sets the condition, then the capture.
static void end_while_body(cudaStream_t s2, cudaGraph_t bodyg, cudaGraphConditionalHandle h,
                           int* counter) {
    loop_next<<<1, 32, 0, s2>>>(h, counter);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamEndCapture(s2, &bodyg));
}

// The default scenario: body() in a plain graph, then as the body of a WHILE node.
static int run_default(cudaStream_t s, cudaStream_t s2, int* counter) {
    float *x, *out;
    CHECK(cudaMalloc(&x, N * sizeof(float)));
    CHECK(cudaMalloc(&out, (N / BLOCK) * sizeof(float)));
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
        cudaGraphConditionalHandle h;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        cudaGraph_t bodyg = begin_while_body(s, s2, counter, ITERS, &h);
        body(s2, x, out);
        end_while_body(s2, bodyg, h, counter);
        CHECK(cudaStreamEndCapture(s, &g));
        bad += run_and_check(g, s, x, out, ITERS, "WHILE body");
        CHECK(cudaGraphDestroy(g));
    }
    return bad;
}

// The pdl scenario: the chain step of the test, with the prologue of cudagraph's PDL_CUDA
// (CG_PDL_ENTER: let the next kernel launch, then wait for the previous one and its memory).
static const int PN = 128;
static const int PDL_STEPS = 4;

__global__ void chain(float* b, int n) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = b[i] * 0.999f + 0.001f;
}

// chain on one block of PN threads, launched as cudagraph's launch_pdl does.
static void chain_pdl(cudaStream_t s, float* b) {
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(1);
    c.blockDim = dim3(PN);
    c.dynamicSmemBytes = 0;
    c.stream = s;
    cudaLaunchAttribute a[1] = {};
    a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = a;
    c.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&c, chain, b, PN));
}

// Edges of `g` whose type is programmatic (edge data: CUDA 12.3+).
static int programmatic_edges(cudaGraph_t g) {
#if CUDART_VERSION >= 13000
#define GRAPH_GET_EDGES cudaGraphGetEdges
#else
#define GRAPH_GET_EDGES cudaGraphGetEdges_v2
#endif
    size_t n = 0;
    CHECK(GRAPH_GET_EDGES(g, nullptr, nullptr, nullptr, &n));
    if (n == 0) return 0;
    std::vector<cudaGraphNode_t> from(n), to(n);
    std::vector<cudaGraphEdgeData> data(n);
    CHECK(GRAPH_GET_EDGES(g, from.data(), to.data(), data.data(), &n));
    int p = 0;
    for (size_t i = 0; i < n && i < data.size(); i++)
        p += data[i].type == cudaGraphDependencyTypeProgrammatic;
    return p;
#undef GRAPH_GET_EDGES
}

static int run_pdl(cudaStream_t s, cudaStream_t s2, int* counter) {
    float *x, *y;
    std::vector<float> hx(PN, 0.5f), hy(PN);
    CHECK(cudaMalloc(&x, PN * sizeof(float)));
    CHECK(cudaMalloc(&y, PN * sizeof(float)));
    CHECK(cudaMemcpy(x, hx.data(), PN * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, hx.data(), PN * sizeof(float), cudaMemcpyHostToDevice));

    // Eager reference: ITERS x PDL_STEPS plain launches on y.
    for (int i = 0; i < ITERS * PDL_STEPS; i++) {
        chain<<<1, PN, 0, s>>>(y, PN);
        CHECK(cudaGetLastError());
    }
    CHECK(cudaStreamSynchronize(s));

    // The graph: a WHILE node running ITERS times a body of PDL_STEPS programmatic launches.
    cudaGraph_t g;
    cudaGraphConditionalHandle h;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    cudaGraph_t bodyg = begin_while_body(s, s2, counter, ITERS, &h);
    for (int k = 0; k < PDL_STEPS; k++) chain_pdl(s2, x);
    end_while_body(s2, bodyg, h, counter);
    CHECK(cudaStreamEndCapture(s, &g));
    int edges = programmatic_edges(bodyg);

    cudaGraphExec_t e;
    CHECK(cudaGraphInstantiate(&e, g, 0));
    CHECK(cudaGraphLaunch(e, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpy(hx.data(), x, PN * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hy.data(), y, PN * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < PN; i++) bad += memcmp(&hx[i], &hy[i], sizeof(float)) != 0;
    if (bad)
        printf("pdl WHILE body: %d iterations, MISMATCH in %d of %d elements "
               "(x[0] = %.9g, eager %.9g)\n", ITERS, bad, PN, hx[0], hy[0]);
    else
        printf("pdl WHILE body: %d iterations, right results\n", ITERS);
    printf("programmatic edges in the WHILE body: %d (expected %d)\n", edges, PDL_STEPS - 1);
    bad += edges != PDL_STEPS - 1;
    CHECK(cudaGraphExecDestroy(e));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    return bad;
}

// The reuse scenario: one buffer of SMALL floats (512 bytes), then one of BIG_BYTES of which
// the kernels write the first BIG_USED floats (64 KiB), through scale from 0 each time.
static const int SMALL = 128;
static const size_t BIG_BYTES = 2u << 20;
static const int BIG_USED = 16384;

// x after k iterations of scale from 0, as the host computes it.
static float scaled(int k) {
    float v = 0.0f;
    while (k-- > 0) v = v * 0.5f + 1.0f;
    return v;
}

// Copies x[0..n) back and counts the elements that differ from want.
static int count_bad(const float* x, int n, float want) {
    std::vector<float> h(n);
    CHECK(cudaMemcpy(h.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += h[i] != want;
    return bad;
}

// Captures scale on x[0..n) run ITERS times, as the body of a WHILE node (in_while) or as ITERS
// launches in a plain graph; zeroes x, runs the graph once, checks and prints x, then destroys
// the exec graph and the graph.
static int scale_graph(cudaStream_t s, cudaStream_t s2, int* counter, float* x, int n,
                       bool in_while, const char* what) {
    unsigned grid = (n + BLOCK - 1) / BLOCK;
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    if (in_while) {
        cudaGraphConditionalHandle h;
        cudaGraph_t bodyg = begin_while_body(s, s2, counter, ITERS, &h);
        scale<<<grid, BLOCK, 0, s2>>>(x, n);
        CHECK(cudaGetLastError());
        end_while_body(s2, bodyg, h, counter);
    } else {
        for (int i = 0; i < ITERS; i++) scale<<<grid, BLOCK, 0, s>>>(x, n);
        CHECK(cudaGetLastError());
    }
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaMemsetAsync(x, 0, n * sizeof(float), s));
    cudaGraphExec_t e;
    CHECK(cudaGraphInstantiate(&e, g, 0));
    CHECK(cudaGraphLaunch(e, s));
    CHECK(cudaStreamSynchronize(s));
    int bad = count_bad(x, n, scaled(ITERS));
    if (bad)
        printf("%s: %d iterations, MISMATCH in %d of %d elements\n", what, ITERS, bad, n);
    else
        printf("%s: %d iterations, right results\n", what, ITERS);
    CHECK(cudaGraphExecDestroy(e));
    CHECK(cudaGraphDestroy(g));
    return bad;
}

// May free *counter and allocate it anew (after big), so that small's memory is all free.
static int run_reuse(cudaStream_t s, cudaStream_t s2, int** counter) {
    // Round 1: the small buffer, in a WHILE body and in a plain launch, then freed.
    float* small;
    CHECK(cudaMalloc(&small, SMALL * sizeof(float)));
    int bad = scale_graph(s, s2, *counter, small, SMALL, true, "small WHILE body");
    scale<<<1, SMALL, 0, s>>>(small, SMALL);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(s));
    int b = count_bad(small, SMALL, scaled(ITERS + 1));
    printf("small plain launch: %s\n", b ? "WRONG" : "right results");
    bad += b;
    const void* small_at = small;
    CHECK(cudaFree(small));

    // Round 2: the big buffer, at small's base address if the allocator gives it.
    float* big;
    CHECK(cudaMalloc(&big, BIG_BYTES));
    printf("small at %p (%zu bytes), big at %p (%zu bytes): %s\n", small_at,
           SMALL * sizeof(float), (void*)big, BIG_BYTES,
           (const void*)big == small_at ? "same base address" : "different base addresses");
    for (int t = 1; t <= 4 && (const void*)big != small_at; t++) {
        CHECK(cudaFree(big));
        // The second try also frees the counter, which may share small's chunk of memory.
        if (t == 2) {
            CHECK(cudaFree(*counter));
            *counter = nullptr;
        }
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMalloc(&big, BIG_BYTES));
        printf("try %d (freed big%s, synchronized, allocated again): big at %p: %s\n", t,
               t == 2 ? " and the counter" : "", (void*)big,
               (const void*)big == small_at ? "same base address" : "different base address");
    }
    if (!*counter) CHECK(cudaMalloc(counter, sizeof(int)));
    if ((const void*)big != small_at)
        printf("(small's address was not reused: this run does not test the hypothesis)\n");
    bad += scale_graph(s, s2, *counter, big, BIG_USED, true, "reuse WHILE body");
    // Round 2b: the same kernel in a plain graph.
    bad += scale_graph(s, s2, *counter, big, BIG_USED, false, "reuse plain graph");
    CHECK(cudaFree(big));
    return bad;
}

// The ptx scenario: a counted WHILE loop built as cudagraph builds it, with its condition
// kernels: the PTX text of CONDITION_PTX (crates/cudagraph/src/graph/conditional.rs, copied
// verbatim) loaded with cuModuleLoadData, whose call to cudaGraphSetConditional the driver's
// JIT resolves (no cudadevrt). The handle is created with default value 0 and flags 0
// (runtime/graph/ conditional_handle_create), cg_loop_begin runs on the capturing stream
// before the node is added, cg_loop_next is the body's last kernel.
static const char CONDITION_PTX[] = R"PTX(
.version 7.0
.target sm_50
.address_size 64

.extern .func cudaGraphSetConditional
(
	.param .b64 cudaGraphSetConditional_param_0,
	.param .b32 cudaGraphSetConditional_param_1
)
;

.visible .entry cg_cond_set(
	.param .u64 cg_cond_set_param_0,
	.param .u64 cg_cond_set_param_1
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<4>;

	ld.param.u64 	%rd1, [cg_cond_set_param_0];
	ld.param.u64 	%rd2, [cg_cond_set_param_1];
	cvta.to.global.u64 	%rd3, %rd2;
	ld.global.u32 	%r1, [%rd3];
	setp.ne.s32 	%p1, %r1, 0;
	selp.u32 	%r2, 1, 0, %p1;
	{
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r2;
	call.uni cudaGraphSetConditional, (param0, param1);
	}
	ret;
}

.visible .entry cg_loop_begin(
	.param .u64 cg_loop_begin_param_0,
	.param .u64 cg_loop_begin_param_1,
	.param .u64 cg_loop_begin_param_2,
	.param .u32 cg_loop_begin_param_3
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [cg_loop_begin_param_0];
	ld.param.u64 	%rd2, [cg_loop_begin_param_1];
	ld.param.u64 	%rd3, [cg_loop_begin_param_2];
	ld.param.u32 	%r1, [cg_loop_begin_param_3];
	cvta.to.global.u64 	%rd4, %rd3;
	mov.u32 	%r2, 0;
	st.global.u32 	[%rd4], %r2;
	setp.ne.s32 	%p1, %r1, 0;
	setp.eq.s64 	%p2, %rd2, 0;
	@%p2 bra 	$L_begin_set;
	cvta.to.global.u64 	%rd5, %rd2;
	ld.global.u32 	%r3, [%rd5];
	setp.ne.and.s32 	%p1, %r3, 0, %p1;
$L_begin_set:
	selp.u32 	%r4, 1, 0, %p1;
	{
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r4;
	call.uni cudaGraphSetConditional, (param0, param1);
	}
	ret;
}

.visible .entry cg_loop_next(
	.param .u64 cg_loop_next_param_0,
	.param .u64 cg_loop_next_param_1,
	.param .u64 cg_loop_next_param_2,
	.param .u32 cg_loop_next_param_3
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [cg_loop_next_param_0];
	ld.param.u64 	%rd2, [cg_loop_next_param_1];
	ld.param.u64 	%rd3, [cg_loop_next_param_2];
	ld.param.u32 	%r1, [cg_loop_next_param_3];
	cvta.to.global.u64 	%rd4, %rd3;
	ld.global.u32 	%r2, [%rd4];
	add.s32 	%r2, %r2, 1;
	st.global.u32 	[%rd4], %r2;
	setp.lt.u32 	%p1, %r2, %r1;
	setp.eq.s64 	%p2, %rd2, 0;
	@%p2 bra 	$L_next_set;
	cvta.to.global.u64 	%rd5, %rd2;
	ld.global.u32 	%r3, [%rd5];
	setp.ne.and.s32 	%p1, %r3, 0, %p1;
$L_next_set:
	selp.u32 	%r4, 1, 0, %p1;
	{
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r4;
	call.uni cudaGraphSetConditional, (param0, param1);
	}
	ret;
}
)PTX";

static const int PTX_ROUNDS = 3;

// One thread of cg_loop_begin or cg_loop_next(handle, cond, counter, limit) on `s`.
static void launch_cond(CUfunction f, cudaStream_t s, cudaGraphConditionalHandle h,
                        unsigned* cond, unsigned* counter, unsigned limit) {
    unsigned long long handle = h;
    CUdeviceptr c = (CUdeviceptr)(uintptr_t)cond, n = (CUdeviceptr)(uintptr_t)counter;
    void* params[] = {&handle, &c, &n, &limit};
    CU_CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr));
}

// PTX_ROUNDS times, a new graph each time: scale on SMALL floats as the body of such a loop with
// limit ITERS, with cond NULL (repeat) and with a condition buffer set to 1 that nothing clears
// (while_loop_capped); compared with ITERS plain launches of scale, and the counter with ITERS.
static int run_ptx(cudaStream_t s, cudaStream_t s2) {
    CHECK(cudaFree(0));  // makes the runtime's primary context current for the driver calls
    CUmodule m;
    CUfunction begin, next;
    CU_CHECK(cuModuleLoadData(&m, CONDITION_PTX));
    CU_CHECK(cuModuleGetFunction(&begin, m, "cg_loop_begin"));
    CU_CHECK(cuModuleGetFunction(&next, m, "cg_loop_next"));
    int bad = 0;
    for (int round = 1; round <= PTX_ROUNDS; round++) {
        for (int with_cond = 0; with_cond < 2; with_cond++) {
            const char* what = with_cond ? "cond buffer = 1" : "cond NULL";
            unsigned *counter, *cond = nullptr;
            float *x, *y;
            CHECK(cudaMalloc(&counter, sizeof(unsigned)));
            CHECK(cudaMalloc(&x, SMALL * sizeof(float)));
            CHECK(cudaMalloc(&y, SMALL * sizeof(float)));
            CHECK(cudaMemset(x, 0, SMALL * sizeof(float)));
            CHECK(cudaMemset(y, 0, SMALL * sizeof(float)));
            if (with_cond) {
                const unsigned one = 1;
                CHECK(cudaMalloc(&cond, sizeof(unsigned)));
                CHECK(cudaMemcpy(cond, &one, sizeof(one), cudaMemcpyHostToDevice));
            }
            // Reference: ITERS plain launches on y.
            for (int i = 0; i < ITERS; i++) scale<<<1, SMALL, 0, s>>>(y, SMALL);
            CHECK(cudaGetLastError());
            CHECK(cudaStreamSynchronize(s));

            cudaGraph_t g;
            cudaGraphConditionalHandle h;
            const cudaGraphNode_t* deps;
            size_t ndeps;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            CHECK(cudaGraphConditionalHandleCreate(&h, capture_graph(s, &deps, &ndeps), 0, 0));
            launch_cond(begin, s, h, cond, counter, ITERS);
            cudaGraph_t bodyg = add_while_node(s, s2, h);
            scale<<<1, SMALL, 0, s2>>>(x, SMALL);
            CHECK(cudaGetLastError());
            launch_cond(next, s2, h, cond, counter, ITERS);
            CHECK(cudaStreamEndCapture(s2, &bodyg));
            CHECK(cudaStreamEndCapture(s, &g));

            cudaGraphExec_t e;
            CHECK(cudaGraphInstantiate(&e, g, 0));
            CHECK(cudaGraphLaunch(e, s));
            CHECK(cudaStreamSynchronize(s));
            std::vector<float> hx(SMALL), hy(SMALL);
            unsigned n = 0;
            CHECK(cudaMemcpy(hx.data(), x, SMALL * sizeof(float), cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(hy.data(), y, SMALL * sizeof(float), cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(&n, counter, sizeof(n), cudaMemcpyDeviceToHost));
            int b = 0;
            for (int i = 0; i < SMALL; i++) b += memcmp(&hx[i], &hy[i], sizeof(float)) != 0;
            if (b || n != (unsigned)ITERS)
                printf("ptx WHILE body: %d iterations, MISMATCH in %d of %d elements, counter %u "
                       "(x[0] = %.9g, plain %.9g; round %d, %s)\n",
                       ITERS, b, SMALL, n, hx[0], hy[0], round, what);
            else
                printf("ptx WHILE body: %d iterations, right results (round %d, %s)\n", ITERS,
                       round, what);
            bad += b + (n != (unsigned)ITERS);
            CHECK(cudaGraphExecDestroy(e));
            CHECK(cudaGraphDestroy(g));
            CHECK(cudaFree(x));
            CHECK(cudaFree(y));
            CHECK(cudaFree(counter));
            if (cond) CHECK(cudaFree(cond));
        }
    }
    CU_CHECK(cuModuleUnload(m));
    return bad;
}

// No argument: the default scenario; `pdl`, `reuse` or `ptx`:
// that scenario.
int main(int argc, char** argv) {
    const char* scenario = argc > 1 ? argv[1] : "";
    bool pdl = strcmp(scenario, "pdl") == 0;
    bool reuse = strcmp(scenario, "reuse") == 0;
    bool ptx = strcmp(scenario, "ptx") == 0;
    if (argc > 2 || (argc > 1 && !pdl && !reuse && !ptx)) {
        fprintf(stderr, "usage: %s [pdl|reuse|ptx]\n", argv[0]);
        return 2;
    }
    int* counter;
    CHECK(cudaMalloc(&counter, sizeof(int)));
    cudaStream_t s, s2;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    int bad = pdl     ? run_pdl(s, s2, counter)
              : reuse ? run_reuse(s, s2, &counter)
              : ptx   ? run_ptx(s, s2)
                      : run_default(s, s2, counter);
    printf("%s\n", bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
