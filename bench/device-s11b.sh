#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 3: the GPU suite with the column-warp kernels
# (`colsRxCwW:KS`); the Linear and MLP kinds of the sweep, two rounds per side alternating;
# the seed bench beside PyTorch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11b"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 220 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=2 KINDS="linear- mlp-" OUT="$r" timeout 240 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
ours="$b bench --json"
timeout 70 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
PYTHONUNBUFFERED=1 timeout 70 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
{ echo "# cudagraph bench vs PyTorch — $d"; echo
  python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | head -12
cd "$o" && tar czf s11b.tgz s11b
echo "all done ($((SECONDS - t0)) s)"
