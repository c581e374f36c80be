#!/usr/bin/env python3
"""PyTorch beside `cudagraph bench cache`: the seed MLP (1024 -> 512 -> 256 -> 10) served at
random batch sizes 1..256 (the same generator and request count as ours), the way seed 002
does it: a dict of graphs for the exact sizes 1, 4, 16 and 32, each in its own pool, and every
other size eagerly. Also the eager model alone on the same requests. fp32, TF32 off; wall time
per request over all requests, after 20 warm-up requests.

usage: python3 bench/pytorch_cache.py [--requests 2000] > pytorch-cache.json
"""
import argparse
import json
import time

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

p = argparse.ArgumentParser()
p.add_argument("--requests", type=int, default=2000)
args = p.parse_args()
dev = torch.device("cuda")
torch.manual_seed(0)


def request_sizes(n):
    """The request sizes of `cudagraph bench cache` (same 64-bit LCG, same seed)."""
    x, out = 42, []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        out.append(1 + ((x >> 33) % 256))
    return out


def seed_mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10)).to(dev)


def per_request_us(serve, sizes, x_all):
    for n in sizes[:20]:
        serve(x_all[:n])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for n in sizes:
        serve(x_all[:n])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / len(sizes)


with torch.no_grad():
    m = seed_mlp().eval()
    x_all = torch.randn(256, 1024, device=dev)
    graph_dict = {}
    before = torch.cuda.memory_reserved()
    for bs in [32, 16, 4, 1]:
        static_input = torch.randn(bs, 1024, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                m(static_input)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            static_output = m(static_input)
        graph_dict[bs] = (g, static_input, static_output)
    dict_mem = torch.cuda.memory_reserved() - before

    def dict_of_graphs(data):
        bs = data.shape[0]
        if bs in graph_dict:
            g, si, so = graph_dict[bs]
            si.copy_(data)
            g.replay()
            return so.clone()
        return m(data)

    sizes = request_sizes(args.requests)
    dict_us = per_request_us(dict_of_graphs, sizes, x_all)
    eager_us = per_request_us(m, sizes, x_all)
    graphed = sum(1 for n in sizes if n in graph_dict)

print(json.dumps(dict(benchmark="cache-pytorch", torch=torch.__version__,
                      device=torch.cuda.get_device_name(), requests=len(sizes),
                      eager_us_per_request=eager_us, dict_of_graphs_us_per_request=dict_us,
                      dict_graph_sizes=sorted(graph_dict), requests_graphed=graphed,
                      graph_memory_bytes=dict_mem), indent=1))
