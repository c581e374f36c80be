#!/usr/bin/env bash
# 2026-11-24, ninth session, call 2: the capture gate extended to device drops, module and
# library loading and engines' first calls; cuBLASLt split-K candidates. The GPU suite; the nn
# binaries with their tests in parallel threads (lazy and eager module loading); the two Linear
# points still above PyTorch, ours and PyTorch alternating, three times each.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9b"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
for p in linear-m512-k256-n1024 linear-m128-k256-n4096; do
  for i in 1 2 3; do
    .gpu-bin/bin/cudagraph bench sweep --json --only $p > "$r/ours-$p-$i.json" 2>> "$r/ours.log"
    PYTHONUNBUFFERED=1 python3 bench/pytorch_sweep.py --only $p > "$r/pytorch-$p-$i.json" 2>> "$r/pytorch.log"
  done
done
echo "points done ($((SECONDS - t0)) s)"
.gpu-bin/bin/cudagraph bench sweep --only linear-m512-k256-n1024,linear-m128-k256-n4096 > "$r/sweep-two-points.txt" 2>&1
cp /tmp/cudagraph-cache/engines-*.json "$r/" 2>/dev/null
export CUDAGRAPH_REQUIRE_GPU=1
par() { # name runs timeout [env]
  local t=$(ls .gpu-bin/tests/$1-* | head -n1) fails=0 segv=0 i rc
  for i in $(seq $2); do
    [ $((SECONDS - t0)) -gt 560 ] && { echo "$1 $4: stopped after $((i - 1)) runs (time)"; break; }
    env $4 CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout $3 $t > "$r/$1-parallel$4-$i.log" 2>&1; rc=$?
    if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/$1-parallel$4-$i.log"; fi
  done
  echo "$1 $4, parallel threads: $fails of $2 runs failed ($segv segfaults) ($((SECONDS - t0)) s)"
}
par gpu_engines 6 120 X=1
for b in gpu_nn gpu_optim gpu_soundness_nn gpu_soundness gpu_steps; do par $b 2 120 X=1; done
par gpu_engines 3 120 CUDA_MODULE_LOADING=EAGER
par gpu_optim 2 120 CUDA_MODULE_LOADING=EAGER
grep -h -E "source:|panicked at" "$r"/*-parallel*.log 2>/dev/null | sed -E 's/.*source: //' | cut -c1-160 | sort | uniq -c | head -20
