#!/usr/bin/env python3
"""Joins several sweep JSON files of one side (`cudagraph bench sweep --json` or
bench/pytorch_sweep.py, each run with `--only` on one part of the points) into one, in the
order given: rows concatenated, seconds added, everything else from the first file.

usage: sweep_merge.py PART.json [PART.json ...] > ALL.json
"""
import json
import sys


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    parts = []
    for path in sys.argv[1:]:
        with open(path) as f:
            parts.append(json.load(f))
    out = dict(parts[0])
    out["rows"] = [r for p in parts for r in p["rows"]]
    out["seconds"] = sum(p.get("seconds", 0) for p in parts)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
