"""Times NN kernels of ours outside the library, on the GPU machine (no cargo there): compiles
CUDA sources with NVRTC (like the library), loads them with the driver API, launches them on
PyTorch's tensors inside a CUDA graph of `REPS` launches, and prints µs per launch beside
PyTorch's own `F.linear` timed the same way, after checking each result against PyTorch's.

    python3 bench/probe/gemm_probe.py [--ncu]

Kernels probed: every `extern "C"` kernel named in KERNELS below with sgemm_tiled's argument
list, over SHAPES (forward layout x·wᵀ + bias unless given). fp32, TF32 off."""
import ctypes
import sys

import torch
import torch.nn.functional as F

from probe_nvrtc import check, load

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

ROOT = "crates/cudagraph-nn/src/kernels/"
SOURCES = [ROOT + "common.cu", ROOT + "gemm_tile.cu", ROOT + "gemm.cu"]
EXTRA = [a for a in sys.argv[1:] if a.endswith(".cu")]
NCU = "--ncu" in sys.argv
REPS = 20

# (name, rows per block, cols per block, threads)
KERNELS = [("sgemm_tiled", 32, 32, 256), ("sgemm_reg", 64, 64, 512), ("sgemm_reg4", 64, 64, 512)]
for path in EXTRA:
    for line in open(path):
        # A probe kernel announces itself: // PROBE name BM BN THREADS
        if line.startswith("// PROBE "):
            n, bm, bn, th = line.split()[2:6]
            KERNELS.append((n, int(bm), int(bn), int(th)))

SHAPES = [(512, 256, 1024), (512, 1024, 256), (128, 1024, 1024), (64, 1024, 64), (256, 4096, 1024),
          (32, 1024, 512), (1024, 1024, 1024)]
if NCU:
    SHAPES = [(512, 256, 1024)]


def main():
    src = "".join(open(p).read() for p in SOURCES + EXTRA)
    torch.zeros(1, device="cuda")
    cuda, funcs = load(src, [name for name, *_ in KERNELS], [b"-lineinfo"])
    for name, *_ in KERNELS:
        regs, local = ctypes.c_int(), ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(regs), 4, funcs[name])
        cuda.cuFuncGetAttribute(ctypes.byref(local), 3, funcs[name])
        print(f"# {name}: {regs.value} registers, {local.value} B local", flush=True)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape m,k->n':>18} {'torch':>8} " + " ".join(f"{n:>14}" for n, *_ in KERNELS))
    for m, k, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g)
        b = torch.randn(n, device="cuda", generator=g)
        want = F.linear(x, w, b)
        outs = {}

        def launch(name, bm, bn, threads, y, stream):
            args = [ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_float(1.0),
                    ctypes.c_void_p(x.data_ptr()), ctypes.c_int(k), ctypes.c_int(0),
                    ctypes.c_void_p(w.data_ptr()), ctypes.c_int(k), ctypes.c_int(1),
                    ctypes.c_float(0.0), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(b.data_ptr()),
                    ctypes.c_int(0), ctypes.c_int((k + 31) // 32 * 32), ctypes.c_void_p(0)]
            ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
            check(cuda.cuLaunchKernel(funcs[name], (n + bn - 1) // bn, (m + bm - 1) // bm, 1,
                                      threads, 1, 1, 0, ctypes.c_void_p(stream), ptrs, None), name)

        def timed(fn):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(1 if NCU else 3):
                    fn(s.cuda_stream)
            torch.cuda.synchronize()
            if NCU:
                return 0.0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(REPS):
                    fn(torch.cuda.current_stream().cuda_stream)
            best = float("inf")
            for _ in range(7):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(10):
                    graph.replay()
                e1.record()
                torch.cuda.synchronize()
                best = min(best, e0.elapsed_time(e1) * 1000 / (10 * REPS))
            return best

        row = [timed(lambda st: F.linear(x, w, b))]
        for name, bm, bn, th in KERNELS:
            y = torch.empty(m, n, device="cuda")
            row.append(timed(lambda st: launch(name, bm, bn, th, y, st)))
            err = ((y - want).abs().max() / want.abs().max()).item()
            if err > 1e-4:
                print(f"# {name} {m},{k}->{n}: relative error {err:.2e}")
        print(f"{f'{m},{k}->{n}':>18} " + " ".join(f"{t:8.2f}" if i == 0 else f"{t:14.2f}" for i, t in enumerate(row)), flush=True)


main()
