#!/usr/bin/env python3
"""Joins several sweep (or seed: `cudagraph bench --json`) JSON files of one side (`cudagraph bench sweep --json` or
bench/pytorch_sweep.py, each run with `--only` on one part of the points) into one, in the
order given: rows concatenated, seconds added, everything else from the first file.

With --rounds R (R >= 1, default 1) the files hold R runs of the same points: each (point,
mode) keeps its fastest run's row (the same rule for both sides), in first-seen order, and the
result records "rounds": R.

usage: sweep_merge.py [--rounds R] PART.json [PART.json ...] > ALL.json
"""
import json
import sys


def main():
    args = sys.argv[1:]
    rounds = 1
    if args[:1] == ["--rounds"] and len(args) >= 2:
        rounds = int(args[1])
        args = args[2:]
    if not args or rounds < 1:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    parts = []
    for path in args:
        with open(path) as f:
            parts.append(json.load(f))
    out = dict(parts[0])
    rows = [r for p in parts for r in p["rows"]]
    if rounds > 1:
        best = {}
        for r in rows:
            key = (r["id"], r["mode"]) if "id" in r else (r["workload"], r["config"])
            t = r.get("graph_us")
            old = best.get(key)
            if old is None or (t is not None and (old.get("graph_us") is None or t < old["graph_us"])):
                best[key] = r
        rows = list(best.values())
        out["rounds"] = rounds
    out["rows"] = rows
    out["seconds"] = sum(p.get("seconds", 0) for p in parts)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
