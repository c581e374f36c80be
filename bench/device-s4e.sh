#!/usr/bin/env bash
# 2026-11-23, fourth session: the seed bench twice beside PyTorch once (the final call's seed
# rows spread more than usual: a second and third sample of the same binaries). $OUT/s4e.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s4e"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
for i in 1 2; do
  ours="$b bench --json --only mlp,mlp-host,train,pool,dropout"
  timeout 90 $ours > "$r/bench-ours-$i.json" 2> "$r/bench-ours-$i.log"
  [ $i = 1 ] && PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $d (sample $i)"; echo
    python3 bench/compare.py "$r/bench-ours-$i.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d-$i.md"
  grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d-$i.md" | cut -d'|' -f2-9
done
tar -czf "$o/s4e.tar.gz" -C "$o" s4e
