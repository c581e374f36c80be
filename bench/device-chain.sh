#!/usr/bin/env bash
# On the GPU machine: our chain benchmark, the raw CUDA C++ baseline and PyTorch's graphs, in one run, written to
# $OUT (or bench/results/ when OUT is unset). Needs .gpu-bin/bin/cudagraph (../shared/tools/gpu-bundle).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%d)
nvcc -O3 -arch=sm_90 bench/raw/chain.cu -o /tmp/raw_chain || exit 1
cmd=".gpu-bin/bin/cudagraph bench chain --pdl --json"
$cmd > "$out/chain-ours.json" || exit 1
/tmp/raw_chain 100000 7 > "$out/chain-raw.json" || exit 1
python3 bench/pytorch_chain.py > "$out/chain-pytorch.json" || exit 1
{
  echo "# bench chain — $stamp"
  echo
  python3 bench/chain_compare.py "$out/chain-ours.json" "$out/chain-raw.json" "$cmd; nvcc -O3 -arch=sm_90 bench/raw/chain.cu && ./raw_chain 100000 7; python3 bench/pytorch_chain.py" "$out/chain-pytorch.json"
} > "$out/chain-$stamp.md"
cat "$out/chain-$stamp.md"
