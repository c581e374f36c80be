#!/usr/bin/env bash
# 2026-11-23, seventh session, second call: the GPU suite (allocator and test fixes); the
# cross-entropy points with the new lane rule; ours with PDL off and on over launch-bound
# points (JSON, two rounds); the 512 × 4096 → 1024 product alone and after the Linear kind,
# both sides, with the registry's timings for it; the conv kind both sides (warm-up now).
# Everything in $OUT/s7b.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s7b"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
pick() { python3 -c "
import json,sys
for r in json.load(sys.stdin)['rows']: print(f\"{sys.argv[1]} {r['id']} {r['mode']} {r['graph_us']:.2f} {r['engine']}\")" "$1"; }
echo "--- ce, conv kinds both sides ($((SECONDS - t0)) s)"
OUT="$r" SWEEP_ONLY=ce-,conv- SWEEP_NAME=ceconv timeout 120 bash bench/device-sweep.sh
echo "--- PDL A/B ($((SECONDS - t0)) s)"
for p in 0 1 0 1; do
  CUDAGRAPH_PDL=$p timeout 60 $b bench sweep --json --only ce-r32-c10000,ce-r64-c10000,ce-r64-c100,linear-m1-k256,mlp-,cnn- 2>/dev/null | pick "PDL=$p"
done > "$r/pdl.txt"
python3 - "$r/pdl.txt" <<'PY'
import sys, collections, math
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    t[(f[1], f[2], f[0])].append(float(f[3]))
keys = sorted({(a, b) for a, b, _ in t})
logs = []
for a, b in keys:
    off, on = min(t[(a, b, "PDL=0")]), min(t[(a, b, "PDL=1")])
    logs.append(math.log(on / off))
    print(f"{a:40} {b:8} off {off:8.2f} on {on:8.2f} on/off {on/off:.3f}")
print(f"geomean on/off {math.exp(sum(logs)/len(logs)):.3f} over {len(logs)}")
PY
echo "--- 512 x 4096 -> 1024 ($((SECONDS - t0)) s)"
for i in 1 2; do
  timeout 30 $b bench sweep --json --only linear-m512-k4096-n1024 2>/dev/null | pick "alone-ours-$i"
  timeout 60 python3 bench/pytorch_sweep.py --only linear-m512-k4096-n1024 2>/dev/null | pick "alone-pytorch-$i"
done | tee "$r/m512.txt"
timeout 90 $b bench sweep --json --only linear- 2>/dev/null | pick "kind-ours" | grep -E "m512-k4096-n1024|m512-k1024-n1024|m128-k4096-n4096" | tee -a "$r/m512.txt"
python3 -c "
import json,glob
for f in glob.glob('/tmp/cudagraph-cache/engines-*.json'):
    t=json.load(open(f))
    for k,e in t['entries'].items():
        if 'm=512' in k and 'n=1024' in k and 'k=4096' in k: print(k, json.dumps(e))
" | tee "$r/m512-registry.txt"
tar -czf "$o/s7b.tar.gz" -C "$o" s7b
echo "done in $((SECONDS - t0)) s"
