#!/usr/bin/env bash
# The one entry point for measurements and checks on a GPU machine. Runs from the repository
# root, with the binaries of bench/bundle.sh in .gpu-bin/ (no Rust toolchain needed there) and,
# for the comparisons, python3 with PyTorch:
#
#     bash bench/bundle.sh                  # where cargo is: build and gather .gpu-bin/
#     bash bench/device.sh suite seed       # on the GPU machine
#     bash bench/device.sh --help           # the parts, their knobs and what each writes
#
# Each part writes one current file, bench/results/PART-DEVICE.md (+ .json where the part has
# structured data), with the device, the date, the exact command and, where PyTorch does the
# same work, ours and PyTorch side by side. DEVICE comes from nvidia-smi: `h100`, `h200`,
# `2xh200`, … (set DEVICE= to override). Logs go to bench/results/logs/ (ignored by git).
# When OUT is set (the device tool's output folder), the result files are packed into
# $OUT/results.tgz, the logs into $OUT/logs.tgz and a summary into $OUT/summary.txt;
# `tar -xzf results.tgz` in the repository root puts the results in place.
#
# Every part and every step has a time limit, and all parts of one call share a budget of
# TIME_BUDGET_S seconds (default 570, under the device call limit of 600): a part that cannot
# get the time it needs is skipped and reported, so run long parts in calls of their own.
# Each part starts from an empty engine registry (a first process's measurement), unless
# CUDAGRAPH_CACHE_DIR names a directory of the caller's, which is used as it is.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

RES=bench/results
LOGS=$RES/logs
BIN=.gpu-bin/bin/cudagraph
BUDGET=${TIME_BUDGET_S:-570}
START=$SECONDS
# The kernel cache and engine registry: this script's own directory unless the caller names
# one (OWN_CACHE=0: the caller's, left as it is).
OWN_CACHE=1
[ -n "${CUDAGRAPH_CACHE_DIR:-}" ] && OWN_CACHE=0
export CUDAGRAPH_CACHE_DIR=${CUDAGRAPH_CACHE_DIR:-/tmp/cudagraph-cache}
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1

# part|seconds it needs at least|what it runs|knobs (environment variables it reads)
PARTS=(
  "suite|120|the GPU test suite (.gpu-bin/run-tests.sh, GPU required); with 2+ GPUs the two-GPU tests too|SUITE_ARGS TEST_TIMEOUT_S SUITE_TIMEOUT_S"
  "seed|150|the seed workloads eager and graphed (cudagraph bench) beside bench/pytorch_baseline.py; SEED_DTYPE=bf16 (or f16) runs both under autocast and writes seed-DTYPE-DEVICE.md; + .json, .svg|SEED_ARGS SEED_DTYPE"
  "sweep|150|the shape grid, forward and training, both graphed, kinds alternating between ours and bench/pytorch_sweep.py; SWEEP_DTYPE=bf16 (or f16) runs both under autocast and writes sweep-DTYPE-DEVICE.md; + .json|SWEEP_ROUNDS SWEEP_KINDS SWEEP_DTYPE"
  "chain|60|k dependent tiny kernels, eager and graphed, with PDL: ours, raw CUDA (bench/raw/chain.cu, needs nvcc), PyTorch; + .json|"
  "cache|60|the seed MLP at random batch sizes through a GraphCache beside bench/pytorch_cache.py (dict of graphs); + .json|CACHE_COLD"
  "serve|60|cudagraph bench serve: 64 clients against the dynamic batcher, graph vs eager|SERVE_DURATION_S SERVE_CLIENTS"
  "soak|100|10^6 training-step replays and graph-cache requests; memory must stay flat|SOAK_REQUESTS"
  "ddp|240|two GPUs: cudagraph bench ddp beside bench/pytorch_ddp.py, the data-parallel tests, training, failure handling; + .json|DDP_STEPS"
  "sanitize|200|compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over the GPU suite and the CLI (bench/sanitize.sh)|SANITIZE_TOOLS SANITIZE_TESTS SANITIZE_FILTER SANITIZE_CLI SANITIZE_JOBS SANITIZE_JOB_LIMIT_S"
  "racecheck|150|racecheck over one test binary split by test name into parallel jobs|RACECHECK_BIN RACECHECK_JOBS"
  "while-sanitize|90|the raw CUDA WHILE-body program (bench/raw/while_sanitize.cu, needs nvcc) plainly and under every tool|"
  "engines|60|cudagraph bench engines: the registry's choice and every candidate's time for representative shapes|ENGINES_ARGS"
  "gemm|30|cudagraph bench gemm: the workloads' products on each engine family|"
  "gemm-lowp|150|cudagraph bench gemm --dtype bf16 and f16 (squares 1024³–8192³ and the workloads' products on tensor cores) beside bench/pytorch_gemm.py (torch.matmul, graphed too): µs, TFLOP/s, ratio, the large-product targets; GEMM_LOWP_CANDIDATES=G also times every candidate of products of at least G GFLOP (in the .json); + .json|GEMM_LOWP_DTYPES GEMM_LOWP_CANDIDATES"
  "rebind|20|cudagraph bench rebind: copy-in vs rebind vs re-capture per request|"
  "streams|30|cudagraph bench streams: what ordering replays of shared pools, graphs and caches across streams costs|"
  "train|60|digits training: eager, graphed, and k steps per graph launch (WHILE node), MLP and CNN|TRAIN_MODELS"
  "precision|90|digits training graphed in f32, bf16 autocast and f16 autocast with the loss scaler, PRECISION_SEEDS seeds each: mean test accuracy and µs per step|PRECISION_SEEDS TRAIN_MODELS"
  "ab|150|one build against another (BASE= in bench/bundle.sh) or one setting against another: sweep kinds and seed rows|AB_BASE AB_ENV_A AB_ENV_B AB_KINDS AB_ROUNDS AB_SEED AB_SEED_RUNS"
  "decode|300|cudagraph bench decode beside bench/decode_torch.py (transformers, StaticCache, torch.compile reduce-overhead), random-init gpt2-small and llama-1b from bench/hf_models.py; both models take about 350 s on an H100 (PyTorch compiles per shape; DECODE_MODELS=llama-1b for one); + .json|DECODE_MODELS DECODE_BATCHES DECODE_PROMPTS DECODE_STEPS DECODE_DTYPE"
  "chat|40|a chat turn through cudagraph generate --chat --show-prompt beside transformers' apply_chat_template and greedy generation (bench/hf_chat.py): a tiny Llama folder in f32 given a byte-level BPE tokenizer and a chat template in Llama 3's form; fails on a difference in the rendered text, the prompt ids, the greedy tokens or the reply|"
  "parity|90|tiny GPT-2 and Llama folders in f32 and bf16, Hugging Face logits (bench/hf_reference.py) then cudagraph bench parity; fails on any mismatch|PARITY_MODELS PARITY_DTYPES PARITY_ROWS PARITY_STEPS"
)

usage() {
  cat <<'EOF'
usage: bash bench/device.sh PART...     (on the GPU machine, from the repository root)

Parts (each writes bench/results/PART-DEVICE.md, + .json where noted):
EOF
  local p name need what knobs
  for p in "${PARTS[@]}"; do
    IFS='|' read -r name need what knobs <<<"$p"
    printf '  %-15s %s\n' "$name" "$what"
    [ -n "$knobs" ] && printf '  %-15s knobs: %s\n' "" "$knobs"
    printf '  %-15s needs at least %s s of the budget\n' "" "$need"
  done
  cat <<'EOF'

Knobs:
  SUITE_ARGS          libtest arguments for every test binary (e.g. a name filter)
  TEST_TIMEOUT_S      seconds one test binary may run (300)
  SEED_ARGS           extra arguments for `cudagraph bench` (e.g. --only mlp,train)
  SEED_DTYPE          f32 (default), bf16 or f16: both sides of the seed part under autocast
  SWEEP_ROUNDS        runs of every kind per side; each point keeps its faster run (1)
  SWEEP_KINDS         kinds of points ("linear- conv- ce- mlp- cnn- opt-")
  CACHE_COLD=1        start from an empty engine registry and kernel cache
  SERVE_DURATION_S    seconds per mode (15); SERVE_CLIENTS (64)
  SOAK_REQUESTS       replays and requests each (1000000)
  DDP_STEPS           any of "bench tests train failures" (all)
  SANITIZE_TOOLS      "memcheck racecheck synccheck initcheck"; SANITIZE_TESTS: binary names;
  SANITIZE_FILTER     libtest name filters; SANITIZE_CLI=0 leaves the CLI's paths out;
  SANITIZE_JOBS (8), SANITIZE_JOB_LIMIT_S (300)
  RACECHECK_BIN       test binary to split (gpu_nn); RACECHECK_JOBS (4)
  ENGINES_ARGS        e.g. --quick
  GEMM_LOWP_DTYPES    dtypes of the gemm-lowp part ("bf16 f16")
  TRAIN_MODELS        "mlp cnn"
  AB_BASE             binary A (default .gpu-bin/bin/cudagraph-base[.gz], from BASE= bench/bundle.sh)
  AB_ENV_A, AB_ENV_B  environment for side A / B (e.g. AB_ENV_B="CUDAGRAPH_PDL=1"; without a
                      base binary both sides run .gpu-bin/bin/cudagraph)
  AB_KINDS            sweep kinds ("linear- mlp-"); AB_ROUNDS (2); AB_SEED=0 skips the seed rows;
                      AB_SEED_RUNS seed runs per side (3)
  DECODE_MODELS       "gpt2-small llama-1b"; DECODE_BATCHES (1,8,32,64); DECODE_PROMPTS (128,1024);
  DECODE_STEPS        timed decode steps (64); DECODE_DTYPE (bf16); the folders live in /tmp/cg-hf/
  PARITY_MODELS       "gpt2-tiny llama-tiny qwen2-tiny mistral-tiny"; PARITY_DTYPES ("f32 bf16"); PARITY_ROWS (3);
  PARITY_STEPS        decode steps per row (32)
  TIME_BUDGET_S       seconds for all parts of this call (570); DEVICE overrides the device tag
  CUDAGRAPH_*         passed through to the library and recorded in each result's command
EOF
}

# ---------------------------------------------------------------- helpers

SUMMARY=()
WRITTEN=()
say() { echo "$*"; SUMMARY+=("$*"); }
left() { echo $((BUDGET - (SECONDS - START))); }
# tmo N: N seconds, or what is left of the budget if less (at least 1).
tmo() {
  local want=$1 l
  l=$(left)
  [ "$l" -lt "$want" ] && want=$l
  [ "$want" -lt 1 ] && want=1
  echo "$want"
}
written() { local f; for f in "$@"; do [ -e "$f" ] && WRITTEN+=("$f"); done; return 0; }
md_path() { echo "$RES/$1-$DEVICE.md"; }
# The reports (.md) written since WRITTEN held $1 entries; part $2's default name if none.
reports_since() {
  local f out=()
  for f in "${WRITTEN[@]:$1}"; do [[ $f == *.md ]] && out+=("$f"); done
  if [ ${#out[@]} -gt 0 ]; then echo "${out[*]}"; else md_path "$2"; fi
}

# The short tag of a GPU name: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA GeForce RTX 4090" -> rtx4090.
short_name() {
  local n w prev=""
  n=$(echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia|geforce|tesla//g')
  for w in $n; do
    if [[ $w =~ [0-9] ]]; then
      w=${w%%-*}
      [[ $prev =~ ^[a-z]+$ ]] && w=$prev$w
      echo "$w" | tr -cd 'a-z0-9'
      return
    fi
    prev=$w
  done
  echo gpu
}

detect_device() {
  command -v nvidia-smi >/dev/null || { echo "device.sh: nvidia-smi not found: this runs on a GPU machine" >&2; exit 2; }
  local names driver cuda
  mapfile -t names < <(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
  GPU_COUNT=${#names[@]}
  [ "$GPU_COUNT" -gt 0 ] || { echo "device.sh: nvidia-smi lists no GPU" >&2; exit 2; }
  local short
  short=$(short_name "${names[0]}")
  if [ "$GPU_COUNT" -gt 1 ]; then DEVICE=${DEVICE:-${GPU_COUNT}x$short}; else DEVICE=${DEVICE:-$short}; fi
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
  cuda=$(nvidia-smi | sed -nE 's/.*CUDA Version: ([0-9.]+).*/\1/p' | head -n 1)
  COMPUTE_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1)
  DEV_DESC="${names[0]}"
  [ "$GPU_COUNT" -gt 1 ] && DEV_DESC="$GPU_COUNT × ${names[0]}"
  DEV_DESC="$DEV_DESC (driver $driver, CUDA $cuda)"
  DATE=$(date -u +%Y-%m-%d)
  BUILD="unknown (no .gpu-bin/BUILD: build with bash bench/bundle.sh)"
  [ -f .gpu-bin/BUILD ] && BUILD=$(sed -n 's/^commit: //p' .gpu-bin/BUILD | head -n 1)
  export DEV_DESC DATE BUILD
}

# The environment variables a part reads (its knobs), from PARTS.
knobs() {
  local p name need what k
  for p in "${PARTS[@]}"; do
    IFS='|' read -r name need what k <<<"$p"
    [ "$name" = "$1" ] && { echo "$k"; return; }
  done
}
need_of() {
  local p name need rest
  for p in "${PARTS[@]}"; do
    IFS='|' read -r name need rest <<<"$p"
    [ "$name" = "$1" ] && { echo "$need"; return; }
  done
}

# The command that reproduces part $1: its knobs and the library's switches as set now.
command_for() {
  local v line=""
  for v in $(knobs "$1") $(compgen -e | grep '^CUDAGRAPH_' | grep -vE '^CUDAGRAPH_(CACHE_DIR|REQUIRE_GPUS?)$'); do
    [ -n "${!v:-}" ] && line+="$v=${!v@Q} "
  done
  echo "${line}bash bench/device.sh $1"
}

# header PART TITLE: the lines every result file starts with.
header() {
  echo "# $2"
  echo
  echo "- Device: $DEV_DESC"
  echo "- Date: $DATE"
  echo "- Command: \`$(command_for "$1")\`"
  echo "- Build: $BUILD"
  echo
}

# merge_json OUT PART NAME=FILE...: one JSON object with the run's metadata and each file.
merge_json() {
  local out=$1 part=$2
  shift 2
  COMMAND=$(command_for "$part") python3 - "$out" "$@" <<'PY'
import json, os, sys
doc = {"device": os.environ["DEV_DESC"], "date": os.environ["DATE"],
       "command": os.environ["COMMAND"], "build": os.environ["BUILD"]}
for arg in sys.argv[2:]:
    name, path = arg.split("=", 1)
    try:
        with open(path) as f:
            doc[name] = json.load(f)
    except (OSError, ValueError) as e:
        doc[name] = {"error": str(e)}
with open(sys.argv[1], "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
PY
  written "$out"
}

# code_block FILE: FILE's text as a Markdown code block.
code_block() { echo '```'; cat "$1"; echo '```'; }

# A PyTorch result that says why there is none, so the comparisons still print our side.
no_pytorch() { printf '{"torch": "not run", "device": "-", "rows": [], "notes": ["%s"]}\n' "$2" >"$1"; }

need_bin() {
  [ -x "$BIN" ] && return 0
  say "$1: no $BIN: run bash bench/bundle.sh where cargo is and carry .gpu-bin/ here"
  return 1
}

find_nvcc() {
  command -v nvcc 2>/dev/null && return
  [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc
}

test_binary() { find .gpu-bin/tests -maxdepth 1 -name "$1-*" -type f | sort | head -n 1; }

# ---------------------------------------------------------------- parts

part_suite() {
  local md log=$LOGS/suite-$DEVICE.log args=() env=() rc total
  [ -x .gpu-bin/run-tests.sh ] || { say "suite: no .gpu-bin/run-tests.sh: run bash bench/bundle.sh where cargo is"; return 1; }
  read -r -a args <<<"${SUITE_ARGS:-}"
  if [ "$GPU_COUNT" -ge 2 ]; then args+=(--include-ignored); env=(CUDAGRAPH_REQUIRE_GPUS=2); fi
  timeout "$(tmo "${SUITE_TIMEOUT_S:-450}")" env "${env[@]}" bash .gpu-bin/run-tests.sh "${args[@]}" >"$log" 2>&1
  rc=$?
  written "$log"
  total=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
  [ -n "$total" ] || total="no total line: the runner was stopped (exit status $rc)"
  md=$(md_path suite)
  {
    header suite "GPU test suite on $DEVICE"
    echo "**$total**"
    echo
    echo "$(grep -E '^GPU suite:' "$log" | tail -n 1)."
    if [ "$GPU_COUNT" -ge 2 ]; then
      echo "Two GPUs: the two-GPU tests ran too (\`--include-ignored\`, \`CUDAGRAPH_REQUIRE_GPUS=2\`)."
    else
      echo "Ignored tests need two GPUs; \`bash bench/device.sh suite\` runs them on a machine with two."
    fi
    if grep -q '^FAILED ' "$log"; then
      echo
      echo "Failures:"
      echo
      sed -n 's/^FAILED /- /p' "$log"
    fi
    echo
    echo "| test binary | passed | failed | ignored | seconds |"
    echo "|---|---:|---:|---:|---:|"
    sed -nE 's/^binary (.+)-[0-9a-f]+: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) ignored, ([0-9]+) s, rc .*/| \1 | \2 | \3 | \4 | \5 |/p' "$log"
  } >"$md"
  written "$md"
  say "suite: $total"
  [ "$rc" -eq 0 ]
}

part_seed() {
  need_bin seed || return 1
  # SEED_DTYPE=bf16|f16: both sides under autocast (`--dtype`), results in seed-DTYPE-DEVICE.*.
  local dtype=${SEED_DTYPE:-f32} name=seed dt=() title=""
  case $dtype in
    f32) ;;
    bf16 | f16) name=seed-$dtype dt=(--dtype "$dtype") title=" in $dtype autocast" ;;
    *) say "seed: SEED_DTYPE must be f32, bf16 or f16, not '$dtype'"; return 1 ;;
  esac
  local l=$LOGS/$name-$DEVICE md svg=$RES/$name-$DEVICE.svg ours=() extra=() chart=() pt=()
  mkdir -p "$l"
  read -r -a extra <<<"${SEED_ARGS:-}"
  ours=("$BIN" bench --json "${dt[@]}" "${extra[@]}")
  pt=(python3 bench/pytorch_baseline.py "${dt[@]}")
  if ! timeout "$(tmo 200)" "${ours[@]}" >"$l/ours.json" 2>"$l/ours.log"; then
    say "$name: cudagraph bench failed: $(tail -n 3 "$l/ours.log" | tr '\n' ' ')"
    return 1
  fi
  timeout "$(tmo 200)" "${pt[@]}" >"$l/pytorch.json" 2>"$l/pytorch.log" ||
    no_pytorch "$l/pytorch.json" "bench/pytorch_baseline.py failed: see logs/$name-$DEVICE/pytorch.log"
  # The chart, drawn from both runs' JSON after both measured (PyTorch's bars beside ours; ours
  # alone when PyTorch did not run). `cudagraph bench --from-json bench/results/seed-DEVICE.json
  # --svg FILE` redraws it from the committed results.
  chart=("$BIN" bench --from-json "$l/ours.json" --pytorch "$l/pytorch.json" --svg "$svg")
  rm -f "$svg"
  "${chart[@]}" >/dev/null 2>>"$l/ours.log" || say "$name: the chart was not drawn (logs/$name-$DEVICE/ours.log)"
  md=$(md_path "$name")
  {
    header seed "Seed workloads$title, eager and graphed: ours and PyTorch ($DEVICE)"
    python3 bench/compare.py "$l/ours.json" "$l/pytorch.json" \
      "${ours[*]}; ${pt[*]}; ${chart[*]}"
    [ -s "$svg" ] && printf '\n![ours and PyTorch, eager and graphed](%s)\n' "$(basename "$svg")"
  } >"$md"
  written "$md" "$svg" "$l"
  merge_json "$RES/$name-$DEVICE.json" seed ours="$l/ours.json" pytorch="$l/pytorch.json"
  say "$name: $(grep -cE '^\| [a-z]' "$md") rows; mlp-inference bs=32 graph: $(awk -F'|' '$2 ~ /mlp-inference/ && $3 ~ /bs=32 / {print $5 " µs ours, " $8 " µs PyTorch"}' "$md")"
}

part_sweep() {
  need_bin sweep || return 1
  local dtype=${SWEEP_DTYPE:-f32} name=sweep
  case $dtype in
    f32) ;;
    bf16 | f16) name=sweep-$dtype ;;
    *) say "sweep: SWEEP_DTYPE must be f32, bf16 or f16, not '$dtype'"; return 1 ;;
  esac
  local l=$LOGS/$name-$DEVICE md rounds=${SWEEP_ROUNDS:-1} kinds=${SWEEP_KINDS:-linear- conv- ce- mlp- cnn- opt-}
  local i=0 round kind
  rm -rf "$l"
  mkdir -p "$l/parts"
  sweep_side() { # side kind index
    local cmd
    if [ "$1" = ours ]; then cmd=("$BIN" bench sweep --json --dtype "$dtype" --only "$2"); else cmd=(python3 bench/pytorch_sweep.py --dtype "$dtype" --only "$2"); fi
    timeout "$(tmo 240)" "${cmd[@]}" >"$l/parts/$1-$3.json" 2>>"$l/$1.log" && return 0
    say "sweep: $1 failed or ran out of time on kind $2 (see logs/$name-$DEVICE/$1.log)"
    return 1
  }
  for round in $(seq "$rounds"); do
    for kind in $kinds; do
      # Which side goes first alternates, so neither always runs on a warmer or cooler GPU.
      if (((i + round) % 2 == 0)); then
        sweep_side ours "$kind" "$i" && sweep_side pytorch "$kind" "$i" || return 1
      else
        sweep_side pytorch "$kind" "$i" && sweep_side ours "$kind" "$i" || return 1
      fi
      echo "sweep: round $round, kind $kind done ($((SECONDS - START)) s)"
      i=$((i + 1))
    done
  done
  local side
  for side in ours pytorch; do
    mapfile -t files < <(find "$l/parts" -name "$side-*.json" | sort -V)
    python3 bench/sweep_merge.py --rounds "$rounds" "${files[@]}" >"$l/$side.json"
  done
  md=$(md_path "$name")
  {
    header sweep "Shape sweep in $dtype, both graphed: ours and PyTorch ($DEVICE)"
    python3 bench/sweep_compare.py "$l/ours.json" "$l/pytorch.json" \
      "per kind K, sides alternating: $BIN bench sweep --json --dtype $dtype --only K; python3 bench/pytorch_sweep.py --dtype $dtype --only K"
  } >"$md"
  written "$md" "$l"
  merge_json "$RES/$name-$DEVICE.json" sweep ours="$l/ours.json" pytorch="$l/pytorch.json"
  say "sweep: $(grep -E '^\*\*Geometric' "$md" | tr -d '*')"
}

part_chain() {
  need_bin chain || return 1
  local l=$LOGS/chain-$DEVICE md nvcc raw="-" raw_cmd="" pt=()
  mkdir -p "$l"
  nvcc=$(find_nvcc)
  if [ -n "$nvcc" ] && "$nvcc" -O3 -arch="sm_${COMPUTE_CAP//./}" bench/raw/chain.cu -o "$l/raw_chain" >"$l/nvcc.log" 2>&1; then
    if timeout "$(tmo 120)" "$l/raw_chain" 100000 7 >"$l/raw.json" 2>"$l/raw.log"; then
      raw="$l/raw.json"
      raw_cmd="; nvcc -O3 -arch=sm_${COMPUTE_CAP//./} bench/raw/chain.cu -o raw_chain && ./raw_chain 100000 7"
    fi
  else
    say "chain: the raw CUDA baseline was not built (nvcc ${nvcc:-not found}; logs/chain-$DEVICE/nvcc.log)"
  fi
  if ! timeout "$(tmo 150)" "$BIN" bench chain --pdl --json >"$l/ours.json" 2>"$l/ours.log"; then
    say "chain: cudagraph bench chain failed: $(tail -n 3 "$l/ours.log" | tr '\n' ' ')"
    return 1
  fi
  timeout "$(tmo 150)" python3 bench/pytorch_chain.py >"$l/pytorch.json" 2>"$l/pytorch.log" && pt=("$l/pytorch.json")
  md=$(md_path chain)
  {
    header chain "Launch cost per kernel, a chain of k tiny kernels: ours, raw CUDA and PyTorch ($DEVICE)"
    python3 bench/chain_compare.py "$l/ours.json" "$raw" \
      "$BIN bench chain --pdl --json$raw_cmd; python3 bench/pytorch_chain.py" "${pt[@]}"
  } >"$md"
  written "$md" "$l"
  merge_json "$RES/chain-$DEVICE.json" chain ours="$l/ours.json" raw="$l/raw.json" pytorch="$l/pytorch.json"
  say "chain: written"
}

part_cache() {
  need_bin cache || return 1
  local l=$LOGS/cache-$DEVICE md theirs="-"
  mkdir -p "$l"
  local dir=$CUDAGRAPH_CACHE_DIR
  if [ "${CACHE_COLD:-0}" = 1 ]; then dir=$l/cold-cache; rm -rf "$dir"; fi
  local t0=$SECONDS
  if ! CUDAGRAPH_CACHE_DIR=$dir timeout "$(tmo 200)" "$BIN" bench cache --json >"$l/ours.json" 2>"$l/ours.log"; then
    say "cache: cudagraph bench cache failed: $(tail -n 3 "$l/ours.log" | tr '\n' ' ')"
    return 1
  fi
  local took=$((SECONDS - t0))
  timeout "$(tmo 120)" python3 bench/pytorch_cache.py >"$l/pytorch.json" 2>"$l/pytorch.log" && theirs=$l/pytorch.json
  md=$(md_path cache)
  {
    header cache "Random batch sizes through a GraphCache: ours and PyTorch's dict of graphs ($DEVICE)"
    echo "Ours took $took s in all$([ "${CACHE_COLD:-0}" = 1 ] && echo ", from an empty engine registry (every product measured on first use)")."
    echo
    python3 bench/cache_compare.py "$l/ours.json" "$theirs"
  } >"$md"
  written "$md" "$l"
  merge_json "$RES/cache-$DEVICE.json" cache ours="$l/ours.json" pytorch="$l/pytorch.json"
  say "cache: $(grep -E '^\| ours \| GraphCache, staged, graph or' "$md" | cut -d'|' -f4-5)"
}

part_serve() {
  need_bin serve || return 1
  local l=$LOGS/serve-$DEVICE.txt md rc
  timeout "$(tmo 200)" "$BIN" bench serve --clients "${SERVE_CLIENTS:-64}" --min-rows 1 --max-rows 256 \
    --duration-s "${SERVE_DURATION_S:-15}" >"$l" 2>&1
  rc=$?
  md=$(md_path serve)
  {
    header serve "Serving under load: dynamic batching through a GraphCache vs eager ($DEVICE)"
    echo "\`$BIN bench serve --clients ${SERVE_CLIENTS:-64} --min-rows 1 --max-rows 256 --duration-s ${SERVE_DURATION_S:-15}\` (exit status $rc):"
    echo
    cat "$l"
  } >"$md"
  written "$md" "$l"
  say "serve: $(grep -E '^graph vs eager' "$l" || echo "exit status $rc")"
  [ "$rc" -eq 0 ]
}

part_soak() {
  need_bin soak || return 1
  local l=$LOGS/soak-$DEVICE.txt md rc n=${SOAK_REQUESTS:-1000000}
  timeout "$(tmo 400)" "$BIN" bench soak --requests "$n" >"$l" 2>&1
  rc=$?
  md=$(md_path soak)
  {
    header soak "Soak: memory over a long run ($DEVICE)"
    echo "\`$BIN bench soak --requests $n\` (exit status $rc; it fails when memory grew):"
    echo
    code_block "$l"
  } >"$md"
  written "$md" "$l"
  say "soak: $(grep -E '^memory end' "$l" || echo "exit status $rc")"
  [ "$rc" -eq 0 ]
}

part_engines() {
  local extra=()
  read -r -a extra <<<"${ENGINES_ARGS:-}"
  simple_part engines "The engine registry's choices ($DEVICE)" 300 bench engines "${extra[@]}"
}
part_gemm() { simple_part gemm "Matrix products on each engine family, inside graphs ($DEVICE)" 120 bench gemm; }

# Half-precision products, ours and torch.matmul in one call. The side that goes first
# alternates between dtypes (ours first for the first), so neither always runs on a cooler
# GPU; PyTorch times our rows' shapes when ours ran first, its built-in copy of the CLI's list
# otherwise.
part_gemm_lowp() {
  need_bin gemm-lowp || return 1
  local l=$LOGS/gemm-lowp-$DEVICE md dt i=0 bad=0 merged=() measured=()
  rm -rf "$l"
  mkdir -p "$l"
  lowp_ours() { # dtype
    local extra=()
    [ -n "${GEMM_LOWP_CANDIDATES:-}" ] && extra=(--candidates "$GEMM_LOWP_CANDIDATES")
    timeout "$(tmo 240)" "$BIN" bench gemm --dtype "$1" --json "${extra[@]}" >"$l/ours-$1.json" 2>"$l/ours-$1.log" && return 0
    say "gemm-lowp: $BIN bench gemm --dtype $1 failed or ran out of time: $(tail -n 3 "$l/ours-$1.log" | tr '\n' ' ')"
    rm -f "$l/ours-$1.json"
    return 1
  }
  lowp_pytorch() { # dtype
    local from=()
    [ -s "$l/ours-$1.json" ] && from=(--shapes-from "$l/ours-$1.json")
    timeout "$(tmo 240)" python3 bench/pytorch_gemm.py --dtype "$1" "${from[@]}" >"$l/pytorch-$1.json" 2>"$l/pytorch-$1.log" && return 0
    say "gemm-lowp: bench/pytorch_gemm.py --dtype $1 failed or ran out of time (logs/gemm-lowp-$DEVICE/pytorch-$1.log)"
    no_pytorch "$l/pytorch-$1.json" "bench/pytorch_gemm.py --dtype $1 failed: see logs/gemm-lowp-$DEVICE/pytorch-$1.log"
    return 0
  }
  for dt in ${GEMM_LOWP_DTYPES:-bf16 f16}; do
    case $dt in
      bf16 | f16) ;;
      *)
        say "gemm-lowp: unknown dtype '$dt' in GEMM_LOWP_DTYPES (bf16 or f16)"
        bad=1
        continue
        ;;
    esac
    if ((i % 2 == 0)); then
      lowp_ours "$dt" && lowp_pytorch "$dt"
    else
      lowp_pytorch "$dt"
      lowp_ours "$dt"
    fi
    i=$((i + 1))
    if [ -s "$l/ours-$dt.json" ]; then
      measured+=("$dt")
      merged+=("ours_$dt=$l/ours-$dt.json" "pytorch_$dt=$l/pytorch-$dt.json")
    else
      bad=1
    fi
  done
  md=$(md_path gemm-lowp)
  {
    header gemm-lowp "Half-precision products on tensor cores: ours and torch.matmul, both graphed ($DEVICE)"
    echo "Per dtype D: \`$BIN bench gemm --dtype D --json\` and \`python3 bench/pytorch_gemm.py --dtype D --shapes-from OURS.json\`"
    echo "(PyTorch first for every second dtype, with its built-in copy of the shapes). Ratio = ours µs / PyTorch µs."
    [ ${#measured[@]} -gt 0 ] || { echo; echo "No dtype was measured: see bench/results/logs/gemm-lowp-$DEVICE/."; }
    for dt in "${measured[@]}"; do
      echo
      echo "## $dt"
      echo
      python3 bench/gemm_compare.py "$l/ours-$dt.json" "$l/pytorch-$dt.json" || echo "(no table: bench/gemm_compare.py failed)"
    done
  } >"$md"
  written "$md" "$l"
  [ ${#merged[@]} -gt 0 ] && merge_json "$RES/gemm-lowp-$DEVICE.json" gemm-lowp "${merged[@]}"
  say "gemm-lowp: $(grep -E '^- target' "$md" | sed 's/^- //' | paste -sd ';' -)"
  [ "$bad" = 0 ]
}
part_rebind() { simple_part rebind "A new input buffer per request: copy-in, rebind, re-capture ($DEVICE)" 120 bench rebind; }
part_streams() { simple_part streams "Replays across streams: the cost of ordering shared pools, graphs and caches ($DEVICE)" 120 bench streams; }

# simple_part PART TITLE SECONDS ARGS...: one CLI run, its output as a code block.
simple_part() {
  need_bin "$1" || return 1
  local part=$1 title=$2 secs=$3 l md rc
  shift 3
  l=$LOGS/$part-$DEVICE.txt
  timeout "$(tmo "$secs")" "$BIN" "$@" >"$l" 2>&1
  rc=$?
  md=$(md_path "$part")
  {
    header "$part" "$title"
    echo "\`$BIN $*\` (exit status $rc):"
    echo
    code_block "$l"
  } >"$md"
  written "$md" "$l"
  say "$part: exit status $rc"
  [ "$rc" -eq 0 ]
}

part_train() {
  need_bin train || return 1
  local l=$LOGS/train-$DEVICE md model args log rc bad=0
  mkdir -p "$l"
  md=$(md_path train)
  {
    header train "Training on the UCI digits: eager, graphed, k steps per graph launch ($DEVICE)"
    echo "\`$BIN train --model M ARGS\`: 30 epochs, batch 64, Adam; µs per step with the data copies."
    echo
    echo "| model | arguments | µs/step | steps/s | test accuracy | how |"
    echo "|---|---|---:|---:|---:|---|"
  } >"$md"
  for model in ${TRAIN_MODELS:-mlp cnn}; do
    for args in "" "--graph" "--steps-per-launch 1" "--steps-per-launch 22" "--steps-per-launch 22 --skip-nonfinite"; do
      log="$l/$model${args// /_}.log"
      # shellcheck disable=SC2086 # ARGS splits into words on purpose
      timeout "$(tmo 120)" "$BIN" train --model "$model" $args >"$log" 2>&1
      rc=$?
      [ "$rc" -eq 0 ] || bad=1
      python3 - "$log" "$model" "${args:-(eager)}" "$rc" >>"$md" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
step = re.search(r"steps in [0-9.]+ s \(([0-9.]+) us/step", text)
thr = re.search(r"throughput: ([0-9]+) steps/s \(([^)]*)\)", text)
acc = re.search(r"test accuracy: ([0-9.]+%)", text)
how = thr.group(2) if thr else ("eager" if sys.argv[3] == "(eager)" else f"exit status {sys.argv[4]}")
print(f"| {sys.argv[2]} | `{sys.argv[3]}` | {step.group(1) if step else '–'} | "
      f"{thr.group(1) if thr else '–'} | {acc.group(1) if acc else '–'} | {how} |")
PY
    done
  done
  written "$md" "$l"
  say "train: $(grep -c '^| .* | `' "$md") runs$([ "$bad" = 1 ] && echo ", some failed")"
  [ "$bad" = 0 ]
}

part_precision() {
  need_bin train || return 1
  local l=$LOGS/precision-$DEVICE md model dtype seed log bad=0 seeds=${PRECISION_SEEDS:-5}
  mkdir -p "$l"
  md=$(md_path precision)
  for model in ${TRAIN_MODELS:-mlp cnn}; do
    for dtype in f32 bf16 f16; do
      for seed in $(seq 0 $((seeds - 1))); do
        log="$l/$model-$dtype-$seed.log"
        timeout "$(tmo 60)" "$BIN" train --graph --model "$model" --dtype "$dtype" --seed "$seed" >"$log" 2>&1 || bad=1
      done
    done
  done
  {
    header precision "Digits training in f32, bf16 and f16, graphed ($DEVICE)"
    echo "\`$BIN train --graph --model M --dtype D --seed S\` for S = 0…$((seeds - 1)): 30 epochs, batch 64, Adam lr 2e-3;"
    echo "bf16 and f16 run the forward pass and loss under autocast (f32 masters), f16 with the loss scaler."
    echo
    python3 - "$l" "$seeds" <<'PY'
import pathlib, re, statistics, sys
logs, seeds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
print("| model | dtype | mean test accuracy | min – max | µs/step (median) | runs |")
print("|---|---|---:|---:|---:|---:|")
base = {}
for model in ["mlp", "cnn"]:
    for dtype in ["f32", "bf16", "f16"]:
        acc, us = [], []
        for seed in range(seeds):
            f = logs / f"{model}-{dtype}-{seed}.log"
            if not f.exists():
                continue
            t = f.read_text()
            a = re.search(r"test accuracy: ([0-9.]+)%", t)
            u = re.search(r"\(([0-9.]+) us/step", t)
            if a and u:
                acc.append(float(a.group(1)))
                us.append(float(u.group(1)))
        if not acc:
            continue
        mean = statistics.mean(acc)
        if dtype == "f32":
            base[model] = mean
        delta = f" ({mean - base[model]:+.2f})" if dtype != "f32" and model in base else ""
        print(f"| {model} | {dtype} | {mean:.2f}%{delta} | {min(acc):.2f} – {max(acc):.2f} | "
              f"{statistics.median(us):.1f} | {len(acc)} |")
PY
  } >"$md"
  written "$md" "$l"
  say "precision: $(grep -c '^| [mc]' "$md") rows$([ "$bad" = 1 ] && echo ", some runs failed")"
  [ "$bad" = 0 ]
}

part_ddp() {
  need_bin ddp || return 1
  if [ "$GPU_COUNT" -lt 2 ]; then
    say "ddp: needs two GPUs, this machine has $GPU_COUNT"
    return 1
  fi
  local l=$LOGS/ddp-$DEVICE md steps=" ${DDP_STEPS:-bench tests train failures} " bad=0 rc
  rm -rf "$l"
  mkdir -p "$l"
  export NCCL_NVLS_ENABLE=0 # no NVLink SHARP / multicast
  # NCCL: libnccl.so from the loader path, else PyTorch's wheel.
  if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
    local lib
    lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
    [ -z "$lib" ] && lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
    [ -n "$lib" ] && [ -e "$lib" ] && export CUDAGRAPH_NCCL_LIB="$lib"
  fi
  local notes=()
  note() { notes+=("$1"); echo "$1"; }
  note "NCCL: ${CUDAGRAPH_NCCL_LIB:-libnccl.so from the loader path}; $(nvidia-smi topo -m 2>/dev/null | sed -n 2p | tr -s ' ')"

  if [[ $steps == *" bench "* ]]; then
    timeout "$(tmo 200)" "$BIN" bench ddp --json >"$l/ours.json" 2>"$l/ours.log" || { bad=1; note "cudagraph bench ddp failed: $(tail -n 2 "$l/ours.log" | tr '\n' ' ')"; }
    timeout -k 10 "$(tmo 200)" python3 bench/pytorch_ddp.py >"$l/pytorch.json" 2>"$l/pytorch.log" ||
      no_pytorch "$l/pytorch.json" "bench/pytorch_ddp.py failed or ran out of time: see logs/ddp-$DEVICE/pytorch.log"
    python3 bench/compare_ddp.py "$l/ours.json" "$l/pytorch.json" >"$l/table.md" 2>>"$l/pytorch.log" ||
      echo "(no table: see logs/ddp-$DEVICE)" >"$l/table.md"
  fi
  if [[ $steps == *" tests "* ]]; then
    local b t x
    for b in gpu_dist gpu_dist_failure gpu_dist_timeout; do
      t=$(test_binary "$b")
      [ -n "$t" ] || { note "$b: no test binary"; bad=1; continue; }
      CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_REQUIRE_GPUS=2 timeout "$(tmo 120)" "$t" --test-threads=1 \
        --include-ignored --show-output >"$l/$b.log" 2>&1
      rc=$?
      [ "$rc" -eq 0 ] || bad=1
      note "$b (exit status $rc): $(grep -E '^test result' "$l/$b.log" | tail -n 1)"
      while IFS= read -r x; do note "  $x"; done < <(grep -E '^test .* \.\.\. ' "$l/$b.log")
      while IFS= read -r x; do note "  $x"; done < <(grep -E 'relative difference|eager vs graphed relative|rank 0 (failed|timed out) after' "$l/$b.log" | head -n 8)
    done
  fi
  if [[ $steps == *" train "* ]]; then
    timeout "$(tmo 120)" "$BIN" train --graph >"$l/train-1gpu-graph.log" 2>&1
    note "train, 1 GPU, graphed (exit status $?): $(grep -E 'steps in' "$l/train-1gpu-graph.log" | tr '\n' ' ')"
    local mode
    for mode in "" "--graph"; do
      # shellcheck disable=SC2086 # no word when the mode is empty
      timeout "$(tmo 150)" "$BIN" train --nproc 2 $mode >"$l/train-2gpu$mode.log" 2>&1
      rc=$?
      [ "$rc" -eq 0 ] || bad=1
      note "train --nproc 2 ${mode:-(eager)} (exit status $rc): $(grep -E 'DDP x2: .* steps in' "$l/train-2gpu$mode.log" | head -n 1)"
    done
  fi
  if [[ $steps == *" failures "* ]]; then
    ddp_failures "$l" || bad=1
  fi
  md=$(md_path ddp)
  {
    header ddp "Data parallelism on two GPUs: ours and PyTorch DDP ($DEVICE)"
    [ -f "$l/table.md" ] && { cat "$l/table.md"; echo; }
    echo "Steps: ${DDP_STEPS:-bench tests train failures}."
    echo
    printf -- '- %s\n' "${notes[@]}"
  } >"$md"
  written "$md" "$l"
  [ -f "$l/ours.json" ] && merge_json "$RES/ddp-$DEVICE.json" ddp ours="$l/ours.json" pytorch="$l/pytorch.json"
  say "ddp: $(grep -E '^- target: 2-GPU scaling' "$l/table.md" 2>/dev/null | cut -c3-)$([ "$bad" = 1 ] && echo " (some steps failed)")"
  [ "$bad" = 0 ]
}

# What happens when a rank dies or stalls: with the launcher, and without (ranks started by hand).
ddp_failures() {
  local l=$1 t rc r0 r1 rc0 rc1 p bad=0
  port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
  rank_env() { echo "RANK=$1 WORLD_SIZE=2 LOCAL_RANK=$1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2"; }
  [ "$(left)" -gt 60 ] || { note "failure handling: skipped, out of time"; return 1; }
  t=$SECONDS
  timeout 120 "$BIN" train --nproc 2 --graph --fail-rank 1 --fail-at-step 20 >"$l/fail-launcher.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] || bad=1
  note "launcher, rank 1 exits at step 20: exit status $rc after $((SECONDS - t)) s (want non-zero)"
  [ "$(left)" -gt 60 ] || return 1
  p=$(port)
  # shellcheck disable=SC2046 # the rank's variables split into words on purpose
  env $(rank_env 0 "$p") timeout 120 "$BIN" train --graph >"$l/fail-crash-rank0.log" 2>&1 &
  r0=$!
  # shellcheck disable=SC2046
  env $(rank_env 1 "$p") timeout 120 "$BIN" train --graph --fail-rank 1 --fail-at-step 20 >"$l/fail-crash-rank1.log" 2>&1 &
  r1=$!
  wait "$r1"; rc1=$?; t=$SECONDS
  wait "$r0"; rc0=$?
  [ "$rc0" -ne 0 ] && [ "$rc0" -ne 124 ] || bad=1
  note "no launcher, rank 1 exits at step 20 (status $rc1): rank 0 exited $rc0 after $((SECONDS - t)) s more (want non-zero, within seconds): $(grep -E '^error' "$l/fail-crash-rank0.log" | head -n 1)"
  [ "$(left)" -gt 60 ] || return 1
  p=$(port)
  t=$SECONDS
  # shellcheck disable=SC2046
  env $(rank_env 0 "$p") CUDAGRAPH_DIST_TIMEOUT=10 timeout 120 "$BIN" train --graph >"$l/fail-stall-rank0.log" 2>&1 &
  r0=$!
  # shellcheck disable=SC2046
  env $(rank_env 1 "$p") CUDAGRAPH_DIST_TIMEOUT=10 timeout 120 "$BIN" train --graph --fail-rank 1 --fail-at-step 20 --fail-mode hang >"$l/fail-stall-rank1.log" 2>&1 &
  r1=$!
  wait "$r0"; rc0=$?
  kill -9 "$r1" 2>/dev/null; wait "$r1" 2>/dev/null
  [ "$rc0" -ne 0 ] && [ "$rc0" -ne 124 ] || bad=1
  note "no launcher, rank 1 stalls at step 20, CUDAGRAPH_DIST_TIMEOUT=10: rank 0 exited $rc0 after $((SECONDS - t)) s (want non-zero, not 124): $(grep -E '^error' "$l/fail-stall-rank0.log" | head -n 1)"
  t=$SECONDS
  # shellcheck disable=SC2046
  env $(rank_env 1 "$(port)") CUDAGRAPH_RDZV_TIMEOUT=5 timeout 60 "$BIN" train >"$l/fail-rdzv.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || bad=1
  note "rank 1 without rank 0, CUDAGRAPH_RDZV_TIMEOUT=5: exit status $rc after $((SECONDS - t)) s: $(grep -E '^error' "$l/fail-rdzv.log" | head -n 1)"
  [ "$bad" = 0 ]
}

part_sanitize() {
  local l=$LOGS/sanitize-$DEVICE md rc limit
  command -v compute-sanitizer >/dev/null || { say "sanitize: compute-sanitizer not found"; return 1; }
  rm -rf "$l"
  mkdir -p "$l"
  limit=${SANITIZE_JOB_LIMIT_S:-300}
  [ "$limit" -gt $(($(left) - 40)) ] && limit=$(($(left) - 40))
  SANITIZE_LOGS=$l TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck} TESTS=${SANITIZE_TESTS:-} \
    FILTER=${SANITIZE_FILTER:-} CLI=${SANITIZE_CLI:-1} JOBS=${SANITIZE_JOBS:-8} JOB_LIMIT_S=$limit \
    timeout "$(tmo $((limit * 3)))" bash bench/sanitize.sh >"$l/run.txt" 2>&1
  rc=$?
  if [ ! -s "$l/summary.txt" ]; then
    # Stopped before its summary: summarise what finished (unfinished jobs count as failed).
    SUMMARY_ONLY=1 SANITIZE_LOGS=$l TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck} \
      bash bench/sanitize.sh >>"$l/run.txt" 2>&1
  fi
  md=$(md_path sanitize)
  {
    header sanitize "compute-sanitizer over the GPU suite ($DEVICE)"
    echo "$(head -n 1 "$l/run.txt")."
    echo "Tests named \`misuse_*\` provoke driver errors on purpose and are skipped; \`CUDAGRAPH_TEST_QUICK=1\`"
    echo "shortens loops that add time but no coverage (bench/sanitize.sh explains each rule)."
    echo
    sed 's/^/- /' "$l/summary.txt"
    echo
    echo "| tool | job | exit status | errors | seconds | note |"
    echo "|---|---|---:|---:|---:|---|"
    awk -F'\t' '{ sub(/-[0-9a-f]+$/, "", $2); printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6 }' "$l/jobs-summary.tsv"
  } >"$md"
  written "$md" "$l"
  say "sanitize: $(grep -E '^sanitize [a-z]+:' "$l/summary.txt" | cut -d'(' -f1 | tr '\n' ';')"
  [ "$rc" -eq 0 ]
}

part_racecheck() {
  local l=$LOGS/racecheck-$DEVICE md bin=${RACECHECK_BIN:-gpu_nn} jobs=${RACECHECK_JOBS:-4} t limit names j i part rc
  command -v compute-sanitizer >/dev/null || { say "racecheck: compute-sanitizer not found"; return 1; }
  t=$(test_binary "$bin")
  [ -n "$t" ] || { say "racecheck: no test binary $bin in .gpu-bin/tests"; return 1; }
  rm -rf "$l"
  mkdir -p "$l"
  limit=$(tmo 400)
  mapfile -t names < <("$t" --list 2>/dev/null | sed -n 's/: test$//p' | grep -v '^misuse_')
  for j in $(seq 0 $((jobs - 1))); do
    part=()
    for i in "${!names[@]}"; do ((i % jobs == j)) && part+=("${names[$i]}"); done
    (
      CUDAGRAPH_REQUIRE_GPU=1 CUDAGRAPH_TEST_QUICK=1 CUDAGRAPH_CACHE_DIR=/tmp/cg-race-$j timeout "$limit" \
        compute-sanitizer --tool racecheck --error-exitcode 9 "$t" --test-threads=1 --exact "${part[@]}" >"$l/job-$j.log" 2>&1
      rc=$?
      echo "| $j | ${#part[@]} | $rc | $(grep -E 'RACECHECK SUMMARY' "$l/job-$j.log" | tail -n 1 | sed 's/^=* *//') | $(grep -E '^test result' "$l/job-$j.log" | tail -n 1) |" >"$l/job-$j.row"
    ) &
  done
  wait
  md=$(md_path racecheck)
  {
    header racecheck "racecheck over $bin, split by test name ($DEVICE)"
    echo "${#names[@]} tests of $bin (\`misuse_*\` left out) in $jobs parallel jobs, $limit s each at most (exit status 124: stopped)."
    echo
    echo "| job | tests | exit status | racecheck summary | result |"
    echo "|---:|---:|---:|---|---|"
    cat "$l"/job-*.row
  } >"$md"
  written "$md" "$l"
  say "racecheck: $(awk -F'|' '{print $4}' "$l"/job-*.row | tr -d ' ' | tr '\n' ' ')(exit statuses)"
  ! grep -qvE '^\| [0-9]+ \| [0-9]+ \| 0 \|' "$l"/job-*.row
}

part_while_sanitize() {
  local l=$LOGS/while-sanitize-$DEVICE md nvcc scenario tool rc args run
  command -v compute-sanitizer >/dev/null || { say "while-sanitize: compute-sanitizer not found"; return 1; }
  nvcc=$(find_nvcc)
  [ -n "$nvcc" ] || { say "while-sanitize: nvcc not found"; return 1; }
  mkdir -p "$l"
  # -rdc and cudadevrt: cudaGraphSetConditional is a device-runtime function; libcuda: the ptx
  # scenario loads cudagraph's condition kernels through the driver API.
  "$nvcc" -O2 -arch="sm_${COMPUTE_CAP//./}" -rdc=true -o "$l/while_sanitize" bench/raw/while_sanitize.cu -lcudadevrt -lcuda >"$l/nvcc.log" 2>&1 ||
    { say "while-sanitize: build failed (logs/while-sanitize-$DEVICE/nvcc.log)"; return 1; }
  md=$(md_path while-sanitize)
  {
    header while-sanitize "compute-sanitizer on a raw CUDA WHILE-body program ($DEVICE)"
    echo "bench/raw/while_sanitize.cu builds WHILE conditional nodes the way cudagraph does and runs plainly"
    echo "correct kernels in their bodies (\`default\`: a scale and a block reduction; \`pdl\`: programmatic"
    echo "launches; \`reuse\`: a freed and reused allocation; \`ptx\`: cudagraph's own condition kernels)."
    echo "The same kernels also run in a plain graph as the control."
    echo "$("$nvcc" --version | tail -n 1); $(compute-sanitizer --version 2>&1 | tail -n 1)."
    echo
    echo "| scenario | tool | summary | exit status |"
    echo "|---|---|---|---:|"
  } >"$md"
  for scenario in default pdl reuse ptx; do
    args=()
    [ "$scenario" = default ] || args=("$scenario")
    for tool in plain memcheck initcheck synccheck racecheck; do
      run="$l/$scenario-$tool.log"
      if [ "$tool" = plain ]; then
        timeout "$(tmo 60)" "$l/while_sanitize" "${args[@]}" >"$run" 2>&1
      else
        timeout "$(tmo 60)" compute-sanitizer --tool "$tool" "$l/while_sanitize" "${args[@]}" >"$run" 2>&1
      fi
      rc=$?
      echo "| $scenario | $tool | $(grep -ciE 'right results' "$run") right results, $(grep -ciE 'MISMATCH|failed:' "$run") failures; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$run" | head -n 1 | sed 's/^=* *//') | $rc |" >>"$md"
    done
  done
  # Failures under the tools inside WHILE bodies can be intermittent: the ptx scenario again.
  for tool in memcheck initcheck; do
    for i in 1 2 3 4; do
      run="$l/ptx-$tool-$i.log"
      timeout "$(tmo 60)" compute-sanitizer --tool "$tool" "$l/while_sanitize" ptx >"$run" 2>&1
      rc=$?
      echo "| ptx | $tool (repeat $i) | $(grep -ciE 'right results' "$run") right results, $(grep -ciE 'MISMATCH|failed:' "$run") failures; $(grep -E 'ERROR SUMMARY' "$run" | head -n 1 | sed 's/^=* *//') | $rc |" >>"$md"
    done
  done
  written "$md" "$l"
  say "while-sanitize: $(grep -c '^| ' "$md") runs"
}

part_ab() {
  need_bin ab || return 1
  local l=$LOGS/ab-$DEVICE md a_bin b_bin=$BIN kinds=${AB_KINDS:-linear- mlp-} rounds=${AB_ROUNDS:-2}
  local env_a=() env_b=() i=0 round kind la lb
  rm -rf "$l"
  mkdir -p "$l/parts"
  a_bin=${AB_BASE:-}
  if [ -z "$a_bin" ]; then
    if [ -f .gpu-bin/bin/cudagraph-base.gz ]; then
      gunzip -c .gpu-bin/bin/cudagraph-base.gz >"$l/cudagraph-base" && chmod +x "$l/cudagraph-base" && a_bin=$l/cudagraph-base
    elif [ -x .gpu-bin/bin/cudagraph-base ]; then
      a_bin=.gpu-bin/bin/cudagraph-base
    fi
  fi
  read -r -a env_a <<<"${AB_ENV_A:-}"
  read -r -a env_b <<<"${AB_ENV_B:-}"
  if [ -z "$a_bin" ]; then
    [ ${#env_a[@]} -gt 0 ] || [ ${#env_b[@]} -gt 0 ] ||
      { say "ab: nothing to compare: build with BASE=<revision> bash bench/bundle.sh, or set AB_ENV_A/AB_ENV_B"; return 1; }
    a_bin=$BIN
  fi
  la="A ($(basename "$a_bin")${AB_ENV_A:+ $AB_ENV_A})"
  lb="B ($(basename "$b_bin")${AB_ENV_B:+ $AB_ENV_B})"
  # ab_side A|B INDEX ARGS...: one run of one side, each side with its own engine registry.
  ab_side() {
    local side=$1 idx=$2 bin
    local -a envs
    shift 2
    if [ "$side" = A ]; then
      bin=$a_bin
      envs=("${env_a[@]}")
    else
      bin=$b_bin
      envs=("${env_b[@]}")
    fi
    env "${envs[@]}" CUDAGRAPH_CACHE_DIR="/tmp/cg-ab-$side" timeout "$(tmo 200)" "$bin" "$@" \
      >"$l/parts/$side-$idx.json" 2>>"$l/$side.log" && return 0
    say "ab: side $side failed or ran out of time on: $* (see logs/ab-$DEVICE/$side.log)"
    return 1
  }
  for round in $(seq "$rounds"); do
    for kind in $kinds; do
      if (((i + round) % 2 == 0)); then
        ab_side A "$i" bench sweep --json --only "$kind" && ab_side B "$i" bench sweep --json --only "$kind" || return 1
      else
        ab_side B "$i" bench sweep --json --only "$kind" && ab_side A "$i" bench sweep --json --only "$kind" || return 1
      fi
      i=$((i + 1))
    done
  done
  local side files
  for side in A B; do
    mapfile -t files < <(find "$l/parts" -name "$side-[0-9]*.json" | sort -V)
    python3 bench/sweep_merge.py --rounds "$rounds" "${files[@]}" >"$l/sweep-$side.json"
  done
  local seed_runs=${AB_SEED_RUNS:-3} r
  if [ "${AB_SEED:-1}" != 0 ]; then
    for r in $(seq "$seed_runs"); do
      if ((r % 2 == 1)); then
        ab_side A "seed-$r" bench --json && ab_side B "seed-$r" bench --json || return 1
      else
        ab_side B "seed-$r" bench --json && ab_side A "seed-$r" bench --json || return 1
      fi
    done
    for side in A B; do
      mapfile -t files < <(find "$l/parts" -name "$side-seed-[0-9]*.json" | sort -V)
      python3 bench/sweep_merge.py --rounds "$seed_runs" "${files[@]}" >"$l/parts/$side-seed.json"
    done
  fi
  md=$(md_path ab)
  {
    header ab "One build or setting against another, same call ($DEVICE)"
    echo "A: \`${AB_ENV_A:+$AB_ENV_A }$a_bin\`; B: \`${AB_ENV_B:+$AB_ENV_B }$b_bin\`$([ -f .gpu-bin/BUILD ] && sed -n 's/^base: / (A built from /p' .gpu-bin/BUILD | sed 's/$/)/')."
    echo
    echo "## Sweep kinds $kinds, $rounds rounds per side, sides alternating (each point keeps its faster run)"
    echo
    python3 bench/ab_compare.py "$l/sweep-A.json" "$l/sweep-B.json" "$la" "$lb"
    if [ -f "$l/parts/B-seed.json" ]; then
      echo
      echo "## Seed workloads, graph µs ($seed_runs runs per side, alternating; each row keeps its fastest run)"
      echo
      python3 bench/ab_compare.py "$l/parts/A-seed.json" "$l/parts/B-seed.json" "$la" "$lb"
    fi
  } >"$md"
  written "$md" "$l"
  say "ab: $(grep -E '^\*\*Geometric' "$md" | tr -d '*' | tr '\n' ' ')"
}

# ---------------------------------------------------------------- part copy (self-contained)

PARTS+=("copy|150|a 4-layer GPT-2-shaped model learns a copy task, the whole step in one graph: cudagraph train copy beside bench/copy_task_torch.py (torch.autocast bf16, torch.cuda.graph, AdamW capturable); final accuracy and µs per step|COPY_ARGS COPY_DTYPES")

part_copy() {
  need_bin copy || return 1
  local l=$LOGS/copy-$DEVICE md dtype bad=0
  mkdir -p "$l"
  md=$(md_path copy)
  for dtype in ${COPY_DTYPES:-bf16}; do
    # shellcheck disable=SC2086 # COPY_ARGS splits into words on purpose
    timeout "$(tmo 240)" "$BIN" train copy --dtype "$dtype" ${COPY_ARGS:-} >"$l/ours-$dtype.log" 2>&1 || bad=1
    # shellcheck disable=SC2086
    timeout -k 10 "$(tmo 240)" python3 bench/copy_task_torch.py --dtype "$dtype" ${COPY_ARGS:-} >"$l/pytorch-$dtype.log" 2>&1 || bad=1
  done
  {
    header copy "GPT-2-shaped training on a copy task, one graph per step ($DEVICE)"
    echo "\`$BIN train copy --dtype D ${COPY_ARGS:-}\` beside \`python3 bench/copy_task_torch.py --dtype D ${COPY_ARGS:-}\`:"
    echo "the whole step (forward under autocast, cross-entropy, backward, clip_grad_norm, AdamW) captured once and replayed;"
    echo "µs per step between progress lines (batch copies into the static inputs included)."
    echo
    echo "| dtype | side | µs/step | final accuracy (repeated half, fresh sequences) | last progress line |"
    echo "|---|---|---:|---:|---|"
    for dtype in ${COPY_DTYPES:-bf16}; do
      python3 - "$l/ours-$dtype.log" "$l/pytorch-$dtype.log" "$dtype" <<'PY'
import re, sys
for side, path in [("cudagraph", sys.argv[1]), ("PyTorch", sys.argv[2])]:
    try:
        text = open(path).read()
    except OSError:
        text = ""
    us = re.search(r": ([0-9.]+) us/step", text)
    acc = re.search(r"final accuracy: ([0-9.]+%)", text)
    steps = [x for x in text.splitlines() if x.startswith("step ")]
    print(f"| {sys.argv[3]} | {side} | {us.group(1) if us else '–'} | {acc.group(1) if acc else '–'} | "
          f"{steps[-1].strip() if steps else 'no run (see the log)'} |")
PY
    done
    for dtype in ${COPY_DTYPES:-bf16}; do
      echo
      echo "### Ours, $dtype"
      echo
      code_block "$l/ours-$dtype.log"
      echo
      echo "### PyTorch, $dtype"
      echo
      code_block "$l/pytorch-$dtype.log"
    done
  } >"$md"
  written "$md" "$l"
  say "copy: $(grep -cE '^\| (bf16|f32) \| ' "$md") rows$([ "$bad" = 1 ] && echo ", some runs failed")"
  [ "$bad" = 0 ]
}

# ---------------------------------------------------------------- parts decode and parity (self-contained)

# Random-init Hugging Face folders (bench/hf_models.py) live here, one per shape and dtype,
# and are reused while they hold the same shape, dtype and seed.
HF_DIR=${HF_DIR:-/tmp/cg-hf}

# hf_folder SHAPE DTYPE LOG: makes (or reuses) the folder and prints its path.
hf_folder() {
  local dir=$HF_DIR/$1-$2
  timeout "$(tmo 300)" python3 bench/hf_models.py --shape "$1" --dtype "$2" --out "$dir" --reuse >>"$3" 2>&1 ||
    return 1
  echo "$dir"
}

part_decode() {
  need_bin decode || return 1
  local l=$LOGS/decode-$DEVICE md dtype=${DECODE_DTYPE:-bf16} batches=${DECODE_BATCHES:-1,8,32,64}
  local prompts=${DECODE_PROMPTS:-128,1024} steps=${DECODE_STEPS:-64} m dir i=0 bad=0 notes=()
  local cmp=() merged=() cmds=() o p v
  rm -rf "$l"
  mkdir -p "$l"
  # decode_side LABEL LOG JSON CMD...: one side's run; on failure its JSON is removed.
  decode_side() {
    local label=$1 log=$2 json=$3
    shift 3
    timeout "$(tmo 480)" "$@" >"$log" 2>&1 && [ -s "$json" ] && return 0
    say "decode: $label failed or ran out of time: $(tail -n 3 "$log" | tr '\n' ' ')"
    rm -f "$json"
    return 1
  }
  for m in ${DECODE_MODELS:-gpt2-small llama-1b}; do
    case $m in
      gpt2-small | llama-1b | qwen2-0.5b | gpt2-tiny | llama-tiny | qwen2-tiny | mistral-tiny) ;;
      *)
        say "decode: unknown model '$m' in DECODE_MODELS (gpt2-small llama-1b qwen2-0.5b gpt2-tiny llama-tiny qwen2-tiny mistral-tiny)"
        bad=1
        continue
        ;;
    esac
    if ! dir=$(hf_folder "$m" "$dtype" "$l/$m-folder.log"); then
      say "decode: bench/hf_models.py --shape $m --dtype $dtype failed: $(tail -n 3 "$l/$m-folder.log" | tr '\n' ' ')"
      bad=1
      continue
    fi
    o=("$BIN" bench decode --model "$dir" --dtype "$dtype" --batches "$batches" --prompts "$prompts"
      --steps "$steps" --json "$l/$m-ours.json")
    p=(python3 bench/decode_torch.py --model "$dir" --dtype "$dtype" --batches "$batches" --prompts "$prompts"
      --steps "$steps" --json "$l/$m-pytorch.json")
    cmds+=("python3 bench/hf_models.py --shape $m --dtype $dtype --out $dir; ${o[*]}; ${p[*]}")
    # Which side goes first alternates between models, so neither always meets a cooler GPU.
    if ((i % 2 == 0)); then
      decode_side "$m, ours" "$l/$m-ours.log" "$l/$m-ours.json" "${o[@]}" || bad=1
      decode_side "$m, PyTorch" "$l/$m-pytorch.log" "$l/$m-pytorch.json" "${p[@]}" || bad=1
    else
      decode_side "$m, PyTorch" "$l/$m-pytorch.log" "$l/$m-pytorch.json" "${p[@]}" || bad=1
      decode_side "$m, ours" "$l/$m-ours.log" "$l/$m-ours.json" "${o[@]}" || bad=1
    fi
    i=$((i + 1))
    v=$(grep -m 1 '^torch ' "$l/$m-pytorch.log" 2>/dev/null) && notes+=("$m, PyTorch side: $v")
    cmp+=("$m" "$([ -s "$l/$m-ours.json" ] && echo "$l/$m-ours.json" || echo -)"
      "$([ -s "$l/$m-pytorch.json" ] && echo "$l/$m-pytorch.json" || echo -)")
    merged+=("$m-ours=$l/$m-ours.json" "$m-pytorch=$l/$m-pytorch.json")
  done
  md=$(md_path decode)
  {
    header decode "Graphed decode, ours and Hugging Face transformers with torch.compile ($DEVICE)"
    echo "Random-init weights (bench/hf_models.py, seed 0) in $dtype, the same folder for both sides;"
    echo "random prompt ids; prompts $prompts, batches $batches, $steps timed decode steps each;"
    echo "both sides report the median of 3 runs of them (ours: \`--repeats\`, the prompts prefilled again each run)."
    echo "Ours measures and tunes its engines for every row in a child process first and times the steps in a"
    echo "process that only reads the saved choices (\`cudagraph bench decode\` does this unless \`--measure-in-process\`:"
    echo "measuring engines slows the captured steps that follow in the same process; docs/transformers.md)."
    echo "PyTorch: \`AutoModelForCausalLM\`, a \`StaticCache\` of prompt + steps positions, eager"
    echo "prefill, the one-token step (with the greedy argmax) under"
    echo "\`torch.compile(mode=\"reduce-overhead\", dynamic=False)\`, median of 3 runs of the timed steps"
    echo "(bench/decode_torch.py). gpt2-small has 2048 positions (GPT-2 has 1024) so that 1024 + 64 fit."
    echo
    if [ ${#cmp[@]} -gt 0 ]; then
      python3 bench/decode_compare.py "${cmp[@]}"
    else
      echo "No model ran."
    fi
    echo
    echo "Commands:"
    echo
    # shellcheck disable=SC2016 # the backquotes are Markdown
    [ ${#cmds[@]} -gt 0 ] && printf -- '- `%s`\n' "${cmds[@]}"
    [ ${#notes[@]} -gt 0 ] && printf -- '- %s\n' "${notes[@]}"
  } >"$md"
  written "$md" "$l"
  [ ${#merged[@]} -gt 0 ] && merge_json "$RES/decode-$DEVICE.json" decode "${merged[@]}"
  say "decode: $(grep -cE '^\| (gpt2|llama|qwen2)' "$md") rows; $(grep -c 'NOT met' "$md") targets not met$([ "$bad" = 1 ] && echo " (some steps failed)")"
  [ "$bad" = 0 ]
}

# exit_words RC: what a command run under `timeout` ended with, in words.
exit_words() {
  case $1 in
    124 | 137) echo "ran out of time (the part's budget: TIME_BUDGET_S)" ;;
    *) echo "failed (exit status $1)" ;;
  esac
}

part_chat() {
  need_bin chat || return 1
  local l=$LOGS/chat-$DEVICE md dir rc steps=16 sys user ours
  rm -rf "$l"
  mkdir -p "$l"
  if ! dir=$(hf_folder llama-tiny f32 "$l/folder.log"); then
    say "chat: bench/hf_models.py failed: $(tail -n 1 "$l/folder.log")"
    return 1
  fi
  timeout "$(tmo 150)" python3 bench/hf_chat.py --model "$dir" --out "$l/expected.json" --steps "$steps" \
    >"$l/transformers.log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    say "chat: bench/hf_chat.py $(exit_words "$rc"): $(tail -n 1 "$l/transformers.log")"
    return 1
  fi
  field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]], end="")' "$l/expected.json" "$1"; }
  sys=$(field system)
  user=$(field user)
  ours=("$BIN" generate --model "$dir" --dtype f32 --chat "$user" --system "$sys" --show-prompt --ignore-eos --greedy
    --max-new-tokens "$steps")
  timeout "$(tmo 150)" "${ours[@]}" >"$l/ours.out" 2>"$l/ours.err"
  rc=$?
  if [ "$rc" -eq 0 ]; then
    python3 bench/hf_chat.py --check "$l/expected.json" --stdout "$l/ours.out" --stderr "$l/ours.err" >"$l/check.log" 2>&1
    rc=$?
  else
    echo "cudagraph generate $(exit_words "$rc"): $(tail -n 2 "$l/ours.err" | tr '\n' ' ')" >"$l/check.log"
  fi
  md=$(md_path chat)
  {
    header chat "A chat turn: cudagraph generate --chat against transformers ($DEVICE)"
    echo "bench/hf_models.py's tiny Llama folder in f32; bench/hf_chat.py gives it a byte-level BPE"
    echo "tokenizer (Llama 3's special tokens) and a chat template in Llama 3's form, saved with"
    echo "transformers' save_pretrained, then renders a system and a user message with"
    echo "\`apply_chat_template(add_generation_prompt=True)\` and greedy-generates $steps tokens in f32. Ours:"
    echo "\`cudagraph generate --chat\` on the same folder (built with \`--features tokenizers\`). Compared:"
    echo "the rendered conversation, the prompt ids, the greedy tokens up to the first step whose top-2"
    echo "margin is within 1e-4 of the largest logit, and the decoded reply. Exit status 0: all equal."
    echo
    echo "Commands:"
    echo
    echo "- \`python3 bench/hf_models.py --shape llama-tiny --dtype f32 --out $dir; python3 bench/hf_chat.py --model $dir --out EXPECTED --steps $steps\`"
    echo "- \`$BIN generate --model $dir --dtype f32 --chat USER --system SYSTEM --show-prompt --ignore-eos --greedy --max-new-tokens $steps\` (USER, SYSTEM: EXPECTED's \`user\` and \`system\`)"
    echo "- \`python3 bench/hf_chat.py --check EXPECTED --stdout OURS_STDOUT --stderr OURS_STDERR\`"
    echo
    echo "Transformers' side:"
    echo
    code_block "$l/transformers.log"
    echo
    echo "The comparison (exit status $rc):"
    echo
    code_block "$l/check.log"
    echo
    echo "Ours (stderr, then stdout):"
    echo
    code_block "$l/ours.err"
    echo
    code_block "$l/ours.out"
  } >"$md"
  written "$md" "$l"
  say "chat: $(tail -n 1 "$l/check.log")"
  [ "$rc" -eq 0 ]
}

part_parity() {
  need_bin parity || return 1
  local l=$LOGS/parity-$DEVICE md m dt dir ref rc bad=0 n=0 ok=0 rows=() cmds=()
  local nrows=${PARITY_ROWS:-3} steps=${PARITY_STEPS:-32} base
  rm -rf "$l"
  mkdir -p "$l"
  for m in ${PARITY_MODELS:-gpt2-tiny llama-tiny qwen2-tiny mistral-tiny}; do
    for dt in ${PARITY_DTYPES:-f32 bf16}; do
      n=$((n + 1))
      base=$l/$m-$dt
      if ! dir=$(hf_folder "$m" "$dt" "$base.folder.log"); then
        rows+=("| $m | $dt | bench/hf_models.py failed | $(tail -n 1 "$base.folder.log" | tr '|' '/') |")
        bad=1
        continue
      fi
      ref=$base.reference.safetensors
      cmds+=("python3 bench/hf_models.py --shape $m --dtype $dt --out $dir; python3 bench/hf_reference.py --model $dir --out REF --dtype $dt --rows $nrows --decode-steps $steps; $BIN bench parity --model $dir --reference REF --dtype $dt")
      timeout "$(tmo 150)" python3 bench/hf_reference.py --model "$dir" --out "$ref" --dtype "$dt" \
        --rows "$nrows" --decode-steps "$steps" >"$base.reference.log" 2>&1
      rc=$?
      if [ "$rc" -ne 0 ]; then
        rows+=("| $m | $dt | bench/hf_reference.py $(exit_words "$rc") | $(tail -n 1 "$base.reference.log" | tr '|' '/') |")
        bad=1
        continue
      fi
      timeout "$(tmo 150)" "$BIN" bench parity --model "$dir" --reference "$ref" --dtype "$dt" >"$base.parity.log" 2>&1
      rc=$?
      if [ "$rc" -eq 0 ]; then ok=$((ok + 1)); else bad=1; fi
      rows+=("| $m | $dt | $rc$([ "$rc" -ne 0 ] && echo " ($(exit_words "$rc"))") | $(grep -v '^[[:space:]]*$' "$base.parity.log" | tail -n 1 | tr '|' '/') |")
    done
  done
  md=$(md_path parity)
  {
    header parity "Teacher-forced logits and greedy tokens against Hugging Face ($DEVICE)"
    echo "Random-init tiny folders (bench/hf_models.py, seed 0) in each dtype; bench/hf_reference.py: $nrows"
    echo "rows of random prompts (57, 128, 20 tokens), each alone greedy-generating $steps tokens with"
    echo "transformers, then one teacher-forced forward over prompt + generated ids (TF32 off). \`cudagraph"
    echo "bench parity\` prefills each prompt, feeds the rest one step at a time, alone and batched, and"
    echo "compares every logit row (f32 1e-4 relative, bf16 2e-2) and the greedy tokens where the"
    echo "top-2 margin exceeds the tolerance, and each batched row with the same row alone. Exit status 0: all agree. For bf16 the reference also"
    echo "holds Hugging Face's f32 forward of the same ids and weights; the \`context\` lines give how far"
    echo "our rows (alone) and Hugging Face's own bf16 rows are from it, and how far Hugging Face's"
    echo "bf16 rows through PyTorch's math attention backend are from its default (flash) rows: the"
    echo "spread between two of transformers' own bf16 paths (printed, not checked)."
    echo
    echo "| model | dtype | exit status | summary (last line) |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "Commands (REF: the reference file, in the logs):"
    echo
    # shellcheck disable=SC2016 # the backquotes are Markdown
    [ ${#cmds[@]} -gt 0 ] && printf -- '- `%s`\n' "${cmds[@]}"
    for m in ${PARITY_MODELS:-gpt2-tiny llama-tiny qwen2-tiny mistral-tiny}; do
      for dt in ${PARITY_DTYPES:-f32 bf16}; do
        [ -s "$l/$m-$dt.parity.log" ] || continue
        echo
        echo "### $m, $dt"
        echo
        echo "Hugging Face's side:"
        echo
        code_block "$l/$m-$dt.reference.log"
        echo
        echo "Ours:"
        echo
        echo '```'
        tail -n 40 "$l/$m-$dt.parity.log"
        echo '```'
      done
    done
  } >"$md"
  written "$md" "$l"
  say "parity: $ok of $n model and dtype pairs agree with Hugging Face"
  [ "$bad" = 0 ]
}

# ---------------------------------------------------------------- main

pack() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
  local results=() logs=() f
  for f in "${WRITTEN[@]}"; do
    if [[ $f == "$LOGS"/* ]]; then logs+=("$f"); else results+=("$f"); fi
  done
  [ ${#results[@]} -gt 0 ] && tar -czf "$OUT/results.tgz" "${results[@]}"
  [ ${#logs[@]} -gt 0 ] && tar -czf "$OUT/logs.tgz" "${logs[@]}"
  return 0
}

if [ $# -eq 0 ] || [[ " $* " == *" -h "* ]] || [[ " $* " == *" --help "* ]]; then
  usage
  [ $# -gt 0 ]
  exit $?
fi
for part in "$@"; do
  [ -n "$(need_of "$part")" ] || { echo "device.sh: unknown part '$part'" >&2; usage >&2; exit 2; }
done

detect_device
mkdir -p "$LOGS"
trap pack EXIT
say "device.sh on $DEV_DESC as '$DEVICE', $DATE, build $BUILD; parts: $*; budget $BUDGET s"
failed=0
for part in "$@"; do
  need=$(need_of "$part")
  if [ "$(left)" -lt "$need" ]; then
    say "$part: SKIPPED: $(left) s of the budget left, it needs $need s; run it in a call of its own"
    failed=$((failed + 1))
    continue
  fi
  echo "== $part ($((SECONDS - START)) s)"
  # Every part starts from an empty engine registry, as a first process does, so that no
  # part's results depend on the parts before it in the call; compiled kernels stay cached.
  [ "$OWN_CACHE" = 1 ] && rm -f "$CUDAGRAPH_CACHE_DIR"/engines-*.json
  t0=$SECONDS
  n0=${#WRITTEN[@]}
  if "part_${part//-/_}"; then
    say "$part: ok in $((SECONDS - t0)) s -> $(reports_since "$n0" "$part")"
  else
    say "$part: FAILED after $((SECONDS - t0)) s -> $(reports_since "$n0" "$part") and $LOGS/"
    failed=$((failed + 1))
  fi
done
say "done in $((SECONDS - START)) s: $(($# - failed)) of $# parts ok"
[ "$failed" -eq 0 ]
