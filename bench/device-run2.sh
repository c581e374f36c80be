#!/usr/bin/env bash
# One device call (under 10 minutes): the seed bench beside PyTorch (with the dropout rows),
# `bench chain` beside raw CUDA and PyTorch's graphs, the cross-entropy part of the sweep beside
# PyTorch, and compute-sanitizer on the k-steps-per-launch test with and without cuBLAS (to
# tell our errors from the tools' handling of conditional bodies). Needs .gpu-bin/ and python3
# with torch; results in $OUT (default /tmp/out).
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
b=.gpu-bin/bin/cudagraph; d=$(date -u +%Y-%m-%d)
nvidia-smi -L | tee "$o/device.txt"
ours="$b bench --json --svg $o/bench-$d.svg"
timeout 150 $ours > "$o/bench-ours.json" 2> "$o/bench-ours.log"; echo "bench rc $?"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/pytorch_baseline.py > "$o/bench-pytorch.json" 2> "$o/bench-pytorch.log"; echo "pytorch rc $?"
{ echo "# cudagraph bench vs PyTorch — $d"; echo
  python3 bench/compare.py "$o/bench-ours.json" "$o/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$o/bench-$d.md"
grep -E '^\| (mlp|linear|shared|dropout)' "$o/bench-$d.md"
OUT="$o" timeout 150 bash bench/device-chain.sh > "$o/chain.log" 2>&1; echo "chain rc $?"; tail -n 8 "$o/chain-$d.md"
timeout 60 $b bench sweep --json --only ce- > "$o/sweep-ce-ours.json" 2> "$o/sweep-ce-ours.log"
PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_sweep.py --only ce- > "$o/sweep-ce-pytorch.json" 2> "$o/sweep-ce-pytorch.log"
python3 bench/sweep_compare.py "$o/sweep-ce-ours.json" "$o/sweep-ce-pytorch.json" "$b bench sweep --json --only ce-; python3 bench/pytorch_sweep.py --only ce-" > "$o/sweep-ce-$d.md"
grep -E '^\*\*|^Per kind' "$o/sweep-ce-$d.md"
t=$(ls .gpu-bin/tests/gpu_steps-* | head -n1)
for tool in memcheck synccheck; do
  for g in auto tiled; do
    CUDAGRAPH_GEMM=$g timeout 90 compute-sanitizer --tool $tool --print-limit 5 "$t" --test-threads=1 \
      --exact k_steps_per_launch_equal_one_step_per_launch_and_eager_steps > "$o/steps-$tool-$g.log" 2>&1
    echo "k-steps test under $tool, CUDAGRAPH_GEMM=$g: $(grep -E 'test result|ERROR SUMMARY' "$o/steps-$tool-$g.log" | tr '\n' ' ')"
  done
done
