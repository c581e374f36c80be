#!/usr/bin/env bash
# Multi-GPU data parallelism, everything in one device call on a 2-GPU machine (nvidia-h200-x2):
# (the 2-GPU tests are #[ignore]d in the normal suite; here they run with --include-ignored)
#   1. the GPU test suite with the 2-GPU tests required (CUDAGRAPH_REQUIRE_GPUS=2),
#   2. `cudagraph train --nproc 2` on the digits, eager and graphed (+ one GPU for reference),
#   3. `cudagraph bench ddp` (1 and 2 GPUs, eager vs graph) beside PyTorch DDP (bench/pytorch_ddp.py),
#   4. failure handling: a rank that crashes (with and without the launcher), a rank that stalls,
#      a rendezvous nobody answers,
# then a summary. Needs .gpu-bin/ (../shared/tools/gpu-bundle); results in $OUT/ddp/ (+ .tar.gz).
# Every step has a time limit; a normal run takes about 5 minutes.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
export NCCL_NVLS_ENABLE=0          # never NVLink SHARP / multicast on this machine
export RUST_BACKTRACE=1
res="$OUT/ddp"
mkdir -p "$res"
stamp=$(date -u +%Y-%m-%d)
bin=.gpu-bin/bin/cudagraph
[ -x "$bin" ] || { echo "no $bin: run ../shared/tools/gpu-bundle first"; exit 2; }
summary=()
note() { summary+=("$1"); echo "$1"; }
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.1f}')"; }

{ nvidia-smi -L; nvidia-smi topo -m; } > "$res/device.txt" 2>&1
head -n 2 "$res/device.txt"

# NCCL: cudarc finds libnccl.so on the loader path; otherwise point at a libnccl.so.2.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
  [ -z "$lib" ] && lib=$(python3 -c "import nvidia.nccl, os; d=os.path.join(list(nvidia.nccl.__path__)[0], 'lib'); print(os.path.join(d, 'libnccl.so.2'))" 2>/dev/null)
  [ -n "$lib" ] && [ -e "$lib" ] && export CUDAGRAPH_NCCL_LIB="$lib"
fi
echo "NCCL library: ${CUDAGRAPH_NCCL_LIB:-libnccl.so from the loader path}" | tee "$res/nccl.txt"

# 1. Tests (the 2-GPU ones must run, not skip).
t=$(now)
CUDAGRAPH_REQUIRE_GPUS=2 timeout 300 bash .gpu-bin/run-tests.sh --include-ignored > "$res/gpu-tests-$stamp.log" 2>&1
rc=$?
note "GPU tests (CUDAGRAPH_REQUIRE_GPUS=2, rc $rc, $(secs "$t" "$(now)") s): $(tail -n 1 "$res/gpu-tests-$stamp.log")"
for name in two_rank_graphed_training_matches_one_rank_on_the_full_batch \
            ddp_eager_and_graphed_steps_agree_on_every_rank \
            a_rank_that_fails_mid_training_makes_the_other_fail_within_seconds \
            a_stalled_rank_makes_the_other_time_out_and_abort; do
  line=$(grep -E "^test $name \.\.\. " "$res/gpu-tests-$stamp.log" | tail -n 1)
  note "  ${line:-test $name: NOT RUN}"
done
# The data-parallel tests again, with their measurements shown (tolerances, detection times).
for b in .gpu-bin/tests/gpu_dist-* .gpu-bin/tests/gpu_dist_failure-* .gpu-bin/tests/gpu_dist_timeout-*; do
  [ -x "$b" ] && CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_REQUIRE_GPUS=2 timeout 100 "$b" --test-threads=1 --include-ignored --show-output
done > "$res/dist-tests-$stamp.log" 2>&1
grep -E "parameter [0-9]: relative difference|eager vs graphed relative|rank 0 (failed|timed out) after|^test result" "$res/dist-tests-$stamp.log" | sed 's/^/  /' | head -n 16

# 2. Training on the digits: one GPU, then two (eager, graphed).
timeout 120 "$bin" train --graph > "$res/train-1gpu-graph.log" 2>&1
note "train 1 GPU graphed (rc $?): $(grep -E '^cudagraph:|^test accuracy' "$res/train-1gpu-graph.log" | tr '\n' ' ')"
for mode in "" "--graph"; do
  log="$res/train-2gpu${mode:+-graph}.log"
  timeout 150 "$bin" train --nproc 2 $mode > "$log" 2>&1
  rc=$?
  note "train --nproc 2 ${mode:-(eager)} (rc $rc):"
  grep -E "DDP x2: .* steps in" "$log" | sed 's/^/  /'
  [ $rc -eq 0 ] || tail -n 5 "$log" | sed 's/^/  /'
done

# 3. Benchmarks, ours then PyTorch's, in the same run.
timeout 240 "$bin" bench ddp --json > "$res/bench-ddp-ours.json" 2> "$res/bench-ddp-ours.log"
note "cudagraph bench ddp (rc $?)"
PYTHONUNBUFFERED=1 timeout -k 10 240 python3 bench/pytorch_ddp.py > "$res/bench-ddp-pytorch.json" 2> "$res/bench-ddp-pytorch.log"
note "bench/pytorch_ddp.py (rc $?)"
if python3 bench/compare_ddp.py "$res/bench-ddp-ours.json" "$res/bench-ddp-pytorch.json" > "$res/bench-ddp-$stamp.md" 2>> "$res/bench-ddp-pytorch.log"; then
  cat "$res/bench-ddp-$stamp.md"
  while IFS= read -r l; do note "$l"; done < <(grep -E '^- target' "$res/bench-ddp-$stamp.md")
else
  note "comparison failed: see $res/bench-ddp-*.log"; tail -n 20 "$res/bench-ddp-ours.log" "$res/bench-ddp-pytorch.log"
fi

# 4. Failure handling. Ranks started by hand get the launcher's variables.
port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
rank_env() { echo "RANK=$1 WORLD_SIZE=2 LOCAL_RANK=$1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2"; }

# 4a. Through the launcher: rank 1 exits (status 3) at step 20; the launcher stops rank 0.
t=$(now)
timeout 120 "$bin" train --nproc 2 --graph --fail-rank 1 --fail-at-step 20 > "$res/fail-launcher.log" 2>&1
rc=$?
note "4a launcher, rank 1 crashes at step 20: exit $rc after $(secs "$t" "$(now)") s (want non-zero): $(grep -E 'injected|the job failed' "$res/fail-launcher.log" | tr '\n' ' ')"

# 4b. No launcher: rank 1 crashes at step 20, rank 0 must notice by itself (peer monitor).
p=$(port)
env $(rank_env 0 "$p") timeout 120 "$bin" train --graph > "$res/fail-crash-rank0.log" 2>&1 & r0=$!
env $(rank_env 1 "$p") timeout 120 "$bin" train --graph --fail-rank 1 --fail-at-step 20 > "$res/fail-crash-rank1.log" 2>&1 & r1=$!
wait $r1; rc1=$?; t1=$(now)
wait $r0; rc0=$?; t0=$(now)
note "4b rank 1 crashed (exit $rc1); rank 0 exited $rc0 $(secs "$t1" "$t0") s later (want non-zero, within seconds): $(grep -E '^error' "$res/fail-crash-rank0.log" | head -n 1)"

# 4c. No launcher: rank 1 stalls at step 20 (alive, heartbeats fine): rank 0's watchdog must
#     time out (CUDAGRAPH_DIST_TIMEOUT=10) and abort.
p=$(port)
t=$(now)
env $(rank_env 0 "$p") CUDAGRAPH_DIST_TIMEOUT=10 timeout 120 "$bin" train --graph > "$res/fail-stall-rank0.log" 2>&1 & r0=$!
env $(rank_env 1 "$p") CUDAGRAPH_DIST_TIMEOUT=10 timeout 120 "$bin" train --graph --fail-rank 1 --fail-at-step 20 --fail-mode hang > "$res/fail-stall-rank1.log" 2>&1 & r1=$!
wait $r0; rc0=$?; t0=$(now)
kill -9 $r1 2>/dev/null; wait $r1 2>/dev/null
note "4c rank 1 stalls at step 20: rank 0 exited $rc0 after $(secs "$t" "$t0") s in all, timeout 10 s (want non-zero, not 124): $(grep -E '^error' "$res/fail-stall-rank0.log" | head -n 1)"

# 4d. A rendezvous nobody answers: rank 1 alone, then rank 0 alone (5 s limit).
p=$(port)
t=$(now)
env $(rank_env 1 "$p") CUDAGRAPH_RDZV_TIMEOUT=5 timeout 60 "$bin" train > "$res/fail-rdzv-rank1.log" 2>&1
rc=$?
note "4d rank 1 without rank 0: exit $rc after $(secs "$t" "$(now)") s: $(grep -E '^error' "$res/fail-rdzv-rank1.log" | head -n 1)"
t=$(now)
env $(rank_env 0 "$(port)") CUDAGRAPH_RDZV_TIMEOUT=5 timeout 60 "$bin" train > "$res/fail-rdzv-rank0.log" 2>&1
rc=$?
note "4d rank 0 without rank 1: exit $rc after $(secs "$t" "$(now)") s: $(grep -E '^error' "$res/fail-rdzv-rank0.log" | head -n 1)"

echo
echo "==================== summary ===================="
printf '%s\n' "${summary[@]}" | tee "$res/summary-$stamp.txt"
tar -C "$OUT" -czf "$OUT/ddp-results.tar.gz" ddp
