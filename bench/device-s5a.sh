#!/usr/bin/env bash
# 2026-11-23, fifth session, first device call: the GPU suite, `bench gemm` and the seed MLP
# with PDL off and on (parts of bench/device-s4c.sh, with the cluster split-K kernels), ncu
# kernel times of the seed MLP at batch 32, and the raw-CUDA conditional-body programs under
# every compute-sanitizer tool (bench/raw/while_sanitize.sh). Everything lands in $OUT.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"; t0=$SECONDS; b=.gpu-bin/bin/cudagraph
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
OUT="$o" PARTS="suite gemm pdl" DEADLINE_S=300 bash bench/device-s4c.sh
echo "--- ncu, seed MLP bs 32 ($((SECONDS - t0)) s)"
timeout 60 ncu --graph-profiling node --clock-control none --cache-control none --metrics gpu__time_duration.sum \
  $b bench --only mlp --batch-sizes 32 --iters 3 --repeats 1 > "$o/ncu-mlp32.txt" 2>&1
grep -E '^  [a-zA-Z_].*\(|gpu__time_duration' "$o/ncu-mlp32.txt" | paste - - | awk '{print $NF"  "$1" "$2" "$3" "$4}' | tail -n 8
echo "--- raw conditional bodies under compute-sanitizer ($((SECONDS - t0)) s)"
timeout 200 bash bench/raw/while_sanitize.sh > "$o/raw-while-sanitize.txt" 2>&1
grep -E "^== |SUMMARY|exit code|right results|mismatch|edges" "$o/raw-while-sanitize.txt" | head -80
echo "done in $((SECONDS - t0)) s"
