#!/usr/bin/env bash
# Builds, on a machine with the Rust toolchain, everything the GPU machine needs, and gathers it
# into .gpu-bin/ at the repository root (ignored by git):
#
#   .gpu-bin/tests/         every test binary of the workspace (release profile, stripped)
#   .gpu-bin/bin/           the release binaries (the `cudagraph` CLI, with the `tokenizers` feature)
#   .gpu-bin/run-tests.sh   the GPU suite runner: every test binary with the GPU required
#   .gpu-bin/BUILD          the commit the binaries were built from, and when
#
# The GPU machine needs no Rust toolchain, only the repository's working tree and .gpu-bin/:
#
#   bash bench/bundle.sh                          # here
#   bash bench/device.sh suite seed               # there, from the repository root
#
# Usage: bash bench/bundle.sh [extra cargo arguments, e.g. -p cudagraph]
#   BASE=<git revision>   also build the CLI of that revision into .gpu-bin/bin/cudagraph-base.gz,
#                         for `bench/device.sh ab` (old and new binaries measured in one call).
#
# The runner (.gpu-bin/run-tests.sh [libtest arguments]) sets CUDAGRAPH_REQUIRE_GPU=1, so a test
# that would skip for want of a GPU fails instead; it runs each binary one test at a time (some
# tests measure the device's free memory), stops a binary after TEST_TIMEOUT_S seconds (default
# 300), and ends with one line: `N passed, M failed`, where M counts failed tests plus binaries
# that crashed or were stopped without reporting a result.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
cd "$root"
command -v cargo >/dev/null || { echo "bundle: cargo not found; install the Rust toolchain (rustup)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "bundle: python3 not found (used to read cargo's JSON messages)" >&2; exit 2; }

out=.gpu-bin
rm -rf "$out"
mkdir -p "$out/tests" "$out/bin"

# Executables named in cargo's JSON messages; $1 = "test" for test binaries, "bin" otherwise.
executables() {
  python3 -c '
import json, sys
want_test = sys.argv[1] == "test"
seen = set()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable") if m.get("reason") == "compiler-artifact" else None
    if not exe or bool(m.get("profile", {}).get("test")) != want_test or exe in seen:
        continue
    seen.add(exe)
    print(exe)
' "$1"
}

msgs=$(mktemp)
tree=""
cleanup() {
  rm -f "$msgs"
  if [ -n "$tree" ]; then git worktree remove --force "$tree" || true; fi
}
trap cleanup EXIT
echo "== building the test binaries (cargo test --workspace --release --no-run $*)"
cargo test --workspace --release --no-run --message-format=json "$@" >"$msgs"
mapfile -t tests < <(executables test <"$msgs")
# The CLI with Hugging Face tokenizers (`generate --prompt TEXT`, `--chat`; device.sh's chat part).
echo "== building the release binaries (cargo build --workspace --release --bins --features cudagraph-cli/tokenizers $*)"
cargo build --workspace --release --bins --features cudagraph-cli/tokenizers --message-format=json "$@" >"$msgs"
mapfile -t bins < <(executables bin <"$msgs")
[ "${#tests[@]}" -gt 0 ] || { echo "bundle: cargo built no test binaries" >&2; exit 1; }
cp "${tests[@]}" "$out/tests/"
[ "${#bins[@]}" -eq 0 ] || cp "${bins[@]}" "$out/bin/"
strip "$out"/tests/* "$out"/bin/* 2>/dev/null || echo "bundle: strip failed or missing; binaries stay unstripped"

commit=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- . 2>/dev/null || commit="$commit with uncommitted changes"
{
  echo "commit: $commit"
  echo "built: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "rustc: $(rustc --version 2>/dev/null || echo unknown)"
} >"$out/BUILD"

if [ -n "${BASE:-}" ]; then
  echo "== building the CLI of $BASE for bench/device.sh ab"
  tree=$(mktemp -d)
  git worktree add --detach "$tree" "$BASE" >/dev/null
  (cd "$tree" && CARGO_TARGET_DIR=${BASE_TARGET_DIR:-$root/target/base} \
    cargo build --release -p cudagraph-cli --bin cudagraph --message-format=json) >"$msgs"
  base_exe=$(executables bin <"$msgs" | tail -n 1)
  strip "$base_exe" -o "$out/bin/cudagraph-base" 2>/dev/null || cp "$base_exe" "$out/bin/cudagraph-base"
  gzip -9 "$out/bin/cudagraph-base"
  echo "base: $(git rev-parse --short=12 "$BASE")" >>"$out/BUILD"
fi

cat >"$out/run-tests.sh" <<'RUN'
#!/usr/bin/env bash
# The GPU suite: every test binary in .gpu-bin/tests with the GPU required. Written by
# bench/bundle.sh; run from anywhere: bash .gpu-bin/run-tests.sh [libtest arguments].
cd "$(dirname "$0")/.." || exit 1
export CUDAGRAPH_REQUIRE_GPU=1 RUST_BACKTRACE=1
limit=${TEST_TIMEOUT_S:-300}
passed=0 failed=0 ignored=0 broken=0
failures=()
for t in .gpu-bin/tests/*; do
  name=$(basename "$t")
  echo "=== $name"
  start=$SECONDS
  out=$(timeout "$limit" "$t" --test-threads=1 "$@" 2>&1)
  rc=$?
  echo "$out" | tail -n 40
  line=$(echo "$out" | grep -E '^test result:' | tail -n 1)
  p=$(echo "$line" | sed -nE 's/.* ([0-9]+) passed.*/\1/p')
  f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
  i=$(echo "$line" | sed -nE 's/.* ([0-9]+) ignored.*/\1/p')
  p=${p:-0} f=${f:-0} i=${i:-0}
  # The gate prints this when there is no GPU; with CUDAGRAPH_REQUIRE_GPU=1 it must not happen.
  skips=$(echo "$out" | grep -c 'skipped: no CUDA device')
  if [ "$skips" -gt 0 ]; then
    f=$((f + skips))
    failures+=("$name: $skips tests skipped for want of a GPU")
  fi
  while IFS= read -r test; do
    [ -n "$test" ] && failures+=("$name: $test")
  done < <(echo "$out" | sed -nE 's/^test (.*) \.\.\. FAILED$/\1/p')
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    # Crashed or stopped before it could report a failing test: counts as one failure.
    broken=$((broken + 1)) f=1
    if [ "$rc" -eq 124 ]; then failures+=("$name: stopped after $limit s"); else failures+=("$name: exited $rc"); fi
  fi
  passed=$((passed + p)) failed=$((failed + f)) ignored=$((ignored + i))
  echo "binary $name: $p passed, $f failed, $i ignored, $((SECONDS - start)) s, rc $rc"
done
echo "GPU suite: $ignored ignored, $broken binaries crashed or stopped"
for x in "${failures[@]}"; do echo "FAILED $x"; done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
RUN
chmod +x "$out/run-tests.sh"

echo "gathered ${#tests[@]} test binaries and ${#bins[@]} binaries ($(du -sh "$out" | cut -f1)); $(head -n 1 "$out/BUILD")"
echo "on the GPU machine, from the repository root: bash bench/device.sh suite   (or bash .gpu-bin/run-tests.sh)"
