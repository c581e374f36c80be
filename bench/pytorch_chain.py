#!/usr/bin/env python3
"""PyTorch's per-kernel cost in a chain of dependent kernels, beside `cudagraph bench chain` and
bench/raw/chain.cu: k tiny in-place kernels on 128 floats (x = x*0.999 + 0.001, one kernel each
as `x.lerp_(ones, 0.001)`), launched one by one (eager) and as one captured CUDA graph, measured
the same way (iterations = launches / k, at least 100, back to back, one synchronisation; the
median of `--repeats` samples). PyTorch has no programmatic dependent launch, so it has no PDL
column.

usage: python3 bench/pytorch_chain.py [--kernels 1,10,100,1000] [--launches 100000] [--repeats 7] > pytorch-chain.json
"""
import argparse
import json

import torch

import torch_timing

p = argparse.ArgumentParser()
p.add_argument("--kernels", default="1,10,100,1000")
p.add_argument("--launches", type=int, default=100_000)
p.add_argument("--repeats", type=int, default=7)
args = p.parse_args()
dev = torch.device("cuda")
x = torch.zeros(128, device=dev)
one = torch.ones(128, device=dev)


def chain(k):
    for _ in range(k):
        x.lerp_(one, 0.001)


def time_us(body, iters):
    return torch_timing.time_us(body, iters, args.repeats, warmup=1)


rows = []
for k in [int(v) for v in args.kernels.split(",")]:
    iters = max(args.launches // max(k, 1), 100)
    eager = time_us(lambda: chain(k), iters)
    torch_timing.warm_up_on_side_stream(lambda: chain(k), n=1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(k)
    g.replay()
    graph = time_us(g.replay, iters)
    rows.append(dict(kernels=k, iterations=iters, eager_us_per_kernel=eager / k,
                     graph_us_per_kernel=graph / k))
print(json.dumps(dict(benchmark="chain-pytorch", torch=torch.__version__,
                      device=torch.cuda.get_device_name(), rows=rows), indent=1))
