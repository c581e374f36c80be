"""Host round trips through a graph: copy-engine memcpy nodes against copy kernels that read
and write pinned host memory directly (mapped, unified addressing). Per request: one replay of
a graph [host -> static input, seed MLP, static output -> host] and one synchronisation, median
of 7 samples of 500 requests, fp32.

    python3 bench/probe/zero_copy.py"""
import ctypes
import statistics
import time

import torch

SRC = r'''
extern "C" __global__ void copy_f32(const float* __restrict__ src, float* __restrict__ dst, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    long step = (long)gridDim.x * blockDim.x;
    if (((long)src | (long)dst) % 16 == 0) {
        long n4 = n / 4;
        for (long j = i; j < n4; j += step)
            reinterpret_cast<float4*>(dst)[j] = reinterpret_cast<const float4*>(src)[j];
        for (long j = n4 * 4 + i; j < n; j += step) dst[j] = src[j];
    } else {
        for (long j = i; j < n; j += step) dst[j] = src[j];
    }
}
'''


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {rc}")


def kernel():
    nvrtc = ctypes.CDLL("libnvrtc.so.13")
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SRC.encode(), b"c.cu", 0, None, None), "create")
    major, minor = torch.cuda.get_device_capability()
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    check(nvrtc.nvrtcCompileProgram(prog, 1, (ctypes.c_char_p * 1)(*opts)), "compile")
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    check(nvrtc.nvrtcGetCUBIN(prog, buf), "cubin")
    cuda = ctypes.CDLL("libcuda.so.1")
    mod, f = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(mod), buf), "load")
    check(cuda.cuModuleGetFunction(ctypes.byref(f), mod, b"copy_f32"), "get")
    keep = []

    def copy(src_ptr, dst_ptr, elems):
        args = [ctypes.c_void_p(src_ptr), ctypes.c_void_p(dst_ptr), ctypes.c_long(elems)]
        keep.append(args)
        ptrs = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        blocks = max(1, min(132, (elems // 4 + 255) // 256))
        check(cuda.cuLaunchKernel(f, blocks, 1, 1, 256, 1, 1, 0,
                                  ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ptrs, None), "launch")
    return copy


def per_request(g):
    samples = []
    for _ in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500):
            g.replay()
            torch.cuda.current_stream().synchronize()
        samples.append((time.perf_counter() - t) * 1e6 / 500)
    return statistics.median(samples)


torch.backends.cuda.matmul.allow_tf32 = False
torch.zeros(1, device="cuda")
copy = kernel()
model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
with torch.no_grad():
    for bs in [1, 4, 8, 16, 32, 256, 2048]:
        x_host = torch.randn(bs, 1024).pin_memory()
        out_a = torch.zeros(bs, 10).pin_memory()
        out_b = torch.zeros(bs, 10).pin_memory()
        static_in = torch.zeros(bs, 1024, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(static_in)
        torch.cuda.current_stream().wait_stream(s)
        ga, gb, gm = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(ga):
            static_in.copy_(x_host, non_blocking=True)
            ya = model(static_in)
            out_a.copy_(ya, non_blocking=True)
        with torch.cuda.graph(gb):
            copy(x_host.data_ptr(), static_in.data_ptr(), bs * 1024)
            yb = model(static_in)
            copy(yb.data_ptr(), out_b.data_ptr(), bs * 10)
        with torch.cuda.graph(gm):
            ym = model(static_in)
        ga.replay(); gb.replay(); torch.cuda.synchronize()
        ok = torch.equal(out_a, out_b) and torch.equal(out_a, model(x_host.cuda()).cpu())
        ta, tb, tm = per_request(ga), per_request(gb), per_request(gm)
        print(f"bs {bs:5d}: memcpy nodes {ta:6.2f} us, copy kernels {tb:6.2f} us, model alone {tm:6.2f} us"
              f" (replay + sync); same outputs: {ok}", flush=True)
