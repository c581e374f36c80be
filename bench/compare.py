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


def mb(b):
    return f"{b / 2**20:.2f}"


print(f"Device: {ours['device']['name']} (CUDA {ours['device']['driver_cuda_version']}); "
      f"PyTorch {pt['torch']} on {pt['device']}, same run.  ")
print(f"Median of {ours['repeats']} samples x {ours['iters']} iterations; µs per iteration.  ")
print(f"Commands: `{commands}`\n")
print("| workload | config | ours eager | ours graph | ours speedup | PyTorch eager | PyTorch graph | ours graph vs PyTorch graph | ours eager vs PyTorch eager | ours pool MB | PyTorch pool MB |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in ours["rows"]:
    p = ref.get((r["workload"], r["config"]), {})
    pg, pe = p.get("graph_us"), p.get("eager_us")
    vs_g = pg / r["graph_us"] if pg and r["graph_us"] and not math.isnan(r["graph_us"]) else None
    vs_e = pe / r["eager_us"] if pe and r["eager_us"] and not math.isnan(r["eager_us"]) else None
    print(f"| {r['workload']} | {r['config']} | {f(r['eager_us'])} | {f(r['graph_us'])} | {f(r['speedup'], 2)}x | "
          f"{f(pe)} | {f(pg)} | {f(vs_g, 2)}x faster | {f(vs_e, 2)}x faster | {mb(r['graph_pool_reserved'])} | "
          f"{mb(p.get('graph_pool_reserved', 0))} |")
print()
for n in ours.get("notes", []):
    print(f"- ours: {n}")
for n in pt.get("notes", []):
    print(f"- PyTorch: {n}")
