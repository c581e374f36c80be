"""Few-row products (m <= 8) as graphs of one kernel, the way the sweep's forward points run:
our library's few-rows kernels (`sgemm_nt_rows4`, `sgemm_nt_rows8`, every K split) and the
probe variants of bench/probe/gemv_variants.cu, beside PyTorch's `F.linear` graphed. Each
variant is captured alone in a CUDA graph; the graph is replayed 300 times behind a 2 ms GPU
sleep (so that Python's launch rate is not what is timed) and the µs per replay between two
events is taken, best of 5 samples. Every result is checked against `F.linear` first.

    python3 bench/probe/gemv_probe.py [--all]

Prints per shape: PyTorch, the best library kernel, the best probe variant (with their names);
with --all every variant's time too. fp32, TF32 off."""
import ctypes
import sys

import torch
import torch.nn.functional as F

from probe_nvrtc import check, load

torch.backends.cuda.matmul.allow_tf32 = False

ROOT = "crates/cudagraph-nn/src/kernels/"
SOURCES = [ROOT + "common.cu", ROOT + "gemm_tile.cu", ROOT + "gemm.cu", "bench/probe/gemv_variants.cu"]
ALL = "--all" in sys.argv
REPLAYS, SAMPLES, SLEEP = 300, 5, 4_000_000

SHAPES = [(m, k, n) for m in (1, 2, 4, 8) for k in (256, 1024, 4096) for n in (256, 1024, 4096)]


def variants(m, k, n):
    """(name, kernel, grid, threads, ks) for every launch worth trying at this shape."""
    out = []
    for per, kern in ((4, "sgemm_nt_rows4"), (8, "sgemm_nt_rows8")):
        if m > per:
            continue
        for ks in (1, 2, 4, 8, 16):
            warps = max(8, ks)
            gx = -(-(-(-n // 4)) // (warps // ks))
            out.append((f"{kern[9:]}:{ks}", kern, (gx, -(-m // per)), 32 * warps, ks))
    for r in (1, 2, 4, 8):
        if r < m or r > 2 * max(m, 1) and r > 1:
            continue
        for cpw in (1, 2, 4):
            name = f"gemv_r{r}c{cpw}"
            if name not in FUNCS:
                continue
            for warps in (4, 8):
                for ks in (1, 2, 4, 8):
                    if ks > warps:
                        continue
                    gx = -(-(-(-n // cpw)) // (warps // ks))
                    out.append((f"r{r}c{cpw}w{warps}:{ks}", name, (gx, -(-m // r)), 32 * warps, ks))
    return out


FUNCS = {}


def main():
    torch.zeros(1, device="cuda")
    src = "".join(open(p).read() for p in SOURCES)
    names = ["sgemm_nt_rows4", "sgemm_nt_rows8"] + [f"gemv_r{r}c{c}" for r, c in
             ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2))]
    cuda, funcs = load(src, names)
    FUNCS.update(funcs)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; µs per replay of a one-kernel graph")
    print(f"{'m,k->n':>14} {'torch':>7} {'library':>7} {'(kernel)':>12} {'probe':>7} {'(variant)':>14} {'probe/torch':>11}")

    def timed(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(SAMPLES):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SLEEP)
            e0.record()
            for _ in range(REPLAYS):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) * 1000 / REPLAYS)
        return best

    for m, k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=gen)
        w = torch.randn(n, k, device="cuda", generator=gen)
        b = torch.randn(n, device="cuda", generator=gen)
        want = F.linear(x, w, b)
        t_torch = timed(lambda: F.linear(x, w, b))
        res = []
        for label, name, (gx, gy), threads, ks in variants(m, k, n):
            y = torch.full((m, n), float("nan"), device="cuda")
            args = [ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(b.data_ptr()),
                    ctypes.c_int(0), ctypes.c_int(ks)]
            ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])

            def launch():
                check(cuda.cuLaunchKernel(FUNCS[name], gx, gy, 1, threads, 1, 1, 0,
                                          ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ptrs, None), label)

            t = timed(launch)
            err = ((y - want).abs().max() / want.abs().max()).item()
            if not err <= 1e-5:
                print(f"# {label} {m},{k}->{n}: relative error {err:.2e}")
                continue
            res.append((t, label))
        lib = min((r for r in res if r[1].startswith("rows")), default=(float("nan"), "-"))
        new = min((r for r in res if not r[1].startswith("rows")), default=(float("nan"), "-"))
        print(f"{f'{m},{k}->{n}':>14} {t_torch:7.2f} {lib[0]:7.2f} {lib[1]:>12} {new[0]:7.2f} {new[1]:>14} {new[0] / t_torch:11.3f}", flush=True)
        if ALL:
            print("    " + "  ".join(f"{l}={t:.2f}" for t, l in sorted(res)))


main()
