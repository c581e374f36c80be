#!/usr/bin/env bash
# 2026-11-23, seventh session: the GPU suite; the cross-entropy and conv kinds beside PyTorch;
# ncu kernel durations of the 32 × 10 000 and 64 × 100 cross-entropy forward graphs, ours and
# PyTorch's. Everything in $OUT/s7d.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s7d"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- ce, conv beside PyTorch ($((SECONDS - t0)) s)"
OUT="$r" SWEEP_ONLY=ce-,conv- SWEEP_NAME=ceconv timeout 120 bash bench/device-sweep.sh
grep '⚠' "$r/ceconv.md"
echo "--- ncu ($((SECONDS - t0)) s)"
for p in ce-r32-c10000 ce-r64-c100; do
  timeout 60 ncu --metrics gpu__time_duration.sum --launch-skip 20 --launch-count 12 \
    $b bench sweep --only $p --sample-ms 0.05 --repeats 1 2>&1 | grep -E '^\s+[a-z_0-9]+\(|gpu__time_duration' | head -24 | sed "s/^/ours $p: /"
  timeout 90 ncu --metrics gpu__time_duration.sum --launch-skip 40 --launch-count 12 \
    python3 bench/pytorch_sweep.py --only $p --sample-ms 0.05 --repeats 1 2>&1 | grep -E '^\s+[a-zA-Z_0-9:<>, ]+\(|^  [a-zA-Z].*\(|gpu__time_duration' | head -24 | sed "s/^/pytorch $p: /"
done | tee "$r/ncu.txt"
tar -czf "$o/s7d.tar.gz" -C "$o" s7d
echo "done in $((SECONDS - t0)) s"
