#!/usr/bin/env bash
# 2026-11-24, ninth session, call 9: the GPU suite on the final code (after call 5: a test
# helper shared by the plain and fused cuDNN graph-API replay tests, and the registry keeping a
# remeasured candidate's better measurement whole); gpu_engines and gpu_cudnn_graph once with
# their tests in parallel threads.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9g"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 240 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
export CUDAGRAPH_REQUIRE_GPU=1
for n in gpu_engines gpu_cudnn_graph gpu_soundness; do
  t=$(ls .gpu-bin/tests/$n-* | head -n1)
  CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout 60 $t > "$r/par-$n.log" 2>&1; echo "$n, parallel threads: rc $?"
done
echo "all done ($((SECONDS - t0)) s)"
