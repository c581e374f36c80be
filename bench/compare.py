#!/usr/bin/env python3
"""Side-by-side table of `cudagraph bench --json` and bench/pytorch_baseline.py output.

usage: compare.py OURS.json PYTORCH.json "COMMANDS" > table.md
"""
import json
import math
import sys

ours = json.load(open(sys.argv[1]))
pt = json.load(open(sys.argv[2]))
commands = sys.argv[3] if len(sys.argv) > 3 else ""
ref = {(r["workload"], r["config"]): r for r in pt["rows"]}


def f(v, d=1):
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"


def x(v, suffix=""):
    return "–" if f(v) == "–" else f"{v:.2f}x{suffix}"


def ratio(a, b):
    """a / b, or None where either does not apply (None, NaN from older runs, or zero)."""
    ok = lambda v: isinstance(v, (int, float)) and not math.isnan(v) and v != 0  # noqa: E731
    return a / b if ok(a) and ok(b) else None


def mb(b):
    return f"{b / 2**20:.2f}"


print(f"Device: {ours['device']['name']} (CUDA {ours['device']['driver_cuda_version']}); "
      f"PyTorch {pt['torch']} on {pt['device']}, same run.  ")
dtype = ours.get("dtype", "f32")
if dtype != "f32" or pt.get("dtype", "f32") != "f32":
    print(f"Precision: ours {dtype}, PyTorch {pt.get('dtype', 'f32')} autocast with f32 master "
          f"weights (f16: a loss scaler on both sides; PyTorch's training steps use fused "
          f"optimizers, which its scaler steps without a host read).  ")
print(f"Median of {ours['repeats']} samples x {ours['iters']} iterations; µs per iteration.  ")
print(f"Commands: `{commands}`\n")
print("| workload | config | ours eager | ours graph | ours speedup | PyTorch eager | PyTorch graph | ours graph vs PyTorch graph | ours eager vs PyTorch eager | ours pool MB | PyTorch pool MB |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
footnotes = []
for r in ours["rows"]:
    p = ref.get((r["workload"], r["config"]), {})
    pg, pe = p.get("graph_us"), p.get("eager_us")
    vs_g = ratio(pg, r.get("graph_us"))
    vs_e = ratio(pe, r.get("eager_us"))
    config = r["config"]
    # Values that do not apply print as "–"; the row's footnote says why (when the missing
    # value is one this table shows: the max diff is not among them).
    shown = (r.get("eager_us"), r.get("graph_us"), r.get("speedup"))
    if r.get("not_applicable") and any(v is None for v in shown):
        if r["not_applicable"] not in footnotes:
            footnotes.append(r["not_applicable"])
        config += f" [{footnotes.index(r['not_applicable']) + 1}]"
    print(f"| {r['workload']} | {config} | {f(r.get('eager_us'))} | {f(r.get('graph_us'))} | {x(r.get('speedup'))} | "
          f"{f(pe)} | {f(pg)} | {x(vs_g, ' faster')} | {x(vs_e, ' faster')} | {mb(r['graph_pool_reserved'])} | "
          f"{mb(p.get('graph_pool_reserved', 0))} |")
print()
for i, n in enumerate(footnotes):
    print(f"[{i + 1}] {n}  ")
if footnotes:
    print()
for n in ours.get("notes", []):
    print(f"- ours: {n}")
for n in pt.get("notes", []):
    print(f"- PyTorch: {n}")
