"""Does recording an event after every graph replay cost GPU time? Back-to-back replays of
one-product graphs (the sweep's 512 x 256 -> 1024 and 1 x 1024 -> 256 forward points, F.linear,
fp32) timed plain, with an event recorded on the stream after every replay (what
`Graph::replay` does for its completion tracking), and with the event recorded by a node at
the end of the graph instead (`external=True` capture), alternating, median of 7 samples.

    python3 bench/probe/replay_event.py"""
import statistics
import time

import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"


def graph_of(m, k, n, node_event):
    x = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev)
    b = torch.randn(n, device=dev)
    ev = torch.cuda.Event(external=True) if node_event else None
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        F.linear(x, w, b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        F.linear(x, w, b)
        if ev is not None:
            ev.record()
    return g, (x, w, b, ev)


def per_replay(g, ev, iters):
    torch.cuda.synchronize()
    t = time.perf_counter()
    if ev is None:
        for _ in range(iters):
            g.replay()
    else:
        for _ in range(iters):
            g.replay()
            ev.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / iters


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
for m, k, n in [(512, 256, 1024), (1, 1024, 256), (64, 1024, 1024)]:
    plain, keep = graph_of(m, k, n, False)
    node, keep2 = graph_of(m, k, n, True)
    after = torch.cuda.Event()
    for g in (plain, node):
        g.replay(); g.replay()
    est = per_replay(plain, None, 50)
    iters = max(50, int(100_000 / est))
    res = {"plain": [], "event after": [], "event node": []}
    for _ in range(7):
        res["plain"].append(per_replay(plain, None, iters))
        res["event after"].append(per_replay(plain, after, iters))
        res["event node"].append(per_replay(node, None, iters))
    print(f"{m}x{k}->{n}: " + ", ".join(f"{kk} {statistics.median(v):.3f} us" for kk, v in res.items()), flush=True)
