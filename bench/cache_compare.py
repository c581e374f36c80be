#!/usr/bin/env python3
"""Side-by-side table of `cudagraph bench cache --json` and bench/pytorch_cache.py: µs per
request for the seed MLP at random batch sizes 1..256, ours (eager and the GraphCache's three
ways of serving) beside PyTorch (eager and seed 002's dict of graphs), then each bucket's
measured choice.

usage: cache_compare.py OURS.json PYTORCH.json > table.md   (PYTORCH.json may be "-": ours only)
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ours = json.load(open(sys.argv[1]))
    pt = json.load(open(sys.argv[2])) if sys.argv[2] != "-" else None
    eager = ours["eager_us_per_request"]
    mb = 2**20
    print(f"Device: {ours['device']['name']} (CUDA {ours['device']['driver_cuda_version']})"
          + (f"; PyTorch {pt['torch']} on {pt['device']}" if pt else "; no PyTorch side")
          + f". {ours['requests']} requests of 1–256 rows (the same sizes on both sides); "
          "µs per request, wall time over all requests after a warm-up of every size.\n")
    print("| side | how | µs/request | vs our eager | graph memory MB |")
    print("|---|---|---:|---:|---:|")
    rows = [
        ("ours", "eager", eager, None),
        ("ours", "GraphCache, staged, graph or eager per bucket by measurement",
         ours["cache_us_per_request"], ours["pool_reserved_bytes"]),
        ("ours", "GraphCache, staged, graphs only", ours["staged_graph_only_us_per_request"],
         ours["pool_reserved_bytes"]),
        ("ours", "GraphCache::run_into (copy in, copy out)", ours["run_into_us_per_request"],
         ours["pool_reserved_bytes"]),
        ("ours", "GraphCache::run (copy in, new output)", ours["run_us_per_request"],
         ours["pool_reserved_bytes"]),
    ]
    if pt:
        rows += [
            ("PyTorch", "eager", pt["eager_us_per_request"], None),
            ("PyTorch", "dict of graphs (sizes "
             + "/".join(str(s) for s in pt["dict_graph_sizes"]) + ", eager otherwise)",
             pt["dict_of_graphs_us_per_request"], pt["graph_memory_bytes"]),
        ]
    for side, how, us, mem in rows:
        memory = f"{mem / mb:.2f}" if mem is not None else "–"
        print(f"| {side} | {how} | {us:.2f} | {eager / us:.2f}× | {memory} |")
    print()
    print(f"Ours: {ours['captured_sizes']} graphs in one pool (peak {ours['pool_peak_bytes'] / mb:.2f} MB, "
          f"largest graph alone {ours['largest_entry_peak_bytes'] / mb:.2f} MB, shared static input "
          f"{ours['static_input_bytes'] / mb:.2f} MB); buckets by graph when staged: "
          f"{ours['buckets_graph']}, eager: {ours['buckets_eager']}; eager for copied-in requests: "
          f"{ours['buckets_copied_eager']}.  ")
    print(f"Cache: {ours['cache_stats']}.  ")
    print(f"Planner, for the request histogram: {ours['plan']}.")
    if pt:
        print(f"\nPyTorch: {pt['requests_graphed']} of {pt['requests']} requests hit an exact-size graph.")
    print("\n| bucket | graph µs | eager µs | copy in µs | staged by | copied-in by | hits |")
    print("|---:|---:|---:|---:|---|---|---:|")
    f = lambda v: "–" if v is None else f"{v:.2f}"
    for b in ours["buckets"]:
        print(f"| {b['size']} | {f(b['graph_us'])} | {f(b['eager_us'])} | {f(b['copy_in_us'])} | "
              f"{b['choice']} | {b['copy_choice']} | {b['hits']} |")


if __name__ == "__main__":
    main()
