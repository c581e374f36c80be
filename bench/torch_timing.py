"""Timing shared by the PyTorch baselines (bench/pytorch_*.py), measured the way our `bench`
commands measure: warm-up calls, then `repeats` samples of `iters` back-to-back calls ending in
one synchronisation; the median µs per call."""
import statistics
import time

import torch


def time_us(body, iters, repeats, warmup=3):
    for _ in range(warmup):
        body()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            body()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e6 / iters)
    return statistics.median(samples)


def warm_up_on_side_stream(body, n=3):
    """Runs `body` n times on a side stream (what torch.cuda.graph wants before a capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
