// C entry points over the CUDA launchers of csrc/ (fused_adam_cuda.h,
// mask_tokens_cuda.h), for ctypes in tests/test_cuda_emulated.py. Compiled together
// with the emulated .cu files; "device" pointers are host memory here.
#include <cstddef>
#include <cstdint>

#include "fused_adam_cuda.h"
#include "mask_tokens_cuda.h"

using namespace roberta_fast;

extern "C" {

const char* emu_adam_step(int32_t param_type, int32_t grad_type, int64_t n, void* const* params,
                          const void* const* grads, float* const* exp_avgs,
                          float* const* exp_avg_sqs, float* const* masters, float* const* steps,
                          const int64_t* sizes, double lr, double beta1, double beta2, double eps,
                          double weight_decay, const float* grad_scale, const float* sumsq,
                          double max_norm) {
  const AdamTensors t{n, params, grads, exp_avgs, exp_avg_sqs, masters, steps, sizes};
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay};
  return adam_step_cuda(param_type, grad_type, t, h, grad_scale, sumsq, max_norm, nullptr);
}

const char* emu_adam_bump_steps(int64_t n, float* const* steps, const float* sumsq) {
  return adam_bump_steps_cuda(n, steps, sumsq, nullptr);
}

const char* emu_grad_sumsq_partials(int32_t grad_type, int64_t n, const void* const* grads,
                                    const int64_t* sizes, const float* grad_scale,
                                    float* partials) {
  return grad_sumsq_partials_cuda(grad_type, n, grads, sizes, grad_scale, partials, nullptr);
}

const char* emu_sum_partials(const float* partials, int64_t count, float* out) {
  return sum_partials_cuda(partials, count, out, nullptr);
}

int64_t emu_num_chunks(int64_t numel) { return num_chunks(numel); }

// Layout of MaskParams, for the ctypes mirror to check itself against.
size_t emu_mask_params_size() { return sizeof(MaskParams); }
size_t emu_mask_params_special_offset() { return offsetof(MaskParams, special); }

const char* emu_mask_tokens(const MaskParams* params, const int64_t* ids, const bool* word_starts,
                            int64_t rows, int64_t len, uint32_t sample_offset, int64_t* out,
                            int64_t* labels, int64_t* spans) {
  return mask_tokens_cuda(*params, ids, word_starts, rows, len, sample_offset, out, labels, spans,
                          nullptr);
}

}  // extern "C"
