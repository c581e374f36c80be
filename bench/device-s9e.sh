#!/usr/bin/env bash
# 2026-11-24, ninth session, call 5 (final code): the GPU suite (fused conv+bias candidates,
# split-K off by default); the whole sweep, one round per side, kinds alternating; the
# registry's fused conv+bias timings; the seed bench beside PyTorch if time is left.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9e"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 240 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
grep -h -A3 "fused" "$r/gpu-tests-$d.log" | grep -iE "candidates|fused|cc|found" | head -8
ROUNDS=1 OUT="$r" timeout 280 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
python3 - <<'PY' > "$r/registry-fused.txt"
import json, glob
for f in glob.glob('/tmp/cudagraph-cache/engines-*.json'):
    t = json.load(open(f))
    n = won = 0
    for k, e in sorted(t['entries'].items()):
        fu = [x for x in e['timings'] if '+bias' in x['engine']]
        if fu:
            n += 1; won += '+bias' in e['engine']
            best = min((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
            bf = min((x for x in fu if x.get('us')), key=lambda x: x['us'], default=None)
            print(k, '->', e['engine'], f"best {best['us']:.2f}", f"best fused {bf['engine']}={bf['us']:.2f}" if bf else "fused failed")
    print(f"keys with fused conv+bias candidates: {n}; chosen: {won}")
PY
tail -n 1 "$r/registry-fused.txt"
if [ $((SECONDS - t0)) -lt 380 ]; then
  ours="$b bench --json"
  timeout 80 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
  PYTHONUNBUFFERED=1 timeout 80 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $d"; echo
    python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
  grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md" | head -12
fi
echo "all done ($((SECONDS - t0)) s)"
