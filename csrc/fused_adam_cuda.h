// Launchers of the CUDA fused Adam (fused_adam_cuda.cu), called by the torch
// binding in fused_adam.cpp. Raw pointers only: no torch headers, so the .cu
// builds with plain nvcc.
#pragma once

#include <stdint.h>

#include "adam_math.h"

namespace roberta_fast {

enum FloatType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Host arrays describing `n` tensors of one dtype combination, on one device.
struct AdamTensors {
  int64_t n;
  void* const* params;          // FloatType param_type
  const void* const* grads;     // FloatType grad_type
  float* const* exp_avgs;
  float* const* exp_avg_sqs;
  float* const* masters;        // fp32 master weights, or null when there are none
  float* const* steps;          // one fp32 scalar per tensor: the steps taken so far
  const int64_t* sizes;         // elements per tensor
};

// One AdamW step over all tensors in a handful of multi-tensor launches. Each
// tensor takes step *steps[i] + 1; steps are not written (see adam_bump_steps_cuda).
// grad_scale (loss scale), sumsq (sum of squares of the unscaled gradients) may be
// null; a non-finite *sumsq skips the step. Returns null or the CUDA error string.
const char* adam_step_cuda(int32_t param_type, int32_t grad_type, const AdamTensors& t,
                           const AdamHyper& hyper, const float* grad_scale,
                           const float* sumsq, double max_norm, void* stream);

// steps[i] += 1 for every tensor, unless *sumsq (may be null) is not finite.
const char* adam_bump_steps_cuda(int64_t n, float* const* steps, const float* sumsq,
                                 void* stream);

// Per-chunk partial sums of squares of grad / *grad_scale for `n` gradients of
// grad_type, written to partials[0 .. sum of chunks(sizes)).
const char* grad_sumsq_partials_cuda(int32_t grad_type, int64_t n, const void* const* grads,
                                     const int64_t* sizes, const float* grad_scale,
                                     float* partials, void* stream);

// *out = sum of partials[0 .. count), in a fixed order (deterministic).
const char* sum_partials_cuda(const float* partials, int64_t count, float* out, void* stream);

}  // namespace roberta_fast
