#!/usr/bin/env bash
# Everything for one device session, in one call: GPU tests, the chain benchmark beside raw
# CUDA C++, the workloads beside PyTorch (+ cache, rebind, cuBLAS-only comparison), the GEMM
# table, and eager vs graphed training. Results go to $OUT/results/ and $OUT/results.tar.gz.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
res="$OUT/results"
mkdir -p "$res"
stamp=$(date -u +%Y-%m-%d)
nvidia-smi -L | tee "$res/device.txt"
bash .gpu-bin/run-tests.sh > "$res/gpu-tests-$stamp.log" 2>&1
tail -n 3 "$res/gpu-tests-$stamp.log"
OUT="$res" bash bench/device-chain.sh > /dev/null 2>&1 || echo "chain bench failed"
OUT="$res" bash bench/device-bench.sh > "$res/bench-all-$stamp.log" 2>&1 || echo "workload bench failed"
.gpu-bin/bin/cudagraph bench gemm > "$res/gemm-$stamp.txt" 2>&1
.gpu-bin/bin/cudagraph train > "$res/train-eager-$stamp.log" 2>&1
.gpu-bin/bin/cudagraph train --graph > "$res/train-graph-$stamp.log" 2>&1
.gpu-bin/bin/cudagraph inspect train --dot "$res/train-step.dot" > "$res/inspect-train-$stamp.txt" 2>&1
tail -n 2 "$res/train-eager-$stamp.log" "$res/train-graph-$stamp.log"
tar -C "$OUT" -czf "$OUT/results.tar.gz" results
cat "$res/bench-$stamp.md"
