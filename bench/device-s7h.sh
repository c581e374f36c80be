#!/usr/bin/env bash
# 2026-11-24, seventh session: why three convolution forwards chose slower engines than in the
# sixth session — the registry's measured µs for their keys (and the bias keys), with each point
# run alone. Output in $OUT/s7h.txt.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache-s7h
b=.gpu-bin/bin/cudagraph
for p in conv-n64-c128-o128-4px-k3-s1-p1 conv-n8-c64-o32-32px-k7-s1-p1 conv-n128-c1-o32-28px-k3-s1-p1; do
  timeout 60 $b bench sweep --only $p 2>&1 | grep -v '^\s*$' | tail -n 3
done | tee "$o/s7h.txt"
python3 - <<'PY' | tee -a "$o/s7h.txt"
import json, glob
for f in glob.glob('/tmp/cudagraph-cache-s7h/engines-*.json'):
    t = json.load(open(f))
    for k, e in sorted(t['entries'].items()):
        if 'conv_fwd' in k or 'conv_bias' in k:
            ts = sorted((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
            print(k, '->', e['engine'], ' '.join(f"{x['engine']}={x['us']:.1f}" for x in ts[:8]))
PY
