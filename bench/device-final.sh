#!/usr/bin/env bash
# One short device call: the GPU suite, `bench cache` (the graph cache's per-path choice), the
# shape sweep beside PyTorch, and the seed MLP at batch 32 with and without PDL.
#     bash bench/device-final.sh                                  # all four, about 2 minutes
#     PARTS="suite sweep" SWEEP_ONLY=conv- bash bench/device-final.sh  # suite + conv sweep
# Everything lands in $OUT/final.tar.gz (the device tool returns few files). Needs .gpu-bin/
# (../shared/tools/gpu-bundle) and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/final"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
parts=" ${PARTS:-suite cache sweep pdl} "
nvidia-smi -L | tee "$r/device.txt"
if [[ $parts == *" suite "* ]]; then
  timeout 150 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
  grep -E '^test .*FAILED' "$r/gpu-tests-$d.log" | head -10
  tail -n 2 "$r/gpu-tests-$d.log"
fi
if [[ $parts == *" cache "* ]]; then
  echo "--- bench cache ($((SECONDS - t0)) s)"
  timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
fi
if [[ $parts == *" sweep "* ]]; then
  echo "--- sweep beside PyTorch ($((SECONDS - t0)) s)"
  OUT="$r" SWEEP_ONLY=${SWEEP_ONLY:-} timeout 120 bash bench/device-sweep.sh
fi
if [[ $parts == *" pdl "* ]]; then
  echo "--- seed MLP at batch 32, NN kernels plain vs PDL ($((SECONDS - t0)) s)"
  for p in 0 1; do CUDAGRAPH_PDL=$p timeout 20 $b bench --only mlp --batch-sizes 32 2>&1 | tail -n 6 | sed "s/^/PDL=$p: /"; done | tee "$r/mlp32-pdl.txt"
fi
tar -czf "$o/final.tar.gz" -C "$o" final
echo "done in $((SECONDS - t0)) s"
