#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 4 (final code): compute-sanitizer (four tools, in
# parallel, quick test sizes) over the column-warp kernels' test (gpu_engines), the copy
# kernel's tests (gpu_core: device copies of every shape, static-graph copies) and the
# cross-entropy tests (gpu_optim); then sweep round one (all kinds, sides alternating) and
# `bench cache`.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11c"; mkdir -p "$r"; t0=$SECONDS
d=$(date -u +%Y-%m-%d); b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
export CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1
run_tool() {
  local tool=$1 bin=$2 filter=$3 t; t=$(ls .gpu-bin/tests/$bin-* | head -n1)
  CUDAGRAPH_CACHE_DIR=/tmp/cg-san-$tool-$bin timeout 170 compute-sanitizer --tool $tool \
    --error-exitcode 9 "$t" --test-threads=1 $filter > "$r/san-$tool-$bin.log" 2>&1
  echo "$tool $bin ($filter): rc $?; $(grep -E 'SUMMARY' "$r/san-$tool-$bin.log" | tail -n1); $(grep -E '^test result' "$r/san-$tool-$bin.log")"
}
for tool in memcheck racecheck synccheck initcheck; do
  run_tool $tool gpu_engines column_warp &
  run_tool $tool gpu_core copies &
  run_tool $tool gpu_optim cross_entropy &
done
wait
echo "sanitizers done ($((SECONDS - t0)) s)"
unset CUDAGRAPH_TEST_QUICK CUDAGRAPH_REQUIRE_GPU
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
ROUNDS=1 OUT="$r" timeout 300 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
cd "$o" && tar czf s11c.tgz s11c
echo "all done ($((SECONDS - t0)) s)"
