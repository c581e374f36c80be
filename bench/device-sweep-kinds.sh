#!/usr/bin/env bash
# On the GPU machine: the shape sweep with ours and PyTorch alternating kind by kind (Linear,
# conv, cross-entropy, MLP, CNN, optimizers; which side goes first alternates too), so that
# both sides of a point run minutes apart at most under the same load and clocks — in one run
# of bench/device-sweep.sh the heaviest points of one side ran after a minute of load the
# other side never had. Joined into $OUT/$SWEEP_NAME-<date>.md and $OUT/$SWEEP_NAME.md
# (default bench/results/, name "sweep"). Needs .gpu-bin/bin/cudagraph and python3 with torch.
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%d)
name=${SWEEP_NAME:-sweep}
parts=$(mktemp -d)
ours=".gpu-bin/bin/cudagraph bench sweep --json"
theirs="python3 bench/pytorch_sweep.py"
# ROUNDS=R runs every kind R times per side; each point keeps its faster run on both sides
# (sweep_merge.py --rounds). KINDS="linear- conv-" runs only those kinds.
rounds=${ROUNDS:-1}
i=0
for round in $(seq "$rounds"); do
for kind in ${KINDS:-linear- conv- ce- mlp- cnn- opt-}; do
  run_ours() { $ours --only $kind > "$parts/ours-$i.json" 2>> "$out/$name-ours-$stamp.log" || { tail -n 20 "$out/$name-ours-$stamp.log"; exit 1; }; }
  run_theirs() { PYTHONUNBUFFERED=1 $theirs --only $kind > "$parts/pytorch-$i.json" 2>> "$out/$name-pytorch-$stamp.log" || { tail -n 20 "$out/$name-pytorch-$stamp.log"; exit 1; }; }
  if (( (i + round) % 2 == 0 )); then run_ours; run_theirs; else run_theirs; run_ours; fi
  i=$((i + 1))
done
done
python3 bench/sweep_merge.py --rounds "$rounds" $(ls "$parts"/ours-*.json | sort -V) > "$out/$name-ours-$stamp.json"
python3 bench/sweep_merge.py --rounds "$rounds" $(ls "$parts"/pytorch-*.json | sort -V) > "$out/$name-pytorch-$stamp.json"
python3 bench/sweep_compare.py "$out/$name-ours-$stamp.json" "$out/$name-pytorch-$stamp.json" \
  "ROUNDS=$rounds KINDS='${KINDS:-all}' bash bench/device-sweep-kinds.sh (per kind: $ours --only KIND; $theirs --only KIND)" > "$out/$name-$stamp.md"
cp "$out/$name-$stamp.md" "$out/$name.md"
rm -rf "$parts"
grep -E '^\*\*|^Per kind' "$out/$name.md"
