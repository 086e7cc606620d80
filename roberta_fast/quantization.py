"""`rf.quantize(model)` (this module is roberta_fast.quantization): int8 CPU inference for the drop-in classes.

    model = rf.RobertaForSequenceClassification.from_pretrained(path)
    rf.quantize(model)              # in place, returned for chaining; reads as rf.patch does
    with torch.inference_mode():
        logits = model(input_ids, attention_mask=mask).logits

The four Linear layers of every encoder block (the fused `qkv`, `attn_out`, `ffn_in`,
`ffn_out`: 85M of roberta-base's 124.7M parameters) become `Int8Linear`: int8 weights, one
symmetric scale per output row, and int8 activations quantized dynamically (per tensor, at
each call), through PyTorch's own quantized Linear (`torch.ops.quantized.linear_dynamic`,
the fbgemm / oneDNN x86 kernels quantize_dynamic uses). Everything else stays fp32
(embeddings, LayerNorms, attention, pooler and heads), and the unpadded CPU path is kept.

Why this library (measured on the 2-core AMD EPYC, AVX2, no VNNI; docs/inference.md):
torchao 0.18 (PyPI) installs beside torch 2.13 and quantizes, but on the CPU its int8 Linear
runs torch._int_mm eagerly, 10-30x slower than fp32 (its fast CPU path needs torch.compile);
`torch.ao.quantization` is deprecated (its warning says "removed in 2.10") yet present and
working in 2.13, and its quantized Linear ops are the maintained fbgemm / oneDNN kernels.

Numerics: the activations are quantized as fbgemm does on x86, to 7 bits (reduce_range:
AVX2's u8·s8 pair sums would saturate at 8), one scale over the whole input, so a row's
output depends slightly on the other rows of its batch, as with ONNX Runtime's and
PyTorch's dynamic quantization; unpadded, padding takes no part in the scale.

Export: under torch.export (and so torch.onnx.export) Int8Linear traces `int8_linear_ref`,
the same arithmetic in plain aten ops (round, clamp, an fp32 matmul of the integer values,
the scales): ONNX Runtime runs the exported graph with the eager model's logits, but with
fp32 matmuls, so at fp32 speed. For int8 speed under ONNX Runtime, quantize the fp32 export
with onnxruntime.quantization.quantize_dynamic (benchmarks/bench_inference.py's
`onnxruntime-int8`). Export traces the padded path, so compare it with `model.roberta.unpad = False`.

Quantized models are for inference: training, gradients and save_pretrained are refused
(fine-tune and save the fp32 model, quantize after loading).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

LAYER_LINEARS = ("qkv", "attn_out", "ffn_in", "ffn_out")  # RobertaLayer's four projections
ACTIVATION_QMAX = 127  # uint8 activations in [0, 127]: fbgemm's reduce_range on x86


class Int8Linear(nn.Module):
    """nn.Linear's forward with int8 weights (per-output-row scales) and dynamically quantized
    int8 activations; weights held in two forms: `weight_int8` / `weight_scale` buffers (the
    state, and what export traces) and the kernel library's packed copy (what eager runs)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        # symmetric per-row scales: the row's largest |w| maps to 127
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self._kernel = _PackedWeight(self)

    def forward(self, x):
        if self.training:
            raise RuntimeError("a quantized model is for inference: call model.eval() (to train, fine-tune the "
                               "fp32 model and quantize it afterwards)")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("int8 Linear layers have no gradient: run a quantized model under torch.no_grad() "
                               "or torch.inference_mode(), with its parameters frozen (rf.quantize freezes them)")
        if torch.compiler.is_exporting() or torch.jit.is_tracing():
            return int8_linear_ref(x, self.weight_int8, self.weight_scale, self.bias)
        return torch.ops.quantized.linear_dynamic(x, self._kernel.packed, reduce_range=True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights per row"

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._kernel = _PackedWeight(self)  # the kernel's copy follows the loaded weights


class _PackedWeight:
    """The kernel library's packed weight (fbgemm or oneDNN, by torch.backends.quantized.engine), in a
    plain holder: torch.export would try to trace a TorchScript object held by the module itself."""

    def __init__(self, linear: Int8Linear):
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized-tensor creation (pytorch#184982)
            warnings.simplefilter("ignore")
            scale = linear.weight_scale.double()
            zero_points = torch.zeros_like(scale, dtype=torch.long)
            qweight = torch._make_per_channel_quantized_tensor(linear.weight_int8, scale, zero_points, 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, linear.bias)


def activation_qparams(x):
    """(scale, zero_point) of fbgemm's dynamic activation quantization on x86: uint8 in
    [0, ACTIVATION_QMAX], the range [min(x, 0), max(x, 0)], zero point from the nearer end, rounded."""
    low, high = x.min().clamp(max=0), x.max().clamp(min=0)
    scale = ((high - low) / ACTIVATION_QMAX).clamp(min=6.1e-5)  # fbgemm's smallest scale
    from_min, from_max = -low / scale, ACTIVATION_QMAX - high / scale
    # fbgemm picks the zero point whose end is represented with less error (|qmin| - |min/s| vs |qmax| - |max/s|)
    zero_point = torch.where(-(low / scale).abs() < ACTIVATION_QMAX - (high / scale).abs(), from_min, from_max)
    return scale, torch.round(zero_point).clamp(0, ACTIVATION_QMAX)


def int8_linear_ref(x, weight_int8, weight_scale, bias=None):
    """What torch.ops.quantized.linear_dynamic computes, in plain aten ops (export, tests):
    x quantized to uint8 with activation_qparams, times the int8 weights, rescaled, plus bias."""
    scale, zero_point = activation_qparams(x)
    xq = torch.clamp(torch.round(x * (1.0 / scale)) + zero_point, 0, 255) - zero_point  # integer values, as float
    out = F.linear(xq, weight_int8.to(x.dtype)) * (scale * weight_scale)  # exact integer products, fp32 sums
    return out if bias is None else out + bias


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def quantize(model: nn.Module) -> nn.Module:
    """Swap each encoder block's four Linear layers for Int8Linear, in place; returns the model
    (eval mode, parameters frozen). A model already quantized is returned as it is."""
    from .model import RobertaLayer

    if not isinstance(model, nn.Module) or not any(isinstance(m, RobertaLayer) for m in model.modules()):
        raise ValueError(f"rf.quantize takes a roberta_fast model (RobertaModel, RobertaFor*), got "
                         f"{type(model).__name__}; for a transformers model use rf.RobertaModel.from_pretrained(it)")
    if is_quantized(model):
        return model
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        raise RuntimeError(f"this torch ({torch.__version__}) has no quantized Linear kernels "
                           "(torch.ops.quantized.linear_dynamic), which rf.quantize runs: use a torch that "
                           "ships them (2.13 does)")
    for p in model.parameters():
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"rf.quantize takes an fp32 model on the CPU (int8 Linear runs fbgemm / oneDNN CPU "
                             f"kernels), got {p.dtype} on {p.device}; use model.float().cpu() first")
    for layer in (m for m in model.modules() if isinstance(m, RobertaLayer)):
        for name in LAYER_LINEARS:
            setattr(layer, name, Int8Linear(getattr(layer, name)))
    model.requires_grad_(False)
    return model.eval()


def refuse_quantized(model: nn.Module, action: str):
    """ValueError when `model` is quantized: `action` (e.g. saving) needs the fp32 weights."""
    if is_quantized(model):
        raise ValueError(f"cannot {action} a quantized model: its Linear layers hold int8 weights, which "
                         "transformers and the fp32 classes do not read; keep the fp32 model and quantize after loading")
