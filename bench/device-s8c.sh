#!/usr/bin/env bash
# 2026-11-24, eighth session, call 3: the seed MLP inference rows (`bench --only mlp-inference`)
# with the registry ranking by chain time and by the mean of chain and single-graph time (one
# registry cache each, every side twice) and their picks for the seed's products; the reworked
# shared-pool test; then every sanitizer over the cross-entropy tests (the seventh session's
# last two cross-entropy edits were not sanitized) and the product engine test (few-rows
# kernels with 16 warps per group). Everything in $OUT/s8c.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8c"; mkdir -p "$r"
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
export CUDAGRAPH_REQUIRE_GPU=1
for rep in 1 2; do
  for m in chain both; do
    echo "--- bench mlp-inference, $m, $rep ($((SECONDS - t0)) s)"
    CUDAGRAPH_CACHE_DIR=/tmp/cg8c-$m CUDAGRAPH_REGISTRY_TIMING=$m timeout 60 $b bench --only mlp-inference --json > "$r/mlp-$m-$rep.json" 2>> "$r/mlp.log"
    python3 -c "import json,sys; d=json.load(open('$r/mlp-$m-$rep.json')); print(' '.join(f\"{x['config']}={x['graph_us']:.1f}\" for x in d['rows']))"
  done
done
for m in chain both; do
  python3 - "$m" <<'PY' | tee -a "$r/registry-picks.txt"
import json, glob, sys
m = sys.argv[1]
for f in glob.glob(f'/tmp/cg8c-{m}/engines-*.json'):
    t = json.load(open(f))
    for k, e in sorted(t['entries'].items()):
        ts = sorted((x for x in e['timings'] if x.get('us')), key=lambda x: x['us'])
        print(m, k, '->', e['engine'], ' '.join(f"{x['engine']}={x['us']:.2f}({x.get('chain_us') or 0:.2f}|{x.get('single_us') or 0:.2f})" for x in ts[:5]))
PY
done
t=$(ls .gpu-bin/tests/gpu_nn-* | head -n1)
$t --exact shared_pool_holds_nine_batch_sizes_within_1_1x_of_the_largest 2>&1 | tail -n 3
echo "--- sanitizers ($((SECONDS - t0)) s)"
mkdir -p "$r/san"
export CUDAGRAPH_CACHE_DIR=/tmp/cg8c-san CUDAGRAPH_TEST_QUICK=1
opt=$(ls .gpu-bin/tests/gpu_optim-* | head -n1); eng=$(ls .gpu-bin/tests/gpu_engines-* | head -n1)
for tool in memcheck racecheck synccheck initcheck; do
  fl="--tool $tool"; [ $tool = memcheck ] && fl="$fl --leak-check full"
  ( timeout 300 compute-sanitizer $fl --print-limit 20 $opt --test-threads=1 cross_entropy > "$r/san/$tool-ce.log" 2>&1; echo "rc $?" >> "$r/san/$tool-ce.log" ) &
  ( timeout 300 compute-sanitizer $fl --print-limit 20 $eng --test-threads=1 every_gemm_engine > "$r/san/$tool-gemm.log" 2>&1; echo "rc $?" >> "$r/san/$tool-gemm.log" ) &
done
wait
for f in "$r"/san/*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' $f | tr '\n' ' ') $(tail -n1 $f)"; done
tar -czf "$o/s8c.tar.gz" -C "$o" s8c
echo "done in $((SECONDS - t0)) s"
