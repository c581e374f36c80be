#!/usr/bin/env bash
# 2026-11-23, fifth session, second device call: the GPU suite, `bench gemm`, the seed MLP with
# PDL off and on, the linear and MLP points of the sweep beside PyTorch (parts of
# bench/device-s4c.sh), and ncu kernel times of the seed MLP at batch 32 — with the chunked
# forward kernel (sgemm_nt_chunks). Everything lands in $OUT.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"; t0=$SECONDS; b=.gpu-bin/bin/cudagraph
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
OUT="$o" PARTS="suite gemm pdl sweep" SWEEP_ONLY=linear-,mlp- DEADLINE_S=400 bash bench/device-s4c.sh
echo "--- ncu, seed MLP bs 32 ($((SECONDS - t0)) s)"
timeout 60 ncu --graph-profiling node --clock-control none --cache-control none --metrics gpu__time_duration.sum \
  $b bench --only mlp --batch-sizes 32 --iters 3 --repeats 1 > "$o/ncu-mlp32.txt" 2>&1
grep -E '^  [a-zA-Z_].*\(|gpu__time_duration' "$o/ncu-mlp32.txt" | paste - - | awk '{print $NF"  "$1" "$2" "$3" "$4}' | tail -n 8
echo "done in $((SECONDS - t0)) s"
