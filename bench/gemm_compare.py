#!/usr/bin/env python3
"""Side-by-side table of `cudagraph bench gemm --dtype D --json` and bench/pytorch_gemm.py
output for one dtype: per shape, ours µs and TFLOP/s (with the engine the registry chose),
PyTorch's, and the time ratio ours / PyTorch (below 1: ours is faster); then the issue's
targets for large products (8192³ bf16 at least 650 TFLOP/s and within 3 % of torch.matmul,
4096³ within 3 %), each marked met or missed.

usage: gemm_compare.py OURS.json PYTORCH.json > table.md
"""
import json
import math
import sys

TARGET_TFLOPS_8192_BF16 = 650.0
TARGET_RATIO = 1.03


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"rows": [], "error": f"{path}: {e}"}


ours = load(sys.argv[1])
pt = load(sys.argv[2])
dtype = ours.get("dtype", "?")
key = lambda r: (r["m"], r["n"], r["k"], bool(r["ta"]), bool(r["tb"]))  # noqa: E731
theirs = {key(r): r for r in pt.get("rows", [])}


def f(v, d=2):
    ok = isinstance(v, (int, float)) and not math.isnan(v)
    return f"{v:.{d}f}" if ok else "–"


if "error" in ours:
    print(f"No result of ours: {ours['error']}")
    sys.exit(0)
dev = ours.get("device", {}).get("name", "?")
print(f"{dtype} products (operands and result {dtype}, f32 accumulation) on {dev}; "
      f"{ours.get('products_per_graph', '?')} products per graph, replayed between CUDA events, "
      f"median of 5 samples; µs per product.  ")
if pt.get("rows"):
    s = pt.get("settings", {})
    print(f"PyTorch {pt.get('torch', '?')} (CUDA {pt.get('cuda', '?')}) on {pt.get('device', '?')}, "
          f"same call: `torch.matmul` into a preallocated output; its defaults "
          f"(reduced-precision reductions: bf16 {s.get('allow_bf16_reduced_precision_reduction')}, "
          f"f16 {s.get('allow_fp16_reduced_precision_reduction')}; "
          f"BLAS {s.get('preferred_blas_library')}).\n")
else:
    why = pt.get("error") or "; ".join(pt.get("notes", [])) or "no rows"
    print(f"PyTorch: not measured ({why}).\n")
print("| shape | m × n × k | layout | ours µs | ours TFLOP/s | engine | PyTorch µs | PyTorch TFLOP/s | ours / PyTorch |")
print("|---|---|---|---:|---:|---|---:|---:|---:|")
by_shape = {}
for r in ours["rows"]:
    t = theirs.get(key(r))
    ratio = r["us"] / t["us"] if t and t.get("us") else None
    by_shape[(r["m"], r["n"], r["k"])] = (r, t, ratio)
    layout = ("T" if r["ta"] else "N") + ("T" if r["tb"] else "N")
    print(f"| {r['shape']} | {r['m']} × {r['n']} × {r['k']} | {layout} | {f(r['us'])} | "
          f"{f(r['tflops'], 1)} | {r['engine']} | {f(t['us']) if t else '–'} | "
          f"{f(t['tflops'], 1) if t else '–'} | {f(ratio)} |")
print()


def verdict(ok):
    return "**met**" if ok else "**missed**"


for d in (8192, 4096):
    r, t, ratio = by_shape.get((d, d, d), (None, None, None))
    if r is None:
        print(f"- {d}³: not measured")
        continue
    parts = []
    if d == 8192 and dtype == "bf16":
        parts.append(f"{f(r['tflops'], 1)} TFLOP/s (target ≥ {TARGET_TFLOPS_8192_BF16:.0f}: "
                     f"{verdict(r['tflops'] >= TARGET_TFLOPS_8192_BF16)})")
    if ratio is None:
        parts.append("no PyTorch time to compare with")
    else:
        parts.append(f"{(ratio - 1) * 100:+.1f} % against torch.matmul (target within 3 %: "
                     f"{verdict(ratio <= TARGET_RATIO)})")
    print(f"- target {d}³ {dtype}: " + "; ".join(parts))
