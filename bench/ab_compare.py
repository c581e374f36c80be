#!/usr/bin/env python3
"""Compares two runs of the same points measured in one device call, A (before a change, or
one setting) and B (after it, or the other setting): per point B µs, A µs and B/A for the graph
times, then the geometric mean of B/A and the points that moved by more than 3 %. Works on
`cudagraph bench sweep --json` output (points by id and mode) and on `cudagraph bench --json`
output (rows by workload and config).

usage: ab_compare.py A.json B.json [LABEL_A LABEL_B]
"""
import json
import math
import sys


def key(row):
    if "id" in row:
        return (row["id"], row["mode"])
    return (row["workload"], row["config"])


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
    la, lb = (sys.argv[3], sys.argv[4]) if len(sys.argv) >= 5 else ("A", "B")
    ref = {key(r): r.get("graph_us") for r in a["rows"]}
    print(f"| point | mode | {lb} µs | {la} µs | {lb} / {la} |")
    print("|---|---|---:|---:|---:|")
    logs, moved = [], []
    for r in b["rows"]:
        tb, ta = r.get("graph_us"), ref.get(key(r))
        if not tb or not ta or math.isnan(tb) or math.isnan(ta):
            continue
        q = tb / ta
        logs.append(math.log(q))
        name, mode = key(r)
        print(f"| {name} | {mode} | {tb:.2f} | {ta:.2f} | {q:.3f} |")
        if abs(q - 1) > 0.03:
            moved.append(f"{name} {mode} {q:.3f}")
    if logs:
        print(f"\n**Geometric mean {lb} / {la}: {math.exp(sum(logs) / len(logs)):.3f}** over {len(logs)} points.  ")
    print(f"Moved by more than 3 %: {', '.join(moved) if moved else 'none'}.")


if __name__ == "__main__":
    main()
