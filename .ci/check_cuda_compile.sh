#!/usr/bin/env bash
# Compiles every csrc/*.cu for the GPUs the product targets, on a machine without one,
# with the flags torch.utils.cpp_extension adds (under C++17, older torch's standard, and
# C++20, torch's from 2.13), and fails on a compile error or a
# register spill (ptxas -v). The .cu files include no torch header, so no CUDA torch
# is needed. Exits non-zero on the first failure.
#   sm_75, sm_80, sm_90 (T4, A100, H100): the machine's nvcc (CUDA 13 builds sm_75 and newer).
#   sm_70 (V100): CUDA 13 has dropped it, and PyPI's CUDA 12 nvcc wheels hold ptxas only.
#     So the kernels are lowered to PTX for compute_75 by this nvcc, retargeted to sm_70
#     (PTX ISA 7.0, CUDA 11.0's), and assembled by a CUDA 12 ptxas, Triton's bundled one.
#     It catches instructions or PTX features a V100 lacks and its registers and spills;
#     it cannot see source paths under __CUDA_ARCH__ that differ between 700 and 750 (the
#     kernels have none; CUDA's half/bf16 headers switch at 530, 800 and 900).
#   .ci/check_cuda_compile.sh            (NVCC=..., PTXAS70=... to pick the tools)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [ ! -x "$NVCC" ]; then
  echo "check_cuda_compile: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 2
fi
PTXAS70="${PTXAS70:-$(python -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))' 2>/dev/null || true)}"
if [ ! -x "$PTXAS70" ]; then
  echo "check_cuda_compile: no ptxas for sm_70 (install triton, or set PTXAS70=/path/to/a CUDA 12 ptxas)" >&2
  exit 2
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
flags=(-O3 --use_fast_math --expt-relaxed-constexpr
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -DWITH_CUDA -Icsrc -Xcompiler -Wall -Werror all-warnings)

build() {  # $1: what is built; the rest: the command. Fails on its error or on a register spill (ptxas -v)
  local what="$1" log="$tmp/log"
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "check_cuda_compile: $what does not build" >&2
    exit 1
  fi
  if grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$log" >&2; then
    echo "check_cuda_compile: $what spills registers" >&2
    exit 1
  fi
}

shopt -s nullglob
files=(csrc/*.cu)
if [ ${#files[@]} -eq 0 ]; then
  echo "check_cuda_compile: no csrc/*.cu files" >&2
  exit 1
fi
for std in c++17 c++20; do
for f in "${files[@]}"; do
  name="$(basename "$f").$std"
  echo "nvcc (sm_75, sm_80, sm_90, $std): $f"
  build "$f ($std)" "$NVCC" -std=$std "${flags[@]}" -Xptxas -v -gencode arch=compute_75,code=sm_75 \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -c "$f" -o "$tmp/$name.o"
  echo "ptxas (sm_70, from compute_75 PTX, $std): $f"
  build "$f (PTX, $std)" "$NVCC" -std=$std "${flags[@]}" -arch=compute_75 -ptx "$f" -o "$tmp/$name.ptx"
  sed -e 's/^\.version .*/.version 7.0/' -e 's/^\.target sm_75/.target sm_70/' "$tmp/$name.ptx" > "$tmp/$name.70.ptx"
  build "$f (sm_70, $std)" "$PTXAS70" -arch=sm_70 -v "$tmp/$name.70.ptx" -o "$tmp/$name.70.cubin"
done
done
echo "check_cuda_compile: ${#files[@]} CUDA files compile (C++17 and C++20) for sm_75/80/90 with $("$NVCC" --version | tail -1)" \
     "and for sm_70 with $("$PTXAS70" --version | tail -1), no spills"
