#!/usr/bin/env bash
# The CPU inference record in one command: rf's int8 contenders against transformers and ONNX Runtime on
# this CPU, the figures of docs/inference.md's "int8 on the CPU: In short" table.
#
#   benchmarks/cpu_session.sh [STAGE ...]           # STAGE: batches, latency, mlm (default: all three)
#   CPU_SESSION_DRY=1 benchmarks/cpu_session.sh     # print the commands only (tests parse them)
#
#   batches  fixed 32 x 128 and uniform 8..512 (the issue's targets): rf fp32, rf int8 on each engine,
#            ONNX Runtime int8 (defaults and reduce_range), transformers + quantize_dynamic
#   latency  single requests of 8, 16 and 32 tokens: rf int8 on each engine, ONNX Runtime int8
#   mlm      fill-mask (logits at every position) at 1 x 16: rf int8, ONNX Runtime int8, transformers int8
#
# transformers SDPA fp32, the peer, runs in every record. Records (JSON and chart) go to
# benchmarks/results/inference-cpu-<cores>cores-<date>-<isa>-<what>.json, where <isa> is amx, vnni
# (AVX-512 VNNI or AVX-VNNI) or avx2 from the CPU's flags: int8 speed and activation bits depend on it.
# Run it with nothing else on the machine: a build or a test suite beside it moves figures by tens of
# percent. On the 2-core AMD EPYC with VNNI: batches ~20 minutes, latency ~8, mlm ~3.
set -euo pipefail
cd "$(dirname "$0")/.."

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(batches latency mlm)
for stage in "${stages[@]}"; do  # all checked before the first run, which takes minutes
  case $stage in
    batches | latency | mlm) ;;
    *) echo "cpu_session.sh: no stage $stage (the stages: batches, latency, mlm)" >&2; exit 2 ;;
  esac
done

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
case " $flags " in
  *" amx_int8 "*) isa=amx ;;
  *" avx512_vnni "* | *" avx_vnni "*) isa=vnni ;;
  *" avx2 "*) isa=avx2 ;;
  *) isa=$(uname -m) ;;
esac
prefix="benchmarks/results/inference-cpu-$(nproc)cores-$(date -u +%F)-$isa"

record() {  # record NAME ARGS...: one bench_inference.py run written to $prefix-NAME.json (+ .png)
  local name=$1
  shift
  local out="$prefix-$name.json"
  [ -e "$out" ] && out="$prefix-$name-$(date -u +%H%M).json"  # a rerun the same day keeps the first
  local cmd=(python benchmarks/bench_inference.py --device cpu --dtypes fp32 --skip-compile "$@" --json "$out"
             --note "benchmarks/cpu_session.sh: $name")
  if [ -n "${CPU_SESSION_DRY:-}" ]; then
    printf '%q ' "${cmd[@]}"
    echo
  else
    echo "== $name -> $out"
    "${cmd[@]}"
  fi
}

int8_batches=rf-unpadded,rf-int8,rf-int8-fbgemm,rf-int8-auto,onnxruntime-int8,onnxruntime-int8-7bit,hf-int8
for stage in "${stages[@]}"; do
  case $stage in
    batches)
      record int8-fixed --lengths fixed --repeats 5 --only "$int8_batches"
      record int8-uniform --lengths uniform --repeats 3 --only "$int8_batches" ;;
    latency)
      for tokens in 8 16 32; do
        record "latency-1x$tokens" --lengths fixed --batch-size 1 --fixed-length "$tokens" --batches 20 --repeats 9 \
          --only rf-int8,rf-int8-fbgemm,rf-int8-auto,onnxruntime-int8
      done ;;
    mlm)
      record mlm-latency-1x16 --lengths fixed --batch-size 1 --fixed-length 16 --batches 20 --repeats 9 --head mlm \
        --only rf-int8,rf-int8-auto,onnxruntime-int8,hf-int8 ;;
  esac
done
