#!/usr/bin/env bash
# 2026-11-24, eighth session, call 5 (final code): the GPU suite; the whole sweep, each side
# twice with the kinds alternating (ROUNDS=2, the faster run of each point counts on both
# sides); the seed bench beside PyTorch; `bench cache`; the registry's picks for the points
# closest to PyTorch; racecheck over the few-rows products with 16 warps per column group.
# Everything in $OUT/s8d.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8d"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- sweep, kinds alternating, two rounds ($((SECONDS - t0)) s)"
ROUNDS=2 OUT="$r" timeout 300 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md"
python3 - <<'PY' | tee "$r/registry-picks.txt"
import json, glob
keys = ['gemm NT m=1 n=256 k=4096', 'gemm NT m=1 n=256 k=1024', 'gemm NT m=8 n=256 k=256',
        'gemm NT m=128 n=4096 k=256', 'gemm NT m=512 n=1024 k=256', 'conv_fwd n=16 c=48 h=40']
for f in glob.glob('/tmp/cudagraph-cache/engines-*.json'):
    t = json.load(open(f))
    for k, e in sorted(t['entries'].items()):
        if any(k.startswith(p) for p in keys):
            ts = sorted((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
            print(k, '->', e['engine'], ' '.join(f"{x['engine']}={x['us']:.2f}({x.get('chain_us') or 0:.2f}|{x.get('single_us') or 0:.2f})" for x in ts[:6]))
PY
echo "--- seed bench beside PyTorch ($((SECONDS - t0)) s)"
ours="$b bench --json --svg $r/bench-$d.svg"
timeout 90 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
{ echo "# cudagraph bench vs PyTorch — $d"; echo
  python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md"
echo "--- bench cache ($((SECONDS - t0)) s)"
timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
echo "--- racecheck, few-rows products ($((SECONDS - t0)) s)"
CUDAGRAPH_CACHE_DIR=/tmp/cg8d-race CUDAGRAPH_GEMM=rows timeout 120 compute-sanitizer --tool racecheck --print-limit 20 \
  $b bench sweep --only linear-m1-k4096-n256,linear-m8-k1024-n256 --repeats 1 --sample-ms 0.2 > "$r/racecheck-rows.log" 2>&1
echo "rc $?"; grep -E 'RACECHECK SUMMARY|rows' "$r/racecheck-rows.log" | head -8
tar -czf "$o/s8d.tar.gz" -C "$o" s8d
echo "done in $((SECONDS - t0)) s"
