#!/usr/bin/env bash
# 2026-11-24, eighth session, call 13 and 14: the registry's timing graphs captured into a pool kept
# with the device (a dropped timing graph releases nothing). The GPU suite; gpu_engines eight
# times with its tests in parallel threads (6 of 8 failed before, 0 of 8 without graph timing).
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8l"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 220 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
export CUDAGRAPH_REQUIRE_GPU=1
t=$(ls .gpu-bin/tests/gpu_engines-* | head -n1); fails=0; segv=0
for i in $(seq 8); do
  CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout 120 $t > "$r/engines-parallel-$i.log" 2>&1; rc=$?
  if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/engines-parallel-$i.log"; fi
done 2>/dev/null
echo "gpu_engines, parallel threads: $fails of 8 runs failed ($segv segfaults) ($((SECONDS - t0)) s)"
grep -h -E "source:" "$r"/engines-parallel-*.log 2>/dev/null | sed -E 's/.*source: //' | cut -c1-160 | sort | uniq -c | head
