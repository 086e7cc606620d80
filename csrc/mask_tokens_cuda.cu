// CUDA dynamic masking for roberta_fast.mask_tokens: the rule of mask_math.h on
// the device, so masking needs no host round-trip. Token strategy: one block per
// row, a thread per position, block reductions for the at-least-one rule, and for
// the span boundaries each predicted token scans its run of predicted neighbours.
// Whole words and spans are sequential within a row (spans depend on earlier spans):
// one thread per row running the very function the CPU build runs. The torch
// binding is mask_tokens.cpp; no torch header here (CI compiles it with nvcc).
#include <cuda_runtime.h>

#include "mask_math.h"
#include "mask_tokens_cuda.h"
#include "multi_tensor_apply.cuh"  // block_reduce

namespace roberta_fast {
namespace {

constexpr int kRowBlock = 256;      // threads per row, token strategy
constexpr int kRowsPerBlock = 64;   // rows per block, whole_word and span

__global__ void mask_token_rows_kernel(const MaskParams p, const int64_t* ids, int64_t len,
                                       uint32_t sample_offset, int64_t* out, int64_t* labels,
                                       int64_t* spans) {
  const int64_t row = blockIdx.x;
  const uint32_t sample = sample_offset + static_cast<uint32_t>(row);
  ids += row * len;
  out += row * len;
  labels += row * len;
  int any = 0;
  unsigned long long best = ~0ull;  // (draw << 32) | position of the smallest draw
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    const int64_t id = ids[j];
    int64_t o = id, label = kIgnoreIndex;
    if (is_maskable(p, id)) {
      const uint32_t u = mask_draw(p, static_cast<uint32_t>(j), sample, 0).x;
      if (u < p.select_threshold) {
        label = id;
        o = replace_token(p, id, static_cast<uint32_t>(j), static_cast<uint32_t>(j), sample);
        any = 1;
      }
      const unsigned long long key = (static_cast<unsigned long long>(u) << 32) |
                                     static_cast<unsigned long long>(j);
      best = key < best ? key : best;
    }
    out[j] = o;
    labels[j] = label;
  }
  any = __syncthreads_or(any);
  best = block_reduce(best, [](unsigned long long a, unsigned long long b) { return a < b ? a : b; });
  if (threadIdx.x == 0 && !any && best != ~0ull) {
    // A row with maskable tokens and nothing selected predicts its smallest draw.
    const int64_t j = static_cast<int64_t>(best & 0xFFFFFFFFull);
    labels[j] = ids[j];
    out[j] = replace_token(p, ids[j], static_cast<uint32_t>(j), static_cast<uint32_t>(j), sample);
  }
  if (spans == nullptr) return;
  __syncthreads();  // the row's labels, the fix-up included, are final
  spans += 3 * row * len;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    if (labels[j] == kIgnoreIndex) {
      spans[3 * j] = spans[3 * j + 1] = spans[3 * j + 2] = -1;
      continue;
    }
    int64_t s = j, e = j;  // the maximal run of predicted tokens around j
    while (s > 0 && labels[s - 1] != kIgnoreIndex) --s;
    while (e + 1 < len && labels[e + 1] != kIgnoreIndex) ++e;
    write_span(len, s, e, j, spans + 3 * j);
  }
}

__global__ void mask_rows_serial_kernel(const MaskParams p, const int64_t* ids,
                                        const bool* word_starts, int64_t rows, int64_t len,
                                        uint32_t sample_offset, int64_t* out, int64_t* labels,
                                        int64_t* spans) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const int64_t off = row * len;
  mask_row(p, ids + off, word_starts ? word_starts + off : nullptr, len,
           sample_offset + static_cast<uint32_t>(row), out + off, labels + off,
           spans ? spans + 3 * off : nullptr);
}

}  // namespace

const char* mask_tokens_cuda(const MaskParams& params, const int64_t* ids,
                             const bool* word_starts, int64_t rows, int64_t len,
                             uint32_t sample_offset, int64_t* out, int64_t* labels,
                             int64_t* spans, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (rows == 0 || len == 0) return nullptr;
  if (params.strategy == kToken) {
    // Rows beyond the grid's y/x limits do not occur: x allows 2^31 - 1 blocks.
    mask_token_rows_kernel<<<static_cast<unsigned>(rows), kRowBlock, 0, s>>>(
        params, ids, len, sample_offset, out, labels, spans);
  } else {
    const auto blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    mask_rows_serial_kernel<<<blocks, kRowsPerBlock, 0, s>>>(params, ids, word_starts, rows, len,
                                                            sample_offset, out, labels, spans);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace roberta_fast
