#!/usr/bin/env bash
# A last short device call of the 2026-11-23 third session (about 2 minutes): the GPU suite and
# the convolution part of the shape sweep beside PyTorch (a deeper split-K candidate for
# long-K products). Everything lands in $OUT/final2.tar.gz. Needs .gpu-bin/ and python3 + torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/final2"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 75 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED' "$r/gpu-tests-$d.log" | head -10
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- conv sweep beside PyTorch ($((SECONDS - t0)) s)"
OUT="$r" SWEEP_ONLY=conv- SWEEP_NAME=sweep-conv timeout 55 bash bench/device-sweep.sh
tar -czf "$o/final2.tar.gz" -C "$o" final2
echo "done in $((SECONDS - t0)) s"
