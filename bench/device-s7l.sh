#!/usr/bin/env bash
# 2026-11-24, seventh session, last call: the GPU suite and the cross-entropy kind beside
# PyTorch on the final code (the gradient scan's full batches unpredicated again). Everything in
# $OUT/s7l.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s7l"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- cross-entropy beside PyTorch ($((SECONDS - t0)) s)"
OUT="$r" SWEEP_ONLY=ce- SWEEP_NAME=sweep-ce timeout 120 bash bench/device-sweep.sh
grep -E '^\| ce-' "$r/sweep-ce.md"
tar -czf "$o/s7l.tar.gz" -C "$o" s7l
echo "done in $((SECONDS - t0)) s"
