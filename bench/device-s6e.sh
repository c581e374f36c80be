#!/usr/bin/env bash
# 2026-11-23, sixth session: the cross-entropy and the 512-row Linear sweep points beside
# PyTorch, twice each, in one call (are the final sweep's two outliers repeatable?).
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
for i in 1 2; do
  for only in ce- linear-m512; do
    OUT="$o" SWEEP_ONLY=$only SWEEP_NAME="rerun$i-${only%-}" timeout 100 bash bench/device-sweep.sh > /dev/null
    echo "== round $i, $only"; grep -E '^\| (ce-r64-c100|ce-r32-c10000|ce-r64-c10000|linear-m512-k4096-n1024|linear-m512-k1024-n1024) ' "$o/rerun$i-${only%-}.md"
  done
done
cd "$o" && tar -czf rerun.tar.gz rerun* && find . -name 'rerun*' ! -name rerun.tar.gz -delete
