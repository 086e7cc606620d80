// Multi-tensor launches, after apex's csrc/multi_tensor_apply.cuh: the tensors of
// a list are cut into kChunkSize chunks, one CUDA block per chunk, and the
// addresses of up to MaxTensors tensors travel by value in the kernel's
// arguments, so a whole model is updated in a handful of launches instead of one
// per parameter. Plain CUDA, no torch headers.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "adam_math.h"  // kChunkSize, num_chunks

namespace roberta_fast {

constexpr int kMaxBlocksPerLaunch = 320;

// Kernel argument block: Depth pointers per tensor (e.g. grad, param, exp_avg, ...),
// each tensor's size and index of its first chunk in the whole list (for per-chunk
// outputs), and which (tensor, chunk) each block handles. Under 4 KB by design.
template <int Depth, int MaxTensors>
struct TensorListMeta {
  void* addresses[Depth][MaxTensors];
  int64_t sizes[MaxTensors];
  int64_t first_chunk[MaxTensors];
  uint8_t block_to_tensor[kMaxBlocksPerLaunch];
  int32_t block_to_chunk[kMaxBlocksPerLaunch];
};

template <typename Meta, typename Op>
__global__ void multi_tensor_kernel(const Meta meta, const Op op) {
  const int t = meta.block_to_tensor[blockIdx.x];
  op(meta, t, static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]));
}

// Runs op(meta, tensor slot, chunk) on every chunk of the n tensors whose Depth
// addresses are lists[d][i] and sizes sizes[i]; empty tensors are skipped.
template <int Depth, int MaxTensors, typename Op>
cudaError_t multi_tensor_apply(int64_t n, void* const* const lists[Depth], const int64_t* sizes,
                               const Op& op, int block_size, cudaStream_t stream) {
  static_assert(sizeof(TensorListMeta<Depth, MaxTensors>) + sizeof(Op) <= 4096,
                "kernel arguments must stay within 4 KB");
  static_assert(MaxTensors <= 256, "block_to_tensor is a uint8_t");
  using Meta = TensorListMeta<Depth, MaxTensors>;
  Meta meta;
  int tensors = 0, blocks = 0;
  int64_t chunk_base = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t chunks = num_chunks(sizes[i]);
    if (chunks == 0) continue;
    for (int d = 0; d < Depth; ++d) meta.addresses[d][tensors] = lists[d][i];
    meta.sizes[tensors] = sizes[i];
    meta.first_chunk[tensors] = chunk_base;
    chunk_base += chunks;
    ++tensors;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<uint8_t>(tensors - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool blocks_full = blocks == kMaxBlocksPerLaunch;
      const bool tensors_full = tensors == MaxTensors && c == chunks - 1;
      if (blocks_full || tensors_full) {
        multi_tensor_kernel<<<blocks, block_size, 0, stream>>>(meta, op);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        blocks = 0;
        if (c == chunks - 1) {
          tensors = 0;
        } else {  // the current tensor goes on in the next launch, in slot 0
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][tensors - 1];
          meta.sizes[0] = meta.sizes[tensors - 1];
          meta.first_chunk[0] = meta.first_chunk[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) {
    multi_tensor_kernel<<<blocks, block_size, 0, stream>>>(meta, op);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

// Block-wide reductions (any block size that is a multiple of 32, up to 1024).
template <typename T, typename F>
__device__ T block_reduce(T value, F combine) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2)
    value = combine(value, __shfl_down_sync(0xFFFFFFFFu, value, offset));
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / 32;
  if (warp == 0) {
    value = lane < warps ? partial[lane] : partial[0];
    for (int offset = 16; offset > 0; offset /= 2) {
      const T other = __shfl_down_sync(0xFFFFFFFFu, value, offset);
      if (lane + offset < warps) value = combine(value, other);
    }
  }
  return value;  // valid in thread 0
}

}  // namespace roberta_fast
