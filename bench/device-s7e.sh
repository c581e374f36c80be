#!/usr/bin/env bash
# 2026-11-23/24, seventh session: the GPU suite, then every sanitizer over the test binaries
# whose kernels this session changed or added (gpu_optim: cross-entropy plans and block sums;
# gpu_engines: bias_planes, conv twins, cuBLASLt workspaces; gpu_nn; gpu_cudnn_graph; the
# allocator). Everything in $OUT/s7e.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s7e"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- sanitizers ($((SECONDS - t0)) s)"
OUT="$r" CLI=0 TESTS="gpu_optim gpu_engines gpu_nn gpu_cudnn_graph allocator" JOBS=10 JOB_LIMIT_S=330 \
  timeout 380 bash bench/sanitize.sh 2>&1 | tail -n 12
tar -czf "$o/s7e.tar.gz" -C "$o" s7e
echo "done in $((SECONDS - t0)) s"
