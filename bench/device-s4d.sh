#!/usr/bin/env bash
# 2026-11-23, fourth session, sanitizer call over this session's new kernels and soundness
# paths: memcheck (leak check) and initcheck over gpu_core (copy kernel, rebind), gpu_cudnn_graph
# (cuDNN graph API), gpu_engines (few-rows product, small weight gradient, implicit-GEMM reduce),
# gpu_nn (bias gradient in parts) and gpu_optim (cross-entropy's one-kernel mean); racecheck
# over the tests that run those kernels. misuse_* tests (driver errors on purpose) are skipped,
# as in bench/sanitize.sh. All jobs at once, 330 s each; logs and summary in $OUT/s4d.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s4d"; mkdir -p "$r"
export CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1 CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-sanitize-cache
t0=$SECONDS
job() { # tool name binary [libtest filter]
  local tool=$1 name=$2 bin=$3 filt=${4:-}; local extra=""
  [ "$tool" = memcheck ] && extra="--leak-check full"
  ( timeout 330 compute-sanitizer --tool $tool $extra --print-limit 20 .gpu-bin/tests/$bin-* $filt \
      --test-threads=1 --skip misuse_ > "$r/$tool-$name.log" 2>&1; echo $? > "$r/$tool-$name.rc" ) &
}
for b in gpu_core gpu_cudnn_graph gpu_engines gpu_nn gpu_optim; do
  job memcheck $b $b; job initcheck $b $b
done
job racecheck gpu_core gpu_core
job racecheck engines-gemm gpu_engines every_gemm_engine
job racecheck engines-conv gpu_engines every_conv_engine
job racecheck nn-conv gpu_nn "conv channel_sum"
job racecheck optim-ce gpu_optim cross_entropy
wait
for f in "$r"/*.log; do
  n=$(basename "$f" .log)
  echo "$n rc=$(cat "$r/$n.rc") $(grep -E 'ERROR SUMMARY: [0-9]+ errors?$|RACECHECK SUMMARY|LEAK SUMMARY|^test result' "$f" | tr '\n' ' ')"
done | tee "$r/summary.txt"
tar -czf "$o/s4d.tar.gz" -C "$o" s4d
echo "done in $((SECONDS - t0)) s"
