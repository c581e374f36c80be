#!/usr/bin/env python3
"""Joins `cudagraph bench sweep --json` and bench/pytorch_sweep.py output into a markdown table
(no title: bench/device.sh writes the heading, device, date and command above it):
per point and mode ours graph µs, PyTorch graph µs, ours/PyTorch and the engine we used; then
the geometric mean of ours/PyTorch (overall and per kind), the worst point, how many points we
win, and the optimizer points' effective bandwidth.

usage: sweep_compare.py OURS.json PYTORCH.json "COMMANDS" > sweep.md
"""
import json
import math
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def fmt(v, d=1):
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def kind_of(point_id):
    return point_id.split("-")[0]


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ours, pt = load(sys.argv[1]), load(sys.argv[2])
    commands = sys.argv[3] if len(sys.argv) > 3 else ""
    ref = {(r["id"], r["mode"]): r for r in pt["rows"]}
    d = ours["device"]
    dtype = ours.get("dtype", "f32")
    if dtype == "f32":
        precision = "fp32, TF32 off"
    else:
        precision = (f"{dtype} autocast, f32 master weights. PyTorch: `torch.autocast` around "
                     f"every forward pass and loss (weights cast in every call and step). Ours: "
                     f"`autocast`; forward points serve an `AutocastModule` (weights cast once, "
                     f"outputs in {dtype} as PyTorch's), training steps use the fused "
                     f"optimizer's {dtype} copies (no weight cast)")
    print(f"Device: {d['name']} (CUDA {d['driver_cuda_version']}, {d['multiprocessors']} SMs); "
          f"PyTorch {pt.get('torch', '?')} on {pt.get('device', '?')}, same run. {precision}, "
          f"cudnn.benchmark on, capturable optimizers.  ")
    det = ours.get("deterministic", True)
    print("Ours: deterministic engines only (the default; PyTorch's default allows cuDNN's "
          "non-deterministic algorithms).  " if det else
          "Ours: `CUDAGRAPH_DETERMINISTIC=0` (non-deterministic cuDNN algorithms allowed, as in "
          "PyTorch's default).  ")
    rounds = ours.get("rounds", 1)
    best = (f"Each side ran every point {rounds} times (kinds alternating between the sides); the "
            f"faster run counts, on both sides. " if rounds > 1 else "")
    print(f"{best}Median of {ours['repeats']} samples of ~{ours['sample_ms']} ms of back-to-back "
          f"replays; µs per replay. Ours took {ours['seconds']:.0f} s, PyTorch "
          f"{pt.get('seconds', 0):.0f} s.  ")
    print(f"Commands: `{commands}`\n")
    print("| point | mode | ours graph µs | PyTorch graph µs | ours / PyTorch | our engine |")
    print("|---|---|---:|---:|---:|---|")
    ratios, by_kind, worst, wins, both, missing = [], {}, None, 0, 0, []
    for r in ours["rows"]:
        p = ref.get((r["id"], r["mode"]), {})
        o, q = r.get("graph_us"), p.get("graph_us")
        ratio = o / q if o and q else None
        if ratio is not None:
            both += 1
            wins += ratio <= 1.0
            ratios.append(ratio)
            by_kind.setdefault(kind_of(r["id"]), []).append(ratio)
            if worst is None or ratio > worst[0]:
                worst = (ratio, r["id"], r["mode"], o, q)
        else:
            missing.append(f"{r['id']} {r['mode']}: ours {r.get('error') or fmt(o)}, "
                           f"PyTorch {p.get('error') or fmt(q)}")
        mark = "" if ratio is None or ratio <= 1.0 else " ⚠"
        print(f"| {r['id']} | {r['mode']} | {fmt(o)} | {fmt(q)} | {fmt(ratio, 2)}{mark} | {r.get('engine', '')} |")
    print()
    g = geomean(ratios)
    print(f"**Geometric mean of ours / PyTorch: {fmt(g, 3)}** over {both} points "
          f"(ours faster or equal at {wins} of {both}).  ")
    if worst:
        print(f"**Worst point: {worst[1]} ({worst[2]}): {worst[3]:.1f} µs vs {worst[4]:.1f} µs, "
              f"{worst[0]:.2f}× PyTorch.**  ")
    print("Per kind: " + ", ".join(f"{k} {fmt(geomean(v), 3)} ({len(v)})" for k, v in sorted(by_kind.items())) + ".")
    bw = []
    for r in ours["rows"]:
        if r.get("bytes") and r.get("graph_us"):
            p = ref.get((r["id"], r["mode"]), {})
            q = p.get("graph_us")
            bw.append(f"{r['id']}: ours {r['bytes'] / r['graph_us'] / 1e3:.0f} GB/s"
                      + (f", PyTorch {r['bytes'] / q / 1e3:.0f} GB/s" if q else ""))
    if bw:
        print("\nOptimizer steps, effective bandwidth (bytes that must move / time):\n")
        for line in bw:
            print(f"- {line}")
    if missing:
        print("\nPoints without both numbers:\n")
        for line in missing:
            print(f"- {line}")


if __name__ == "__main__":
    main()
