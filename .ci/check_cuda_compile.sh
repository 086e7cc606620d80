#!/usr/bin/env bash
# Compiles every csrc/*.cu with the machine's nvcc for sm_80 and sm_90 (compile
# only), with the flags torch.utils.cpp_extension adds, so CUDA code that does not
# build is caught on machines without a GPU. The .cu files include no torch
# header, so no CUDA torch is needed. Exits non-zero on the first failure.
#   .ci/check_cuda_compile.sh            (NVCC=/path/to/nvcc to pick a compiler)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [ ! -x "$NVCC" ]; then
  echo "check_cuda_compile: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 2
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -DWITH_CUDA -Icsrc -Xcompiler -Wall -Werror all-warnings
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
shopt -s nullglob
files=(csrc/*.cu)
if [ ${#files[@]} -eq 0 ]; then
  echo "check_cuda_compile: no csrc/*.cu files" >&2
  exit 1
fi
for f in "${files[@]}"; do
  echo "nvcc (sm_80, sm_90): $f"
  "$NVCC" "${flags[@]}" -c "$f" -o "$tmp/$(basename "$f").o"
done
echo "check_cuda_compile: ${#files[@]} CUDA files compile with $("$NVCC" --version | tail -1)"
