#!/usr/bin/env bash
# 2026-11-23, sixth session, final code: the GPU suite, the whole shape sweep and the seed bench
# beside PyTorch, `bench cache` and `bench gemm` (bench/device-s4c.sh with those parts), all in
# $OUT/s4c.tar.gz. The sanitizers run in a call of their own (bench/device-s5e.sh).
set -uo pipefail
PARTS="suite sweep bench cache gemm" DEADLINE_S=480 bash bench/device-s4c.sh
