#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 6: first-use cost of the column-warp candidates — `bench
# cache` from a cold engine registry with the binary before them (`cudagraph-base`, commit
# c7f356b) and after, timed — then the seed bench beside PyTorch (final code).
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11e"; mkdir -p "$r"; t0=$SECONDS
d=$(date -u +%Y-%m-%d); b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
[ -f .gpu-bin/bin/cudagraph-base.gz ] && gunzip -f .gpu-bin/bin/cudagraph-base.gz
for bin in cudagraph-base cudagraph; do
  t1=$SECONDS
  CUDAGRAPH_CACHE_DIR=/tmp/cold-$bin timeout 200 .gpu-bin/bin/$bin bench cache > "$r/cache-cold-$bin.txt" 2>&1
  echo "$bin bench cache from a cold registry: rc $? in $((SECONDS - t1)) s"; sed -n 2,6p "$r/cache-cold-$bin.txt"
done
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
ours="$b bench --json"
timeout 120 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
{ echo "# cudagraph bench vs PyTorch — $d"; echo
  python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | head -12
cd "$o" && tar czf s11e.tgz s11e
echo "all done ($((SECONDS - t0)) s)"
