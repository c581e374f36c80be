#!/usr/bin/env bash
# 2026-11-24, tenth session, call 1: the register-blocked SGEMM tiles (`reg64:S`, `reg128:S`).
# The GPU suite; the Linear and MLP kinds of the sweep beside PyTorch, one round; the
# registry's timings of the register-blocked candidates against the best other candidate.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10a"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
timeout 240 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
grep -A6 'panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function' | head -30
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
SWEEP_NAME=sweep-reg ROUNDS=1 KINDS="linear- mlp-" OUT="$r" timeout 260 bash bench/device-sweep-kinds.sh
grep '⚠' "$r/sweep-reg.md" | head; echo "sweep done ($((SECONDS - t0)) s)"
python3 bench/registry_reg.py /tmp/cudagraph-cache/engines-*.json > "$r/registry-reg.txt"
tail -n 3 "$r/registry-reg.txt"
echo "all done ($((SECONDS - t0)) s)"
