#!/usr/bin/env bash
# 2026-11-23, fifth session: every compute-sanitizer tool over every GPU test binary and the
# CLI's main paths (bench/sanitize.sh: 12 jobs at a time, 240 s each at most), the summary
# recomputed from the logs if the call's limit stops the script. Logs in $OUT/sanitize.tar.gz.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"; t0=$SECONDS
nvidia-smi -L
OUT="$o/s" JOBS=${JOBS:-12} JOB_LIMIT_S=${JOB_LIMIT_S:-240} timeout ${SANITIZE_LIMIT_S:-540} bash bench/sanitize.sh > "$o/sanitize-run.txt" 2>&1
rc=$?
echo "sanitize.sh exit $rc after $((SECONDS - t0)) s"
if [ ! -s "$o/s/sanitize/summary.txt" ]; then
  OUT="$o/s" SUMMARY_ONLY=1 bash bench/sanitize.sh > "$o/sanitize-summary-only.txt" 2>&1
fi
cat "$o/s/sanitize/summary.txt"
# The first reports of every log that has any (for the notes).
for f in "$o"/s/sanitize/*.log; do
  n=$(grep -cE '^========= (Invalid|Barrier|Uninitialized|Error|Program hit|Race)' "$f")
  [ "$n" -gt 0 ] && { echo "## $(basename "$f"): $n"; grep -E -m 6 -A3 '^========= (Invalid|Barrier|Uninitialized|Error|Program hit|Race)' "$f"; }
done > "$o/sanitize-reports.txt"
head -n 120 "$o/sanitize-reports.txt"
tar -czf "$o/sanitize.tar.gz" -C "$o/s" sanitize
rm -rf "$o/s"
echo "done in $((SECONDS - t0)) s"
