#!/usr/bin/env bash
# 2026-11-24, eighth session, call 12 (final code): the GPU suite; then gpu_engines with its
# tests in parallel threads, eight runs each of the final build (v1-head) and of one whose
# registry times every candidate eagerly, without the graphs it captures and drops per
# candidate (v5-no-graph-timing).
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8k"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 220 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
export CUDAGRAPH_REQUIRE_GPU=1
for v in v5-no-graph-timing v1-head; do
  fails=0; segv=0
  for i in $(seq 8); do
    CUDAGRAPH_CACHE_DIR=/tmp/cg-$v timeout 120 .gpu-bin/bisect/$v > "$r/$v-$i.log" 2>&1; rc=$?
    if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/$v-$i.log"; fi
  done
  echo "$v: $fails of 8 failed ($segv segfaults) ($((SECONDS - t0)) s)"
done 2>/dev/null
grep -h -E "source:" "$r"/v*.log 2>/dev/null | sed -E 's/.*source: //' | cut -c1-160 | sort | uniq -c | head
