#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 5 (final code): the GPU suite; sweep round two (all
# kinds, sides alternating; merged with call 4's round by bench/sweep_merge.py --rounds 2);
# `bench cache` (timed: call 4's was cut at 60 s).
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11d"; mkdir -p "$r"; t0=$SECONDS
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=1 OUT="$r" timeout 270 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
t1=$SECONDS
timeout 170 $b bench cache > "$r/cache-$d.txt" 2>&1; echo "cache: rc $? in $((SECONDS - t1)) s"
head -n 8 "$r/cache-$d.txt"
cd "$o" && tar czf s11d.tgz s11d
echo "all done ($((SECONDS - t0)) s)"
