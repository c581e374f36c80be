#!/usr/bin/env bash
# 2026-11-24, ninth session, call 6 (final code, as call 5): a second round of the whole sweep,
# kinds alternating (merged with call 5's round, each point keeping its faster run on both
# sides); `bench cache`; gpu_engines and gpu_cudnn_graph with their tests in parallel threads.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9f"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
ROUNDS=1 OUT="$r" timeout 300 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
timeout 70 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
export CUDAGRAPH_REQUIRE_GPU=1
for n in gpu_engines gpu_cudnn_graph; do
  t=$(ls .gpu-bin/tests/$n-* | head -n1); fails=0
  for i in 1 2; do
    [ $((SECONDS - t0)) -gt 500 ] && break
    CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout 60 $t > "$r/par-$n-$i.log" 2>&1 || fails=$((fails + 1))
  done
  echo "$n, parallel threads: $fails failed ($((SECONDS - t0)) s)"
done
echo "all done ($((SECONDS - t0)) s)"
