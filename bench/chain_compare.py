#!/usr/bin/env python3
"""Merge `cudagraph bench chain --json` and bench/raw/chain.cu output into a markdown table.

usage: chain_compare.py OURS.json RAW.json COMMAND > table.md
"""
import json
import sys

ours = json.load(open(sys.argv[1]))
raw = json.load(open(sys.argv[2]))
command = sys.argv[3] if len(sys.argv) > 3 else ""
rows = {r["kernels"]: r for r in raw["rows"]}
print(f"Device: {ours['device']['name']} (CUDA {ours['device']['driver_cuda_version']}); raw baseline device: {raw['device']}")
print(f"Command: `{command}`\n")
print("| k | ours eager µs/kernel | raw eager µs/kernel | eager ratio | ours graph µs/kernel | raw graph µs/kernel | graph ratio | ours speedup |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in ours["rows"]:
    b = rows.get(r["kernels"])
    if not b:
        continue
    print(f"| {r['kernels']} | {r['eager_us_per_kernel']:.3f} | {b['eager_us_per_kernel']:.3f} | "
          f"{r['eager_us_per_kernel'] / b['eager_us_per_kernel']:.3f} | {r['graph_us_per_kernel']:.3f} | "
          f"{b['graph_us_per_kernel']:.3f} | {r['graph_us_per_kernel'] / b['graph_us_per_kernel']:.3f} | "
          f"{r['speedup']:.2f}x |")
