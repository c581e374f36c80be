#!/usr/bin/env bash
# 2026-11-24, tenth session, call 6: the GPU suite with the register-blocked SGEMM candidates
# (`reg:S`, eight K groups); the whole sweep, one round per side, kinds alternating; the
# registry's register-blocked timings; the seed bench beside PyTorch if time is left.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10f"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=1 OUT="$r" timeout 280 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
python3 bench/registry_reg.py /tmp/cudagraph-cache/engines-*.json > "$r/registry-reg.txt"
tail -n 1 "$r/registry-reg.txt"
if [ $((SECONDS - t0)) -lt 420 ]; then
  ours="$b bench --json"
  timeout 70 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
  PYTHONUNBUFFERED=1 timeout 70 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $d"; echo
    python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
  grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | head -12
fi
cd "$o" && tar czf s10f.tgz s10f
echo "all done ($((SECONDS - t0)) s)"
