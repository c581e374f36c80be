#!/usr/bin/env bash
# A development run on the GPU machine: PyTorch fixtures, the whole GPU suite, the graph-feature
# benchmarks (chain with PDL beside raw CUDA, MLP with/without PDL, k steps per launch), and
# `bench serve`. Everything lands in /tmp/o, packed into $OUT/all.tgz; a summary is printed.
set -uo pipefail
o=/tmp/o; mkdir -p "$o"; bin=.gpu-bin/bin/cudagraph
python3 bench/export_pytorch.py 2>&1 | tail -n 4
cp -r crates/cudagraph-nn/tests/data/pytorch "$o/" 2>/dev/null
bash .gpu-bin/run-tests.sh > "$o/tests.log" 2>&1
grep -E '^(test .*FAILED|GPU suite|[0-9]+ passed)' "$o/tests.log"
OUT="$o" bash bench/device-chain.sh > "$o/chain.log" 2>&1 || tail -n 5 "$o/chain.log"
grep -A12 'per kernel' "$o"/chain-*.md 2>/dev/null | head -30
for p in 0 1; do CUDAGRAPH_PDL=$p $bin bench --only mlp --batch-sizes 1,32 2>&1 | grep mlp-inference | sed "s/^/pdl=$p /"; done
$bin inspect loop > "$o/inspect-loop.txt" 2>&1; grep -iE 'conditional|IF|WHILE' "$o/inspect-loop.txt" | head -3
for args in "--graph" "--steps-per-launch 1" "--steps-per-launch 22"; do
  $bin train --model mlp $args > "$o/train-${args// /_}.log" 2>&1
  echo "train mlp $args: $(grep -hE 'throughput|test accuracy' "$o/train-${args// /_}.log" | tr '\n' ' ')"
done
$bin bench serve --clients 64 --min-rows 1 --max-rows 256 --duration-s 20 > "$o/serve.txt" 2>&1; tail -n 14 "$o/serve.txt"
tar -czf "$OUT/all.tgz" -C /tmp o
