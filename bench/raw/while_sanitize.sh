#!/usr/bin/env bash
# Builds bench/raw/while_sanitize.cu and runs each scenario (default, pdl, reuse, ptx) plainly
# and under compute-sanitizer's memcheck, initcheck, synccheck and racecheck, 60 s each: a
# `== <scenario> <tool>` header, the first 40 lines of the output, the tool's summary line(s) and
# the exit code. Then, as the failures of cudagraph's WHILE tests are intermittent, the ptx
# scenario 4 more times under memcheck and 4 under initcheck (only the summary, result, failed-call
# and illegal-address lines, and the exit code). Goes on after failures; everything goes to
# stdout. Run on the GPU machine, from any directory:
#     bash bench/raw/while_sanitize.sh > bench/results/raw-while-sanitize-<date>.txt
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
BIN=/tmp/while_sanitize
# -rdc=true and libcudadevrt: cudaGraphSetConditional is a device-runtime function; libcuda: the
# ptx scenario loads cudagraph's condition kernels with the driver API.
echo "== build"
nvcc -O2 -arch=sm_90 -rdc=true -o "$BIN" bench/raw/while_sanitize.cu -lcudadevrt -lcuda 2>&1
rc=$?
echo "exit code: $rc"
[ "$rc" -eq 0 ] || exit "$rc"
nvcc --version 2>&1 | tail -n 2
compute-sanitizer --version 2>&1 | tail -n 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1

log=$(mktemp)
trap 'rm -f "$log"' EXIT
for scenario in default pdl reuse ptx; do
    args=()
    [ "$scenario" = default ] || args=("$scenario")
    for tool in plain memcheck initcheck synccheck racecheck; do
        echo "== $scenario $tool"
        if [ "$tool" = plain ]; then
            timeout 60 "$BIN" ${args[@]+"${args[@]}"} >"$log" 2>&1
        else
            timeout 60 compute-sanitizer --tool "$tool" "$BIN" ${args[@]+"${args[@]}"} >"$log" 2>&1
        fi
        rc=$?
        head -n 40 "$log"
        if [ "$tool" != plain ]; then
            echo "-- summary:"
            grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" || echo "(no ERROR SUMMARY line)"
        fi
        [ "$rc" -eq 124 ] && echo "(timed out after 60 s)"
        echo "exit code: $rc"
    done
done
for tool in memcheck initcheck; do
    for run in 1 2 3 4; do
        echo "== ptx $tool, repeat $run"
        timeout 60 compute-sanitizer --tool "$tool" "$BIN" ptx >"$log" 2>&1
        rc=$?
        grep -iE "illegal|right results|MISMATCH| failed: |ERROR SUMMARY" "$log" ||
            echo "(no result or summary line)"
        [ "$rc" -eq 124 ] && echo "(timed out after 60 s)"
        echo "exit code: $rc"
    done
done
exit 0
