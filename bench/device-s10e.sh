#!/usr/bin/env bash
# 2026-11-24, tenth session, call 5: probe variants of the register-blocked SGEMM whose K
# groups run independently (named barriers per group), against F.linear; ncu on one.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s10e"; mkdir -p "$r"; t0=$SECONDS
timeout 200 python3 bench/probe/gemm_probe.py bench/probe/variants.cu 2>&1 | tee "$r/probe.txt"
echo "probe done ($((SECONDS - t0)) s)"
timeout 150 ncu --kernel-name regex:'probe_ind_g8_k4|probe_ind_g4_k8_lb2' --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats \
  --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed.sum \
  python3 bench/probe/gemm_probe.py bench/probe/variants.cu --ncu > "$r/ncu.txt" 2>&1
grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|Registers Per|Warp Cycles Per Issued|Issued Warp|stalled|inst_executed" "$r/ncu.txt" | head -60
echo "all done ($((SECONDS - t0)) s)"
