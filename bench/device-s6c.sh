#!/usr/bin/env bash
# 2026-11-23, sixth session, final code: the GPU suite and the cross-entropy sweep points beside
# PyTorch (bench/device-s4c.sh, results in $OUT/s4c.tar.gz), then the raw WHILE programs and
# every compute-sanitizer tool over every test binary and the CLI's main paths
# (bench/device-s5e.sh: $OUT/sanitize.tar.gz and the summaries).
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
OUT=/tmp/s6c PARTS="suite sweep" SWEEP_ONLY=ce- DEADLINE_S=200 bash bench/device-s4c.sh
cp /tmp/s6c/s4c.tar.gz "$o/"
grep -E '^\| ce-' /tmp/s6c/s4c/sweep.md
OUT="$o" bash bench/device-s5e.sh 2>&1 | grep -vE '^(small|try|reuse|\(small|pdl|programmatic|plain|WHILE)'
