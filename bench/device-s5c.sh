#!/usr/bin/env bash
# 2026-11-23, fifth session, third device call: ncu sections (speed of light, launch,
# occupancy, warp states, scheduler) of one warm launch each of our product kernels and
# cuBLAS's, from the registry's measurements in `bench gemm`. Everything lands in $OUT.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"; t0=$SECONDS; b=.gpu-bin/bin/cudagraph
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
secs="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
for k in sgemm_nt_chunks8 sgemm_tiled_cluster8 sgemm_tiled sgemm_nt_rows 'gemv|gemmSN|gemmk1'; do
  echo "=== $k ($((SECONDS - t0)) s)"
  timeout 90 ncu --clock-control none --cache-control none $secs -k "regex:$k" --launch-skip 3 --launch-count 1 \
    $b bench gemm > "$o/ncu-$(echo "$k" | tr -c 'a-z0-9_\n' '_').txt" 2>&1
  grep -E '^  [a-zA-Z_].*\(|Duration|SM Frequency|Elapsed Cycles|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Memory Throughput|Compute \(SM\) Throughput|L2 Hit|Grid Size|Cluster|Waves' "$o/ncu-$(echo "$k" | tr -c 'a-z0-9_\n' '_').txt" | head -40
done
echo "done in $((SECONDS - t0)) s"
