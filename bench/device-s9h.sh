#!/usr/bin/env bash
# 2026-11-24, ninth session, call 10: cuBLASLt configurations found by search
# (`CUDAGRAPH_LT_SEARCH=1`, opt-in). The GPU suite; the Linear kind of the sweep with the search
# on (ours) beside PyTorch, one round, kinds alternating as usual; the registry's timings of
# the searched configurations.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9h"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 240 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
grep -E "cublaslt:c|\+search" "$r/gpu-tests-$d.log" | cut -c1-400 | head -8
CUDAGRAPH_LT_SEARCH=1 SWEEP_NAME=sweep-ltsearch ROUNDS=1 KINDS=linear- OUT="$r" timeout 200 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep-ltsearch.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
python3 - <<'PY' > "$r/registry-ltsearch.txt"
import json, glob
for f in glob.glob('/tmp/cudagraph-cache/engines-*.json'):
    t = json.load(open(f))
    n = won = 0
    for k, e in sorted(t['entries'].items()):
        cs = [x for x in e['timings'] if ':c' in x['engine']]
        if cs:
            n += 1; won += ':c' in e['engine']
            best = min((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
            h = [x for x in e['timings'] if x['engine'] == 'cublaslt:0' and x.get('us')]
            bc = min((x for x in cs if x.get('us')), key=lambda x: x['us'], default=None)
            print(k, '->', e['engine'], f"best {best['us']:.2f}", f"cublaslt:0 {h[0]['us']:.2f}" if h else "", f"best searched {bc['engine']}={bc['us']:.2f}" if bc else "searched failed")
    print(f"keys with searched configurations: {n}; chosen: {won}")
PY
tail -n 1 "$r/registry-ltsearch.txt"
echo "all done ($((SECONDS - t0)) s)"
