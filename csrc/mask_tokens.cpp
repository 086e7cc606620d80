// Dynamic MLM masking (roberta_fast.mask_tokens): the torch binding, the CPU
// implementation (torch's OpenMP pool over rows) and the dispatch to the CUDA launcher. The
// rule itself lives in mask_math.h, shared with the CUDA build.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "mask_math.h"
#include "mask_tokens_cuda.h"

#ifdef WITH_CUDA
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that needs the cuBLAS/cuSPARSE dev headers
#include <c10/cuda/CUDAGuard.h>
#endif

namespace roberta_fast {
namespace {

// floor(prob * 2^32) clamped to [0, 2^32]: draws below it happen with probability prob.
uint64_t probability_threshold(double prob) {
  const double t = std::floor(prob * 4294967296.0);
  if (t <= 0.0) return 0;
  if (t >= 4294967296.0) return uint64_t(1) << 32;
  return static_cast<uint64_t>(t);
}

MaskParams make_params(int64_t seed_lo, int64_t seed_hi, int64_t step, int64_t strategy,
                       double mlm_probability, double mask_replace_prob,
                       double random_replace_prob, int64_t vocab_size,
                       int64_t mask_token_id, std::vector<int64_t> special) {
  std::sort(special.begin(), special.end());
  special.erase(std::unique(special.begin(), special.end()), special.end());
  TORCH_CHECK_VALUE(special.size() <= static_cast<size_t>(kMaxSpecialIds),
                    "mask_tokens: at most ", kMaxSpecialIds, " special ids, got ",
                    special.size());
  TORCH_CHECK_VALUE(strategy >= kToken && strategy <= kSpan, "mask_tokens: bad strategy");
  MaskParams p{};
  p.key0 = static_cast<uint32_t>(seed_lo);
  p.key1 = static_cast<uint32_t>(seed_hi);
  p.step = static_cast<uint32_t>(step);
  p.strategy = static_cast<int32_t>(strategy);
  p.select_threshold = probability_threshold(mlm_probability);
  p.mask_threshold = probability_threshold(mask_replace_prob);
  p.random_threshold = probability_threshold(mask_replace_prob + random_replace_prob);
  p.vocab_size = vocab_size;
  p.mask_token_id = mask_token_id;
  p.num_special = static_cast<int32_t>(special.size());
  for (size_t i = 0; i < special.size(); ++i) {
    TORCH_CHECK_VALUE(special[i] >= 0 && special[i] < vocab_size, "mask_tokens: special id ",
                      special[i], " is outside the vocabulary [0, ", vocab_size, ")");
    p.special[i] = special[i];
  }
  p.num_regular = vocab_size - p.num_special;
  TORCH_CHECK_VALUE(p.num_regular > 0, "mask_tokens: every id of the vocabulary is special");
  // Truncated geometric(0.2) on 1..10, renormalised (SpanBERT, mean ~3.8):
  // P(len <= l) = (1 - 0.8^l) / (1 - 0.8^10). Powers by repeated products so the
  // NumPy reference computes the very same doubles.
  double q[kMaxSpanWords + 1];
  q[0] = 1.0;
  for (int l = 1; l <= kMaxSpanWords; ++l) q[l] = q[l - 1] * 0.8;
  for (int l = 1; l < kMaxSpanWords; ++l)
    p.span_cdf[l - 1] = probability_threshold((1.0 - q[l]) / (1.0 - q[kMaxSpanWords]));
  return p;
}

void mask_tokens_cpu(const MaskParams& p, const int64_t* ids, const bool* word_starts,
                     int64_t rows, int64_t len, uint32_t sample_offset, int64_t* out,
                     int64_t* labels, int64_t* spans) {
  // Range check first: an id outside the vocabulary must not become a label.
  int64_t bad = -1;
  for (int64_t i = 0; i < rows * len && bad < 0; ++i)
    if (ids[i] < 0 || ids[i] >= p.vocab_size) bad = i;
  TORCH_CHECK_VALUE(bad < 0, "mask_tokens: input id ", bad < 0 ? 0 : ids[bad], " at flat index ",
                    bad, " is outside the vocabulary [0, ", p.vocab_size,
                    "); pass the tokenizer's vocab_size");
  // torch's OpenMP pool; rows per task so that a task has ~2^15 tokens.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(len, 1));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t off = r * len;
      mask_row(p, ids + off, word_starts ? word_starts + off : nullptr, len,
               sample_offset + static_cast<uint32_t>(r), out + off, labels + off,
               spans ? spans + 3 * off : nullptr);
    }
  });
}

}  // namespace

// Returns (masked ids, labels), both int64 like `ids`, on ids' device, and with
// return_spans the (batch, seqlen, 3) int64 spans (see write_row_spans).
std::vector<torch::Tensor> mask_tokens(const torch::Tensor& ids,
                                       const c10::optional<torch::Tensor>& word_starts,
                                       int64_t seed_lo, int64_t seed_hi, int64_t step,
                                       int64_t sample_offset, int64_t strategy,
                                       double mlm_probability, double mask_replace_prob,
                                       double random_replace_prob, int64_t vocab_size,
                                       int64_t mask_token_id, std::vector<int64_t> special,
                                       bool return_spans) {
  TORCH_CHECK_TYPE(ids.scalar_type() == torch::kLong, "mask_tokens: ids must be int64, got ",
                   ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 2, "mask_tokens: ids must be (batch, seqlen), got ",
                    ids.dim(), " dims");
  TORCH_CHECK_VALUE(ids.is_contiguous(), "mask_tokens: ids must be contiguous");
  const int64_t rows = ids.size(0), len = ids.size(1);
  const bool* starts = nullptr;
  if (word_starts.has_value()) {
    const auto& ws = *word_starts;
    TORCH_CHECK_TYPE(ws.scalar_type() == torch::kBool, "mask_tokens: word_starts must be bool");
    TORCH_CHECK_VALUE(ws.sizes() == ids.sizes() && ws.is_contiguous(),
                      "mask_tokens: word_starts must be contiguous and shaped like ids");
    TORCH_CHECK_VALUE(ws.device() == ids.device(),
                      "mask_tokens: word_starts and ids are on different devices");
    starts = ws.data_ptr<bool>();
  }
  TORCH_CHECK_VALUE(strategy == kToken || starts != nullptr,
                    "mask_tokens: the whole_word and span strategies need word_starts");
  TORCH_CHECK_VALUE(sample_offset >= 0 && sample_offset + rows <= (int64_t(1) << 32) &&
                        len < (int64_t(1) << 32) && step >= 0 && step < (int64_t(1) << 32),
                    "mask_tokens: step, sample index and position must fit in 32 bits");
  special.push_back(mask_token_id);
  const MaskParams p = make_params(seed_lo, seed_hi, step, strategy, mlm_probability,
                                   mask_replace_prob, random_replace_prob, vocab_size,
                                   mask_token_id, special);
  auto out = torch::empty_like(ids);
  auto labels = torch::empty_like(ids);
  std::vector<torch::Tensor> result{out, labels};
  int64_t* spans = nullptr;
  if (return_spans) {
    result.push_back(torch::empty({rows, len, 3}, ids.options()));
    spans = result.back().data_ptr<int64_t>();
  }
  if (ids.numel() == 0) return result;
  if (ids.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard guard(ids.device());
    const char* err = mask_tokens_cuda(p, ids.data_ptr<int64_t>(), starts, rows, len,
                                       static_cast<uint32_t>(sample_offset),
                                       out.data_ptr<int64_t>(), labels.data_ptr<int64_t>(),
                                       spans, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == nullptr, "mask_tokens: CUDA launch failed: ", err);
#else
    TORCH_CHECK(false, "mask_tokens: ids are on CUDA but roberta_fast._C was built without "
                       "CUDA; rebuild with `pip install --no-build-isolation -e .` on a "
                       "machine with a CUDA torch and nvcc");
#endif
  } else {
    TORCH_CHECK_VALUE(ids.is_cpu(), "mask_tokens: unsupported device ", ids.device());
    mask_tokens_cpu(p, ids.data_ptr<int64_t>(), starts, rows, len,
                    static_cast<uint32_t>(sample_offset), out.data_ptr<int64_t>(),
                    labels.data_ptr<int64_t>(), spans);
  }
  return result;
}

// Philox4x32-10 of each (n, 4) counter row with key (k0, k1), on the CPU: lets
// the tests check the C++ generator against the published known-answer vectors.
torch::Tensor philox4x32(const torch::Tensor& counters, int64_t k0, int64_t k1) {
  TORCH_CHECK_VALUE(counters.scalar_type() == torch::kLong && counters.dim() == 2 &&
                        counters.size(1) == 4 && counters.is_cpu(),
                    "philox4x32: counters must be a CPU int64 tensor of shape (n, 4)");
  auto c = counters.contiguous();
  auto result = torch::empty_like(c);
  const int64_t* in = c.data_ptr<int64_t>();
  int64_t* res = result.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.size(0); ++i) {
    const Philox4 r = philox4x32_10(
        Philox4{static_cast<uint32_t>(in[4 * i]), static_cast<uint32_t>(in[4 * i + 1]),
                static_cast<uint32_t>(in[4 * i + 2]), static_cast<uint32_t>(in[4 * i + 3])},
        static_cast<uint32_t>(k0), static_cast<uint32_t>(k1));
    res[4 * i] = r.x;
    res[4 * i + 1] = r.y;
    res[4 * i + 2] = r.z;
    res[4 * i + 3] = r.w;
  }
  return result;
}

}  // namespace roberta_fast
