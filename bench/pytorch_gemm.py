#!/usr/bin/env python3
"""PyTorch timing `torch.matmul` on the half-precision products of `cudagraph bench gemm --dtype
bf16|f16` the same way (crates/cudagraph-cli/src/bench/gemm.rs): operands from randn in the
dtype, a result of the same dtype; after a warm-up on a side stream, 20 products (`torch.matmul`
into one preallocated output) captured in one `torch.cuda.graph`; one replay sets how many
replays make a sample of about 50 ms (1 to 50), then 5 samples, each timed between CUDA events
on the current stream; the median µs per product, and 2·m·n·k / time as TFLOP/s.

A stored transposed (`ta`, k×m) or B (`tb`, n×k) are transposed views, as in our layouts, so
cuBLAS sees the same transposes. PyTorch's defaults stay as they are (they are recorded in the
output): for bf16 and f16 products it allows reduced-precision reductions inside split-K
cuBLAS calls, which ours never use.

Shapes: `--shapes-from OURS.json` (the rows of `cudagraph bench gemm --dtype D --json`, so both
sides time exactly the same products; what bench/device.sh gemm-lowp does) or the built-in list,
the CLI's own.

usage: python3 bench/pytorch_gemm.py --dtype bf16 [--shapes-from ours.json] > pytorch.json
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_timing  # noqa: E402

PRODUCTS_PER_GRAPH = 20
SAMPLES = 5
SAMPLE_US = 50_000.0

# The CLI's shapes (crates/cudagraph-cli/src/bench/gemm.rs: SQUARES, then SHAPES):
# (m, n, k, ta, tb, name).
BUILT_IN = [(d, d, d, False, False, f"square {d}") for d in (1024, 2048, 4096, 8192)] + [
    (1, 512, 1024, False, True, "mlp L1 bs1"),
    (8, 512, 1024, False, True, "mlp L1 bs8"),
    (32, 512, 1024, False, True, "mlp L1 bs32"),
    (256, 512, 1024, False, True, "mlp L1 bs256"),
    (32, 256, 512, False, True, "mlp L2 bs32"),
    (32, 10, 256, False, True, "mlp L3 bs32"),
    (32, 500, 1000, False, True, "linear 1000x500 bs32"),
    (64, 1024, 1024, False, True, "train fwd"),
    (1024, 1024, 64, True, False, "train dW"),
    (64, 1024, 1024, False, False, "train dX"),
]

p = argparse.ArgumentParser()
p.add_argument("--dtype", choices=["bf16", "f16"], required=True)
p.add_argument("--shapes-from", help="`cudagraph bench gemm --dtype D --json` output")
args = p.parse_args()

if not torch.cuda.is_available():
    sys.exit("pytorch_gemm.py: torch sees no CUDA device")
dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
dev = torch.device("cuda")
torch.manual_seed(0)

if args.shapes_from:
    try:
        with open(args.shapes_from) as f:
            ours = json.load(f)
        shapes = [(r["m"], r["n"], r["k"], r["ta"], r["tb"], r["shape"]) for r in ours["rows"]]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"pytorch_gemm.py: cannot read the shapes from {args.shapes_from}: {e}")
    if ours.get("dtype") not in (None, args.dtype):
        sys.exit(f"pytorch_gemm.py: {args.shapes_from} is for {ours['dtype']}, not {args.dtype}")
else:
    shapes = BUILT_IN


def operand(rows, cols, transposed):
    """A rows × cols operand; stored cols × rows and viewed transposed when `transposed`."""
    if transposed:
        return torch.randn(cols, rows, device=dev, dtype=dtype).t()
    return torch.randn(rows, cols, device=dev, dtype=dtype)


# Microseconds of replays before the samples of each shape.
WARM_US = 200_000


def time_graph(g):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(reps):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (reps * PRODUCTS_PER_GRAPH)

    g.replay()
    torch.cuda.synchronize()
    once = sample(1) * PRODUCTS_PER_GRAPH
    reps = min(50, max(1, math.ceil(SAMPLE_US / max(once, 1.0))))
    # Warm-up of at least WARM_US of replays, so that every shape is timed at the clocks and
    # power state of sustained work (as `cudagraph bench gemm --dtype` does).
    sample(max(1, math.ceil(WARM_US / max(once, 1.0))))
    return statistics.median(sample(reps) for _ in range(SAMPLES))


rows = []
for m, n, k, ta, tb, name in shapes:
    a = operand(m, k, ta)
    b = operand(k, n, tb)
    out = torch.empty(m, n, device=dev, dtype=dtype)

    def body():
        torch.matmul(a, b, out=out)

    torch_timing.warm_up_on_side_stream(body)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(PRODUCTS_PER_GRAPH):
            body()
    us = time_graph(g)
    rows.append({"shape": name, "m": m, "n": n, "k": k, "ta": ta, "tb": tb, "us": us,
                 "tflops": 2.0 * m * n * k / (us * 1e6)})
    del g, a, b, out
    torch.cuda.empty_cache()

matmul = torch.backends.cuda.matmul
json.dump({
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "device": torch.cuda.get_device_name(),
    "dtype": args.dtype,
    "products_per_graph": PRODUCTS_PER_GRAPH,
    "settings": {
        "allow_bf16_reduced_precision_reduction":
            getattr(matmul, "allow_bf16_reduced_precision_reduction", None),
        "allow_fp16_reduced_precision_reduction":
            getattr(matmul, "allow_fp16_reduced_precision_reduction", None),
        "preferred_blas_library":
            str(getattr(torch.backends.cuda, "preferred_blas_library", lambda: "unknown")()),
    },
    "rows": rows,
}, sys.stdout, indent=1)
print()
