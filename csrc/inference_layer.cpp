// One post-LN encoder layer for fp32 CPU inference (plain, or on rf.quantize's and rf.prepack's
// packed weights), in one call from Python instead of ~30. Its reference is RobertaLayer.forward's own Python path
// (roberta_fast/model.py): the same ATen ops and kernels on the same tensors in the same order,
// so the two agree bit for bit (tests/test_inference_layer.py). Why: on a short request the
// arithmetic is small and the Python around each op is not. At roberta-base's depth and heads but
// a width of 96 (1 x 16 tokens, int8 on fbgemm) a request spent ~1.8 ms of its ~3.5 ms in
// Python between the ops (a scripted copy of the layer ran in ~1.7 ms; 2-core AVX-512 EPYC).
//
//   x = LayerNorm(x + attn_out(Attention(qkv(x))));  x = LayerNorm(x + ffn_out(GELU(ffn_in(x))))
//
// Each Linear layer comes as its kernel holder's spec(tokens), a tuple naming the op its
// __call__ runs and that op's packed weight (roberta_fast/quantization.py, prepacked.py):
//   ("linear_dynamic", packed, reduce_range)  quantized::linear_dynamic (int8: fbgemm, x86, qnnpack)
//   ("linear_dynamic_fp16", packed)           quantized::linear_dynamic_fp16 (fbgemm's fp16 weights)
//   ("qlinear_pointwise", packed, w_scale, w_zero_points, bias, qmax)
//                                             quantize_activations, then onednn::qlinear_pointwise
//   ("linear_pointwise", packed, bias)        mkldnn::_linear_pointwise (rf.prepack's fp32)
// and a plain nn.Linear as ("linear", weight, bias): F.linear.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/csrc/jit/api/object.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace roberta_fast {

// quantize_activations.cpp
std::tuple<torch::Tensor, double, int64_t> quantize_activations(const torch::Tensor& x, int64_t qmax);
void check_activations_finite(const torch::Tensor& x);

namespace {

std::optional<torch::Tensor> optional_tensor(const py::handle& h) {
  if (h.is_none()) return std::nullopt;
  return py::cast<torch::Tensor>(h);
}

// One Linear layer's kernel, read from its spec while the GIL is held (the layer runs without it).
struct LinearKernel {
  enum Kind { kLinearDynamic, kLinearDynamicFp16, kQlinearPointwise, kLinearPointwise, kLinear } kind;
  c10::intrusive_ptr<LinearPackedParamsBase> params;  // linear_dynamic{,_fp16}: fbgemm's packed weight
  bool reduce_range = false;                           // linear_dynamic: 7-bit activations
  torch::Tensor packed, w_scale, w_zero_points;        // oneDNN's packed weight (and int8 scales), or a plain one
  std::optional<torch::Tensor> bias;                   // all but fbgemm take it apart from the weight
  int64_t qmax = 0;                                    // qlinear_pointwise: activations in [0, qmax]

  explicit LinearKernel(const py::tuple& spec) {
    const std::string name = py::cast<std::string>(spec[0]);
    if (name == "linear_dynamic" || name == "linear_dynamic_fp16") {
      const bool int8 = name == "linear_dynamic";
      kind = int8 ? kLinearDynamic : kLinearDynamicFp16;
      // the packed weight held by a torch.ScriptObject (what quantized.linear_prepack{,_fp16} return)
      params = c10::IValue(py::cast<torch::jit::Object>(spec[1])._ivalue()).toCustomClass<LinearPackedParamsBase>();
      reduce_range = int8 && py::cast<bool>(spec[2]);
    } else if (name == "qlinear_pointwise") {
      kind = kQlinearPointwise;
      packed = py::cast<torch::Tensor>(spec[1]);
      w_scale = py::cast<torch::Tensor>(spec[2]);
      w_zero_points = py::cast<torch::Tensor>(spec[3]);
      bias = optional_tensor(spec[4]);
      qmax = py::cast<int64_t>(spec[5]);
    } else if (name == "linear_pointwise" || name == "linear") {
      kind = name == "linear" ? kLinear : kLinearPointwise;
      packed = py::cast<torch::Tensor>(spec[1]);
      bias = optional_tensor(spec[2]);
    } else {
      TORCH_CHECK_VALUE(false, "inference_layer: unknown Linear kernel '", name, "'");
    }
  }

  // The layer's output for x, with erf GELU applied when `gelu` (in the kernel's epilogue where it
  // has one, else in place on the fresh output: ops.gelu_fresh).
  torch::Tensor operator()(const torch::Tensor& x, bool gelu) const {
    const std::string post_op = gelu ? "gelu" : "none";
    const std::string algorithm = gelu ? "none" : "";  // oneDNN's GELU algorithms: "none" (erf) or "tanh"
    switch (kind) {
      case kLinearDynamic:
      case kLinearDynamicFp16: {  // what those two ops run
        if (kind == kLinearDynamic) check_activations_finite(x);  // fbgemm would quantize a NaN to plausible values
        torch::Tensor out = params->apply_dynamic(x, reduce_range);
        return gelu ? at::gelu_(out) : out;
      }
      case kQlinearPointwise: {
        if (x.numel() == 0) {  // no tokens: nothing to scale by
          std::vector<int64_t> shape = x.sizes().vec();
          shape.back() = w_scale.numel();
          return x.new_empty(shape);
        }
        const auto [xq, scale, zero_point] = quantize_activations(x, qmax);
        static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
        // fp32 out: output scale 1, zero point 0
        return call_boxed(op, {xq, scale, zero_point, packed, w_scale, w_zero_points, bias, 1.0, int64_t{0},
                               c10::ScalarType::Float, post_op, c10::List<std::optional<at::Scalar>>(), algorithm});
      }
      case kLinearPointwise: {
        static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
        return call_boxed(op, {x, packed, bias, post_op, c10::List<std::optional<at::Scalar>>(), algorithm});
      }
      case kLinear: {  // ops.linear_gelu's reference: GELU in place on the fresh output
        torch::Tensor out = at::linear(x, packed, bias);
        return gelu ? at::gelu_(out) : out;
      }
    }
    TORCH_CHECK(false, "inference_layer: unreachable");
  }

 private:
  // An op called through the dispatcher on a stack of IValues (boxed), as torch.ops calls it from
  // Python, so no C++ signature of a private op is assumed here.
  static torch::Tensor call_boxed(const c10::OperatorHandle& op, std::vector<c10::IValue> stack) {
    op.callBoxed(&stack);
    return stack.at(0).toTensor();
  }
};

// Softmax attention, as ops.attention (dense) and ops.attention_varlen_sdpa (packed) compute it
// in inference. qkv: (batch, seqlen, 3H) with attention_mask (bool (batch, seqlen) over keys or
// (batch, seqlen, seqlen) over (query, key) pairs, true = attend) or none; or (tokens, 3H) with
// cu_seqlens, sequence i being tokens cu_seqlens[i]:cu_seqlens[i + 1]. Returns (batch, seqlen, H)
// or (tokens, H).
torch::Tensor attention(const torch::Tensor& qkv, int64_t heads,
                        const std::optional<torch::Tensor>& attention_mask,
                        const std::optional<torch::Tensor>& cu_seqlens) {
  const int64_t hidden = qkv.size(-1) / 3, head_dim = hidden / heads;
  if (cu_seqlens.has_value()) {
    const int64_t tokens = qkv.size(0);
    const auto qkv_split = qkv.view({tokens, 3, heads, head_dim}).unbind(1);  // each (tokens, heads, head_dim)
    const torch::Tensor bounds = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* b = bounds.data_ptr<int64_t>();
    std::vector<torch::Tensor> outs;
    for (int64_t i = 0; i + 1 < bounds.numel(); ++i) {
      if (b[i + 1] <= b[i]) continue;
      auto one = [&](int j) { return qkv_split[j].slice(0, b[i], b[i + 1]).transpose(0, 1).unsqueeze(0); };
      // 4-D (1, heads, length, head_dim): SDPA's CPU flash kernel takes only 4-D inputs
      outs.push_back(at::scaled_dot_product_attention(one(0), one(1), one(2)).select(0, 0));
    }
    if (outs.empty()) return torch::empty({tokens, hidden}, qkv.options());  // every row fully padded
    return at::cat(outs, 1).transpose(0, 1).reshape({tokens, hidden});  // (heads, tokens, hd) -> (tokens, H)
  }
  const int64_t batch = qkv.size(0), seqlen = qkv.size(1);
  const auto qkv_split = qkv.view({batch, seqlen, 3, heads, head_dim}).unbind(2);
  auto one = [&](int j) { return qkv_split[j].transpose(1, 2); };  // (batch, heads, seqlen, head_dim)
  std::optional<torch::Tensor> additive;
  if (attention_mask.has_value()) {
    // finfo.min added where masked, as Hugging Face adds it: a fully masked row attends uniformly
    const torch::Tensor& mask = *attention_mask;
    const torch::Tensor keep =  // (batch, 1, 1 or seqlen, seqlen), as ops._broadcast_mask
        (mask.dim() == 2 ? mask.unsqueeze(1).unsqueeze(1) : mask.unsqueeze(1)).to(at::kBool);
    additive = torch::zeros(keep.sizes(), qkv.options())
                   .masked_fill(keep.logical_not(), std::numeric_limits<float>::lowest());
  }
  const torch::Tensor out = at::scaled_dot_product_attention(one(0), one(1), one(2), additive);
  return out.transpose(1, 2).reshape({batch, seqlen, hidden});
}

}  // namespace

torch::Tensor inference_layer(const torch::Tensor& x, const std::vector<py::tuple>& linears,
                              const std::vector<torch::Tensor>& norms, double attn_eps, double ffn_eps,
                              int64_t heads, const std::optional<torch::Tensor>& attention_mask,
                              const std::optional<torch::Tensor>& cu_seqlens) {
  TORCH_CHECK_VALUE(linears.size() == 4 && norms.size() == 4,
                    "inference_layer: 4 Linear specs (qkv, attn_out, ffn_in, ffn_out) and 4 LayerNorm tensors "
                    "(attn_LayerNorm weight and bias, ffn_LayerNorm weight and bias)");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat,
                    "inference_layer: fp32 CPU input, got ", x.scalar_type(), " on ", x.device());
  const LinearKernel qkv(linears[0]), attn_out(linears[1]), ffn_in(linears[2]), ffn_out(linears[3]);
  // The ops release the GIL in Python's bindings; so does this layer, for threads serving requests beside it.
  py::gil_scoped_release no_gil;
  const std::vector<int64_t> hidden{x.size(-1)};
  const torch::Tensor a = attn_out(attention(qkv(x, false), heads, attention_mask, cu_seqlens), false);
  const torch::Tensor y = at::layer_norm(a + x, hidden, norms[0], norms[1], attn_eps);
  const torch::Tensor f = ffn_out(ffn_in(y, true), false);
  return at::layer_norm(f + y, hidden, norms[2], norms[3], ffn_eps);
}

}  // namespace roberta_fast
