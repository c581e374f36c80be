#!/usr/bin/env bash
# 2026-11-23, sixth session, last call: bench/device-s6b.sh (suite, whole sweep, seed bench,
# cache, gemm beside PyTorch) on the final code, then every compute-sanitizer tool over the
# optimizer and NN test binaries (the fused SGD kernel changed after the full sanitizer run).
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
bash bench/device-s6b.sh
echo "--- sanitizers over gpu_optim and gpu_nn"
OUT=/tmp/s6f CLI=0 RACECHECK_TESTS="gpu_optim" TESTS="gpu_optim gpu_nn" JOBS=8 JOB_LIMIT_S=150 timeout 200 bash bench/sanitize.sh > /tmp/s6f-san.txt 2>&1
cat /tmp/s6f/sanitize/summary.txt 2>/dev/null || tail -n 20 /tmp/s6f-san.txt
tar -czf "$o/sanitize-optim-nn.tar.gz" -C /tmp/s6f sanitize 2>/dev/null
