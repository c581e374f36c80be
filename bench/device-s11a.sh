#!/usr/bin/env bash
# 2026-11-24, eleventh session, call 1: the GPU suite (one copy kernel for every copy; GEMM
# kernels that load their bias before the main loop); then the Linear and cross-entropy kinds
# of the sweep with the binary before the bias change (`cudagraph-base`, commit c7f356b), the
# binary after it and PyTorch, two rounds, alternating, each binary with its own cache and
# engine registry.
set -uo pipefail
o=${OUT:-/tmp/out}; r="$o/s11a"; mkdir -p "$r"
d=$(date -u +%Y-%m-%d); t0=$SECONDS
nvidia-smi -L | tee "$r/device.txt"
# The binary before the change travels gzipped (the carry limit).
[ -f .gpu-bin/bin/cudagraph-base.gz ] && gunzip -f .gpu-bin/bin/cudagraph-base.gz
CUDAGRAPH_CACHE_DIR=/tmp/cg-new timeout 220 bash .gpu-bin/run-tests.sh > "$r/gpu-tests-$d.log" 2>&1
grep -E '^test .*FAILED|panicked at' "$r/gpu-tests-$d.log" | grep -v 'host-function node panicked' | head -12
tail -n 2 "$r/gpu-tests-$d.log"; echo "suite done ($((SECONDS - t0)) s)"
only="linear-,ce-"
for round in 1 2; do
  for side in base new torch; do
    case $side in
      base) CUDAGRAPH_CACHE_DIR=/tmp/cg-base timeout 150 .gpu-bin/bin/cudagraph-base bench sweep --json --only $only > "$r/$side-$round.json" 2>> "$r/$side.log" ;;
      new) CUDAGRAPH_CACHE_DIR=/tmp/cg-new timeout 150 .gpu-bin/bin/cudagraph bench sweep --json --only $only > "$r/$side-$round.json" 2>> "$r/$side.log" ;;
      torch) PYTHONUNBUFFERED=1 timeout 150 python3 bench/pytorch_sweep.py --only $only > "$r/$side-$round.json" 2>> "$r/$side.log" ;;
    esac
    echo "round $round $side done ($((SECONDS - t0)) s)"
  done
done
for side in base new torch; do python3 bench/sweep_merge.py --rounds 2 "$r/$side-1.json" "$r/$side-2.json" > "$r/$side.json"; done
cmd="bash bench/device-s11a.sh (two rounds of: cudagraph-base, cudagraph, pytorch_sweep.py with --only $only)"
python3 bench/sweep_compare.py "$r/new.json" "$r/torch.json" "$cmd" > "$r/sweep-new.md"
python3 bench/sweep_compare.py "$r/base.json" "$r/torch.json" "$cmd" > "$r/sweep-base.md"
python3 bench/ab_compare.py "$r/base.json" "$r/new.json" base new > "$r/ab.md"
grep -E '^\*\*|^Per kind' "$r/sweep-new.md" "$r/sweep-base.md"
grep '⚠' "$r/sweep-new.md" | head; tail -n 3 "$r/ab.md"
cd "$o" && tar czf s11a.tgz s11a
echo "all done ($((SECONDS - t0)) s)"
