#!/usr/bin/env bash
# 2026-11-24, ninth session, call 4 (final code): the GPU suite; the whole sweep, one round per
# side, kinds alternating (the cuBLASLt split-K candidates are new in the registry); then test
# binaries with their tests in parallel threads until the device's time limit nears.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s9d"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=1 OUT="$r" timeout 270 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
python3 - <<'PY' > "$r/registry-splitk.txt"
import json, glob
for f in glob.glob('/tmp/cudagraph-cache/engines-*.json'):
    t = json.load(open(f))
    n = won = 0
    for k, e in sorted(t['entries'].items()):
        sk = [x for x in e['timings'] if '/sk' in x['engine']]
        if sk:
            n += 1; won += '/sk' in e['engine']
            best = min((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
            bsk = min((x for x in sk if x.get('us')), key=lambda x: x['us'], default=None)
            print(k, '->', e['engine'], f"best {best['us']:.2f}", f"best split-K {bsk['engine']}={bsk['us']:.2f}" if bsk else "split-K failed")
    print(f"keys with split-K candidates: {n}; chosen: {won}")
PY
tail -n 1 "$r/registry-splitk.txt"
export CUDAGRAPH_REQUIRE_GPU=1
par() { # name runs timeout env
  local t=$(ls .gpu-bin/tests/$1-* | head -n1) fails=0 segv=0 i rc=- n=0
  for i in $(seq $2); do
    [ $((SECONDS - t0 + $3)) -gt 560 ] && break
    env $4 CUDAGRAPH_CACHE_DIR=/tmp/cg-par timeout $3 $t > "$r/par-$1-$i.log" 2>&1; rc=$?; n=$i
    if [ $rc -ne 0 ]; then fails=$((fails + 1)); [ $rc -eq 139 ] && segv=$((segv + 1)); else rm -f "$r/par-$1-$i.log"; fi
  done
  echo "$1, parallel threads: $fails of $n runs failed ($segv segfaults) ($((SECONDS - t0)) s)"
}
par gpu_soundness 2 40 LAZY=1
par gpu_engines 2 60 LAZY=1
for b in gpu_nn gpu_optim gpu_soundness_nn gpu_core gpu_graphfeat gpu_misuse_graph gpu_misuse_streams gpu_fork gpu_interop gpu_io gpu_rng gpu_cudnn_graph gpu_steps; do par $b 1 40 LAZY=1; done
grep -h -E "source:|panicked at" "$r"/par-*.log 2>/dev/null | sed -E 's/.*source: //' | cut -c1-160 | sort | uniq -c | head -20
