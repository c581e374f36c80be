#!/usr/bin/env bash
# One device call (under 10 minutes), second of the 2026-11-23 third session: the GPU suite;
# compute-sanitizer experiments on the conditional-body reports (the same tests with device 0's
# primary context kept for the whole process, CUDAGRAPH_TEST_KEEP_CONTEXT=1, and with eager
# module loading); the cross-entropy sweep beside PyTorch; then bench/sanitize.sh over everything.
# Everything lands in $OUT/diag2.tar.gz. Needs .gpu-bin/ and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/diag2"; mkdir -p "$r/san"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked\|gpu_core.rs:808' | head -10
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- suite done ($((SECONDS - t0)) s)"
steps=$(ls .gpu-bin/tests/gpu_steps-*); feat=$(ls .gpu-bin/tests/gpu_graphfeat-*); core=$(ls .gpu-bin/tests/gpu_core-*)
san() { # name, env..., command
  local name=$1; shift
  ( env CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1 "$@" > "$r/san/$name.log" 2>&1; echo $? > "$r/san/$name.rc" ) &
}
cs="compute-sanitizer --print-limit 20"
keep=CUDAGRAPH_TEST_KEEP_CONTEXT=1
san mem-steps CUDAGRAPH_TRACE_SEGMENTS=1 timeout 150 $cs --tool memcheck $steps --test-threads=1
san mem-steps-keep $keep timeout 150 $cs --tool memcheck --leak-check full $steps --test-threads=1
san sync-steps-keep $keep timeout 150 $cs --tool synccheck $steps --test-threads=1
san race-steps-keep $keep timeout 150 $cs --tool racecheck $steps --test-threads=1
san mem-steps-eager CUDA_MODULE_LOADING=EAGER timeout 150 $cs --tool memcheck $steps --test-threads=1
san sync-steps-eager CUDA_MODULE_LOADING=EAGER timeout 150 $cs --tool synccheck $steps --test-threads=1
san init-feat timeout 150 $cs --tool initcheck $feat --test-threads=1
san init-feat-keep $keep timeout 150 $cs --tool initcheck $feat --test-threads=1
san init-feat-alone timeout 150 $cs --tool initcheck $feat --test-threads=1 --exact programmatic_edges_inside_a_loop_body
san init-core timeout 150 $cs --tool initcheck $core --test-threads=1 --skip misuse_
wait
echo "--- sanitizer experiments ($((SECONDS - t0)) s)"
for f in "$r"/san/*.log; do
  n=$(basename "$f" .log)
  echo "$n rc=$(cat "$r/san/$n.rc") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$f" | tr '\n' ' ')"
done
echo "--- cross-entropy sweep beside PyTorch ($((SECONDS - t0)) s)"
OUT="$r" SWEEP_ONLY=ce- SWEEP_NAME=sweep-ce timeout 150 bash bench/device-sweep.sh
echo "--- bench/sanitize.sh ($((SECONDS - t0)) s)"
left=$((580 - (SECONDS - t0)))
OUT="$r" JOBS=${SANITIZE_JOBS:-10} JOB_LIMIT_S=$((left - 40)) timeout $((left - 10)) bash bench/sanitize.sh > "$r/sanitize.txt" 2>&1
grep -q "^sanitize initcheck" "$r/sanitize.txt" || OUT="$r" SUMMARY_ONLY=1 bash bench/sanitize.sh >> "$r/sanitize.txt" 2>&1
grep -E "^sanitize|^  " "$r/sanitize.txt" | tail -n 30
tar -czf "$o/diag2.tar.gz" -C "$o" diag2
echo "done in $((SECONDS - t0)) s"
