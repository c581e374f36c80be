#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 5 (final code): the GPU suite; sweep round two (all
# kinds, sides alternating; merged with call 4's round by bench/sweep_merge.py --rounds 2);
# the seed bench beside PyTorch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11d"; mkdir -p "$r"; t0=$SECONDS
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=1 OUT="$r" timeout 270 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
if [ $((SECONDS - t0)) -lt 440 ]; then
  ours="$b bench --json"
  timeout 70 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
  PYTHONUNBUFFERED=1 timeout 70 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $d"; echo
    python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
  grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | head -12
fi
cd "$o" && tar czf s11d.tgz s11d
echo "all done ($((SECONDS - t0)) s)"
