#!/usr/bin/env bash
# 2026-11-24, ninth session, call 3: the capture gate with per-thread holders (a thread holding
# it may begin a capture itself: call 2's suite hung in gpu_cudnn_graph when an engine's first
# call, run with captures held off, measured a nested product and captured it); engines' runs
# no longer hold it. The GPU suite; the binaries with tests in parallel threads (lazy and eager
# module loading). Stops itself before the device's 600 s limit.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9c"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 250 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
export CUDAGRAPH_REQUIRE_GPU=1
par() { # name runs timeout env
  local t=$(ls .gpu-bin/tests/$1-* | head -n1) fails=0 segv=0 i rc n=0
  for i in $(seq $2); do
    [ $((SECONDS - t0 + $3)) -gt 540 ] && { echo "$1 $4: stopped after $((i - 1)) runs (time)"; break; }
    env $4 CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout $3 $t > "$r/par-$1-$i-$4.log" 2>&1; rc=$?; n=$i
    if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/par-$1-$i-$4.log"; fi
  done
  echo "$1 $4, parallel threads: $fails of $n runs failed ($segv segfaults, rc of last $rc) ($((SECONDS - t0)) s)"
}
par gpu_engines 6 90 LAZY=1
for b in gpu_nn gpu_optim gpu_soundness_nn gpu_soundness gpu_cudnn_graph gpu_steps; do par $b 1 60 LAZY=1; done
par gpu_engines 3 90 CUDA_MODULE_LOADING=EAGER
par gpu_optim 1 60 CUDA_MODULE_LOADING=EAGER
grep -h -E "source:|panicked at" "$r"/par-*.log 2>/dev/null | sed -E 's/.*source: //' | cut -c1-160 | sort | uniq -c | head -20
