#!/usr/bin/env bash
# Everything a GPU run checks and records, in stages that each fit in about ten minutes.
#
#   benchmarks/gpu_session.sh STAGE [OUTDIR]
#
#   test       build (if needed), then the whole test suite on the GPU (bf16 included)
#   sanitize   the extension's CUDA tests under compute-sanitizer (memcheck, racecheck)
#   e2e        throughput.py: roberta-base, seq 512, --precision auto's dtype (bf16; fp16 on a V100/T4), all
#              four contenders, profiled; roofline.py's floor for this GPU
#   e2e-fp16   the same in fp16 (with loss scaling)
#   e2e-more   throughput.py: roberta-large at 512, and base and large at 128 (auto's dtype)
#   kernels    every per-kernel benchmark (attention, bias+GELU, LayerNorm, FusedAdam, masking,
#              preprocessing, inference) and the AOT compile report
#
# Logs and JSON files are packed into one file, OUTDIR/STAGE.tgz (default OUTDIR:
# benchmarks/results/pending), refreshed after every step: a machine that hands back
# only a few files gets all of them, and a stage cut off at its time limit still
# hands back what it finished. Nothing is written to benchmarks/results/ itself: copy
# the JSON files there and run `python benchmarks/throughput.py --refresh-record` to
# update the record's table. The last lines printed are a summary of the stage.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: benchmarks/gpu_session.sh test|sanitize|e2e|e2e-fp16|e2e-more|kernels [OUTDIR]}
dest=${2:-benchmarks/results/pending}
out=${TMPDIR:-/tmp}/gpu_session-$stage  # the stage's files, packed into $dest/$stage.tgz
rm -rf "$out" && mkdir -p "$out" "$dest"
py=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONUNBUFFERED=1
summary=()
start=$SECONDS

# --precision auto's dtype on this GPU (bf16 on sm_80+, fp16 on a V100/T4) and its roofline column
read -r auto_dtype roofline_gpu < <("$py" - 2>/dev/null <<'EOF'
import torch
from roberta_fast.precision import resolve_precision
cap = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else (9, 0)
gpu = {(7, 0): "v100", (7, 5): "t4", (8, 0): "a100"}.get(cap, "h100")
print(resolve_precision("auto", torch.device("cuda")) if torch.cuda.is_available() else "bf16", gpu)
EOF
) || true
auto_dtype=${auto_dtype:-bf16} roofline_gpu=${roofline_gpu:-h100}

note() { summary+=("$1"); echo "== $1"; printf '%s\n' "${summary[@]}" >"$out/summary.txt"; pack; }
pack() { tar czf "$dest/$stage.tgz" -C "$out" . 2>/dev/null; }

"$py" - >"$out/environment.txt" 2>&1 <<'EOF'
import subprocess, torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print(subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
EOF

ensure_built() {
  if "$py" -c "import torch, roberta_fast._C as C; assert torch.cuda.is_available() and C.built_with_cuda()" \
      2>/dev/null; then
    return 0
  fi
  local t=$SECONDS
  if MAX_JOBS=${MAX_JOBS:-16} "$py" -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 &&
     "$py" -c "import torch, roberta_fast._C as C; assert C.built_with_cuda()"; then  # torch first: _C links libc10
    note "build: ok ($((SECONDS - t)) s)"
  else
    tail -40 "$out/build.log"
    note "build: FAILED (see build.log)"
    finish 1
  fi
}

run() {  # run NAME CMD...: log to NAME.log, note the exit status and time
  local name=$1 t=$SECONDS rc
  shift
  "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  note "$name: exit $rc ($((SECONDS - t)) s)$( [ "$rc" = 0 ] || echo '  <-- FAILED')"
  return "$rc"
}

finish() {
  pack
  echo
  echo "==== $stage summary ($((SECONDS - start)) s) ===="
  cat "$out/environment.txt"
  printf '%s\n' "${summary[@]}"
  exit "${1:-0}"
}

case $stage in
  test)
    ensure_built
    xdist=()
    "$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
    # Default configs (no autotuning) except where a test turns it on; --durations names the slow ones.
    # The device has no network: the transformers-suite gate (it fetches their tests from PyPI) skips.
    ROBERTA_FAST_AUTOTUNE=0 ROBERTA_FAST_OFFLINE=1 run pytest "$py" -m pytest -q -rs "${xdist[@]}" --durations=15 \
      --junitxml="$out/pytest.xml"
    note "pytest: $(grep -E '(passed|failed|error)' "$out/pytest.log" | tail -1)"
    ;;
  sanitize)
    ensure_built
    for tool in memcheck racecheck; do
      run "sanitize-$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 "$py" -m pytest -q -x \
        tests/test_fused_adam.py tests/test_mask_tokens.py -k cuda
    done
    ;;
  e2e|e2e-fp16)
    ensure_built
    dtype=$([ "$stage" = e2e ] && echo "$auto_dtype" || echo fp16)
    run "throughput-base512-$dtype" "$py" benchmarks/throughput.py --models base --seq-lens 512 --dtypes "$dtype" \
      --profile --no-record --json "$out/throughput-base512-$dtype.json" --chart "$out/throughput-base512-$dtype.png"
    # the predicted floor of the same step, beside the measured profile (batch 32: the benchmarks' shape)
    run roofline-base512 "$py" benchmarks/roofline.py --model base --seq-len 512 --batch 32 --gpu "$roofline_gpu" \
      --json "$out/roofline-base512.json"
    ;;
  e2e-more)
    ensure_built
    run throughput-more "$py" benchmarks/throughput.py --models base large --seq-lens 128 512 --dtypes "$auto_dtype" \
      --no-record --json "$out/throughput-more.json" --chart "$out/throughput-more.png"
    ;;
  kernels)
    ensure_built
    for bench in attention bias_gelu layer_norm cross_entropy fused_adam mask_tokens preprocess inference; do
      run "bench_$bench" "$py" "benchmarks/bench_$bench.py" --json "$out/bench_$bench.json"
    done
    # attention as the model trains (dropout 0.1 in every contender)
    run bench_attention_dropout "$py" benchmarks/bench_attention.py --dropout 0.1 \
      --json "$out/bench_attention_dropout.json"
    run compile_report "$py" benchmarks/compile_report.py --launched-only --json "$out/compile_report.json"
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
finish 0
