#!/usr/bin/env bash
# 2026-11-23, sixth session: the cross-entropy sweep points beside PyTorch with the split plan
# (default) and without it (CUDAGRAPH_CE_SPLIT=0: a block per wide row), in one call.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
OUT="$o" SWEEP_ONLY=ce- SWEEP_NAME=ce-split timeout 100 bash bench/device-sweep.sh
CUDAGRAPH_CE_SPLIT=0 OUT="$o" SWEEP_ONLY=ce- SWEEP_NAME=ce-nosplit timeout 100 bash bench/device-sweep.sh
for n in ce-split ce-nosplit; do echo "== $n"; grep -E '^\| ce-' "$o/$n.md"; done
rm -f "$o"/*.log "$o"/ce-split.md "$o"/ce-nosplit.md
