// Fused AdamW (roberta_fast.FusedAdam): the torch binding, the CPU
// implementation (at::parallel_for, i.e. torch's OpenMP pool, over chunks of all
// tensors; vectorisable inner loops)
// and the dispatch to the CUDA launchers. Per-element math: adam_math.h.
#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

#include "adam_math.h"
#include "fused_adam_cuda.h"

#ifdef WITH_CUDA
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that needs the cuBLAS/cuSPARSE dev headers
#include <c10/cuda/CUDAGuard.h>
#endif

namespace roberta_fast {
namespace {

using TensorList = std::vector<torch::Tensor>;

FloatType float_type(const torch::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case torch::kFloat: return kFloat32;
    case torch::kHalf: return kFloat16;
    case torch::kBFloat16: return kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "FusedAdam: ", what, " must be float32, float16 or bfloat16, got ",
                       t.scalar_type());
  }
  return kFloat32;
}

void check_tensor(const torch::Tensor& t, const torch::Device& device, const char* what) {
  TORCH_CHECK_VALUE(t.device() == device, "FusedAdam: ", what, " is on ", t.device(),
                    " but the parameters are on ", device, "; move them to one device");
  TORCH_CHECK_VALUE(t.is_contiguous(), "FusedAdam: ", what, " must be contiguous");
}

void check_fp32(const torch::Tensor& t, const torch::Tensor& like, const torch::Device& device,
                const char* what) {
  check_tensor(t, device, what);
  TORCH_CHECK_TYPE(t.scalar_type() == torch::kFloat, "FusedAdam: ", what, " must be float32");
  TORCH_CHECK_VALUE(t.numel() == like.numel(), "FusedAdam: ", what, " has ", t.numel(),
                    " elements, its parameter ", like.numel());
}

const float* scalar_ptr(const c10::optional<torch::Tensor>& t, const torch::Device& device,
                        const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_VALUE(t->numel() == 1 && t->scalar_type() == torch::kFloat,
                    "FusedAdam: ", what, " must be a float32 tensor of one element");
  TORCH_CHECK_VALUE(t->device() == device, "FusedAdam: ", what, " is on ", t->device(),
                    " but the parameters are on ", device);
  return t->data_ptr<float>();
}

int64_t total_numel(const TensorList& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.numel();
  return n;
}

// Chunks per task of at::parallel_for (torch's OpenMP pool, so torch.set_num_threads
// applies and small steps stay serial): about 2^18 elements, where a parallel region
// starts to pay off.
int64_t grain_size(int64_t jobs, int64_t elements) {
  const int64_t per_task = int64_t(1) << 18;
  return std::max<int64_t>(1, (per_task * jobs + std::max<int64_t>(elements, 1) - 1) /
                                  std::max<int64_t>(elements, 1));
}

// (tensor, first element, end) work items: every tensor cut into kChunkSize chunks.
std::vector<std::tuple<int64_t, int64_t, int64_t>> chunks_of(const TensorList& ts) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> jobs;
  for (int64_t i = 0; i < static_cast<int64_t>(ts.size()); ++i)
    for (int64_t s = 0; s < ts[i].numel(); s += kChunkSize)
      jobs.emplace_back(i, s, std::min(s + kChunkSize, ts[i].numel()));
  return jobs;
}

template <typename T>
float to_float(T x) { return static_cast<float>(x); }

template <typename P, typename G, bool kMaster>
void adam_chunk(P* param, const G* grad, float* m, float* v, float* master, int64_t begin,
                int64_t end, float factor, const AdamScalars& s) {
  for (int64_t i = begin; i < end; ++i) {
    float p = kMaster ? master[i] : to_float(param[i]);
    adam_update(p, to_float(grad[i]) * factor, m[i], v[i], s);
    if (kMaster) master[i] = p;
    param[i] = static_cast<P>(p);
  }
}

template <typename P, typename G>
void adam_step_cpu_typed(const TensorList& params, const TensorList& grads,
                         const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                         const TensorList& masters, const TensorList& steps,
                         const AdamHyper& h, float factor) {
  const bool has_master = !masters.empty();
  std::vector<AdamScalars> scalars;
  for (const auto& st : steps) scalars.push_back(adam_scalars(h, *st.data_ptr<float>() + 1.0));
  const auto jobs = chunks_of(params);
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  at::parallel_for(0, njobs, grain_size(njobs, total_numel(params)), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const auto [i, begin, end] = jobs[k];
      P* p = static_cast<P*>(params[i].data_ptr());
      const G* g = static_cast<const G*>(grads[i].data_ptr());
      float* m = exp_avgs[i].data_ptr<float>();
      float* v = exp_avg_sqs[i].data_ptr<float>();
      if (has_master)
        adam_chunk<P, G, true>(p, g, m, v, masters[i].data_ptr<float>(), begin, end, factor,
                               scalars[i]);
      else
        adam_chunk<P, G, false>(p, g, m, v, nullptr, begin, end, factor, scalars[i]);
    }
  });
}

template <typename P>
void adam_step_cpu_dispatch_grad(FloatType gt, const TensorList& params, const TensorList& grads,
                                 const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                                 const TensorList& masters, const TensorList& steps,
                                 const AdamHyper& h, float factor) {
  if (gt == kFloat32)
    adam_step_cpu_typed<P, float>(params, grads, exp_avgs, exp_avg_sqs, masters, steps, h, factor);
  else if (gt == kFloat16)
    adam_step_cpu_typed<P, c10::Half>(params, grads, exp_avgs, exp_avg_sqs, masters, steps, h,
                                      factor);
  else
    adam_step_cpu_typed<P, c10::BFloat16>(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
                                          h, factor);
}

template <typename G>
void grad_sumsq_chunk(const G* g, int64_t begin, int64_t end, float inv_scale, double* out) {
  double acc = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const float x = to_float(g[i]) * inv_scale;
    acc += static_cast<double>(x) * x;
  }
  *out = acc;
}

// Pointers of a list of tensors, as the CUDA launchers take them.
template <typename T>
std::vector<T*> pointers(const TensorList& ts) {
  std::vector<T*> out;
  for (const auto& t : ts) out.push_back(static_cast<T*>(t.data_ptr()));
  return out;
}

}  // namespace

// Sum of squares of grad / grad_scale over all gradients, as a float32 scalar
// tensor on their device (no host sync). inf/NaN gradients make it non-finite.
torch::Tensor grad_sumsq(const TensorList& grads, const c10::optional<torch::Tensor>& grad_scale) {
  TORCH_CHECK_VALUE(!grads.empty(), "grad_sumsq: no gradients");
  const auto device = grads[0].device();
  for (const auto& g : grads) {
    check_tensor(g, device, "a gradient");
    float_type(g, "a gradient");
  }
  const float* scale = scalar_ptr(grad_scale, device, "grad_scale");
  auto out = torch::empty({}, grads[0].options().dtype(torch::kFloat));
  if (device.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    int64_t total = 0;
    for (const auto& g : grads) total += num_chunks(g.numel());
    auto partials = torch::zeros({std::max<int64_t>(total, 1)}, out.options());
    // One pass per gradient dtype, each into its own stretch of the partials.
    int64_t offset = 0;
    for (FloatType gt : {kFloat32, kFloat16, kBFloat16}) {
      std::vector<const void*> ptrs;
      std::vector<int64_t> sizes;
      for (const auto& g : grads)
        if (float_type(g, "a gradient") == gt && g.numel() > 0) {
          ptrs.push_back(g.data_ptr());
          sizes.push_back(g.numel());
        }
      if (ptrs.empty()) continue;
      const char* err = grad_sumsq_partials_cuda(gt, static_cast<int64_t>(ptrs.size()),
                                                 ptrs.data(), sizes.data(), scale,
                                                 partials.data_ptr<float>() + offset, stream);
      TORCH_CHECK(err == nullptr, "grad_sumsq: CUDA launch failed: ", err);
      for (int64_t s : sizes) offset += num_chunks(s);
    }
    const char* err = sum_partials_cuda(partials.data_ptr<float>(), partials.numel(),
                                        out.data_ptr<float>(), stream);
    TORCH_CHECK(err == nullptr, "grad_sumsq: CUDA launch failed: ", err);
    return out;
#else
    TORCH_CHECK(false, "grad_sumsq: tensors are on CUDA but roberta_fast._C was built without "
                       "CUDA; rebuild with `pip install --no-build-isolation -e .`");
#endif
  }
  TORCH_CHECK_VALUE(device.is_cpu(), "grad_sumsq: unsupported device ", device);
  const float inv_scale = scale ? 1.0f / *scale : 1.0f;
  const auto jobs = chunks_of(grads);
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  std::vector<double> partial(jobs.size(), 0.0);
  at::parallel_for(0, njobs, grain_size(njobs, total_numel(grads)), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const auto [i, begin, end] = jobs[k];
      const auto& g = grads[i];
      if (g.scalar_type() == torch::kFloat)
        grad_sumsq_chunk(g.data_ptr<float>(), begin, end, inv_scale, &partial[k]);
      else if (g.scalar_type() == torch::kHalf)
        grad_sumsq_chunk(g.data_ptr<c10::Half>(), begin, end, inv_scale, &partial[k]);
      else
        grad_sumsq_chunk(g.data_ptr<c10::BFloat16>(), begin, end, inv_scale, &partial[k]);
    }
  });
  double total = 0.0;
  for (double x : partial) total += x;
  out.fill_(static_cast<float>(total));
  return out;
}

// One AdamW step of a parameter group (see FusedAdam.step). masters is empty or
// holds an fp32 master weight per parameter; steps holds fp32 scalars counting the
// steps taken, incremented here unless the step is skipped.
void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& masters,
               const TensorList& steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, const c10::optional<torch::Tensor>& grad_scale,
               const c10::optional<torch::Tensor>& sumsq, double max_norm) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                        steps.size() == n && (masters.empty() || masters.size() == n),
                    "adam_step: tensor lists of different lengths");
  if (n == 0) return;
  const auto device = params[0].device();
  const bool has_master = !masters.empty();
  for (size_t i = 0; i < n; ++i) {
    check_tensor(params[i], device, "a parameter");
    check_tensor(grads[i], device, "a gradient");
    TORCH_CHECK_VALUE(grads[i].numel() == params[i].numel(),
                      "adam_step: a gradient's size differs from its parameter's");
    float_type(params[i], "a parameter");
    float_type(grads[i], "a gradient");
    check_fp32(exp_avgs[i], params[i], device, "exp_avg");
    check_fp32(exp_avg_sqs[i], params[i], device, "exp_avg_sq");
    if (has_master) check_fp32(masters[i], params[i], device, "master_param");
    check_tensor(steps[i], device, "step");
    TORCH_CHECK_VALUE(steps[i].numel() == 1 && steps[i].scalar_type() == torch::kFloat,
                      "adam_step: step must be a float32 tensor of one element");
  }
  const float* scale = scalar_ptr(grad_scale, device, "grad_scale");
  const float* ss = scalar_ptr(sumsq, device, "sumsq");
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay};

  if (device.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    // Bucket the tensors by (param dtype, grad dtype): one multi-tensor pass each.
    std::map<std::pair<int32_t, int32_t>, std::vector<size_t>> buckets;
    for (size_t i = 0; i < n; ++i)
      if (params[i].numel() > 0)
        buckets[{float_type(params[i], "a parameter"), float_type(grads[i], "a gradient")}]
            .push_back(i);
    for (const auto& [types, idx] : buckets) {
      std::vector<void*> p;
      std::vector<const void*> g;
      std::vector<float*> m, v, w, st;
      std::vector<int64_t> sizes;
      for (size_t i : idx) {
        p.push_back(params[i].data_ptr());
        g.push_back(grads[i].data_ptr());
        m.push_back(exp_avgs[i].data_ptr<float>());
        v.push_back(exp_avg_sqs[i].data_ptr<float>());
        if (has_master) w.push_back(masters[i].data_ptr<float>());
        st.push_back(steps[i].data_ptr<float>());
        sizes.push_back(params[i].numel());
      }
      const AdamTensors t{static_cast<int64_t>(idx.size()), p.data(), g.data(), m.data(),
                          v.data(), has_master ? w.data() : nullptr, st.data(), sizes.data()};
      const char* err = adam_step_cuda(types.first, types.second, t, h, scale, ss, max_norm,
                                       stream);
      TORCH_CHECK(err == nullptr, "adam_step: CUDA launch failed: ", err);
    }
    // After every update has read the old step counts.
    auto st = pointers<float>(steps);
    const char* err = adam_bump_steps_cuda(static_cast<int64_t>(n), st.data(), ss, stream);
    TORCH_CHECK(err == nullptr, "adam_step: CUDA launch failed: ", err);
    return;
#else
    TORCH_CHECK(false, "adam_step: tensors are on CUDA but roberta_fast._C was built without "
                       "CUDA; rebuild with `pip install --no-build-isolation -e .`");
#endif
  }
  TORCH_CHECK_VALUE(device.is_cpu(), "adam_step: unsupported device ", device);
  if (step_skipped(ss)) return;
  const float factor = grad_factor(scale, ss, max_norm);
  // Group by dtype pair so that each inner loop is monomorphic.
  std::map<std::pair<int32_t, int32_t>, std::vector<size_t>> buckets;
  for (size_t i = 0; i < n; ++i)
    buckets[{float_type(params[i], "a parameter"), float_type(grads[i], "a gradient")}]
        .push_back(i);
  for (const auto& [types, idx] : buckets) {
    TensorList p, g, m, v, w, st;
    for (size_t i : idx) {
      p.push_back(params[i]);
      g.push_back(grads[i]);
      m.push_back(exp_avgs[i]);
      v.push_back(exp_avg_sqs[i]);
      if (has_master) w.push_back(masters[i]);
      st.push_back(steps[i]);
    }
    const auto gt = static_cast<FloatType>(types.second);
    if (types.first == kFloat32)
      adam_step_cpu_dispatch_grad<float>(gt, p, g, m, v, w, st, h, factor);
    else if (types.first == kFloat16)
      adam_step_cpu_dispatch_grad<c10::Half>(gt, p, g, m, v, w, st, h, factor);
    else
      adam_step_cpu_dispatch_grad<c10::BFloat16>(gt, p, g, m, v, w, st, h, factor);
  }
  for (const auto& st : steps) *st.data_ptr<float>() += 1.0f;
}

}  // namespace roberta_fast
