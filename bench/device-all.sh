#!/usr/bin/env bash
# Everything for one device session, in two calls of under 10 minutes each (PART=1, PART=2; no
# PART runs both). Results go to $OUT/results/ (packed into $OUT/results-partN.tar.gz); the
# summary lines are printed. Needs .gpu-bin/ (../shared/tools/gpu-bundle), python3 with torch.
#   PART=1: the GPU test suite; compute-sanitizer (memcheck with leak check, racecheck,
#           synccheck, initcheck over every test binary and the CLI's main paths:
#           bench/sanitize.sh); the soak when SOAK=1 (10^6 training replays and graph-cache
#           requests, memory flat).
#   PART=2: `cudagraph bench` beside PyTorch (the seed rows), the shape sweep beside PyTorch
#           (SWEEP_ONLY=ce,... limits it), `bench chain` (with PDL) beside raw CUDA, `bench cache`,
#           `bench serve`, training on the digits (1 step per launch vs k).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
res="$OUT/results"; mkdir -p "$res"
stamp=$(date -u +%Y-%m-%d)
bin=.gpu-bin/bin/cudagraph
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
part=${PART:-all}
nvidia-smi -L | tee "$res/device.txt"
if [ "$part" = 1 ] || [ "$part" = all ]; then
  timeout 240 bash .gpu-bin/run-tests.sh > "$res/gpu-tests-$stamp.log" 2>&1
  grep -E '^test .*FAILED' "$res/gpu-tests-$stamp.log" | head -20
  tail -n 2 "$res/gpu-tests-$stamp.log"
  # All four tools over every test binary and the CLI's main paths, 8 jobs at a time.
  OUT="$res" JOBS=${SANITIZE_JOBS:-8} JOB_LIMIT_S=${SANITIZE_LIMIT_S:-400} timeout 470 bash bench/sanitize.sh 2>&1 | tail -n 12
  [ "${SOAK:-0}" = 1 ] && timeout 150 $bin bench soak > "$res/soak-$stamp.txt" 2>&1; echo "soak rc $?"; tail -n 3 "$res/soak-$stamp.txt"
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
  ours="$bin bench --json --svg $res/bench-$stamp.svg"
  timeout 120 $ours > "$res/bench-ours.json" 2> "$res/bench-ours.log"
  PYTHONUNBUFFERED=1 timeout 120 python3 bench/pytorch_baseline.py > "$res/bench-pytorch.json" 2> "$res/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $stamp"; echo
    python3 bench/compare.py "$res/bench-ours.json" "$res/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$res/bench-$stamp.md"
  grep -E '^\| (mlp|linear|shared)' "$res/bench-$stamp.md"
  # SWEEP_ONLY (if set) passes through to device-sweep.sh.
  OUT="$res" timeout 420 bash bench/device-sweep.sh
  timeout 60 $bin bench cache > "$res/cache-$stamp.txt" 2>&1; grep -iE 'us/request|eager|staged' "$res/cache-$stamp.txt" | head -8
  timeout 90 $bin bench serve --clients 64 --min-rows 1 --max-rows 256 --duration-s 15 > "$res/serve-$stamp.md" 2>&1; tail -n 6 "$res/serve-$stamp.md"
fi
tar -czf "$OUT/results-part$part.tar.gz" -C "$OUT" results
