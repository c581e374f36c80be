#!/usr/bin/env bash
# 2026-11-24, tenth session, call 2: why the register-blocked SGEMM is slow. The probe
# (bench/probe/gemm_probe.py) times our kernels and probe variants against F.linear in graphs;
# ncu reads stall reasons of two of them on the 512 × 256 → 1024 forward product.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10b"; mkdir -p "$r"; t0=$SECONDS
timeout 200 python3 bench/probe/gemm_probe.py bench/probe/variants.cu 2>&1 | tee "$r/probe.txt"
echo "probe done ($((SECONDS - t0)) s)"
timeout 200 ncu --kernel-name regex:'sgemm_reg64|probe_64x64_4x4_k16v|sgemm_tiled' --launch-count 3 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  python3 bench/probe/gemm_probe.py bench/probe/variants.cu --ncu > "$r/ncu.txt" 2>&1
grep -E "^  [a-z_0-9]+.*\(|Duration|Registers Per|Achieved Occ|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|L1/TEX Hit|L2 Hit|Compute \(SM\) Thr|Memory Thr|Block Limit" "$r/ncu.txt" | head -90
echo "all done ($((SECONDS - t0)) s)"
