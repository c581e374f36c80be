#!/usr/bin/env bash
# 2026-11-23, fourth session, first device call: the GPU suite with the two wip/ patches applied,
# the conv/CNN part of the sweep beside PyTorch, the conditional-body sanitizer experiment
# (bench/device-sanexp.sh), and ncu kernel times (ours and PyTorch's) for the seed MLP at batch
# 32 and the worst sweep points. Everything lands in $OUT/s4a.tar.gz. Needs .gpu-bin/.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s4a"; mkdir -p "$r"
export CUDAGRAPH_CACHE_DIR=/tmp/cudagraph-cache
d=$(date -u +%Y-%m-%d); t0=$SECONDS; b=.gpu-bin/bin/cudagraph
nvidia-smi -L | tee "$r/device.txt"
timeout 170 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked' "$r/gpu-tests-$d.log" | head -10
tail -n 2 "$r/gpu-tests-$d.log"
echo "--- conv/cnn sweep beside PyTorch ($((SECONDS - t0)) s)"
OUT="$r" SWEEP_ONLY=conv-,cnn- SWEEP_NAME=sweep-conv timeout 150 bash bench/device-sweep.sh
echo "--- ncu ($((SECONDS - t0)) s)"
nc="ncu --graph-profiling node --clock-control none --cache-control none --metrics gpu__time_duration.sum"
timeout 60 $nc $b bench --only mlp --batch-sizes 32 --iters 3 --repeats 1 > "$r/ncu-mlp32.txt" 2>&1
pts=conv-n2-c3-o16-224px-k3-s1-p1,conv-n128-c3-o32-32px-k3-s1-p1,conv-n32-c1-o1-32px-k3-s1-p0,cnn-b16-64px-c16-d4,ce-r64-c10000
timeout 90 $nc $b bench sweep --only $pts --sample-ms 0.01 --repeats 1 > "$r/ncu-ours.txt" 2>&1
timeout 120 $nc python3 bench/pytorch_sweep.py --only $pts --sample-ms 0.01 --repeats 1 > "$r/ncu-torch.txt" 2>&1
grep -c 'gpu__time_duration' "$r"/ncu-*.txt
echo "--- sanitizer experiment ($((SECONDS - t0)) s)"
OUT="$r" timeout 200 bash bench/device-sanexp.sh | tail -n 14
tar -czf "$o/s4a.tar.gz" -C "$o" s4a
echo "done in $((SECONDS - t0)) s"
