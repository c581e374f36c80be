#!/usr/bin/env bash
# One short device call (about 4 minutes), last of the 2026-11-23 third session: the GPU suite,
# `bench cache` (the graph cache's per-path choice), the whole shape sweep beside PyTorch, and the
# seed MLP at batch 32 with and without PDL. Everything lands in $OUT/final.tar.gz.
# Needs .gpu-bin/ and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/final"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 150 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED' "$r/gpu-tests-$d.log" | head -10
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- bench cache ($((SECONDS - t0)) s)"
timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
echo "--- sweep beside PyTorch ($((SECONDS - t0)) s)"
OUT="$r" timeout 120 bash bench/device-sweep.sh
echo "--- seed MLP at batch 32, NN kernels plain vs PDL ($((SECONDS - t0)) s)"
for p in 0 1; do CUDAGRAPH_PDL=$p timeout 20 $b bench --only mlp --batch-sizes 32 2>&1 | tail -n 6 | sed "s/^/PDL=$p: /"; done | tee "$r/mlp32-pdl.txt"
tar -czf "$o/final.tar.gz" -C "$o" final
echo "done in $((SECONDS - t0)) s"
