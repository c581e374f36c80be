#!/usr/bin/env bash
# On the GPU machine: the shape sweep for both sides in one run, joined into $OUT/sweep.md
# (default bench/results/). Needs .gpu-bin/bin/cudagraph (../shared/tools/gpu-bundle) and
# python3 with torch.
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%d)
ours=".gpu-bin/bin/cudagraph bench sweep --json"
theirs="python3 bench/pytorch_sweep.py"
$ours > "$out/sweep-ours-$stamp.json" 2> "$out/sweep-ours-$stamp.log" || { tail -n 20 "$out/sweep-ours-$stamp.log"; exit 1; }
PYTHONUNBUFFERED=1 $theirs > "$out/sweep-pytorch-$stamp.json" 2> "$out/sweep-pytorch-$stamp.log" || { tail -n 20 "$out/sweep-pytorch-$stamp.log"; exit 1; }
python3 bench/sweep_compare.py "$out/sweep-ours-$stamp.json" "$out/sweep-pytorch-$stamp.json" "$ours; $theirs" > "$out/sweep-$stamp.md"
cp "$out/sweep-$stamp.md" "$out/sweep.md"
grep -E '^\*\*|^Per kind' "$out/sweep.md"
