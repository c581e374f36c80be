#!/usr/bin/env bash
# 2026-11-23, fourth session, final device call: the GPU suite, the whole shape sweep and the
# seed bench beside PyTorch, `bench cache`, the dependent-kernel chain beside raw CUDA and
# PyTorch (bench/device-chain.sh), `bench gemm`, and the seed MLP with PDL off and on. Each part
# starts only while time is left; everything lands in $OUT/s4c.tar.gz. Needs .gpu-bin/
# (../shared/tools/gpu-bundle) and python3 with torch.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s4c"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
parts=" ${PARTS:-suite sweep bench cache chain gemm pdl} "
# A part starts only while the call has time left for it (the device call ends at 600 s).
want() { [[ $parts == *" $1 "* ]] && (( SECONDS - t0 < ${DEADLINE_S:-480} )); }
nvidia-smi -L | tee "$r/device.txt"
if want suite; then
  timeout 230 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
  grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
  tail -n 2 "$r/gpu-tests-$d.log"
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
if want gemm; then
  echo "--- bench gemm ($((SECONDS - t0)) s)"
  timeout 60 $b bench gemm > "$r/gemm-$d.txt" 2>&1; cat "$r/gemm-$d.txt"
fi
if want cache; then
  echo "--- bench cache ($((SECONDS - t0)) s)"
  timeout 60 $b bench cache > "$r/cache-$d.txt" 2>&1; head -n 8 "$r/cache-$d.txt"
fi
if want chain; then
  echo "--- chain beside raw CUDA and PyTorch ($((SECONDS - t0)) s)"
  OUT="$r" timeout 120 bash bench/device-chain.sh | tail -n 12
fi
if want pdl; then
  echo "--- seed MLP, NN kernels plain vs PDL ($((SECONDS - t0)) s)"
  for p in 0 1; do CUDAGRAPH_PDL=$p timeout 20 $b bench --only mlp --batch-sizes 1,8,32,256 2>&1 | tail -n 5 | sed "s/^/PDL=$p: /"; done | tee "$r/mlp-pdl.txt"
fi
tar -czf "$o/s4c.tar.gz" -C "$o" s4c
echo "done in $((SECONDS - t0)) s"
