#!/usr/bin/env bash
# On the GPU machine: the shape sweep for both sides in one run, joined into
# $OUT/$SWEEP_NAME-<date>.md and $OUT/$SWEEP_NAME.md (default bench/results/, name "sweep").
# SWEEP_ONLY=ce-,conv- limits both sides to the points whose id contains one of the parts.
# Needs .gpu-bin/bin/cudagraph (../shared/tools/gpu-bundle) and python3 with torch.
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%d)
name=${SWEEP_NAME:-sweep}
only=${SWEEP_ONLY:+--only $SWEEP_ONLY}
ours=".gpu-bin/bin/cudagraph bench sweep --json $only"
theirs="python3 bench/pytorch_sweep.py $only"
$ours > "$out/$name-ours-$stamp.json" 2> "$out/$name-ours-$stamp.log" || { tail -n 20 "$out/$name-ours-$stamp.log"; exit 1; }
PYTHONUNBUFFERED=1 $theirs > "$out/$name-pytorch-$stamp.json" 2> "$out/$name-pytorch-$stamp.log" || { tail -n 20 "$out/$name-pytorch-$stamp.log"; exit 1; }
python3 bench/sweep_compare.py "$out/$name-ours-$stamp.json" "$out/$name-pytorch-$stamp.json" "$ours; $theirs" > "$out/$name-$stamp.md"
cp "$out/$name-$stamp.md" "$out/$name.md"
grep -E '^\*\*|^Per kind' "$out/$name.md"
