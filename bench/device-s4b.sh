#!/usr/bin/env bash
# 2026-11-23, fourth session, second device call: the GPU suite, the seed bench and the whole
# shape sweep beside PyTorch, the raw-CUDA WHILE-body sanitizer check (bench/raw/
# while_sanitize.cu), `bench gemm`, ncu kernel times of the seed MLP at batch 32, and `bench
# cache`. Each part has its own limit so the call ends inside 10 minutes; everything lands in
# $OUT/s4b.tar.gz. Needs .gpu-bin/ (../shared/tools/gpu-bundle) and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s4b"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
parts=" ${PARTS:-suite copy sweep bench raw gemm ncu cache} "
# A part starts only while the call has time left for it (the device call ends at 600 s).
want() { [[ $parts == *" $1 "* ]] && (( SECONDS - t0 < ${DEADLINE_S:-480} )); }
nvidia-smi -L | tee "$r/device.txt"
if want suite; then
  timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
  grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
  tail -n 2 "$r/gpu-tests-$d.log"
fi
if want copy; then
  echo "--- copy kernel on: core and NN tests, seed MLP and cache ($((SECONDS - t0)) s)"
  for t in gpu_core gpu_nn gpu_soundness gpu_misuse_streams; do
    CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_COPY_KERNEL=1 timeout 90 .gpu-bin/tests/$t-* --test-threads=1 2>&1 | grep -E '^test result|FAILED|panicked' | grep -v 'host-function' | sed "s/^/$t: /"
  done | tee "$r/copy-kernel-tests.txt"
  for c in 0 1; do CUDAGRAPH_COPY_KERNEL=$c timeout 30 $b bench --only mlp,mlp-host --batch-sizes 1,32,256 2>&1 | grep -E 'mlp' | sed "s/^/COPY_KERNEL=$c: /"; done | tee "$r/copy-kernel-mlp.txt"
fi
if want sweep; then
  echo "--- sweep beside PyTorch ($((SECONDS - t0)) s)"
  OUT="$r" SWEEP_ONLY=${SWEEP_ONLY:-} timeout 150 bash bench/device-sweep.sh
fi
if want bench; then
  echo "--- seed bench beside PyTorch ($((SECONDS - t0)) s)"
  ours="$b bench --json --svg $r/bench-$d.svg"
  timeout 90 $ours > "$r/bench-ours.json" 2> "$r/bench-ours.log"
  PYTHONUNBUFFERED=1 timeout 90 python3 bench/pytorch_baseline.py > "$r/bench-pytorch.json" 2> "$r/bench-pytorch.log"
  { echo "# cudagraph bench vs PyTorch — $d"; echo
    python3 bench/compare.py "$r/bench-ours.json" "$r/bench-pytorch.json" "$ours; python3 bench/pytorch_baseline.py"; } > "$r/bench-$d.md"
  grep -E '^\| (mlp|linear|shared|dropout)' "$r/bench-$d.md"
fi
if want raw; then
  echo "--- raw CUDA WHILE body under compute-sanitizer ($((SECONDS - t0)) s)"
  nvcc -O2 -arch=sm_90 -rdc=true bench/raw/while_sanitize.cu -lcudadevrt -o /tmp/while_sanitize > "$r/raw-build.log" 2>&1 || tail -n 5 "$r/raw-build.log"
  { /tmp/while_sanitize; for tool in memcheck synccheck racecheck initcheck; do echo "== $tool"; timeout 60 compute-sanitizer --tool $tool --print-limit 5 /tmp/while_sanitize; done; } > "$r/raw-while-sanitize.txt" 2>&1
  grep -E 'results|ok|FAILED|== |ERROR SUMMARY|RACECHECK SUMMARY' "$r/raw-while-sanitize.txt"
fi
if want gemm; then
  echo "--- bench gemm ($((SECONDS - t0)) s)"
  timeout 60 $b bench gemm > "$r/gemm-$d.txt" 2>&1; cat "$r/gemm-$d.txt"
fi
if want ncu; then
  echo "--- ncu, seed MLP bs 32 ($((SECONDS - t0)) s)"
  timeout 60 ncu --graph-profiling node --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    $b bench --only mlp --batch-sizes 32 --iters 3 --repeats 1 > "$r/ncu-mlp32.txt" 2>&1
  grep -E '^  [a-zA-Z_].*\(|gpu__time_duration' "$r/ncu-mlp32.txt" | paste - - | awk '{print $NF"  "$1" "$2" "$3" "$4}' | tail -n 8
  for p in 0 1; do CUDAGRAPH_PDL=$p timeout 20 $b bench --only mlp --batch-sizes 1,8,32,256 2>&1 | tail -n 5 | sed "s/^/PDL=$p: /"; done | tee "$r/mlp-pdl.txt"
fi
if want cache; then
  echo "--- bench cache ($((SECONDS - t0)) s)"
  timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
  CUDAGRAPH_COPY_KERNEL=1 timeout 60 $b bench cache > "$r/cache-copykernel-$d.txt" 2>&1; head -n 8 "$r/cache-copykernel-$d.txt" | sed 's/^/COPY_KERNEL=1: /'
fi
tar -czf "$o/s4b.tar.gz" -C "$o" s4b
echo "done in $((SECONDS - t0)) s"
