// The per-element AdamW update of roberta_fast.FusedAdam, shared by the CPU
// (fused_adam.cpp) and CUDA (fused_adam_cuda.cu) builds. fp32 math in the
// operation order of torch.optim.AdamW's single-tensor path, so the two agree to
// rounding. No torch headers.
#pragma once

#include <math.h>
#include <stdint.h>

#include "philox.h"  // RF_HD

namespace roberta_fast {

// Tensors are processed in chunks of this many elements (a CUDA block or an
// OpenMP task each); the grad-norm partial sums are per chunk.
constexpr int64_t kChunkSize = 65536;

RF_HD int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// Per-tensor constants of one step, computed once from the hyperparameters.
struct AdamScalars {
  float decay;        // 1 - lr * weight_decay (decoupled weight decay)
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;    // lr / (1 - beta1^step)
  float bias2_sqrt;   // sqrt(1 - beta2^step)
  float eps;
};

// Hyperparameters of a parameter group; the step is per tensor.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
};

// Constants for a tensor at `step` (the step being taken, 1-based), in double
// like torch's Python-side scalars, then rounded to float.
RF_HD AdamScalars adam_scalars(const AdamHyper& h, double step) {
  AdamScalars s;
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.step_size = static_cast<float>(h.lr / (1.0 - pow(h.beta1, step)));
  s.bias2_sqrt = static_cast<float>(sqrt(1.0 - pow(h.beta2, step)));
  s.eps = static_cast<float>(h.eps);
  return s;
}

// IEEE-rounded division and square root even under nvcc --use_fast_math.
RF_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

RF_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}

// One AdamW step of one element; g is the final (unscaled, clipped) gradient.
RF_HD void adam_update(float& p, float g, float& m, float& v, const AdamScalars& s) {
  p = p * s.decay;
  m = m + s.one_minus_beta1 * (g - m);           // exp_avg.lerp_(grad, 1 - beta1)
  v = v * s.beta2 + s.one_minus_beta2 * g * g;   // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
  const float denom = div_rn(sqrt_rn(v), s.bias2_sqrt) + s.eps;
  p = p + (-s.step_size) * div_rn(m, denom);     // param.addcdiv_(m, denom, -step_size)
}

// Factor applied to every gradient: 1 / loss scale, times the clip coefficient
// min(1, max_norm / (norm + 1e-6)) when clipping (torch.nn.utils.clip_grad_norm_).
// `sumsq` is the sum of squares of the unscaled gradients.
RF_HD float grad_factor(const float* grad_scale, const float* sumsq, double max_norm) {
  float f = grad_scale ? div_rn(1.0f, *grad_scale) : 1.0f;
  if (sumsq && max_norm > 0.0) {
    const float norm = sqrt_rn(*sumsq);
    const float clip = div_rn(static_cast<float>(max_norm), norm + 1e-6f);
    if (clip < 1.0f) f = f * clip;
  }
  return f;
}

// A step is skipped when the gradients hold inf or NaN: their sum of squares is
// then not finite.
RF_HD bool step_skipped(const float* sumsq) {
  return sumsq != nullptr && !isfinite(*sumsq);
}

}  // namespace roberta_fast
