#!/usr/bin/env bash
# 2026-11-23, fifth session, issue 9's benchmarks in one call on the final code: the GPU suite,
# `bench chain --pdl` beside raw CUDA (with and without PDL) and PyTorch (bench/device-chain.sh),
# the seed bench with dropout in a graphed training step beside PyTorch, the seed MLP at batch 32
# with PDL off and on, `inspect` of the PDL MLP and of a loop, and the digits training at 1 step
# per launch vs k steps per launch. Each part starts only while time is left. Results in $OUT.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s5f"; mkdir -p "$r"; t0=$SECONDS; b=.gpu-bin/bin/cudagraph; d=$(date -u +%Y-%m-%d)
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
left() { (( SECONDS - t0 < $1 )); }
nvidia-smi -L | tee "$r/device.txt"
timeout 170 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked\|gpu_core.rs:811' | head -8
tail -n 2 "$r/gpu-tests-$d.log"
if left 300; then echo "--- chain ($((SECONDS - t0)) s)"; OUT="$r" timeout 110 bash bench/device-chain.sh | tail -n 14; fi
if left 380; then
  echo "--- seed bench with dropout beside PyTorch ($((SECONDS - t0)) s)"
  ours="$b bench --json"
  timeout 90 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
  PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $d"; echo
    python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
  grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md"
fi
if left 470; then
  echo "--- seed MLP bs 32, PDL off/on; inspect ($((SECONDS - t0)) s)"
  for p in 0 1; do CUDAGRAPH_PDL=$p timeout 20 $b bench --only mlp --batch-sizes 1,32 2>&1 | tail -n 2 | sed "s/^/PDL=$p: /"; done | tee "$r/mlp-pdl.txt"
  CUDAGRAPH_PDL=1 timeout 20 $b inspect mlp --dot "$r/mlp-pdl.dot" > "$r/inspect-mlp-pdl.txt" 2>&1; grep -iE "programmatic|edges|nodes" "$r/inspect-mlp-pdl.txt" | head -4
  timeout 20 $b inspect loop --dot "$r/loop.dot" > "$r/inspect-loop.txt" 2>&1; grep -iE "while|if|conditional" "$r/inspect-loop.txt" | head -4
fi
echo "--- digits training, steps per launch ($((SECONDS - t0)) s)"
for model in mlp cnn; do
  for args in "--graph" "--steps-per-launch 1" "--steps-per-launch 22"; do
    left 560 || break
    echo "-- train --model $model $args"
    timeout 30 $b train --model $model $args > "$r/train-$model-${args// /_}.log" 2>&1
    grep -E "steps in|test accuracy|throughput" "$r/train-$model-${args// /_}.log"
  done
done
if left 570; then echo "-- train --model mlp --steps-per-launch 22, PDL"; CUDAGRAPH_PDL=1 timeout 20 $b train --model mlp --steps-per-launch 22 2>&1 | grep -E "steps in|throughput"; fi
tar -czf "$o/s5f.tar.gz" -C "$o" s5f
echo "done in $((SECONDS - t0)) s"
