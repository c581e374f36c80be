#!/usr/bin/env bash
# 2026-11-23, sixth session, first measuring call: the GPU suite, the whole shape sweep beside
# PyTorch and `bench gemm` (bench/device-s4c.sh with those parts), then which graph of the raw
# WHILE program synccheck reports in (the plain graph's result line is printed before the
# WHILE body runs). Everything lands in $OUT/s4c.tar.gz and $OUT/raw-synccheck.txt.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
PARTS="suite sweep gemm" DEADLINE_S=420 bash bench/device-s4c.sh
echo "--- raw WHILE program under synccheck, first reports in order"
export PATH="$PATH:/usr/local/cuda/bin"
nvcc -O2 -arch=sm_90 -rdc=true -o /tmp/while_sanitize bench/raw/while_sanitize.cu -lcudadevrt -lcuda 2>&1 | tail -n 3
timeout 60 compute-sanitizer --tool synccheck --print-limit 3 /tmp/while_sanitize > "$o/raw-synccheck.txt" 2>&1
grep -vE "Host Frame|^=========\s*$|Saved host" "$o/raw-synccheck.txt" | head -n 24
