#!/usr/bin/env bash
# On the GPU machine, in one call: the GPU tests of conditional nodes, PDL, random numbers and
# device-side steps (then the whole suite), `bench chain` with and without --pdl beside the raw
# CUDA baseline (with and without PDL) and PyTorch's graphs, dropout in a graphed training step
# beside PyTorch's, the seed MLP at batch 32 with and without PDL for the NN kernels, and the
# digits training at 1 step per launch vs k steps per launch.
# Needs .gpu-bin/ (../shared/tools/gpu-bundle) and nvcc. Results go to $OUT (default /tmp/out).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%d)
bin=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$out/device.txt"
echo "== GPU tests: conditional nodes, PDL, generator, dropout, device-side steps"
for t in gpu_graphfeat gpu_rng gpu_steps; do
  f=$(ls .gpu-bin/tests/${t}-* 2>/dev/null | head -n1)
  [ -n "$f" ] || { echo "missing test binary $t"; continue; }
  CUDAGRAPH_REQUIRE_GPU=1 "$f" --test-threads=1 2>&1 | tee "$out/test-$t.log" | grep -E "^test |test result"
done
echo "== whole GPU suite"
bash .gpu-bin/run-tests.sh > "$out/gpu-tests-$stamp.log" 2>&1
tail -n 2 "$out/gpu-tests-$stamp.log"
echo "== bench chain (ours, with --pdl) beside raw CUDA (with PDL)"
OUT="$out" bash bench/device-chain.sh > "$out/chain.log" 2>&1 || { echo "chain bench failed:"; tail -n 20 "$out/chain.log"; }
cat "$out/chain-$stamp.md" 2>/dev/null
$bin bench chain --pdl 2>&1 | tee "$out/chain-pdl-table.txt"
echo "== dropout in a graphed training step and one dropout op, ours beside PyTorch"
$bin bench --only dropout --json > "$out/dropout-ours.json" 2> "$out/dropout-ours.log"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/pytorch_baseline.py > "$out/bench-pytorch.json" 2> "$out/bench-pytorch.log"
python3 bench/compare.py "$out/dropout-ours.json" "$out/bench-pytorch.json" "$bin bench --only dropout --json; python3 bench/pytorch_baseline.py" > "$out/dropout-$stamp.md"
grep -E '^\| dropout' "$out/dropout-$stamp.md"
echo "== seed MLP inference at batch 32: NN kernels plain vs PDL"
CUDAGRAPH_PDL=0 $bin bench --only mlp --batch-sizes 32 2>&1 | tee "$out/mlp32-plain.txt"
CUDAGRAPH_PDL=1 $bin bench --only mlp --batch-sizes 32 2>&1 | tee "$out/mlp32-pdl.txt"
CUDAGRAPH_PDL=1 $bin inspect mlp --dot "$out/mlp-pdl.dot" 2>&1 | tee "$out/inspect-mlp-pdl.txt"
$bin inspect loop --dot "$out/loop.dot" 2>&1 | tee "$out/inspect-loop.txt"
echo "== digits training: 1 step per launch vs k steps per launch (MLP and CNN)"
for model in mlp cnn; do
  for args in "--graph" "--steps-per-launch 1" "--steps-per-launch 8" "--steps-per-launch 22"; do
    echo "-- train --model $model $args"
    $bin train --model $model $args > "$out/train-$model-${args// /_}.log" 2>&1
    grep -E "steps in|test accuracy|throughput" "$out/train-$model-${args// /_}.log"
  done
  echo "-- train --model $model --steps-per-launch 22 with PDL"
  CUDAGRAPH_PDL=1 $bin train --model $model --steps-per-launch 22 2>&1 | grep -E "steps in|test accuracy|throughput"
done
echo "-- train --model mlp --graph --skip-nonfinite"
$bin train --model mlp --graph --skip-nonfinite 2>&1 | grep -E "steps in|test accuracy|throughput"
