#!/usr/bin/env bash
# 2026-11-24, eighth session, call 9: which change makes gpu_engines fail when its tests run in
# parallel threads (6 of 8 runs in call 8; the suite runs one test at a time). Each build of the
# test binary eight times with the default test threads: v0-s7 (the seventh session's final
# code), v1-head, v2 (head with the seventh session's blas.rs: cuBLAS workspace per stream
# also in captures), v3 (head, registry timing only the chain graph), v4 (head, six of eight
# cuBLASLt heuristics as before). Logs of failing runs in $OUT/s8h/.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8h"; mkdir -p "$r"
export CUDAGRAPH_REQUIRE_GPU=1
for v in v0-s7 v1-head v2 v3 v4; do
  fails=0; segv=0
  for i in $(seq 8); do
    CUDAGRAPH_CACHE_DIR=/tmp/cg-$v timeout 120 .gpu-bin/bisect/$v > "$r/$v-$i.log" 2>&1; rc=$?
    if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/$v-$i.log"; fi
  done
  echo "$v: $fails of 8 failed ($segv segfaults)"
done
grep -h -E "panicked at|capturing|source:" "$r"/*.log 2>/dev/null | cut -c1-220 | sort | uniq -c | head -20
