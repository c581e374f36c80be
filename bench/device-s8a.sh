#!/usr/bin/env bash
# 2026-11-24, eighth session, call 1: the GPU suite; then the Linear, MLP and convolution points
# of the sweep with the registry ranking short candidates by their chain time, by their time as
# a graph of their own, and by the mean of both (CUDAGRAPH_REGISTRY_TIMING=chain|single|both,
# one registry cache each, every side run twice), PyTorch before and after. Everything in
# $OUT/s8a.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8a"; mkdir -p "$r"
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
kinds=linear-,mlp-,conv-
nvidia-smi -L | tee "$r/device.txt"
CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
theirs() { echo "--- pytorch $1 ($((SECONDS - t0)) s)"; PYTHONUNBUFFERED=1 timeout 80 python3 bench/pytorch_sweep.py --only $kinds > "$r/pytorch-$1.json" 2>> "$r/pytorch.log"; }
ours() { echo "--- ours $1 $2 ($((SECONDS - t0)) s)"; CUDAGRAPH_CACHE_DIR=/tmp/cg-$1 CUDAGRAPH_REGISTRY_TIMING=$1 timeout 90 $b bench sweep --json --only $kinds > "$r/ours-$1-$2.json" 2>> "$r/ours.log"; }
theirs 1
for m in chain single both; do ours $m 1; done
theirs 2
for m in both single chain; do ours $m 2; done
for m in chain single both; do cp /tmp/cg-$m/engines-*.json "$r/engines-$m.json" 2>/dev/null; done
tar -czf "$o/s8a.tar.gz" -C "$o" s8a
echo "done in $((SECONDS - t0)) s"
