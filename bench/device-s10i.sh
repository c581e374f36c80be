#!/usr/bin/env bash
# 2026-11-24, tenth session, call 12 (final code): compute-sanitizer over the mapped host-copy
# kernel's tests (gpu_core: static graph copies of every length, static graph against eager).
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10i"; mkdir -p "$r"; t0=$SECONDS
t=$(ls .gpu-bin/tests/gpu_core-* | head -n1)
for tool in memcheck racecheck synccheck initcheck; do
  CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_CACHE_DIR=/tmp/cg-san timeout 150 \
    compute-sanitizer --tool $tool --error-exitcode 9 "$t" --test-threads=1 static_graph \
    > "$r/sanitize-$tool.log" 2>&1; rc=$?
  echo "$tool: rc $rc; $(grep -E 'SUMMARY' "$r/sanitize-$tool.log" | tail -n1); $(grep -E '^test result' "$r/sanitize-$tool.log")"
done
echo "all done ($((SECONDS - t0)) s)"
