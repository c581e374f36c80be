#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 8 (final code: the few-row launchers' shared checks): the
# GPU suite; the Linear kind again (two rounds per side) for the two cuBLASLt ties; the GEMV
# probe through the shared NVRTC helper.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11g"; mkdir -p "$r"; t0=$SECONDS
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d)
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
ROUNDS=2 KINDS="linear-" OUT="$r" timeout 200 bash bench/device-sweep-kinds.sh
grep -E 'm512-k256-n1024 \| forward|m128-k256-n4096 \| forward' "$r/sweep.md"; echo "sweep done ($((SECONDS - t0)) s)"
timeout 120 python3 bench/probe/gemv_probe.py > "$r/gemv-probe.txt" 2>&1; echo "probe: rc $?"; head -n 6 "$r/gemv-probe.txt"
cd "$o" && tar czf s11g.tgz s11g
echo "all done ($((SECONDS - t0)) s)"
