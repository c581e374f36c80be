#!/usr/bin/env python3
"""Side-by-side table of `cudagraph bench ddp --json` and bench/pytorch_ddp.py, with the
issue's two targets checked: 2-GPU scaling >= 1.8x on the compute-heavy model (our graphed
step), and our graphed DDP step <= 0.5x PyTorch DDP's step time on the same model.

usage: compare_ddp.py OURS.json PYTORCH.json > table.md   (exit status 0 either way)
"""
import json
import sys

ours = json.load(open(sys.argv[1]))
pt = json.load(open(sys.argv[2]))
ref = {(r["model"], r["gpus"]): r for r in pt["rows"]}
mine = {(r["model"], r["gpus"]): r for r in ours["rows"]}


def f(v, d=1):
    return "–" if v is None else f"{v:.{d}f}"


def ratio(a, b):
    return a / b if a and b else None


print(f"Device: {ours['device']['name']}; NCCL {ours['nccl']} (ours), PyTorch {pt['torch']} "
      f"with NCCL {pt['nccl']}; one process per GPU; µs per training step, median of "
      f"{ours['repeats']} samples; throughput = samples/s over all GPUs.\n")
print("| model | GPUs | batch/GPU | ours eager | ours graph | PyTorch DDP eager | PyTorch DDP graph "
      "| ours graph / PyTorch eager | ours graph / PyTorch graph | ours graph samples/s | scaling ours (graph) "
      "| scaling PyTorch (eager) | scaling PyTorch (graph) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (model, gpus), r in sorted(mine.items()):
    p = ref.get((model, gpus), {})
    one = mine.get((model, 1), {})
    pone = ref.get((model, 1), {})
    print(f"| {model} | {gpus} | {r['batch_per_gpu']} | {f(r['eager_us'])} | {f(r['graph_us'])} | "
          f"{f(p.get('eager_us'))} | {f(p.get('graph_us'))} | "
          f"{f(ratio(r['graph_us'], p.get('eager_us')), 2)} | {f(ratio(r['graph_us'], p.get('graph_us')), 2)} | "
          f"{f(r['graph_samples_per_s'], 0)} | "
          f"{f(ratio(r['graph_samples_per_s'], one.get('graph_samples_per_s')), 2)}x | "
          f"{f(ratio(p.get('eager_samples_per_s'), pone.get('eager_samples_per_s')), 2)}x | "
          f"{f(ratio(p.get('graph_samples_per_s'), pone.get('graph_samples_per_s')), 2)}x |")
print()
mlp1, mlp2 = mine.get(("mlp", 1)), mine.get(("mlp", 2))
if mlp1 and mlp2:
    s = mlp2["graph_samples_per_s"] / mlp1["graph_samples_per_s"]
    print(f"- target: 2-GPU scaling of the MLP (graphed) >= 1.8x: {s:.2f}x -> {'MET' if s >= 1.8 else 'MISSED'}")
for model in sorted({m for m, _ in mine}):
    r, p = mine.get((model, 2)), ref.get((model, 2), {})
    if not r:
        continue
    for kind in ("eager", "graph"):
        x = ratio(r["graph_us"], p.get(f"{kind}_us"))
        if x is not None:
            print(f"- target: our graphed DDP step <= 0.5x PyTorch DDP ({kind}) step, {model} on 2 GPUs: "
                  f"{x:.2f}x -> {'MET' if x <= 0.5 else 'MISSED'}")
for n in ours.get("notes", []):
    print(f"- ours: {n}")
for n in pt.get("notes", []):
    print(f"- PyTorch: {n}")
