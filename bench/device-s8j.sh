#!/usr/bin/env bash
# 2026-11-24, eighth session, call 11: `Device::open` returns the device already open (one
# allocator per context). The GPU suite (one test at a time, as always); gpu_engines eight
# times with its tests in parallel threads (6 of 8 runs failed in call 8, 3 of 8 with the
# seventh session's code in call 9); then every test binary once with parallel threads.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8j"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 220 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
export CUDAGRAPH_REQUIRE_GPU=1
t=$(ls .gpu-bin/tests/gpu_engines-* | head -n1); fails=0
for i in $(seq 8); do
  timeout 120 $t > "$r/engines-parallel-$i.log" 2>&1 || { fails=$((fails + 1)); grep -E "panicked|source:" "$r/engines-parallel-$i.log" | head -3; continue; }
  rm -f "$r/engines-parallel-$i.log"
done
echo "gpu_engines, parallel threads: $fails of 8 runs failed ($((SECONDS - t0)) s)"
for b in .gpu-bin/tests/*; do
  n=$(basename $b)
  timeout 200 $b --skip twenty_times > "$r/parallel-$n.log" 2>&1; rc=$?
  echo "$n (parallel threads): rc $rc $(grep -E '^test result' "$r/parallel-$n.log" | tail -n1)"
done 2>&1 | grep -v "rc 0 " | head -30
echo "done in $((SECONDS - t0)) s"
