#!/usr/bin/env python3
"""PyTorch DistributedDataParallel (NCCL) doing the work of `cudagraph bench ddp`, measured the
same way (see crates/cudagraph-cli/src/bench/ddp.rs): one process per GPU
(torch.multiprocessing), fp32 with TF32 off, the same models, batch sizes, loss and optimizer,
each rank its own data; median over `--repeats` samples of back-to-back steps, every sample
starting with a barrier and ending with a synchronisation.

- linear: Linear(1024, 1024), MSE (sum), SGD, batch 64 per GPU.
- mlp: 8 x Linear(4096, 4096) with ReLU between, MSE (mean), SGD, batch 512 per GPU.

Eager: the usual DDP step (default 25 MB buckets, all-reduce overlapped with backward).
Graph: the whole step (forward, backward with DDP's all-reduces, SGD) in one torch.cuda.graph,
set up as PyTorch's CUDA Graphs notes require for DDP: async error handling off, DDP built on a
side stream, at least 11 eager DDP iterations before capture.

usage: python3 bench/pytorch_ddp.py [--nprocs 1,2] [--iters 500] [--repeats 5] > pytorch-ddp.json
"""
import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

# Before torch initialises NCCL: capture needs DDP's async error handling off (the watchdog
# would query events recorded during capture); NVLink SHARP stays off on this machine.
os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
os.environ["NCCL_ASYNC_ERROR_HANDLING"] = "0"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def build(name):
    if name == "linear":
        return torch.nn.Linear(1024, 1024), 64, 1024, 1024, torch.nn.MSELoss(reduction="sum")
    if name == "mlp":
        layers = []
        for i in range(8):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(4096, 4096))
        return torch.nn.Sequential(*layers), 512, 4096, 4096, torch.nn.MSELoss(reduction="mean")
    raise SystemExit(f"unknown model {name}")


def worker(rank, world, port, args, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    token = torch.zeros(1, device=dev)

    def time_us(body, iters):
        samples = []
        for _ in range(args.repeats):
            dist.all_reduce(token)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                body()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t) * 1e6 / iters)
        return statistics.median(samples)

    rows, notes = [], []
    for name in args.models.split(","):
        torch.manual_seed(1)
        model, batch, din, dout, loss_fn = build(name)
        model = model.to(dev)
        g = torch.Generator(device=dev).manual_seed(100 + rank)
        x = torch.randn(batch, din, device=dev, generator=g)
        y = torch.randn(batch, dout, device=dev, generator=g)
        iters = max(args.iters // 20, 10) if name == "mlp" else args.iters
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ddp = DDP(model, device_ids=[rank])
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

            def step():
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp(x), y).backward()
                opt.step()

            for _ in range(12):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        eager = time_us(step, iters)
        graph_us, capture_ms = None, None
        try:
            graph = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.graph(graph):
                loss_fn(ddp(x), y).backward()
                opt.step()
            capture_ms = (time.perf_counter() - t) * 1e3
            graph_us = time_us(graph.replay, iters)
        except Exception as e:  # keep the eager number; say why the graph is missing
            notes.append(f"{name} x{world}: graph capture failed: {e!r}")
            if rank == 0:
                traceback.print_exc(file=sys.stderr)
        per_s = lambda us: world * batch / us * 1e6 if us else None  # noqa: E731
        rows.append(dict(model=name, gpus=world, batch_per_gpu=batch,
                         params=sum(p.numel() for p in model.parameters()),
                         eager_us=eager, graph_us=graph_us,
                         eager_samples_per_s=per_s(eager), graph_samples_per_s=per_s(graph_us),
                         capture_ms=capture_ms))
        del ddp, opt, model
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(rows=rows, notes=notes), f)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="linear,mlp")
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    available = torch.cuda.device_count()
    rows, notes = [], []
    for world in [int(n) for n in args.nprocs.split(",")]:
        if world > available:
            notes.append(f"{world} GPU(s): skipped, this machine has {available}")
            continue
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        mp.spawn(worker, args=(world, free_port(), args, path), nprocs=world, join=True)
        with open(path) as f:
            r = json.load(f)
        os.unlink(path)
        rows += r["rows"]
        notes += r["notes"]
    print(json.dumps(dict(benchmark="pytorch-ddp", torch=torch.__version__,
                          nccl=".".join(map(str, torch.cuda.nccl.version())),
                          device=torch.cuda.get_device_name(0), iters=args.iters,
                          repeats=args.repeats, rows=rows, notes=notes), indent=1))


if __name__ == "__main__":
    main()
