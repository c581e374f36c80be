#!/usr/bin/env bash
# One device call (under 10 minutes), first of the 2026-11-23 third session: the GPU suite;
# then compute-sanitizer experiments on gpu_steps and the eight-thread test in parallel
# (correctness only; not beside the suite, whose teardown test measures free memory); then,
# alone on the GPU, the cross-entropy sweep of main's CLI and of the wip CLI (.gpu-bin/wip/,
# built from wip/ce-split-rows-and-barrier-free-gather.patch, since landed on main and removed) beside PyTorch, and the wip
# cross-entropy GPU tests; then initcheck over every test binary if time is left. Everything lands in
# $OUT/diag.tar.gz. Needs .gpu-bin/ (../shared/tools/gpu-bundle) and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/diag"; mkdir -p "$r/san"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 220 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked' "$r/gpu-tests-$d.log" | head -10
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- suite done ($((SECONDS - t0)) s)"
steps=$(ls .gpu-bin/tests/gpu_steps-*); sound=$(ls .gpu-bin/tests/gpu_soundness-*)
san() { # name, env..., -- command
  local name=$1; shift
  ( env CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1 "$@" > "$r/san/$name.log" 2>&1; echo $? > "$r/san/$name.rc" ) &
}
cs="compute-sanitizer --print-limit 20"
san mem-steps CUDAGRAPH_TRACE_SEGMENTS=1 timeout 180 $cs --tool memcheck --leak-check full $steps --test-threads=1
san mem-steps-tiled CUDAGRAPH_GEMM=tiled timeout 180 $cs --tool memcheck $steps --test-threads=1
san mem-ksteps-alone timeout 180 $cs --tool memcheck $steps --test-threads=1 k_steps
san sync-steps timeout 180 $cs --tool synccheck $steps --test-threads=1
san race-steps timeout 180 $cs --tool racecheck $steps --test-threads=1
san init-steps timeout 180 $cs --tool initcheck $steps --test-threads=1
san mem-threads timeout 180 $cs --tool memcheck --leak-check full $sound --test-threads=1 --exact eight_threads_capture_and_replay_at_once_and_match_one_thread
san race-threads timeout 180 $cs --tool racecheck $sound --test-threads=1 --exact eight_threads_capture_and_replay_at_once_and_match_one_thread
wait
echo "--- sanitizer experiments ($((SECONDS - t0)) s)"
for f in "$r"/san/*.log; do
  n=$(basename "$f" .log)
  echo "$n rc=$(cat "$r/san/$n.rc") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$f" | tr '\n' ' ')"
done
echo "--- cross-entropy sweep, main and wip, beside PyTorch ($((SECONDS - t0)) s)"
only="--only ce-"
timeout 100 .gpu-bin/bin/cudagraph bench sweep --json $only > "$r/ce-ours.json" 2> "$r/ce-ours.log"
timeout 100 .gpu-bin/wip/cudagraph bench sweep --json $only > "$r/ce-wip.json" 2> "$r/ce-wip.log"
PYTHONUNBUFFERED=1 timeout 120 python3 bench/pytorch_sweep.py $only > "$r/ce-pytorch.json" 2> "$r/ce-pytorch.log"
for side in ours wip; do
  python3 bench/sweep_compare.py "$r/ce-$side.json" "$r/ce-pytorch.json" \
    ".gpu-bin/${side/ours/bin}/cudagraph bench sweep --json $only; python3 bench/pytorch_sweep.py $only" > "$r/sweep-ce-$side-$d.md"
  echo "[$side]"; grep -E '^\*\*|^Per kind' "$r/sweep-ce-$side-$d.md"
done
CUDAGRAPH_REQUIRE_GPU=1 timeout 60 .gpu-bin/wip/gpu_optim --test-threads=1 cross_entropy > "$r/wip-gpu_optim.log" 2>&1
echo "wip gpu_optim cross_entropy: $(grep -E '^test result' "$r/wip-gpu_optim.log")"
echo "--- initcheck over every test binary ($((SECONDS - t0)) s)"
left=$((575 - (SECONDS - t0)))
if [ $left -gt 60 ]; then
  OUT="$r" TOOLS=initcheck JOBS=10 JOB_LIMIT_S=$((left - 25)) timeout $((left - 5)) bash bench/sanitize.sh > "$r/sanitize-initcheck.txt" 2>&1
  grep -q "^sanitize initcheck" "$r/sanitize-initcheck.txt" || OUT="$r" TOOLS=initcheck SUMMARY_ONLY=1 bash bench/sanitize.sh >> "$r/sanitize-initcheck.txt" 2>&1
  tail -n 3 "$r/sanitize-initcheck.txt"
fi
tar -czf "$o/diag.tar.gz" -C "$o" diag
echo "done in $((SECONDS - t0)) s"
