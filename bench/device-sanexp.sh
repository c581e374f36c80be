#!/usr/bin/env bash
# The conditional-body sanitizer experiment (bench/results/sanitize-2026-11-23.md, runs 14-16):
# memcheck, synccheck and initcheck over gpu_steps and gpu_graphfeat, each with and without
# CUDAGRAPH_TEST_SETTLE=1 (the tests then synchronise the device between their setup and the
# capture of a WHILE body, and between capture and replay: NVIDIA/warp#1406 saw such reports go
# away with that). One process per (tool, binary, setting), all at once; about a minute.
# Logs and a summary in $OUT/sanexp.tar.gz. Needs .gpu-bin/.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/sanexp"; mkdir -p "$r"
export CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
for bin in gpu_steps gpu_graphfeat; do
  t=$(ls .gpu-bin/tests/$bin-* | head -n1)
  for tool in memcheck synccheck initcheck; do
    for settle in 0 1; do
      ( CUDAGRAPH_TEST_SETTLE=$settle timeout 240 compute-sanitizer --tool $tool --print-limit 10 \
          "$t" --test-threads=1 > "$r/$tool-$bin-settle$settle.log" 2>&1
        echo $? > "$r/$tool-$bin-settle$settle.rc" ) &
    done
  done
done
wait
for f in "$r"/*.log; do
  n=$(basename "$f" .log)
  echo "$n rc=$(cat "$r/$n.rc") $(grep -E 'ERROR SUMMARY: [0-9]+ errors?$|^test result' "$f" | tr '\n' ' ')"
done | tee "$r/summary.txt"
tar -czf "$o/sanexp.tar.gz" -C "$o" sanexp
