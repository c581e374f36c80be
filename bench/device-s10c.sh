#!/usr/bin/env bash
# 2026-11-24, tenth session, call 3: the register-blocked SGEMM rewritten (64 x 64 outputs,
# four K groups of 64 threads with 8 x 8 register tiles). Its engine tests; the probe against
# F.linear; ncu on it and on PyTorch's kernel for the 512 × 256 → 1024 forward product.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10c"; mkdir -p "$r"; t0=$SECONDS
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache CUDAGRAPH_REQUIRE_GPU=1
t=$(ls .gpu-bin/tests/gpu_engines*)
timeout 150 "$t" --test-threads=1 register_blocked every_gemm_engine bias_gradient_engines 2>&1 | tail -n 25 | tee "$r/engines.txt"
echo "tests done ($((SECONDS - t0)) s)"
timeout 200 python3 bench/probe/gemm_probe.py bench/probe/variants.cu 2>&1 | tee "$r/probe.txt"
echo "probe done ($((SECONDS - t0)) s)"
timeout 150 ncu --kernel-name regex:'sgemm_reg4|gemm|Kernel' --launch-skip 0 --launch-count 30 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats \
  --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio \
  python3 bench/probe/gemm_probe.py bench/probe/variants.cu --ncu > "$r/ncu.txt" 2>&1
grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|Registers Per|Achieved Occ|Warp Cycles Per Issued|Issued Warp|Grid Size|Block Size|stalled" "$r/ncu.txt" | grep -v probe_ | head -120
echo "all done ($((SECONDS - t0)) s)"
