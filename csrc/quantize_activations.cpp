// Dynamic per-tensor uint8 quantization of fp32 activations for rf.quantize's int8 Linear
// layers on oneDNN (roberta_fast.quantization): the scale and zero point from the tensor's
// min and max, then every element quantized, in one call instead of a dozen aten ops called
// from Python. Its reference is quantization.activation_qparams and int8_linear_ref: the
// same float32 arithmetic step for step (a test compares them bit for bit), so the int8
// model's outputs stay those its export records.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace roberta_fast {
namespace {

// activation_qparams in float32 scalars: the range [min(x, 0), max(x, 0)] over qmax steps
// (at least fbgemm's smallest scale), the zero point from the end represented with less
// error, rounded half to even and clamped to [0, qmax].
std::tuple<float, float> qparams(float low, float high, float qmax) {
  low = std::min(low, 0.0f);
  high = std::max(high, 0.0f);
  const float scale = std::max((high - low) / qmax, 6.1e-5f);
  const float low_steps = low / scale, high_steps = high / scale;
  float zero_point = -std::fabs(low_steps) < qmax - std::fabs(high_steps) ? -low_steps : qmax - high_steps;
  zero_point = std::nearbyint(zero_point);  // the default rounding mode: half to even, as torch.round
  return {scale, std::min(std::max(zero_point, 0.0f), qmax)};
}

// round(v) + zero_point clamped to [0, 255], as int8_linear_ref's float ops. Written to
// vectorize (with -fno-trapping-math, setup.py): v is first held to +-2^22, where adding and
// taking away 1.5 * 2^23 rounds it half to even (the default rounding mode), and beyond which
// the result is 0 or 255 anyway; the clamp to [0, 255] is then exact on int32.
inline uint8_t quantize_one(float x, float inverse, float zero_point) {
  constexpr float kLimit = 4194304.0f, kRound = 12582912.0f;  // 2^22, 1.5 * 2^23
  float v = x * inverse;
  v = v < kLimit ? v : kLimit;
  v = v > -kLimit ? v : -kLimit;
  v = (v + kRound) - kRound;
  int32_t q = static_cast<int32_t>(v + zero_point);  // an integer value: exact
  q = q < 0 ? 0 : q;
  q = q > 255 ? 255 : q;
  return static_cast<uint8_t>(q);
}

// The extension is built for the baseline x86-64 ISA (SSE2), where this loop ran at 1.0 ns per
// element; GCC's target_clones also compiles it for x86-64-v3 (AVX2: 0.28 ns) and x86-64-v4
// (AVX-512: 0.17 ns) and picks one when the library loads (a 4096 x 768 input on the 2-core
// AVX-512 EPYC). Every clone gives the same bytes: -ffp-contract=off (setup.py) keeps FMA out.
// Only with GCC 11+ on x86-64 Linux (ifunc, the arch= levels); elsewhere the one baseline build.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#define RF_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RF_ISA_CLONES
#endif

// quantize_one over n elements; by value and __restrict, as the uint8 stores could otherwise
// alias anything and keep the loop from vectorizing.
RF_ISA_CLONES void quantize_span(const float* __restrict src, uint8_t* __restrict dst, int64_t n,
                                 float inverse, float zero_point) {
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize_one(src[i], inverse, zero_point);
}

// x's (min, max), by ATen's vectorized pass; ValueError when either is not finite: no int8
// scale covers inf or NaN, and a quantized NaN would pass on as plausible values.
std::tuple<float, float> finite_range(const torch::Tensor& x) {
  const auto [low_t, high_t] = at::aminmax(x);
  const float low = low_t.item<float>(), high = high_t.item<float>();
  TORCH_CHECK_VALUE(std::isfinite(low) && std::isfinite(high),
                    "rf.quantize: an int8 layer got a non-finite activation (min ", low, ", max ", high,
                    "): no int8 scale covers it (the fp32 model would carry inf or NaN on from here); look "
                    "for inf or NaN in the weights or inputs");
  return {low, high};
}

}  // namespace

void check_activations_finite(const torch::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "check_activations_finite: unsupported device ", x.device());
  if (x.numel() > 0) finite_range(x);
}

std::tuple<torch::Tensor, double, int64_t> quantize_activations(const torch::Tensor& x, int64_t qmax) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "quantize_activations: unsupported device ", x.device(),
                    " (a CPU op: int8 inference runs on the CPU)");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "quantize_activations: float32 input, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.numel() > 0, "quantize_activations: an empty tensor has no range to scale by");
  TORCH_CHECK_VALUE(qmax > 0 && qmax <= 255, "quantize_activations: qmax in [1, 255], got ", qmax);
  const torch::Tensor input = x.contiguous();
  const auto [low, high] = finite_range(input);
  float scale, zero_point;  // plain locals: a lambda cannot capture structured bindings in C++17
  std::tie(scale, zero_point) = qparams(low, high, static_cast<float>(qmax));
  const float inverse = 1.0f / scale;  // int8_linear_ref multiplies by the float32 reciprocal

  torch::Tensor out = torch::empty(input.sizes(), input.options().dtype(at::kByte));
  const float* src = input.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  constexpr int64_t kGrain = 1 << 16;  // elements per task: small inputs stay on one thread
  at::parallel_for(0, input.numel(), kGrain, [&](int64_t begin, int64_t end) {
    quantize_span(src + begin, dst + begin, end - begin, inverse, zero_point);
  });
  return {out, static_cast<double>(scale), static_cast<int64_t>(zero_point)};
}

}  // namespace roberta_fast
