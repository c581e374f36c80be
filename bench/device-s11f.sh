#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 7 (final code): the GPU suite, then the whole sweep, two
# rounds per side with kinds and sides alternating (bench/device-sweep-kinds.sh), timed with
# the replays-per-sample estimate taken from the fastest of three single replays on both sides.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11f"; mkdir -p "$r"; t0=$SECONDS
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d)
nvidia-smi -L | tee "$r/device.txt"
timeout 150 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=2 OUT="$r" timeout 430 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
cd "$o" && tar czf s11f.tgz s11f
echo "all done ($((SECONDS - t0)) s)"
