#!/usr/bin/env bash
# 2026-11-24, ninth session, call 1: the context's capture gate (context-wide synchronisations
# and releases never overlap a capture of the context, from any thread or Device handle). The
# GPU suite; gpu_engines eight times with its tests in parallel threads (1–3 of 8 failed with
# the eighth session's final code); every other test binary once in parallel threads.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9a"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
export CUDAGRAPH_REQUIRE_GPU=1
par() { # name runs timeout
  local t=$(ls .gpu-bin/tests/$1-* | head -n1) fails=0 segv=0 i rc
  for i in $(seq $2); do
    [ $((SECONDS - t0)) -gt 540 ] && { echo "$1: stopped after $((i - 1)) runs (time)"; break; }
    CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout $3 $t > "$r/$1-parallel-$i.log" 2>&1; rc=$?
    if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/$1-parallel-$i.log"; fi
  done
  echo "$1, parallel threads: $fails of $2 runs failed ($segv segfaults) ($((SECONDS - t0)) s)"
}
par gpu_engines 8 120
for b in $(ls .gpu-bin/tests/ | sed -E 's/-[0-9a-f]+$//' | sort -u | grep '^gpu_' | grep -v '^gpu_engines$'); do par $b 1 120; done
grep -h -E "source:|panicked at" "$r"/*-parallel-*.log 2>/dev/null | sed -E 's/.*source: //' | cut -c1-160 | sort | uniq -c | head -20
