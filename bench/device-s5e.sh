#!/usr/bin/env bash
# 2026-11-23, fifth session: the raw-CUDA conditional-body programs under every
# compute-sanitizer tool (bench/raw/while_sanitize.sh: default, pdl and reuse scenarios), then
# every tool over every GPU test binary and the CLI's main paths (bench/sanitize.sh, each
# conditional-body test in its own process). Logs in $OUT/sanitize.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"; t0=$SECONDS
nvidia-smi -L
timeout 100 bash bench/raw/while_sanitize.sh > "$o/raw-while-sanitize.txt" 2>&1
grep -E "^== |SUMMARY|exit code|right results|mismatch|edges|base|reuse" "$o/raw-while-sanitize.txt" | head -90
echo "--- bench/sanitize.sh ($((SECONDS - t0)) s)"
OUT="$o/s" JOBS=${JOBS:-12} JOB_LIMIT_S=${JOB_LIMIT_S:-330} timeout ${SANITIZE_LIMIT_S:-440} bash bench/sanitize.sh > "$o/sanitize-run.txt" 2>&1
echo "sanitize.sh exit $? after $((SECONDS - t0)) s"
[ -s "$o/s/sanitize/summary.txt" ] || OUT="$o/s" SUMMARY_ONLY=1 bash bench/sanitize.sh > /dev/null 2>&1
cat "$o/s/sanitize/summary.txt"
for f in "$o"/s/sanitize/*.log; do
  n=$(grep -cE '^========= (Invalid|Barrier|Uninitialized|Program hit|Race|Warning)' "$f")
  [ "$n" -gt 0 ] && { echo "## $(basename "$f"): $n"; grep -E -m 4 -A4 '^========= (Invalid|Barrier|Uninitialized|Program hit|Race|Warning)' "$f"; }
done > "$o/sanitize-reports.txt"
head -n 60 "$o/sanitize-reports.txt"
tar -czf "$o/sanitize.tar.gz" -C "$o/s" sanitize; rm -rf "$o/s"
echo "done in $((SECONDS - t0)) s"
