#!/usr/bin/env bash
# One device call (under 10 minutes) on the final binaries: the GPU suite, the cross-entropy
# part of the sweep beside PyTorch, and compute-sanitizer (bench/sanitize.sh: every tool over the
# test binaries and the CLI's main paths). Everything lands in $OUT/run3.tar.gz (the device
# tool returns few files); the summary lines are printed. Needs .gpu-bin/ and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/run3"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
b=.gpu-bin/bin/cudagraph; d=$(date -u +%Y-%m-%d)
nvidia-smi -L | tee "$r/device.txt"
timeout 200 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked' "$r/gpu-tests-$d.log" | head -10
tail -n 2 "$r/gpu-tests-$d.log"
OUT="$r" SWEEP_ONLY=ce- SWEEP_NAME=sweep-ce timeout 150 bash bench/device-sweep.sh
OUT="$r" JOBS=${SANITIZE_JOBS:-10} JOB_LIMIT_S=${SANITIZE_LIMIT_S:-220} timeout 280 bash bench/sanitize.sh > "$r/sanitize.txt" 2>&1
grep -q "^sanitize initcheck" "$r/sanitize.txt" || OUT="$r" SUMMARY_ONLY=1 bash bench/sanitize.sh >> "$r/sanitize.txt" 2>&1
tail -n 12 "$r/sanitize.txt"
tar -czf "$o/run3.tar.gz" -C "$o" run3
