#!/usr/bin/env bash
# 2026-11-24, eighth session, call 10: the parallel gpu_engines segfault under cuda-gdb (there
# is no gdb on the machine): up to five runs; on a crash, the crashing thread's backtrace and
# the other threads' top frames. Logs in $OUT/s8i/.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s8i"; mkdir -p "$r"
export CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_CACHE_DIR=/tmp/cg-dbg
for i in 1 2 3 4 5; do
  timeout 150 cuda-gdb -batch -ex "set pagination off" -ex "handle SIGPIPE nostop noprint" \
    -ex run -ex "bt 40" -ex "info threads" --args .gpu-bin/dbg/gpu_engines > "$r/run-$i.log" 2>&1
  if grep -q "SIGSEGV" "$r/run-$i.log"; then echo "run $i: SIGSEGV"; grep -A45 "SIGSEGV" "$r/run-$i.log" | grep -E "^#|SIGSEGV" | head -45; break; fi
  echo "run $i: $(grep -E 'test result' "$r/run-$i.log" | tail -n1)"
done
