#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 6 (final code): the seed bench beside PyTorch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11e"; mkdir -p "$r"; t0=$SECONDS
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
ours="$b bench --json"
timeout 120 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
{ echo "# cudagraph bench vs PyTorch — $d"; echo
  python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | head -12
cd "$o" && tar czf s11e.tgz s11e
echo "all done ($((SECONDS - t0)) s)"
