#!/usr/bin/env bash
# 2026-11-23, seventh session, first call: the GPU suite; the whole sweep with ours and PyTorch
# alternating kind by kind (bench/device-sweep-kinds.sh); cross-entropy points with lane groups
# off and on, and a few launch-bound points with PDL off and on (ours only). Everything in
# $OUT/s7a.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s7a"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- sweep, kinds alternating ($((SECONDS - t0)) s)"
OUT="$r" timeout 200 bash bench/device-sweep-kinds.sh
echo "--- A/B ($((SECONDS - t0)) s)"
for g in 0 1 0 1; do
  CUDAGRAPH_CE_GROUPS=$g timeout 30 $b bench sweep --only ce-r256-c10,ce-r64-c100,ce-r32-c10 2>&1 | grep -E '^\| ce' | sed "s/^/groups=$g /"
done | tee "$r/ce-groups.txt"
for p in 0 1 0 1; do
  CUDAGRAPH_PDL=$p timeout 40 $b bench sweep --only ce-r32-c10000,ce-r64-c10000,ce-r64-c100,linear-m1-k256,mlp- 2>&1 | grep -E '^\| ' | sed "s/^/PDL=$p /"
done | tee "$r/pdl.txt"
tar -czf "$o/s7a.tar.gz" -C "$o" s7a
echo "done in $((SECONDS - t0)) s"
