#!/usr/bin/env bash
# Everything a GPU session checks and records, in stages that each fit one ten-minute call.
#
#   benchmarks/gpu_session.sh STAGE [OUTDIR]          # on the GPU machine: OUTDIR=$OUT
#   GPU_SESSION_DRY=1 benchmarks/gpu_session.sh STAGE  # rehearsal on a CPU (CI runs it for every stage)
#
# The GPU machine's copy of the tree has no .git, so neither the commit nor uncommitted edits can be
# seen there: compute the label HERE, in the checkout the copy is made from,
#   echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)"
# and start the stage there with its value: `ROBERTA_FAST_COMMIT=<that value> benchmarks/gpu_session.sh
# STAGE "$OUT"`, so every record names the commit it measured, -dirty when tracked files differ from it
# (benchmarks/_common.py reads it where git cannot answer; without it the records say "unknown").
#
# Run `first` first: it alone gives the headline record; then, with time left, the others in the
# order below. Expected times on an H100 (16 cores) are estimates (no stage has run on a GPU yet); every step also has a hard cap, and each stage stops
# starting steps once its budget (GPU_SESSION_BUDGET_S, default 540 s for a call of the full 600 s) is
# spent, so a stage always ends, packed, in time. Give a shorter call (less device time left) its
# timeout_s minus 45 (the margin to stop the last step and pack): timeout_s=300 -> GPU_SESSION_BUDGET_S=255.
#
#   first      ~6 min  build (~1.5 min: 2 .cu and 5 .cpp files, MAX_JOBS=16, sm_90 only), the
#                      correctness gate (~1.5 min: roberta-base at 512, fused vs reference, loss and
#                      every gradient in fp16 and bf16, Triton compiles with autotuning off; then the
#                      CUDA tests of FusedAdam and masking), the record (~3 min: base/512 in auto's dtype,
#                      batch 32 (no batch search), rf-fused, rf-reference, hf-eager, hf-compile, profiled:
#                      autotuning rf-fused's attention ~1 min, compiling hf-compile ~1.5 min, 55 steps each
#                      a few seconds), the roofline (seconds)
#   e2e        ~8 min  build, gate (fp16 and bf16), base/512 in fp16 (batch 32, all five contenders, SpanBERT's
#                      too, profiled; ~3.5 min), large/512 in auto's dtype (batch 16, four contenders; ~3.5 min:
#                      hf-compile compiles 24 layers)
#   test       ~8 min  build, then the suite in parts, each writing its junit XML as it ends: the CUDA
#                      cases first (~2 min), the rest in three parts (~1.5 min each, 8 xdist workers), the
#                      emulated-CUDA tests last (~1 min: they compile csrc/ with g++)
#   e2e-128    ~7 min  build, gate (auto's dtype), base and large at 128 (batch 128), four contenders each
#   sanitize   ~4 min  build, the CUDA tests of FusedAdam and masking under compute-sanitizer memcheck and
#                      racecheck (~1.5 min each: the sanitizer slows the kernels 10-100x, the shapes are small)
#   kernels    ~7 min  every per-kernel GPU benchmark (~40 s each), attention with dropout, the compile report
#                      (~45 s: the configs that run with autotuning off, as CI)
#
# Each stage's logs, JSON reports, charts, junit XML and summary go into ONE file, OUTDIR/STAGE.tgz
# (default OUTDIR: benchmarks/results/pending), packed again after every step, every 15 s while a step
# runs (GPU_SESSION_PACK_S) and on SIGTERM/SIGINT: the device hands back a few files, and a command it
# kills at its limit still hands back what it finished, down to the rows of the step it was in. Back here, one command records
# them: `python benchmarks/throughput.py --refresh-record STAGE.tgz ...`. A throughput figure is marked
# verified only if the correctness gate passed in the same call (throughput.py --gate); otherwise it
# is kept and marked unverified. The last lines printed are the stage's summary.
#
# GPU_SESSION_DRY=1 runs the same commands with the same flags on the CPU (Triton's interpreter), at
# the smallest shapes (tiny preset, seq 16, batch 1, one timed step, --quick benchmarks), skipping the
# build (the extension must be built) and compute-sanitizer: a renamed flag or a missing file fails
# CI (tests/test_session_script.py), not the GPU session.
set -uo pipefail
cd "$(dirname "$0")/.."
stages="first e2e test e2e-128 sanitize kernels"
stage=${1:?usage: benchmarks/gpu_session.sh ${stages// /|} [OUTDIR]}
if [[ " $stages " != *" $stage "* ]]; then
  echo "error: unknown stage '$stage'; choose one of: $stages" >&2
  exit 2
fi
dest=${2:-benchmarks/results/pending}
dry=${GPU_SESSION_DRY:-0}
budget=${GPU_SESSION_BUDGET_S:-$([ "$dry" = 1 ] && echo 2400 || echo 540)}
pack_every=${GPU_SESSION_PACK_S:-15}
slow=$([ "$dry" = 1 ] && echo 4 || echo 1)  # the interpreter on a shared CPU: the caps stretch, not the budget's logic
out=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session-$stage.XXXXXX")  # the stage's files, packed into $dest/$stage.tgz
mkdir -p "$dest" || exit 2
dest=$(cd "$dest" && pwd)
py=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONUNBUFFERED=1 ROBERTA_FAST_OFFLINE=1  # no network there: the transformers-suite gate skips
summary=()
start=$SECONDS

if [ "$dry" = 1 ]; then  # the smallest shapes, on the CPU
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  base=tiny large=tiny long=16 short=16 quick=(--quick)
  gate_shape=(--model tiny --seq-len 16 --batch 1 --device cpu)  # the device of `timing`: on a GPU machine
  # (the test stage runs this rehearsal there) a gate of the GPU would not verify figures of the CPU
  fixed_batch=(--batch 1) big_batch=(--batch 1) large_batch=(--batch 1)
  timing=(--warmup 0 --steps 1 --repeats 1 --device cpu --interpret --skip-compile)
  sanitizer=()  # compute-sanitizer needs a GPU: the tests run bare
  collect=(--collect-only)  # the test stage's parts are collected, not run (this IS the suite)
else
  base=base large=large long=512 short=128 quick=()
  gate_shape=(--model base --seq-len 512 --batch 4)
  fixed_batch=(--batch 32) big_batch=(--batch 128) large_batch=(--batch 16)
  timing=()
  sanitizer=(compute-sanitizer --error-exitcode 1 --tool)
  collect=()
fi

note() { summary+=("$1"); echo "== $1"; printf '%s\n' "${summary[@]}" >"$out/summary.txt"; pack; }
pack() {  # $out into $dest/$stage.tgz, atomically; a file being written goes in as it is (tar's exit 1)
  local tmp="$dest/$stage.tgz.$BASHPID.tmp"
  tar czf "$tmp" -C "$out" . 2>/dev/null
  if [ $? -le 1 ]; then mv -f "$tmp" "$dest/$stage.tgz"; else rm -f "$tmp"; fi
}
packing=
packer_start() {  # while a step runs, pack every $pack_every s: the device may kill the command mid-step
  ( trap 'kill ${!:-} 2>/dev/null; exit 0' TERM
    while true; do sleep "$pack_every" & wait $!; pack; done ) >/dev/null 2>&1 &
  packing=$!
}
packer_stop() {
  [ -n "$packing" ] || return 0
  kill "$packing" 2>/dev/null
  wait "$packing" 2>/dev/null
  packing=
  rm -f "$dest/$stage.tgz".*.tmp  # a pack it was stopped in
}
stopped() { packer_stop; note "stopped by SIG$1: what was written so far is packed"; exit "$2"; }
trap 'stopped TERM 143' TERM
trap 'stopped INT 130' INT
left() { echo $((budget - (SECONDS - start))); }

finish() {
  pack
  echo
  echo "==== $stage summary ($((SECONDS - start)) s of a $budget s budget$([ "$dry" = 1 ] && echo ', DRY RUN on the CPU')) ===="
  cat "$out/environment.txt"
  printf '%s\n' "${summary[@]}"
  echo "packed: $dest/$stage.tgz"
  rm -rf "$out"
  exit "${1:-0}"
}

run() {  # run NAME CAP_S CMD...: log to NAME.log, at most CAP_S seconds (less if the budget is short)
  local name=$1 cap=$(($2 * slow)) t=$SECONDS rc limit
  shift 2
  limit=$(( $(left) - 15 < cap ? $(left) - 15 : cap ))
  if [ "$limit" -lt 10 ]; then
    note "$name: not run (the stage's $budget s budget is spent)  <-- SKIPPED"
    return 124
  fi
  # SIGINT first: pytest then still writes its junit XML, throughput.py keeps the rows it wrote
  packer_start
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  packer_stop
  case $rc in
    0) note "$name: ok ($((SECONDS - t)) s)" ;;
    124|130|137) note "$name: stopped at its $limit s limit  <-- CUT OFF" ;;
    *) note "$name: exit $rc ($((SECONDS - t)) s)  <-- FAILED" ;;
  esac
  return "$rc"
}

# What this machine has: versions, and the packages a bare torch image may lack (what degrades without each)
"$py" - "$dry" >"$out/environment.txt" 2>&1 <<'EOF'
import importlib.metadata as md, os, subprocess, sys, torch
print("dry run (CPU rehearsal)" if sys.argv[1] == "1" else "GPU run")
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:  # the device image may have no git at all (and its copy has no .git)
    head = ""
print("commit", head or os.environ.get("ROBERTA_FAST_COMMIT") or "unknown (no .git: set ROBERTA_FAST_COMMIT)")
DEGRADES = {"triton": "no fused kernels", "transformers": "hf contenders and HF-parity tests skip",
            "tokenizers": "tokenizer tests and hf contenders skip", "safetensors": "HF save/load tests skip",
            "onnx": "ONNX export tests skip", "onnxruntime": "the onnxruntime contender is skipped",
            "pytest": "no tests, so no correctness gate", "pytest-xdist": "tests run serially (slower)",
            "pytest-benchmark": "nothing (unused)", "matplotlib": "charts are SVG", "pyyaml": "YAML config test skips"}
for name, what in DEGRADES.items():
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING: {what}")
EOF
missing=$(grep -o '^  [a-z-]* MISSING' "$out/environment.txt" | awk '{print $1}' | tr '\n' ' ')
[ -n "$missing" ] && note "packages missing here: $missing(see environment.txt for what degrades)"
grep -q '^commit unknown' "$out/environment.txt" && note "commit unknown: no .git and no ROBERTA_FAST_COMMIT (see the header)"

# --precision auto's dtype on this device (bf16 on sm_80+, fp16 on a V100/T4) and its roofline column
# (by the GPU's name: an H100 and an H200 are both sm_90)
read -r auto_dtype roofline_gpu < <("$py" - 2>/dev/null <<'EOF'
import sys, torch
from roberta_fast.precision import resolve_precision
sys.path.insert(0, "benchmarks")
from roofline import gpu_of
if torch.cuda.is_available():
    print(resolve_precision("auto", torch.device("cuda")),
          gpu_of(torch.cuda.get_device_name(), torch.cuda.get_device_capability()))
else:
    print("bf16 h100")
EOF
) || true
auto_dtype=${auto_dtype:-bf16} roofline_gpu=${roofline_gpu:-h100}

describe() {  # what roberta_fast runs on this machine (python -m roberta_fast.info), after the versions
  { echo; timeout 60 "$py" -m roberta_fast.info; } >>"$out/environment.txt" 2>&1
}

ensure_built() {  # the extension with its CUDA ops (MAX_JOBS=16: the machine's cores)
  local check="import torch, roberta_fast._C as C; assert C.built_with_cuda() or '$dry' == '1'"  # torch first: _C links libc10
  if "$py" -c "$check" 2>/dev/null; then
    note "build: $([ "$dry" = 1 ] && echo 'skipped (dry run; the extension here is built)' || echo 'already built')"
    describe
    return 0
  fi
  if [ "$dry" != 1 ]; then
    export MAX_JOBS=${MAX_JOBS:-16}
    run build 300 "$py" -m pip install --no-build-isolation --no-deps -e . && "$py" -c "$check" && describe && return 0
  fi
  note "build: FAILED: roberta_fast._C $([ "$dry" = 1 ] && echo 'is not built here' || echo 'has no CUDA ops (see build.log)')"
  finish 1
}

gate() {  # gate CAP DTYPES...: the correctness gate; gate.json says whether the figures of this call are verified
  local cap=$1
  shift
  # its CUDA tests end 90 s (the model check's) inside the step's cap, so the gate gives its verdict
  # (gate.json is written after the model check too: a gate cut off later still says how the model did)
  run gate "$cap" env ROBERTA_FAST_AUTOTUNE=0 "$py" benchmarks/gpu_gate.py "${gate_shape[@]}" --dtypes "$@" \
    --tests-timeout $((cap * slow - 90)) --json "$out/gate.json"
}

throughput() {  # throughput NAME CAP FLAGS...: one throughput.py run, its JSON and chart, verified by this call's gate
  local name=$1 cap=$2
  shift 2
  run "$name" "$cap" "$py" benchmarks/throughput.py "$@" "${timing[@]}" --no-record --gate "$out/gate.json" \
    --json "$out/$name.json" --chart "$out/$name.png"
  note "$name: $(grep -E '^verified: ' "$out/$name.log" | tail -1 || echo 'verified: not reached (cut off)')"
}

roofline() {  # the predicted floor of the same step, beside the measured profile
  run "roofline-$1-$2" 30 "$py" benchmarks/roofline.py --model "$1" --seq-len "$2" --batch "$3" --gpu "$roofline_gpu" \
    --json "$out/roofline-$1-$2.json"
}

pytest_part() {  # pytest_part NAME CAP ARGS...: one part of the suite, with its own junit XML
  local name=$1 cap=$2
  shift 2
  run "pytest-$name" "$cap" env ROBERTA_FAST_AUTOTUNE=0 "$py" -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" \
    "${collect[@]}" --durations=10 --junitxml="$out/pytest-$name.xml" "$@"
  note "pytest-$name: $(grep -E '[0-9]+ (passed|failed|error|skipped|tests? collected)' "$out/pytest-$name.log" | tail -1)"
}

case $stage in
  first)
    ensure_built
    gate 180 fp16 bf16
    throughput "throughput-$base$long-$auto_dtype" 330 --models "$base" --seq-lens "$long" --dtypes "$auto_dtype" \
      "${fixed_batch[@]}" --contenders rf-fused rf-reference hf-eager hf-compile --profile
    roofline "$base" "$long" 32
    ;;
  test)
    ensure_built
    xdist=()
    "$py" -c "import xdist" 2>/dev/null && [ "$dry" != 1 ] && xdist=(-n 8)
    cuda_k="cuda or gpu"
    # the CUDA cases first (every test's device=cuda case, and the tests named for the GPU)
    pytest_part cuda 180 tests --ignore=tests/test_cuda_emulated.py -k "$cuda_k"
    # the rest in three parts of alternate files (every file is in one part: new files too)
    files=()
    for f in tests/test_*.py; do [ "$f" != tests/test_cuda_emulated.py ] && files+=("$f"); done
    for part in 0 1 2; do
      group=()
      for i in "${!files[@]}"; do [ $((i % 3)) = "$part" ] && group+=("${files[$i]}"); done
      pytest_part "rest-$((part + 1))" 150 "${group[@]}" -k "not ($cuda_k)"
    done
    pytest_part emulated 90 tests/test_cuda_emulated.py
    ;;
  sanitize)
    ensure_built
    for tool in memcheck racecheck; do
      under=()
      [ ${#sanitizer[@]} -gt 0 ] && under=("${sanitizer[@]}" "$tool")
      run "sanitize-$tool" 200 ${under[@]+"${under[@]}"} "$py" -m pytest -q -x -p no:cacheprovider \
        --junitxml="$out/sanitize-$tool.xml" tests/test_fused_adam.py tests/test_mask_tokens.py -k "cuda or gpu"
    done
    ;;
  e2e)
    ensure_built
    gate 180 fp16 bf16
    # fp16 with loss scaling, every contender (SpanBERT's objective after the peers: the extra, cut first);
    # then roberta-large. Caps over the ~210 s estimate: the stage's budget still bounds the total
    throughput "throughput-$base$long-fp16" 240 --models "$base" --seq-lens "$long" --dtypes fp16 \
      "${fixed_batch[@]}" --contenders rf-fused rf-reference hf-eager hf-compile rf-fused+sbo --profile
    throughput "throughput-$large$long-$auto_dtype" 240 --models "$large" --seq-lens "$long" --dtypes "$auto_dtype" \
      "${large_batch[@]}" --contenders rf-fused rf-reference hf-eager hf-compile
    ;;
  e2e-128)
    ensure_built
    gate 150 "$auto_dtype"
    models=("$base")
    [ "$large" != "$base" ] && models+=("$large")
    throughput "throughput-seq$short-$auto_dtype" 330 --models "${models[@]}" --seq-lens "$short" \
      --dtypes "$auto_dtype" "${big_batch[@]}" --contenders rf-fused rf-reference hf-eager hf-compile
    ;;
  kernels)
    ensure_built
    # GPU_SESSION_BENCHES: a subset (CI's dry run takes attention_dropout, the one with flags of its own;
    # tests/test_benchmarks.py runs each script --quick --json). attention_dropout: attention as the
    # model trains (dropout 0.1 in every contender). Not bench_preprocess: it runs on the CPU only, and at
    # full size needs minutes (far over a 75 s cap); record it on a many-core CPU instead
    for bench in ${GPU_SESSION_BENCHES:-attention attention_dropout bias_gelu layer_norm cross_entropy fused_adam mask_tokens inference}; do
      script=(benchmarks/bench_$bench.py)
      [ "$bench" = attention_dropout ] && script=(benchmarks/bench_attention.py --dropout 0.1)
      run "bench_$bench" 75 "$py" "${script[@]}" "${quick[@]}" --json "$out/bench_$bench.json"
    done
    # it compiles with Triton's own ptxas on any machine, never interpreted. --default-configs (as CI): 176
    # compiles of ~4 core-seconds (plus the candidates of any default with a problem), ~45 s on 16 cores;
    # every config would be 704, ~3 min, and it writes its JSON only at the end: nothing would come back
    compile_dry=()
    [ "$dry" = 1 ] && compile_dry=(--arch 90 --dtypes bf16 --head-dims 64 --kernels layer_norm)
    run compile_report 120 env -u TRITON_INTERPRET "$py" benchmarks/compile_report.py --launched-only \
      --default-configs ${compile_dry[@]+"${compile_dry[@]}"} --json "$out/compile_report.json"
    ;;
esac
finish 0
