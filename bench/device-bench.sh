#!/usr/bin/env bash
# On the GPU machine: `cudagraph bench` and the PyTorch baseline in one run, side-by-side table
# into $OUT (or bench/results/). Needs .gpu-bin/bin/cudagraph (../shared/tools/gpu-bundle).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%d)
ours=".gpu-bin/bin/cudagraph bench --json --svg $out/bench-$stamp.svg"
$ours > "$out/bench-ours.json" || exit 1
PYTHONUNBUFFERED=1 python3 bench/pytorch_baseline.py > "$out/bench-pytorch.json" || exit 1
{
  echo "# cudagraph bench vs PyTorch — $stamp"
  echo
  python3 bench/compare.py "$out/bench-ours.json" "$out/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"
} > "$out/bench-$stamp.md"
echo
echo "## Graph cache at random batch sizes (cudagraph bench cache; PyTorch's dict-of-graphs is in the notes above)"
.gpu-bin/bin/cudagraph bench cache 2>&1 | tee "$out/cache-$stamp.txt"
echo
echo "## Rebind vs copy-in vs re-capture (cudagraph bench rebind)"
.gpu-bin/bin/cudagraph bench rebind 2>&1 | tee "$out/rebind-$stamp.txt"
echo
echo "## The same with cuBLAS for every product (CUDAGRAPH_GEMM=cublas), for comparison"
CUDAGRAPH_GEMM=cublas .gpu-bin/bin/cudagraph bench --only mlp,train 2>&1 | tee "$out/bench-cublas-$stamp.txt"
cat "$out/bench-$stamp.md"
