#!/usr/bin/env python3
"""Compares two `cudagraph bench sweep --json` runs of the same points (A = before a change,
B = after it, measured in one device call): per point and mode B µs, A µs and B/A, then the
geometric mean of B/A and the points that moved by more than 3 %.

usage: ab_compare.py A.json B.json [LABEL_A LABEL_B]
"""
import json
import math
import sys


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
    la, lb = (sys.argv[3:5] + ["A", "B"])[:2] if len(sys.argv) >= 5 else ("A", "B")
    ref = {(r["id"], r["mode"]): r.get("graph_us") for r in a["rows"]}
    print(f"| point | mode | {lb} µs | {la} µs | {lb} / {la} |")
    print("|---|---|---:|---:|---:|")
    logs, moved = [], []
    for r in b["rows"]:
        tb, ta = r.get("graph_us"), ref.get((r["id"], r["mode"]))
        if not tb or not ta:
            continue
        q = tb / ta
        logs.append(math.log(q))
        print(f"| {r['id']} | {r['mode']} | {tb:.2f} | {ta:.2f} | {q:.3f} |")
        if abs(q - 1) > 0.03:
            moved.append(f"{r['id']} {r['mode']} {q:.3f}")
    if logs:
        print(f"\nGeometric mean {lb} / {la}: {math.exp(sum(logs) / len(logs)):.3f} over {len(logs)} points.")
    print(f"Moved by more than 3 %: {', '.join(moved) if moved else 'none'}.")


if __name__ == "__main__":
    main()
