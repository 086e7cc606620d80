// A CPU stand-in for the parts of the CUDA runtime that csrc/*.cu use, so that the
// CUDA kernels and their launchers run (slowly, exactly) on a machine with no GPU
// (tests/test_cuda_emulated.py). Tests only.
//
// Each CUDA thread of a block is a std::thread; blocks run one after another, so a
// function-local `static` is the running block's shared memory. __syncthreads and the
// warp shuffles are barriers (a thread that returns early drops out of them, as an
// exited CUDA thread does). Kernel launches `k<<<grid, block, smem, stream>>>(args);`
// are rewritten by the test into `::emu::launch(grid, block, smem, stream, [&] { k(args); });`.
// What it checks: indexing, chunking, tails, launch splitting, reductions and every
// branch, run for real. What it cannot: the device's arithmetic (FMA contraction,
// --use_fast_math), memory-model races between blocks, speed.
#pragma once

#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // one block runs at a time

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };

namespace emu {

using Barrier = std::barrier<>;

struct Block {
  std::unique_ptr<Barrier> all;                 // __syncthreads
  std::vector<std::unique_ptr<Barrier>> warps;  // shuffles, one per warp of 32
  std::vector<int> warp_width;                  // live lanes of each warp at launch
  std::vector<uint64_t> lanes;                  // a shuffle slot per thread
  std::atomic<int> any{0};                      // __syncthreads_or
};

inline Block* block = nullptr;
inline dim3 block_dim, grid_dim;
inline thread_local dim3 thread_index, block_index;
inline cudaError_t last_error = cudaSuccess;

// Runs body() as every thread of every block of the grid; returns when all are done.
template <typename F>
void launch(dim3 grid, dim3 threads, size_t shared_bytes, cudaStream_t, F body) {
  const unsigned n = threads.x * threads.y * threads.z;
  if (n == 0 || n > 1024 || threads.y != 1 || threads.z != 1 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || shared_bytes > 48 * 1024) {
    last_error = cudaErrorInvalidConfiguration;  // 1-D blocks only, as csrc uses
    return;
  }
  block_dim = threads;
  grid_dim = grid;
  const unsigned blocks = grid.x * grid.y * grid.z;
  auto make_block = [n] {
    auto b = std::make_unique<Block>();
    b->all = std::make_unique<Barrier>(n);
    for (unsigned w = 0; w * 32 < n; ++w) {
      const int width = static_cast<int>(std::min<unsigned>(32, n - w * 32));
      b->warps.push_back(std::make_unique<Barrier>(width));
      b->warp_width.push_back(width);
    }
    b->lanes.resize(n);
    return b;
  };
  // The n threads are made once per launch and run the blocks one after another: all of
  // them finish a block (the barrier below) before the next block's state replaces it.
  std::unique_ptr<Block> running = make_block();
  unsigned done = 0;
  std::barrier between(n, [&]() noexcept {
    if (++done < blocks) running = make_block();
    block = running.get();
  });
  block = running.get();
  std::vector<std::thread> pool;
  pool.reserve(n);
  for (unsigned t = 0; t < n; ++t)
    pool.emplace_back([&, t] {
      thread_index = dim3(t);
      for (unsigned k = 0; k < blocks; ++k) {
        block_index = dim3(k % grid.x, k / grid.x % grid.y, k / (grid.x * grid.y));
        body();
        block->warps[t / 32]->arrive_and_drop();  // an exited thread waits on nothing more
        block->all->arrive_and_drop();
        between.arrive_and_wait();
      }
    });
  for (auto& th : pool) th.join();
  block = nullptr;
}

}  // namespace emu

#define threadIdx (::emu::thread_index)
#define blockIdx (::emu::block_index)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = ::emu::last_error;
  ::emu::last_error = cudaSuccess;
  return e;
}

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  }
  return "unknown error";
}

inline void __syncthreads() { ::emu::block->all->arrive_and_wait(); }

inline int __syncthreads_or(int predicate) {
  auto& b = *::emu::block;
  b.all->arrive_and_wait();
  if (predicate) b.any.fetch_or(1);
  b.all->arrive_and_wait();
  const int any = b.any.load();
  b.all->arrive_and_wait();  // everyone has read it: the next call starts from 0
  if (threadIdx.x == 0) b.any.store(0);
  return any;
}

// The value of lane (this lane + delta) of this warp, or this lane's own beyond the warp.
template <typename T>
T __shfl_down_sync(unsigned /*mask: all lanes*/, T value, unsigned delta) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  auto& b = *::emu::block;
  const unsigned t = threadIdx.x, warp = t / 32, lane = t % 32;
  std::memcpy(&b.lanes[t], &value, sizeof(T));
  b.warps[warp]->arrive_and_wait();
  T out = value;
  if (lane + delta < static_cast<unsigned>(b.warp_width[warp])) std::memcpy(&out, &b.lanes[t + delta], sizeof(T));
  b.warps[warp]->arrive_and_wait();  // every lane has read before any writes again
  return out;
}

// CUDA's device min/max overloads for integers and floats.
template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }
