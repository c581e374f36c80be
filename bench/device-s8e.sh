#!/usr/bin/env bash
# 2026-11-24, eighth session, call 6: the 64 x 64-tile forward kernel (`tile64`): the engine
# tests, then the Linear and MLP points with ours and PyTorch, and the registry's timings for
# the products near PyTorch. Everything in $OUT/s8e.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8e"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache CUDAGRAPH_REQUIRE_GPU=1
t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
t=$(ls .gpu-bin/tests/gpu_engines-* | head -n1)
timeout 150 $t > "$r/gpu-engines.log" 2>&1; grep -E "^test .*FAILED|panicked|test result" "$r/gpu-engines.log" | head
echo "--- linear and mlp ($((SECONDS - t0)) s)"
PYTHONUNBUFFERED=1 timeout 80 python3 bench/pytorch_sweep.py --only linear-,mlp- > "$r/pytorch.json" 2> "$r/pytorch.log"
timeout 120 $b bench sweep --json --only linear-,mlp- > "$r/ours.json" 2> "$r/ours.log"
python3 bench/sweep_compare.py "$r/ours.json" "$r/pytorch.json" "see bench/device-s8e.sh" > "$r/sweep.md"
grep -E '^\*\*|^Per kind|⚠|tile64' "$r/sweep.md" | head -40
python3 - <<'PY' | tee "$r/registry-picks.txt"
import json, glob
for f in glob.glob('/tmp/cudagraph-cache/engines-*.json'):
    t = json.load(open(f))
    for k, e in sorted(t['entries'].items()):
        ts = sorted((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
        tl = [x for x in ts if x['engine'] == 'tile64']
        if tl and k.startswith('gemm NT'):
            print(k, '->', e['engine'], 'best', f"{ts[0]['engine']}={ts[0]['us']:.2f}", 'tile64', f"{tl[0]['us']:.2f}")
PY
tar -czf "$o/s8e.tar.gz" -C "$o" s8e
echo "done in $((SECONDS - t0)) s"
