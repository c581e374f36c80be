#!/usr/bin/env bash
# racecheck over one test binary split by test name into JOBS parallel processes (a whole
# binary such as gpu_nn needs more than the sanitizer job limit under racecheck). On the GPU
# machine after ../shared/tools/gpu-bundle:
#     BIN=gpu_nn JOBS=4 bash bench/racecheck-split.sh
# One summary line per job and a total; logs in $OUT/racecheck (or /tmp/racecheck).
set -uo pipefail
bin=${BIN:-gpu_nn}; jobs=${JOBS:-4}; limit=${JOB_LIMIT_S:-400}
logs=${OUT:-/tmp}/racecheck; mkdir -p "$logs"
t=$(ls .gpu-bin/tests/$bin-* | head -n1)
export CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1
mapfile -t names < <("$t" --list 2>/dev/null | sed -n 's/: test$//p' | grep -v '^misuse_')
echo "$bin: ${#names[@]} tests in $jobs jobs"
for j in $(seq 0 $((jobs - 1))); do
  part=()
  for i in "${!names[@]}"; do (( i % jobs == j )) && part+=("${names[$i]}"); done
  ( CUDAGRAPH_CACHE_DIR=/tmp/cg-race-$j timeout "$limit" compute-sanitizer --tool racecheck \
      --error-exitcode 9 "$t" --test-threads=1 --exact "${part[@]}" > "$logs/$bin-$j.log" 2>&1
    echo "job $j (${#part[@]} tests): rc $?; $(grep -E 'RACECHECK SUMMARY' "$logs/$bin-$j.log" | tail -n1); $(grep -E '^test result' "$logs/$bin-$j.log")" ) &
done
wait
