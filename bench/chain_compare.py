#!/usr/bin/env python3
"""Merge `cudagraph bench chain --json` and bench/raw/chain.cu output into a markdown table.

usage: chain_compare.py OURS.json RAW.json COMMAND [PYTORCH.json] > table.md
RAW.json may be "-" when the raw baseline could not be built (no nvcc): its columns read n/a.
"""
import json
import sys

ours = json.load(open(sys.argv[1]))
raw = json.load(open(sys.argv[2])) if sys.argv[2] != "-" else {"device": "not run", "rows": []}
command = sys.argv[3] if len(sys.argv) > 3 else ""
pt = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None
rows = {r["kernels"]: r for r in raw["rows"]}


def fmt(v):
    return f"{v:.3f}" if isinstance(v, (int, float)) else "n/a"


pt_rows = {r["kernels"]: r for r in pt["rows"]} if pt else {}
print(f"Device: {ours['device']['name']} (CUDA {ours['device']['driver_cuda_version']}); raw baseline device: {raw['device']}")
print(f"Command: `{command}`\n")
print("| k | ours eager µs/kernel | raw eager µs/kernel | eager ratio | ours graph µs/kernel | raw graph µs/kernel | graph ratio | ours speedup |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


for r in ours["rows"]:
    b = rows.get(r["kernels"], {})
    be, bg = b.get("eager_us_per_kernel"), b.get("graph_us_per_kernel")
    print(f"| {r['kernels']} | {r['eager_us_per_kernel']:.3f} | {fmt(be)} | "
          f"{fmt(ratio(r['eager_us_per_kernel'], be))} | {r['graph_us_per_kernel']:.3f} | "
          f"{fmt(bg)} | {fmt(ratio(r['graph_us_per_kernel'], bg))} | {r['speedup']:.2f}x |")

pdl_rows = [r for r in ours["rows"] if "graph_pdl_us_per_kernel" in r]
if pdl_rows:
    print()
    print("With programmatic dependent launch (PDL), µs per kernel:")
    print()
    print("| k | ours eager PDL | raw eager PDL | ours graph PDL | raw graph PDL | ours graph PDL vs ours graph | programmatic edges |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in pdl_rows:
        b = rows.get(r["kernels"], {})
        print(f"| {r['kernels']} | {fmt(r['eager_pdl_us_per_kernel'])} | {fmt(b.get('eager_pdl_us_per_kernel'))} | "
              f"{fmt(r['graph_pdl_us_per_kernel'])} | {fmt(b.get('graph_pdl_us_per_kernel'))} | "
              f"{r['graph_pdl_us_per_kernel'] / r['graph_us_per_kernel']:.3f} | {r['pdl_programmatic_edges']} |")

if pt_rows:
    print()
    print(f"PyTorch {pt['torch']} on {pt['device']} (bench/pytorch_chain.py: the same chain as "
          "`x.lerp_(ones, 0.001)`, one kernel each; no PDL in PyTorch), µs per kernel:")
    print()
    print("| k | PyTorch eager | PyTorch graph | ours graph | ours graph PDL | raw graph | ours graph vs PyTorch graph | ours graph PDL vs PyTorch graph |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ours["rows"]:
        q = pt_rows.get(r["kernels"])
        if not q:
            continue
        pdl = r.get("graph_pdl_us_per_kernel")
        cells = [q["eager_us_per_kernel"], q["graph_us_per_kernel"], r["graph_us_per_kernel"], pdl,
                 rows.get(r["kernels"], {}).get("graph_us_per_kernel"),
                 r["graph_us_per_kernel"] / q["graph_us_per_kernel"],
                 pdl / q["graph_us_per_kernel"] if pdl is not None else None]
        print(f"| {r['kernels']} | " + " | ".join(fmt(c) for c in cells) + " |")
