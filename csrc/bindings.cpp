// The one Python binding of roberta_fast._C: declarations of the ops defined in
// their own files (one per op) and the PYBIND11_MODULE that exposes them.
// Users call the Python wrappers roberta_fast.FusedAdam and roberta_fast.mask_tokens,
// which validate arguments; these entry points check them again.
#include <torch/extension.h>

#include <string>
#include <vector>

namespace roberta_fast {

// Build facts, so Python can say what this extension was compiled with.
std::string version() { return "0.1.0"; }

bool built_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

// fused_adam.cpp
torch::Tensor grad_sumsq(const std::vector<torch::Tensor>& grads,
                         const c10::optional<torch::Tensor>& grad_scale);
void adam_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<torch::Tensor>& exp_avgs,
               const std::vector<torch::Tensor>& exp_avg_sqs,
               const std::vector<torch::Tensor>& masters, const std::vector<torch::Tensor>& steps,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               const c10::optional<torch::Tensor>& grad_scale,
               const c10::optional<torch::Tensor>& sumsq, double max_norm);

// mask_tokens.cpp
std::vector<torch::Tensor> mask_tokens(const torch::Tensor& ids,
                                       const c10::optional<torch::Tensor>& word_starts,
                                       int64_t seed_lo, int64_t seed_hi, int64_t step,
                                       int64_t sample_offset, int64_t strategy,
                                       double mlm_probability, double mask_replace_prob,
                                       double random_replace_prob, int64_t vocab_size,
                                       int64_t mask_token_id, std::vector<int64_t> special,
                                       bool return_spans);
torch::Tensor philox4x32(const torch::Tensor& counters, int64_t k0, int64_t k1);

// quantize_activations.cpp
std::tuple<torch::Tensor, double, int64_t> quantize_activations(const torch::Tensor& x, int64_t qmax);
void check_activations_finite(const torch::Tensor& x);

// inference_layer.cpp
torch::Tensor inference_layer(const torch::Tensor& x, const std::vector<py::tuple>& linears,
                              const std::vector<torch::Tensor>& norms, double attn_eps, double ffn_eps,
                              int64_t heads, const std::optional<torch::Tensor>& attention_mask,
                              const std::optional<torch::Tensor>& cu_seqlens);

}  // namespace roberta_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace rf = roberta_fast;
  m.doc() = "roberta_fast C++/CUDA ops (fused Adam, dynamic masking, int8 activation quantization, "
           "the CPU inference layer)";
  m.def("version", &rf::version, "Version of the compiled extension.");
  m.def("built_with_cuda", &rf::built_with_cuda,
        "True when the CUDA implementations of the ops were compiled in.");
  m.def("grad_sumsq", &rf::grad_sumsq,
        "Sum of squares of grad / grad_scale over all gradients: a float32 scalar tensor on "
        "their device, not finite when a gradient holds inf/NaN. No host sync.",
        py::arg("grads"), py::arg("grad_scale") = py::none());
  m.def("adam_step", &rf::adam_step,
        "One fused AdamW step over a parameter group (multi-tensor on CUDA, OpenMP on CPU). "
        "Gradients are multiplied by 1/grad_scale and by the clip coefficient "
        "min(1, max_norm / (sqrt(sumsq) + 1e-6)) when max_norm > 0; a non-finite sumsq "
        "skips the step, leaving everything untouched. steps are incremented otherwise.",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("masters"), py::arg("steps"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale") = py::none(), py::arg("sumsq") = py::none(),
        py::arg("max_norm") = 0.0);
  m.def("mask_tokens", &rf::mask_tokens,
        "Dynamic MLM masking with a Philox4x32-10 rule (see roberta_fast.masking): returns "
        "(masked ids, labels) on the ids' device, no host sync; with return_spans also the "
        "(batch, seqlen, 3) int64 span boundaries (left, right, offset) of each predicted "
        "token, -1 where there is none.",
        py::arg("ids"), py::arg("word_starts"), py::arg("seed_lo"), py::arg("seed_hi"),
        py::arg("step"), py::arg("sample_offset"), py::arg("strategy"),
        py::arg("mlm_probability"), py::arg("mask_replace_prob"),
        py::arg("random_replace_prob"), py::arg("vocab_size"), py::arg("mask_token_id"),
        py::arg("special"), py::arg("return_spans") = false);
  m.def("philox4x32", &rf::philox4x32,
        "Philox4x32-10 of each row of an (n, 4) int64 CPU tensor of counters with key "
        "(k0, k1); for tests against the published known-answer vectors.",
        py::arg("counters"), py::arg("k0"), py::arg("k1"));
  m.def("quantize_activations", &rf::quantize_activations,
        "Dynamic per-tensor quantization of a float32 CPU tensor to uint8 in [0, qmax]: "
        "(uint8 tensor of x's shape, scale, zero point), the arithmetic of "
        "roberta_fast.quantization.activation_qparams and int8_linear_ref bit for bit. "
        "ValueError on an empty or non-finite x.",
        py::arg("x"), py::arg("qmax"));
  m.def("check_activations_finite", &rf::check_activations_finite,
        "ValueError when a CPU tensor holds inf or NaN, with quantize_activations' message (for "
        "int8 kernels that quantize by themselves, and would turn a NaN into finite values).",
        py::arg("x"));
  m.def("inference_layer", &rf::inference_layer,
        "One post-LN encoder layer (RobertaLayer) for CPU inference on packed Linear weights, the "
        "same ops as its Python path in one call: linears are the four layers' kernel specs "
        "(qkv, attn_out, ffn_in, ffn_out), norms attn_LayerNorm's and ffn_LayerNorm's weight and bias. x is "
        "(batch, seqlen, hidden) with an optional bool attention_mask, or (tokens, hidden) with "
        "cu_seqlens (int, batch + 1 offsets).",
        py::arg("x"), py::arg("linears"), py::arg("norms"), py::arg("attn_eps"), py::arg("ffn_eps"),
        py::arg("heads"), py::arg("attention_mask") = py::none(), py::arg("cu_seqlens") = py::none());
}
