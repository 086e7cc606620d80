// CUDA fused AdamW and gradient norm for roberta_fast.FusedAdam: multi-tensor
// launches (multi_tensor_apply.cuh, after apex's multi_tensor_adam.cu), fp32
// math from adam_math.h, 64-bit element offsets. The torch binding is
// fused_adam.cpp; this file includes no torch header so CI can compile it with
// plain nvcc (.ci/check_cuda_compile.sh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <vector>

#include "adam_math.h"
#include "fused_adam_cuda.h"
#include "multi_tensor_apply.cuh"

namespace roberta_fast {
namespace {

constexpr int kBlockSize = 512;
constexpr int kILP = 4;  // elements per thread and access group
static_assert(kChunkSize % kILP == 0, "vector accesses need chunks of whole groups");

__device__ __forceinline__ float load_float(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_float(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
__device__ __forceinline__ float load_float(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store_float(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store_float(__half* p, int64_t i, float x) {
  p[i] = __float2half_rn(x);
}
__device__ __forceinline__ void store_float(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}

// kILP elements of T in one aligned access (16 bytes for fp32, 8 for fp16/bf16).
template <typename T>
struct alignas(sizeof(T) * kILP) Vec {
  T v[kILP];
};

template <typename T>
__device__ __forceinline__ bool is_aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % sizeof(Vec<T>) == 0;
}

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T>*>(ptr);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* ptr, const Vec<T>& x) {
  *reinterpret_cast<Vec<T>*>(ptr) = x;
}

// Slots of the Adam argument block.
enum { kGrad = 0, kParam = 1, kExpAvg = 2, kExpAvgSq = 3, kMaster = 4, kStep = 5, kAdamDepth = 6 };
using AdamMeta = TensorListMeta<kAdamDepth, 36>;

template <typename P, typename G, bool kHasMaster>
struct AdamOp {
  AdamHyper hyper;
  const float* grad_scale;
  const float* sumsq;
  double max_norm;

  __device__ void operator()(const AdamMeta& meta, int t, int64_t chunk) const {
    if (step_skipped(sumsq)) return;
    const float factor = grad_factor(grad_scale, sumsq, max_norm);
    const float step = *static_cast<const float*>(meta.addresses[kStep][t]);  // steps taken
    const AdamScalars s = adam_scalars(hyper, static_cast<double>(step) + 1.0);
    const G* g = static_cast<const G*>(meta.addresses[kGrad][t]);
    P* p = static_cast<P*>(meta.addresses[kParam][t]);
    float* m = static_cast<float*>(meta.addresses[kExpAvg][t]);
    float* v = static_cast<float*>(meta.addresses[kExpAvgSq][t]);
    float* w = static_cast<float*>(meta.addresses[kMaster][t]);
    const int64_t begin = chunk * kChunkSize;
    const int64_t end = min(begin + kChunkSize, meta.sizes[t]);
    const bool vectorised = is_aligned<G>(g) && is_aligned<P>(p) && is_aligned<float>(m) &&
                            is_aligned<float>(v) && (!kHasMaster || is_aligned<float>(w));
    if (vectorised) {
      // kILP consecutive elements per thread, one 16-byte (fp32) or 8-byte (16-bit)
      // access per operand; chunks start at multiples of kILP.
      for (int64_t base = begin + int64_t(threadIdx.x) * kILP; base < end;
           base += int64_t(blockDim.x) * kILP) {
        if (base + kILP > end) {  // the tensor's ragged tail
          for (int64_t i = base; i < end; ++i) update_one(p, g, m, v, w, i, factor, s);
          continue;
        }
        const Vec<G> vg = load_vec(g + base);
        Vec<float> vm = load_vec(m + base), vv = load_vec(v + base), vw;
        Vec<P> vp;
        float rp[kILP];
        if (kHasMaster) {
          vw = load_vec(w + base);
#pragma unroll
          for (int k = 0; k < kILP; ++k) rp[k] = vw.v[k];
        } else {
          vp = load_vec(p + base);
#pragma unroll
          for (int k = 0; k < kILP; ++k) rp[k] = load_float(vp.v, k);
        }
#pragma unroll
        for (int k = 0; k < kILP; ++k)
          adam_update(rp[k], load_float(vg.v, k) * factor, vm.v[k], vv.v[k], s);
#pragma unroll
        for (int k = 0; k < kILP; ++k) {
          if (kHasMaster) vw.v[k] = rp[k];
          store_float(vp.v, k, rp[k]);
        }
        if (kHasMaster) store_vec(w + base, vw);
        store_vec(p + base, vp);
        store_vec(m + base, vm);
        store_vec(v + base, vv);
      }
      return;
    }
    // Unaligned tensors (views at odd offsets): kILP strided elements per thread.
    for (int64_t base = begin + threadIdx.x; base < end; base += int64_t(blockDim.x) * kILP) {
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        const int64_t i = base + int64_t(k) * blockDim.x;
        if (i < end) update_one(p, g, m, v, w, i, factor, s);
      }
    }
  }

  // One element, scalar loads and stores.
  __device__ __forceinline__ void update_one(P* p, const G* g, float* m, float* v, float* w,
                                             int64_t i, float factor,
                                             const AdamScalars& s) const {
    float pi = kHasMaster ? w[i] : load_float(p, i);
    float mi = m[i], vi = v[i];
    adam_update(pi, load_float(g, i) * factor, mi, vi, s);
    if (kHasMaster) w[i] = pi;
    store_float(p, i, pi);
    m[i] = mi;
    v[i] = vi;
  }
};

using NormMeta = TensorListMeta<1, 96>;

template <typename G>
struct SumsqOp {
  const float* grad_scale;
  float* partials;

  __device__ void operator()(const NormMeta& meta, int t, int64_t chunk) const {
    const float inv_scale = grad_scale ? div_rn(1.0f, *grad_scale) : 1.0f;
    const G* g = static_cast<const G*>(meta.addresses[0][t]);
    const int64_t begin = chunk * kChunkSize;
    const int64_t end = min(begin + kChunkSize, meta.sizes[t]);
    float acc = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float x = load_float(g, i) * inv_scale;
      acc += x * x;
    }
    acc = block_reduce(acc, [](float a, float b) { return a + b; });
    if (threadIdx.x == 0) partials[meta.first_chunk[t] + chunk] = acc;
  }
};

using StepMeta = TensorListMeta<1, 96>;

struct BumpStepOp {
  const float* sumsq;
  __device__ void operator()(const StepMeta& meta, int t, int64_t) const {
    if (threadIdx.x == 0 && !step_skipped(sumsq)) *static_cast<float*>(meta.addresses[0][t]) += 1.0f;
  }
};

__global__ void sum_partials_kernel(const float* partials, int64_t count, float* out) {
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_reduce(acc, [](float a, float b) { return a + b; });
  if (threadIdx.x == 0) *out = acc;
}

const char* error_string(cudaError_t err) {
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename P, typename G>
cudaError_t adam_typed(const AdamTensors& t, const AdamHyper& h, const float* grad_scale,
                       const float* sumsq, double max_norm, cudaStream_t stream) {
  void* const* lists[kAdamDepth] = {
      const_cast<void* const*>(t.grads), t.params,
      reinterpret_cast<void* const*>(t.exp_avgs), reinterpret_cast<void* const*>(t.exp_avg_sqs),
      reinterpret_cast<void* const*>(t.masters ? t.masters : t.exp_avgs),  // unused if none
      reinterpret_cast<void* const*>(t.steps)};
  if (t.masters)
    return multi_tensor_apply<kAdamDepth, 36>(
        t.n, lists, t.sizes, AdamOp<P, G, true>{h, grad_scale, sumsq, max_norm}, kBlockSize,
        stream);
  return multi_tensor_apply<kAdamDepth, 36>(
      t.n, lists, t.sizes, AdamOp<P, G, false>{h, grad_scale, sumsq, max_norm}, kBlockSize,
      stream);
}

template <typename P>
cudaError_t adam_dispatch_grad(int32_t grad_type, const AdamTensors& t, const AdamHyper& h,
                               const float* grad_scale, const float* sumsq, double max_norm,
                               cudaStream_t stream) {
  switch (grad_type) {
    case kFloat32: return adam_typed<P, float>(t, h, grad_scale, sumsq, max_norm, stream);
    case kFloat16: return adam_typed<P, __half>(t, h, grad_scale, sumsq, max_norm, stream);
    case kBFloat16:
      return adam_typed<P, __nv_bfloat16>(t, h, grad_scale, sumsq, max_norm, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

const char* adam_step_cuda(int32_t param_type, int32_t grad_type, const AdamTensors& t,
                           const AdamHyper& hyper, const float* grad_scale,
                           const float* sumsq, double max_norm, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  switch (param_type) {
    case kFloat32:
      err = adam_dispatch_grad<float>(grad_type, t, hyper, grad_scale, sumsq, max_norm, s);
      break;
    case kFloat16:
      err = adam_dispatch_grad<__half>(grad_type, t, hyper, grad_scale, sumsq, max_norm, s);
      break;
    case kBFloat16:
      err = adam_dispatch_grad<__nv_bfloat16>(grad_type, t, hyper, grad_scale, sumsq, max_norm, s);
      break;
  }
  return error_string(err);
}

const char* adam_bump_steps_cuda(int64_t n, float* const* steps, const float* sumsq,
                                 void* stream) {
  void* const* lists[1] = {reinterpret_cast<void* const*>(steps)};
  const std::vector<int64_t> ones(static_cast<size_t>(n), 1);  // one element per step tensor
  return error_string(multi_tensor_apply<1, 96>(n, lists, ones.data(), BumpStepOp{sumsq}, 32,
                                                static_cast<cudaStream_t>(stream)));
}

const char* grad_sumsq_partials_cuda(int32_t grad_type, int64_t n, const void* const* grads,
                                     const int64_t* sizes, const float* grad_scale,
                                     float* partials, void* stream) {
  void* const* lists[1] = {const_cast<void* const*>(grads)};
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  switch (grad_type) {
    case kFloat32:
      err = multi_tensor_apply<1, 96>(n, lists, sizes, SumsqOp<float>{grad_scale, partials},
                                       kBlockSize, s);
      break;
    case kFloat16:
      err = multi_tensor_apply<1, 96>(n, lists, sizes, SumsqOp<__half>{grad_scale, partials},
                                       kBlockSize, s);
      break;
    case kBFloat16:
      err = multi_tensor_apply<1, 96>(
          n, lists, sizes, SumsqOp<__nv_bfloat16>{grad_scale, partials}, kBlockSize, s);
      break;
  }
  return error_string(err);
}

const char* sum_partials_cuda(const float* partials, int64_t count, float* out, void* stream) {
  sum_partials_kernel<<<1, 1024, 0, static_cast<cudaStream_t>(stream)>>>(partials, count, out);
  return error_string(cudaGetLastError());
}

}  // namespace roberta_fast
