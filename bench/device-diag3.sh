#!/usr/bin/env bash
# One device call (under 10 minutes), third of the 2026-11-23 third session: the GPU suite, then
# bench/sanitize.sh over every test binary and CLI path (eager module loading, CUDAGRAPH_TEST_QUICK)
# with one experiment beside it (synccheck of gpu_steps with our tiled GEMM instead of cuBLAS).
# Everything lands in $OUT/diag3.tar.gz. Needs .gpu-bin/.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/diag3"; mkdir -p "$r/san"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED' "$r/gpu-tests-$d.log" | head -10
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- suite done ($((SECONDS - t0)) s)"
steps=$(ls .gpu-bin/tests/gpu_steps-*)
( CUDAGRAPH_REQUIRE_GPU=1 CUDA_MODULE_LOADING=EAGER CUDAGRAPH_GEMM=tiled timeout 200 compute-sanitizer --tool synccheck --print-limit 20 $steps --test-threads=1 > "$r/san/sync-steps-tiled.log" 2>&1; echo $? > "$r/san/sync-steps-tiled.rc" ) &
left=$((560 - (SECONDS - t0)))
OUT="$r" JOBS=${SANITIZE_JOBS:-10} JOB_LIMIT_S=$((left - 40)) timeout $((left - 10)) bash bench/sanitize.sh > "$r/sanitize.txt" 2>&1
grep -q "^sanitize initcheck" "$r/sanitize.txt" || OUT="$r" SUMMARY_ONLY=1 bash bench/sanitize.sh >> "$r/sanitize.txt" 2>&1
wait
grep -E "^sanitize|^  " "$r/sanitize.txt" | tail -n 30
echo "sync-steps-tiled rc=$(cat "$r/san/sync-steps-tiled.rc") $(grep -E 'ERROR SUMMARY|^test result' "$r/san/sync-steps-tiled.log" | tr '\n' ' ')"
tar -czf "$o/diag3.tar.gz" -C "$o" diag3
echo "done in $((SECONDS - t0)) s"
