#!/usr/bin/env python3
"""PyTorch doing the work of `cudagraph bench`, measured the same way (see
crates/cudagraph-cli/src/bench/workloads.rs): fp32 with TF32 off, the same shapes, the same
iteration counts, the median of the same number of samples, wall time over back-to-back
iterations ending in one synchronisation.

- mlp: one request = host->device copy (pinned host buffer), forward, device->host copy (pinned),
  synchronise. Eager: model(x_host.cuda(non_blocking)) ...; graph: static_input.copy_, replay,
  out_host.copy_(static_output), as in seed 002 but with pinned staging (PyTorch's best case).
- train: Linear(1024, 1024), MSE sum, N=64, SGD lr 1e-3 and Adam(capturable=True); whole step in
  one graph after a 3-step warm-up on a side stream (seed 001).
- pool: Linear(1000, 500) bs 32 and Conv2d(3, 64, 3) on 16x3x224x224 in one graph pool.
- mlp-pool: the seed MLP captured at nine batch sizes into one pool, largest first, with one
  warm-up side stream (the right way) and with a fresh side stream per warm-up (the naive way).
- dropout: the seed MLP with Dropout(0.1), a whole SGD training step graphed (fresh masks per
  replay), and one dropout op on 64x4096 alone.

--dtype bf16 (or f16), as `cudagraph bench --dtype`: every forward pass and loss under
torch.autocast with f32 master weights; the host round trip's output is widened to f32 inside
the graph (`.float()`), the other inference outputs stay 16-bit. Training steps in f16 scale the
loss with a GradScaler and use fused optimizers (SGD(fused=True), Adam(fused=True,
capturable=True)): only those take the scaler's found-inf flag on the device, so the step
captures (a non-fused optimizer under a scaler reads the flag on the host). The dropout op alone
stays f32 (autocast leaves dropout in its input's type).

Values that do not apply (the nine-sizes row's times) are null, never NaN, so the output is
valid JSON; `cudagraph bench --pytorch pytorch.json --svg chart.svg` draws it beside ours.

usage: python3 bench/pytorch_baseline.py [--iters 500] [--repeats 5] [--dtype f32|bf16|f16] > pytorch.json
"""
import argparse
import json
import time

import torch

import torch_timing

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=500)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--batch-sizes", default="1,4,8,16,32,256")
p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"],
               help="bf16/f16: every forward pass and loss under torch.autocast (f32 masters)")
args = p.parse_args()
dev = torch.device("cuda")
torch.manual_seed(0)
AUTOCAST = {"bf16": torch.bfloat16, "f16": torch.float16}.get(args.dtype)
SCALED = args.dtype == "f16"


def mixed(fn):
    """fn() under torch.autocast of --dtype (as `cudagraph bench --dtype`)."""
    if AUTOCAST is None:
        return fn()
    with torch.autocast("cuda", dtype=AUTOCAST):
        return fn()


def sgd(params, lr):
    # f16: fused, the SGD a GradScaler steps inside a capture; otherwise the default.
    return torch.optim.SGD(params, lr=lr, fused=True) if SCALED else torch.optim.SGD(params, lr=lr)


def adam(params, lr):
    if SCALED:
        return torch.optim.Adam(params, lr=lr, capturable=True, fused=True)
    return torch.optim.Adam(params, lr=lr, capturable=True)


def new_scaler():
    """A training workload's loss scaler: enabled for f16 only (disabled, every call passes
    through)."""
    return torch.amp.GradScaler("cuda", enabled=SCALED)


def scaled_step(loss, opt, scaler):
    """backward, optimizer step and scale update of a training step's unscaled loss."""
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def time_us(body, iters=args.iters):
    return torch_timing.time_us(body, iters, args.repeats)


def graphed_step_row(workload, config, step, opt):
    """A whole training step eager and graphed, as `cudagraph bench` measures its own: warm-up
    on a side stream, eager timing and peak memory, one capture, replay timing."""
    torch_timing.warm_up_on_side_stream(step)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    e = time_us(step)
    eager_peak = torch.cuda.max_memory_allocated() - base
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        out = step()
    cap = (time.perf_counter() - t0) * 1e3
    gr = time_us(g.replay)
    row(workload, config, e, gr, eager_peak, torch.cuda.memory_reserved() - before, 0, cap)
    return g, out


def seed_mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10)).to(dev)


rows, notes = [], []


def row(workload, config, eager, graph, eager_peak=0, pool_reserved=0, graph_peak=0, capture_ms=0.0):
    """One row; a value that does not apply is None (null in the JSON, as in ours)."""
    rows.append(dict(workload=workload, config=config, eager_us=eager, graph_us=graph,
                     speedup=eager / graph if eager and graph else None, eager_peak_bytes=eager_peak,
                     graph_pool_reserved=pool_reserved, graph_peak_bytes=graph_peak, capture_ms=capture_ms))


# 1. MLP inference, the seed's way: device input, copy_ into the static input, replay, clone.
model = seed_mlp().eval()
with torch.no_grad():
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        x = torch.randn(bs, 1024, device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        e = time_us(lambda: mixed(lambda: model(x)))
        eager_peak = torch.cuda.max_memory_allocated() - base
        static_in = torch.zeros(bs, 1024, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                mixed(lambda: model(static_in))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        with torch.cuda.graph(g):
            static_out = mixed(lambda: model(static_in))
        cap = (time.perf_counter() - t0) * 1e3
        reserved = torch.cuda.memory_reserved() - before

        def request():
            static_in.copy_(x)
            g.replay()
            return static_out.clone()

        gr = time_us(request)
        row("mlp-inference", f"bs={bs}", e, gr, eager_peak, reserved, 0, cap)

# 1b. MLP inference as a serving request from pinned host memory (latency).
with torch.no_grad():
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        x_host = torch.randn(bs, 1024).pin_memory()
        out_host = torch.empty(bs, 10).pin_memory()

        def eager():
            y = mixed(lambda: model(x_host.to(dev, non_blocking=True))).float()
            out_host.copy_(y, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        e = time_us(eager)
        eager_peak = torch.cuda.max_memory_allocated() - base
        static_in = torch.zeros(bs, 1024, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                mixed(lambda: model(static_in)).float()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        with torch.cuda.graph(g):
            static_out = mixed(lambda: model(static_in)).float()
        cap = (time.perf_counter() - t0) * 1e3
        reserved = torch.cuda.memory_reserved() - before

        def graphed():
            static_in.copy_(x_host, non_blocking=True)
            g.replay()
            out_host.copy_(static_out, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        gr = time_us(graphed)
        row("mlp-host-roundtrip", f"bs={bs}", e, gr, eager_peak, reserved, 0, cap)

# 2. Training steps
for opt_name in ["sgd", "adam"]:
    lin = torch.nn.Linear(1024, 1024).to(dev)
    opt = sgd(lin.parameters(), 1e-3) if opt_name == "sgd" else adam(lin.parameters(), 1e-3)
    scaler = new_scaler()
    x = torch.randn(64, 1024, device=dev)
    y = torch.randn(64, 1024, device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = mixed(lambda: (lin(x) - y).pow(2).sum())
        scaled_step(loss, opt, scaler)
        return loss

    g, static_loss = graphed_step_row("linear-train", opt_name, step, opt)

# 3. Two models in one pool
with torch.no_grad():
    pool = torch.cuda.graph_pool_handle()
    lin = torch.nn.Linear(1000, 500).to(dev)
    conv = torch.nn.Conv2d(3, 64, 3).to(dev)
    x1 = torch.randn(32, 1000, device=dev)
    x2 = torch.randn(16, 3, 224, 224, device=dev)
    keep = []
    before_all = torch.cuda.memory_reserved()
    for name, m, x in [("linear-1000x500-bs32", lin, x1), ("conv2d-3x64-16x3x224x224", conv, x2)]:
        mixed(lambda: m(x))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        e = time_us(lambda: mixed(lambda: m(x)), min(args.iters, 200))
        eager_peak = torch.cuda.max_memory_allocated() - base
        g = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(g, pool=pool):
            out = mixed(lambda: m(x))
        cap = (time.perf_counter() - t0) * 1e3
        gr = time_us(g.replay, min(args.iters, 200))
        keep.append((g, out))
        row("shared-pool", name, e, gr, eager_peak, torch.cuda.memory_reserved() - before_all, 0, cap)
    notes.append(f"shared pool with both models: reserved delta {(torch.cuda.memory_reserved() - before_all) / 2**20:.1f} MB")
    del keep

# 4. Nine batch sizes in one pool (largest first)
def nine_sizes(fresh_side_stream):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    m = seed_mlp()
    sizes = [256, 192, 128, 64, 32, 16, 8, 4, 1]
    pool = torch.cuda.graph_pool_handle()
    keep = []
    side = torch.cuda.Stream()
    before = torch.cuda.memory_reserved()
    for bs in sizes:
        x = torch.randn(bs, 1024, device=dev)
        s = torch.cuda.Stream() if fresh_side_stream else side
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                mixed(lambda: m(x))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = mixed(lambda: m(x))
        keep.append((g, x, y))
    return torch.cuda.memory_reserved() - before


with torch.no_grad():
    right = nine_sizes(False)
    naive = nine_sizes(True)
# Memory only: nothing is timed.
row("mlp-9-sizes-shared-pool", "bs=256..1", None, None, None, right, 0, 0.0)
notes.append(f"seed MLP at nine batch sizes in one pool: reserved delta {right / 2**20:.2f} MB "
             f"(one warm-up side stream); {naive / 2**20:.2f} MB with a fresh side stream per warm-up")

# 5. Dropout in graphs (`cudagraph bench --only dropout`): the seed MLP with Dropout(0.1) after
# each ReLU, batch 64, cross-entropy, SGD lr 0.01 without momentum, whole step graphed (PyTorch
# registers its generator's state with the graph, so each replay draws fresh masks); and one
# dropout op on 64x4096 alone.
torch.manual_seed(7)
drop = torch.nn.Sequential(
    torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1),
    torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
    torch.nn.Linear(256, 10)).to(dev).train()
opt = sgd(drop.parameters(), 0.01)
drop_scaler = new_scaler()
xd = torch.randn(64, 1024, device=dev)
yd = torch.tensor([(i * 7) % 10 for i in range(64)], device=dev)
lossf = torch.nn.CrossEntropyLoss()


def drop_step():
    opt.zero_grad(set_to_none=True)
    loss = mixed(lambda: lossf(drop(xd), yd))
    scaled_step(loss, opt, drop_scaler)
    return loss


g, drop_loss = graphed_step_row("dropout-train", "mlp-p0.1-bs64-sgd", drop_step, opt)
# Two replays draw different masks (the generator advances per replay).
w0 = drop[0].weight.detach().clone()
g.replay()
d1 = (drop[0].weight - w0).clone()
w1 = drop[0].weight.detach().clone()
g.replay()
d2 = drop[0].weight - w1
notes.append(f"dropout-train: two consecutive replays' weight updates differ by {float((d1 - d2).abs().max()):.3e} (fresh masks)")

xo = torch.randn(64, 4096, device=dev)
op = torch.nn.Dropout(0.1).train()
with torch.no_grad():
    torch_timing.warm_up_on_side_stream(lambda: op(xo))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    e = time_us(lambda: op(xo))
    eager_peak = torch.cuda.max_memory_allocated() - base
    g = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        yo = op(xo)
    cap = (time.perf_counter() - t0) * 1e3
    gr = time_us(g.replay)
    row("dropout-op", "64x4096-p0.1", e, gr, eager_peak, torch.cuda.memory_reserved() - before, 0, cap)

print(json.dumps(dict(benchmark="workloads-pytorch", dtype=args.dtype, torch=torch.__version__,
                      device=torch.cuda.get_device_name(), iters=args.iters, repeats=args.repeats,
                      rows=rows, notes=notes), indent=1, allow_nan=False))
