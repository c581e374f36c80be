#!/usr/bin/env python3
"""PyTorch measuring the points of `cudagraph bench sweep`
(crates/cudagraph-cli/data/sweep_points.json) the same way (see
crates/cudagraph-cli/src/bench/sweep.rs): fp32 with TF32 off, cudnn.benchmark on, a two-step
warm-up on a side stream, one `torch.cuda.graph` capture, then the median of `--repeats`
samples, each as many back-to-back `g.replay()` calls as fill `--sample-ms` (at least one; 3
samples for points slower than 50 ms), ended by one synchronisation.

Modes, as ours:
- forward: the model under torch.no_grad();
- train: zero_grad(set_to_none=True), forward, loss, backward, optimizer step, in one graph.
  Linear and Conv2d: MSE (mean) against a fixed target, SGD lr 1e-3. Cross-entropy: the logits
  are a parameter, SGD lr 1e-3. MLP: cross-entropy, Adam lr 1e-3 (capturable=True). CNN:
  cross-entropy, SGD lr 0.01 momentum 0.9.
- step (optimizer points): the optimizer step alone on preset gradients; SGD lr 1e-3, momentum
  0.9, Adam(capturable=True).

usage: python3 bench/pytorch_sweep.py [--points crates/cudagraph-cli/data/sweep_points.json]
       [--only ID,...] [--sample-ms 10] [--repeats 5] > pytorch.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.benchmark = True

here = os.path.dirname(os.path.abspath(__file__))
p = argparse.ArgumentParser()
p.add_argument("--points",
               default=os.path.join(here, "..", "crates", "cudagraph-cli", "data", "sweep_points.json"))
p.add_argument("--only", default="")
p.add_argument("--sample-ms", type=float, default=10.0)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"],
               help="bf16/f16: every forward pass and loss under torch.autocast (f32 masters)")
args = p.parse_args()
AUTOCAST = {"bf16": torch.bfloat16, "f16": torch.float16}.get(args.dtype)


def mixed(fn):
    """fn() under torch.autocast of --dtype (as `cudagraph bench sweep --dtype`)."""
    if AUTOCAST is None:
        return fn()
    with torch.autocast("cuda", dtype=AUTOCAST):
        return fn()
dev = torch.device("cuda")
torch.manual_seed(0)


def iters_for(sample_ms, est_us):
    if not est_us > 0:
        return 1
    return max(1, min(2000, round(sample_ms * 1000.0 / est_us)))


def time_graph(g):
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    # The fastest of three single replays sets the replays per sample, so that one slow
    # estimate (a host hiccup) cannot shrink every sample to a few replays plus a
    # synchronisation (the same rule as `cudagraph bench sweep`).
    est = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        est = min(est, (time.perf_counter() - t) * 1e6)
    repeats = 3 if est > 50_000 else max(1, args.repeats)
    iters = iters_for(args.sample_ms, est)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e6 / iters)
    return statistics.median(samples)


def measure(step):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    us = time_graph(g)
    del g
    return us


def targets(rows, classes):
    return torch.tensor([(r * 7919) % classes for r in range(rows)], device=dev, dtype=torch.long)


def mlp(inp, width, depth, classes):
    layers, fan_in = [], inp
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(fan_in, width), torch.nn.ReLU()]
        fan_in = width
    layers.append(torch.nn.Linear(fan_in, classes))
    return torch.nn.Sequential(*layers).to(dev)


def cnn(image, cin, ch, depth, classes):
    layers, c, hw = [], cin, image
    for i in range(depth):
        layers += [torch.nn.Conv2d(c, ch, 3, padding=1), torch.nn.ReLU()]
        c = ch
        if i % 2 == 1:
            layers.append(torch.nn.MaxPool2d(2))
            hw //= 2
    layers += [torch.nn.Flatten(), torch.nn.Linear(c * hw * hw, classes)]
    return torch.nn.Sequential(*layers).to(dev)


def train_step(loss_fn, opt):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = mixed(loss_fn)
        loss.backward()
        opt.step()
    return step


def forward_step(fn):
    def step():
        with torch.no_grad():
            mixed(fn)
    return step


def run_point(pt, mode):
    kind = pt["kind"]
    train = mode == "train"
    if kind == "linear":
        m, k, n = pt["m"], pt["k"], pt["n"]
        model = torch.nn.Linear(k, n).to(dev)
        x = torch.randn(m, k, device=dev)
        y = torch.randn(m, n, device=dev)
        if not train:
            return measure(forward_step(lambda: model(x)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return measure(train_step(lambda: F.mse_loss(model(x), y), opt))
    if kind == "conv2d":
        n, c, oc, hw, k, st, pad = (pt[f] for f in ["n", "c", "oc", "hw", "k", "stride", "pad"])
        model = torch.nn.Conv2d(c, oc, k, stride=st, padding=pad).to(dev)
        x = torch.randn(n, c, hw, hw, device=dev)
        oh = (hw + 2 * pad - k) // st + 1
        y = torch.randn(n, oc, oh, oh, device=dev)
        if not train:
            return measure(forward_step(lambda: model(x)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return measure(train_step(lambda: F.mse_loss(model(x), y), opt))
    if kind == "cross_entropy":
        rows, classes = pt["rows"], pt["classes"]
        z = torch.nn.Parameter(torch.randn(rows, classes, device=dev))
        t = targets(rows, classes)
        if not train:
            return measure(forward_step(lambda: F.cross_entropy(z, t)))
        opt = torch.optim.SGD([z], lr=1e-3)
        return measure(train_step(lambda: F.cross_entropy(z, t), opt))
    if kind == "mlp":
        model = mlp(pt["input"], pt["width"], pt["depth"], pt["classes"])
        x = torch.randn(pt["batch"], pt["input"], device=dev)
        t = targets(pt["batch"], pt["classes"])
        if not train:
            return measure(forward_step(lambda: model(x)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
        return measure(train_step(lambda: F.cross_entropy(model(x), t), opt))
    if kind == "cnn":
        model = cnn(pt["image"], pt["in_channels"], pt["channels"], pt["depth"], pt["classes"])
        x = torch.randn(pt["batch"], pt["in_channels"], pt["image"], pt["image"], device=dev)
        t = targets(pt["batch"], pt["classes"])
        if not train:
            return measure(forward_step(lambda: model(x)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return measure(train_step(lambda: F.cross_entropy(model(x), t), opt))
    if kind == "optimizer":
        params = [torch.nn.Parameter(torch.randn(pt["size"], device=dev)) for _ in range(pt["tensors"])]
        for q in params:
            q.grad = 2 * q.detach().clone()
        o = pt["opt"]
        if o == "sgd":
            opt = torch.optim.SGD(params, lr=1e-3)
        elif o == "momentum":
            opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        else:
            opt = torch.optim.Adam(params, lr=1e-3, capturable=True)
        return measure(opt.step)
    raise ValueError(f"unknown point kind {kind}")


def modes(pt):
    return ["step"] if pt["kind"] == "optimizer" else ["forward", "train"]


points = json.load(open(args.points))["points"]
only = [o for o in args.only.split(",") if o]
if only:
    points = [pt for pt in points if any(o in pt["id"] for o in only)]
started = time.perf_counter()
# Warm-up, as ours: the first point of a process is run once and discarded (clocks and caches
# still cold).
if points:
    try:
        run_point(points[0], modes(points[0])[0])
    except Exception:  # the measured run records the error
        pass
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
rows = []
for pt in points:
    for mode in modes(pt):
        row = dict(id=pt["id"], mode=mode, graph_us=None, error=None)
        try:
            row["graph_us"] = run_point(pt, mode)
        except Exception as e:  # a point that fails is recorded, the sweep goes on
            row["error"] = f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"{pt['id']} {mode}: {row['graph_us']}", file=sys.stderr, flush=True)
        rows.append(row)

print(json.dumps(dict(benchmark="sweep", side="pytorch", dtype=args.dtype, torch=torch.__version__,
                      device=torch.cuda.get_device_name(), sample_ms=args.sample_ms,
                      repeats=args.repeats, seconds=time.perf_counter() - started, rows=rows),
                 indent=1, allow_nan=True))
