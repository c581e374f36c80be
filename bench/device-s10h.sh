#!/usr/bin/env bash
# 2026-11-24, tenth session, call 11 (final code: host transfers as kernels). The GPU suite; the
# seed bench beside PyTorch (its host round-trip rows use StaticGraph's copies); `bench cache`;
# the zero-copy probe again for reference.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10h"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
grep -B2 -A12 'panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function\|host node bug' | head -30
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ours="$b bench --json"
timeout 90 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
{ echo "# cudagraph bench vs PyTorch — $d"; echo
  python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | cut -d'|' -f2-9 | head -20
echo "bench done ($((SECONDS - t0)) s)"
timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 6 "$r/cache-$d.txt"
timeout 60 python3 bench/probe/zero_copy.py > "$r/zero-copy.txt" 2>&1; cat "$r/zero-copy.txt"
cd "$o" && tar czf s10h.tgz s10h
echo "all done ($((SECONDS - t0)) s)"
