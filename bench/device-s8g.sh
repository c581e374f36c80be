#!/usr/bin/env bash
# 2026-11-24, eighth session, call 8: how often the product engine tests fail, and under what:
# gpu_engines eight times as it runs in the suite (tests in parallel threads), the graph test
# of one stream alone eight times, gpu_engines eight times one test at a time, and eight times
# with CUDA_MODULE_LOADING=EAGER. Logs of failing runs in $OUT/s8g/.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8g"; mkdir -p "$r"
export CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
t=$(ls .gpu-bin/tests/gpu_engines-* | head -n1)
run() {  # label, then the command's arguments
  local label=$1; shift; local fails=0
  for i in $(seq 8); do
    if ! timeout 120 "$@" > "$r/$label-$i.log" 2>&1; then fails=$((fails + 1)); else rm -f "$r/$label-$i.log"; fi
  done
  echo "$label: $fails of 8 failed"
}
run parallel $t
run alone $t --exact library_graphs_of_one_stream_replay_at_once_on_two
run serial $t --test-threads=1
run eager-loading env CUDA_MODULE_LOADING=EAGER $t
grep -h -E "panicked at|capturing|Segmentation|signal" "$r"/*.log 2>/dev/null | sort | uniq -c | head -20
