#!/usr/bin/env bash
# 2026-11-24, tenth session, call 8 (final code): the GPU suite; compute-sanitizer (racecheck,
# memcheck, synccheck, initcheck) over the register-blocked kernel's test (quick: both load
# paths, split and unsplit); a second round of the whole sweep, kinds alternating (merged with
# call 6's round afterwards); `bench cache`.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10g"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
t=$(ls .gpu-bin/tests/gpu_engines-* | head -n1)
for tool in racecheck memcheck synccheck initcheck; do
  CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1 CUDAGRAPH_CACHE_DIR=/tmp/cg-san timeout 120 \
    compute-sanitizer --tool $tool --error-exitcode 9 "$t" --test-threads=1 register_blocked \
    > "$r/sanitize-$tool.log" 2>&1; rc=$?
  echo "$tool: rc $rc; $(grep -E 'SUMMARY' "$r/sanitize-$tool.log" | tail -n1); $(grep -E '^test result' "$r/sanitize-$tool.log")"
done
echo "sanitizers done ($((SECONDS - t0)) s)"
ROUNDS=1 OUT="$r" timeout 260 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
python3 bench/registry_reg.py /tmp/cudagraph-cache/engines-*.json > "$r/registry-reg.txt"
tail -n 1 "$r/registry-reg.txt"
cd "$o" && tar czf s10g.tgz s10g
echo "all done ($((SECONDS - t0)) s)"
