#!/usr/bin/env python3
"""Joins `cudagraph bench decode --json` and bench/decode_torch.py --json into one Markdown table
(bench/device.sh decode). Each JSON file is a list of objects with prompt, batch, ms_per_step,
tokens_per_s, capture_ms and graph_mib (ours also tune_ms). A side that did not run is given as "-".

usage: python3 bench/decode_compare.py MODEL OURS.json PYTORCH.json [MODEL OURS.json PYTORCH.json ...]

Speed-up = PyTorch's ms per step / ours (above 1: ours is faster). Then issue 29's targets: ms
per step at batch 1 (gpt2-small <= 0.3, llama-1b <= 1.0) and >= 1.5x PyTorch's tokens/s at
batch 8, 32 and 64.
"""
import json
import sys

TARGET_B1_MS = {"gpt2-small": 0.3, "llama-1b": 1.0}
TARGET_SPEEDUP = 1.5


def load(path):
    if path == "-":
        return {}
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        print(f"decode_compare.py: {path}: {e}", file=sys.stderr)
        return {}
    if isinstance(rows, dict):
        rows = rows.get("rows", [])
    return {(int(r["prompt"]), int(r["batch"])): r for r in rows}


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def main():
    args = sys.argv[1:]
    if not args or len(args) % 3:
        sys.exit(__doc__)
    print("| model | prompt | batch | ours ms/step | PyTorch ms/step | speed-up | ours tok/s | PyTorch tok/s "
          "| ours capture ms | ours tune ms | PyTorch capture ms | ours graph MiB | PyTorch graph MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    targets = []
    for i in range(0, len(args), 3):
        model, ours, theirs = args[i], load(args[i + 1]), load(args[i + 2])
        for key in sorted(set(ours) | set(theirs)):
            o, t = ours.get(key, {}), theirs.get(key, {})
            om, tm = o.get("ms_per_step"), t.get("ms_per_step")
            ratio = tm / om if om and tm else None
            print(f"| {model} | {key[0]} | {key[1]} | {fmt(om, '.3f')} | {fmt(tm, '.3f')} | "
                  f"{fmt(ratio, '.2f')}{'×' if ratio else ''} | {fmt(o.get('tokens_per_s'), '.0f')} | "
                  f"{fmt(t.get('tokens_per_s'), '.0f')} | {fmt(o.get('capture_ms'), '.0f')} | "
                  f"{fmt(o.get('tune_ms'), '.0f')} | {fmt(t.get('capture_ms'), '.0f')} | {fmt(o.get('graph_mib'), '.1f')} | "
                  f"{fmt(t.get('graph_mib'), '.1f')} |")
            prompt, batch = key
            if batch == 1 and model in TARGET_B1_MS and om is not None:
                goal = TARGET_B1_MS[model]
                targets.append(f"{model}, prompt {prompt}, batch 1: {om:.3f} ms per step (target ≤ {goal}): "
                               f"{'met' if om <= goal else 'NOT met'}")
            if batch in (8, 32, 64) and ratio is not None:
                targets.append(f"{model}, prompt {prompt}, batch {batch}: {ratio:.2f}× PyTorch's tokens/s "
                               f"(target ≥ {TARGET_SPEEDUP}×): {'met' if ratio >= TARGET_SPEEDUP else 'NOT met'}")
    print()
    print("Speed-up: PyTorch's ms per step over ours. Capture: ours, the graph's capture per bucket "
          "(tune: timing the bucket's forward with alternative engines before, `Engines::tune_graph`, "
          "in the process that measured the engines — a child process of `cudagraph bench decode` unless "
          "`--measure-in-process`; about 0 where the registry had tuned it); "
          "PyTorch, the warm-up steps (torch.compile's compilation for that shape and the CUDA graph's "
          "recording). Graph memory: ours, the peak a captured step allocates from its pool (`cudagraph bench decode`); "
          "PyTorch, the growth of the caching allocator's private (CUDA graph) pools over "
          "the warm-up (cudagraph trees share one pool across shapes, so later shapes may add little).")
    if targets:
        print()
        for line in targets:
            print(f"- target: {line}")


if __name__ == "__main__":
    main()
