"""`rf.quantize(model)` (this module is roberta_fast.quantization): int8 CPU inference for the drop-in classes.

    model = rf.RobertaForSequenceClassification.from_pretrained(path)
    rf.quantize(model)              # in place, returned for chaining; reads as rf.patch does
    with torch.inference_mode():
        logits = model(input_ids, attention_mask=mask).logits

The four Linear layers of every encoder block (the fused `qkv`, `attn_out`, `ffn_in`,
`ffn_out`: 85M of roberta-base's 124.7M parameters) become `Int8Linear`: int8 weights, one
symmetric scale per output row, and int8 activations quantized dynamically (per tensor, at
each call). So does RobertaForMaskedLM's decoder, on a copy of the word embeddings it is tied
to (prepacked.TiedDecoder). Everything else stays fp32 (embeddings, LayerNorms, attention,
pooler and the other heads), and the unpadded CPU path is kept.

Kernels (`engine=`): "onednn", the default, runs oneDNN's int8 matmul
(`torch.ops.onednn.qlinear_pointwise` on a `qlinear_prepack`ed weight, the ops torch.compile's
x86 int8 path emits); it holds the int8 weights once, in oneDNN's layout (0.28x the fp32
layers' memory), and runs the FFN's GELU in the matmul's epilogue. Any other engine
("fbgemm", "x86", "qnnpack") runs PyTorch's quantized Linear
(`torch.ops.quantized.linear_dynamic`, what quantize_dynamic uses). Measured on the 2-core
AMD EPYC (AVX2, no VNNI; docs/inference.md): on batches of 32 x 128 oneDNN ran the int8
encoder 1.04-1.22x faster than fbgemm (whose AVX2 packing pads K to a multiple of 512 in
memory, 0.32x, not in time); on single short requests fbgemm ran 2.2-2.5x faster (oneDNN's int8 matmul costs ~0.4 ms per
call there). "auto" holds both packings and picks one per call (_AutoWeight). torchao 0.18
(PyPI) installs beside torch 2.13 and quantizes, but on the CPU its int8 Linear runs
torch._int_mm eagerly, 10-30x slower than fp32 (its fast CPU path needs torch.compile).

Numerics: the activations are quantized as fbgemm does on x86, one scale over the whole input
(so a row's output depends slightly on the other rows of its batch, or of its group of rows past
1024 tokens (RobertaModel.encode), as with ONNX Runtime's and PyTorch's dynamic quantization;
unpadded, padding takes no part in the scale; a left-padded batch runs padded: RobertaModel.encode), to 8 bits where
the CPU's int8 kernels sum u8·s8 products exactly (VNNI or AMX: `vpdpbusd` adds them into int32)
and to 7 bits elsewhere (reduce_range: without VNNI the kernels add product pairs into int16,
`vpmaddubsw`, which 8-bit activations saturate: measured 9% off on oneDNN's AVX2 kernel).
`activation_bits=` pins it (7 for an export meant for CPUs without VNNI). The oneDNN
path quantizes with int8_linear_ref's own arithmetic, in one C++ op
(csrc/quantize_activations.cpp); fbgemm's differs by a rounding step. An activation holding inf
or NaN is refused on every engine: no int8 scale covers it.

Export: under torch.export each Int8Linear is one `roberta_fast::int8_linear` node (its
weights as constants), whose kernel is `int8_linear_ref`, the same arithmetic in plain aten
ops. torch.onnx.export(..., custom_translation_table=onnx_translation_table()) writes it as
ONNX's integer ops (QuantizeLinear, MatMulInteger), which ONNX Runtime runs at int8 speed
with the eager logits; without the table the export holds the fp32 form (same logits, fp32
speed). Export traces the padded path, so compare it with `model.roberta.unpad = False`.

fp16 weights (`dtype=torch.float16`, as torch.ao.quantization.quantize_dynamic spells it): the
same four layers (and the MLM decoder) become `Fp16WeightLinear`, weights rounded to fp16,
activations and sums in fp32, run by fbgemm's fp16-weight GEMM
(`torch.ops.quantized.linear_dynamic_fp16`, the kernel quantize_dynamic's fp16 mode runs).
Why: on a short request the matmuls mostly wait for their weights to come from memory, and
fp16 halves those bytes at ~1/75 of int8's error. Measured on
the 2-core AVX2 CPU (docs/inference.md): single requests at ONNX Runtime fp32's latency
(0.95-1.03x), 1.2-1.7x faster than rf.prepack; batches of 32 x 128 1.09x rf fp32; hidden states
within 2.3e-3 of fp32's (int8: 0.19); weights 0.62x fp32's (fbgemm's packing pads). Its function
is F.linear on the fp16-rounded weights, which is what export records.

Quantized models are for inference: training, gradients and save_pretrained are refused
(fine-tune and save the fp32 model, quantize after loading), and so is an adapter layer in
the four slots (merge a PEFT LoRA first: its adapters would be dropped). Int8Linear shares
that inference-only base with rf.prepack's fp32 PackedLinear (roberta_fast/prepacked.py).
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import _ext
from .ops import gelu_fresh
from .prepacked import LAYER_LINEARS  # noqa: F401 (public here too)
from .prepacked import _InferenceLinear, as_tensors, attach_tied_decoder, by_value, encoder_linears, mlm_head

ACTIVATION_QMAX = 127  # 7-bit uint8 activations in [0, 127]: fbgemm's reduce_range on x86


class Int8Linear(_InferenceLinear):
    """nn.Linear's forward with int8 weights (per-output-row scales) and dynamically quantized
    int8 activations. The weights are held once, in the kernel library's packed form; the
    state (`weight_int8`, `weight_scale`, `bias`: the state_dict's keys) is read back from it
    (the holder's unpack) when saved or exported, so the int8 model keeps no second copy."""

    STATE = ("weight_int8", "weight_scale", "bias")
    KIND = "quantized"
    FUNCTION = "rf.quantize"

    def __init__(self, linear: nn.Module, engine: str, activation_bits: int = 7):
        super().__init__(linear)
        weight = linear.weight.detach().float()
        # symmetric per-row scales: the row's largest |w| maps to 127
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
        weight_int8 = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._kernel = _packed_weight(weight_int8, scale, bias, engine, 2**activation_bits - 1)

    weight_int8 = property(lambda self: self._kernel.unpack()[0])  # (out, in) int8
    weight_scale = property(lambda self: self._kernel.unpack()[1])  # (out,) fp32
    bias = property(lambda self: self._kernel.unpack()[2])  # (out,) fp32 or None

    def _traced(self, x, weight_int8, weight_scale, bias):
        qmax = self._kernel.qmax
        if torch.jit.is_tracing():
            return int8_linear_ref(x, weight_int8, weight_scale, bias, qmax)
        # one node of the exported graph: see onnx_translation_table
        return torch.ops.roberta_fast.int8_linear(x, weight_int8, weight_scale, bias, qmax)

    def _expected_state(self) -> dict:
        return self._with_bias(weight_int8=((self.out_features, self.in_features), torch.int8),
                               weight_scale=((self.out_features,), torch.float32))

    def _pack(self, state: dict):
        return _packed_weight(state["weight_int8"], state["weight_scale"], state.get("bias"), self._kernel.engine,
                              self._kernel.qmax)

    @property
    def activation_bits(self) -> int:
        return self._kernel.qmax.bit_length()

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", int8 weights per row, {self.activation_bits}-bit activations, "
                f"engine={self._kernel.engine}")


def _packed_weight(weight_int8, scale, bias, engine: str, qmax: int):
    """The int8 weight packed for `engine`'s kernels, its activations quantized to [0, qmax]: oneDNN's
    own int8 matmul where it runs (one copy of the weights), both libraries for "auto", else
    PyTorch's quantized Linear for that engine. 8-bit activations only where they sum exactly."""
    _check_activation_range(engine, qmax)
    if engine == "onednn":
        return _OnednnWeight(weight_int8, scale, bias, qmax)
    if engine == "auto":
        return _AutoWeight(weight_int8, scale, bias, qmax)
    return _PackedWeight(weight_int8, scale, bias, engine, qmax)


def _check_activation_range(engine: str, qmax: int):
    """ValueError unless `engine`'s kernels compute activations in [0, qmax] exactly on this CPU."""
    if qmax not in (ACTIVATION_QMAX, 255):
        raise ValueError(f"int8 activations take 7 or 8 bits (qmax 127 or 255), got qmax {qmax}")
    if engine == "qnnpack" and qmax != 255:  # it ignores reduce_range: eager would differ from its export
        raise ValueError("7-bit int8 activations on the qnnpack engine: its kernels quantize activations to 8 bits "
                         "whatever is asked (they ignore reduce_range), so the model would not compute what it reports "
                         "and exports; quantize the fp32 model with activation_bits=8 or None on qnnpack, or on "
                         "another engine (fbgemm, onednn) for 7 bits")
    if qmax == 255 and not sums_8bit_activations_exactly(engine):
        raise ValueError(f"8-bit int8 activations would saturate on this CPU's {engine} kernels: without VNNI or "
                         "AMX (or under an ISA cap such as ONEDNN_MAX_CPU_ISA) they add u8*s8 product pairs into "
                         "int16; quantize a fresh fp32 copy here with activation_bits=7 or None")


def has_int8_dot_products() -> bool:
    """Whether this CPU has VNNI or AMX (int8 dot products summed into int32), by torch's private probes."""
    has_flag = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731
    return has_flag("_is_vnni_supported") or has_flag("_is_amx_tile_supported")


@functools.cache
def sums_8bit_activations_exactly(engine: str) -> bool:
    """Whether `engine`'s int8 matmul ("auto": both of its libraries) sums 8-bit activations' u8*s8
    products exactly on this CPU. Without VNNI or AMX, x86 kernels add product pairs into int16
    (`vpmaddubsw`), which saturates at 255 * 127 * 2 (hence fbgemm's 7-bit reduce_range); with
    them (`vpdpbusd`, AMX tiles) products add into int32. Two checks must both pass: the CPU's
    flags, and a worst-case matmul (every product 255 * 127, paired) run on the kernels. The
    matmul catches an ISA cap such as ONEDNN_MAX_CPU_ISA; the flags catch a CPU whose library
    picks a non-saturating kernel for the probe's small shape but not for a layer's. qnnpack needs no
    VNNI (its kernels widen u8 and s8 to int16 before multiplying, pmaddwd / vmlal into int32), and
    runs 8 bits anyway: the probe alone decides there."""
    if not has_int8_dot_products() and engine != "qnnpack":
        return False
    if engine == "auto":
        return sums_8bit_activations_exactly("onednn") and sums_8bit_activations_exactly("fbgemm")
    depth, width = 256, 16
    weight = torch.full((width, depth), 127, dtype=torch.int8)
    weight[1::2] = -127  # rows of +127 and of -127: the sums at both ends of int32's use here
    x = torch.full((4, depth), 255.0)  # range [0, 255]: scale 1, zero point 0, every activation 255
    ones = torch.ones(width)
    holder = (_OnednnWeight(weight, ones, None, 255) if engine == "onednn"
              else _PackedWeight(weight, ones, None, engine, 255))
    with torch.inference_mode():
        out = holder(x)
    want = (255.0 * 127 * depth) * torch.where(torch.arange(width) % 2 == 0, 1.0, -1.0)
    return bool(torch.equal(out, want.expand_as(out)))


class _OnednnWeight:
    """The int8 weight in oneDNN's reordered layout, run by oneDNN's int8 matmul
    (torch.ops.onednn.qlinear_pointwise, the kernel torch.compile's x86 int8 path emits).
    It is the only copy (to_dense reads it back), where quantized.linear_prepack on the onednn
    engine keeps the original beside it; the activations are quantized by int8_linear_ref's
    arithmetic, so the two agree but for fp32 summation order. A plain holder, not module state:
    torch.export and deepcopy cannot handle an opaque mkldnn tensor (__getstate__ repacks)."""

    engine = "onednn"

    def __init__(self, weight_int8, scale, bias, qmax=ACTIVATION_QMAX):
        self.packed = torch.ops.onednn.qlinear_prepack(weight_int8, None)  # (in, out) int8, oneDNN's blocked layout
        self.scale = scale.float().contiguous()
        self.zero_points = torch.zeros_like(self.scale, dtype=torch.long)  # symmetric weights
        self.bias = bias
        self.qmax = qmax

    def unpack(self):
        bias = None if self.bias is None else self.bias.clone()
        return self.packed.to_dense().t().contiguous(), self.scale.clone(), bias

    def __getstate__(self):
        return (*by_value(self.unpack()), self.qmax)

    def __setstate__(self, state):
        _unpickled(self, state)

    def spec(self, tokens: int) -> tuple:
        """What __call__ runs, for the C++ inference layer (csrc/inference_layer.cpp)."""
        return ("qlinear_pointwise", self.packed, self.scale, self.zero_points, self.bias, self.qmax)

    def __call__(self, x, post_op="none"):
        """The layer's fp32 output, with oneDNN's `post_op` applied to it ("gelu": erf GELU)."""
        if x.numel() == 0:  # no tokens: nothing to scale by
            return x.new_empty(*x.shape[:-1], self.scale.numel())
        # min, max, scale, zero point and uint8 values in one C++ call (csrc/quantize_activations.cpp),
        # int8_linear_ref's arithmetic bit for bit: 22 us for a 16 x 768 input where the dozen aten
        # ops and host reads it replaced took 168 us, and 1.6x faster at 4096 x 3072 (2-core AVX2 CPU;
        # 6.8 us on the AVX-512 CPU since its loop has AVX2 and AVX-512 clones)
        xq, scale, zero_point = _ext.load().quantize_activations(x, self.qmax)  # x: fp32 (checked)
        algorithm = "none" if post_op == "gelu" else ""  # oneDNN's GELU algorithms: "none" (erf) or "tanh"
        return torch.ops.onednn.qlinear_pointwise.default(
            xq, scale, zero_point, self.packed, self.scale, self.zero_points, self.bias,
            1.0, 0, torch.float32, post_op, [], algorithm)  # fp32 out: output scale 1, zero point 0


def _unpickled(holder, state):
    """__setstate__ of the oneDNN and auto holders: the state unpacked, packed again on this CPU,
    which must compute its activation range (a pickle from before activation_bits: 7 bits)."""
    *tensors, qmax = state if len(state) == 4 else (*state, ACTIVATION_QMAX)
    _check_activation_range(holder.engine, qmax)
    holder.__init__(*as_tensors(tensors), qmax)


@contextlib.contextmanager
def _on_engine(engine: str):
    """torch's quantized engine set to `engine` (it picks the library a prepack op packs for), then restored."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


@functools.cache
def _eager_op(name: str):
    """torch.ops.quantized.<name>'s C++ function, for the holders, which only ever run eagerly (outside
    the graph under torch.compile; export traces int8_linear_ref). torch.ops' Python wrapper first
    scans the arguments for torch.export's fake script objects, since the packed weight is a script
    object: 4-8 us a call, against ~14 us for linear_dynamic itself at 16 x 96. Skipping it took 5%
    off a 1 x 16 request (48 calls) on roberta-base's shape (2-core AVX-512 VNNI CPU, interleaved)."""
    overload = getattr(torch.ops.quantized, name).default
    return getattr(overload, "_op", overload)  # the wrapper itself, should a torch lack the attribute


class _PackedWeight:
    """PyTorch's quantized Linear weight packed for `engine` (fbgemm, x86, qnnpack), in a plain
    holder: torch.export would try to trace a TorchScript object held by the module itself. The
    packed object carries its library: linear_dynamic runs it whatever the global engine is later."""

    def __init__(self, weight_int8, scale, bias, engine: str, qmax=ACTIVATION_QMAX):
        self.engine, self.qmax = engine, qmax
        with _on_engine(engine), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.13 deprecates quantized-tensor creation (pytorch#184982)
            scale = scale.double()
            zero_points = torch.zeros_like(scale, dtype=torch.long)
            qweight = torch._make_per_channel_quantized_tensor(weight_int8, scale, zero_points, 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def unpack(self):
        """(weight_int8, weight_scale, bias): fresh tensors read back from the packed weight (the
        bias copied too: the library may hand back the tensor it holds)."""
        qweight, bias = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float(), None if bias is None else bias.clone()

    def __getstate__(self):
        return {"engine": self.engine, "qmax": self.qmax, "weights": by_value(self.unpack())}

    def __setstate__(self, state):
        """Unpickled, packed again (an older pickle's packed weight unpickles itself): this CPU must compute
        its activation range."""
        state = {"qmax": ACTIVATION_QMAX, **state}
        _check_activation_range(state["engine"], state["qmax"])
        if "weights" in state:
            self.__init__(*as_tensors(state["weights"]), state["engine"], state["qmax"])
        else:
            self.__dict__.update(state)

    def spec(self, tokens: int) -> tuple:
        """What __call__ runs, for the C++ inference layer (csrc/inference_layer.cpp)."""
        return ("linear_dynamic", self.packed, self.qmax == ACTIVATION_QMAX)

    def __call__(self, x, post_op="none"):
        """The layer's fp32 output, then `post_op` ("gelu": erf GELU; linear_dynamic has no epilogue)."""
        _ext.load().check_activations_finite(x)  # fbgemm would quantize a NaN to plausible values
        # reduce_range: fbgemm's own 7-bit activations, [0, 127]; else 8 bits, [0, 255]
        out = _eager_op("linear_dynamic")(x, self.packed, self.qmax == ACTIVATION_QMAX)
        return gelu_fresh(out) if post_op == "gelu" else out


# engine="auto": a call of fewer tokens runs on fbgemm, any other on oneDNN; where the two crossed end
# to end on roberta-base's shape (2 cores): 512 on the AVX2 CPU, ~24 on the AVX-512 VNNI one (AMX not measured)
AUTO_FBGEMM_BELOW_TOKENS = 24 if has_int8_dot_products() else 512


class _AutoWeight:
    """The int8 weight packed for both libraries (0.28x + 0.32x the fp32 layer's memory); each call
    runs fbgemm when it has fewer than AUTO_FBGEMM_BELOW_TOKENS tokens, oneDNN otherwise. Why:
    on the 2-core AVX2 CPU without VNNI (docs/inference.md, "Mixed traffic") fbgemm ran
    roberta-base's int8 encoder 2.2x faster at 1 x 16 tokens, 1.32x at 1 x 64 and 1.14x at 2 x 128
    (256 tokens per call), and 1.02x at 3 x 128; oneDNN was 1.03x faster at 4 x 128 and
    1.04-1.11x at 32 x 128. Since oneDNN's activations are quantized in C++ the two are level
    from ~192 to ~384 tokens (scratch runs), so 512 costs at most ~5% there. On the 2-core AVX-512
    VNNI CPU oneDNN's fixed cost per call is smaller: fbgemm ran 1.21x faster at 1 x 8, the two were
    within a few percent from 1 x 16 to 1 x 32, and oneDNN ran 1.13-1.23x faster from 1 x 64 to
    1 x 256 and 1.11x at 1 x 384 and 4 x 128 (scratch, medians of interleaved forwards), hence 24 there. Every
    layer of one forward (of one group of rows, RobertaModel.encode) sees the same token count, so
    a call runs on one library."""

    engine = "auto"

    def __init__(self, weight_int8, scale, bias, qmax=ACTIVATION_QMAX):
        self.onednn = _OnednnWeight(weight_int8, scale, bias, qmax)
        self.fbgemm = _PackedWeight(weight_int8, scale, bias, "fbgemm", qmax)
        self.qmax = qmax

    def unpack(self):
        return self.onednn.unpack()

    def __getstate__(self):
        return (*by_value(self.unpack()), self.qmax)

    def __setstate__(self, state):
        _unpickled(self, state)

    def _library(self, tokens: int):
        return self.fbgemm if tokens < AUTO_FBGEMM_BELOW_TOKENS else self.onednn

    def spec(self, tokens: int) -> tuple:
        """What __call__ runs on `tokens` rows, for the C++ inference layer (csrc/inference_layer.cpp)."""
        return self._library(tokens).spec(tokens)

    def __call__(self, x, post_op="none"):
        tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0  # (..., in) -> rows
        return self._library(tokens)(x, post_op)


FP16_MAX = 65504.0  # the largest finite fp16


class Fp16WeightLinear(_InferenceLinear):
    """nn.Linear's forward on fp16-rounded weights: fp32 activations, the weights converted to fp32
    inside fbgemm's GEMM (the only copy: fbgemm's packed fp16), fp32 sums. Its state
    (`weight_fp16`, `bias`) is read back from the packed weight; its function is
    F.linear(x, weight_fp16.float(), bias), which export records."""

    STATE = ("weight_fp16", "bias")
    KIND = "quantized"
    FUNCTION = "rf.quantize"

    def __init__(self, linear: nn.Module):
        super().__init__(linear)
        weight = linear.weight.detach().float()
        _check_fp16_range(weight, "a Linear layer")
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._kernel = _Fp16Weight(weight.half(), bias)

    weight_fp16 = property(lambda self: self._kernel.unpack()[0])  # (out, in) fp16
    bias = property(lambda self: self._kernel.unpack()[1])  # (out,) fp32 or None

    def _traced(self, x, weight_fp16, bias):
        return F.linear(x, weight_fp16.to(x.dtype), bias)  # fp16 constants in the graph, cast once

    def _expected_state(self) -> dict:
        return self._with_bias(weight_fp16=((self.out_features, self.in_features), torch.float16))

    def _pack(self, state: dict):
        return _Fp16Weight(state["weight_fp16"], state.get("bias"))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp16 weights, engine=fbgemm"


def _check_fp16_range(weight, where: str):
    """ValueError when `weight` holds a value fp16 cannot (it would saturate to +-65504 silently)."""
    largest = weight.abs().max().item() if weight.numel() else 0.0
    if not largest <= FP16_MAX:  # NaN too
        raise ValueError(f"rf.quantize(dtype=torch.float16): {where} has a weight of magnitude {largest:g}, beyond "
                         f"fp16's range (+-{FP16_MAX:g}); use int8 (rf.quantize(model)) or fp32 (rf.prepack(model))")


class _Fp16Weight:
    """An fp16 Linear weight packed by fbgemm for its fp16-weight GEMM (linear_dynamic_fp16), in a
    plain holder (as _PackedWeight, whose notes apply)."""

    engine = "fbgemm"

    def __init__(self, weight_fp16, bias):
        with _on_engine(self.engine):  # fp16 values, handed over as fp32: exact, nothing left for fbgemm to round
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight_fp16.float(), bias)

    def unpack(self):
        """(weight_fp16, bias): fresh tensors read back from the packed weight."""
        weight, bias = torch.ops.quantized.linear_unpack_fp16(self.packed)  # fp32 holding fp16 values
        return weight.half(), None if bias is None else bias.clone()

    def __getstate__(self):
        return by_value(self.unpack())

    def __setstate__(self, state):
        if isinstance(state, dict):  # an older pickle: the packed weight unpickled itself
            self.__dict__.update(state)
        else:
            self.__init__(*as_tensors(state))

    def spec(self, tokens: int) -> tuple:
        """What __call__ runs, for the C++ inference layer (csrc/inference_layer.cpp)."""
        return ("linear_dynamic_fp16", self.packed)

    def __call__(self, x, post_op="none"):
        """The layer's fp32 output, then `post_op` ("gelu": erf GELU; the kernel has no epilogue)."""
        out = _eager_op("linear_dynamic_fp16")(x, self.packed)
        return gelu_fresh(out) if post_op == "gelu" else out


def activation_qparams(x, qmax=ACTIVATION_QMAX):
    """(scale, zero_point) of fbgemm's dynamic activation quantization on x86: uint8 in [0, qmax]
    (127: 7 bits, reduce_range; 255: 8 bits), the range [min(x, 0), max(x, 0)], zero point from the
    nearer end, rounded."""
    low, high = x.min().clamp(max=0), x.max().clamp(min=0)  # (min and max export to ONNX, torch.aminmax does not)
    scale = ((high - low) / qmax).clamp(min=6.1e-5)  # fbgemm's smallest scale
    from_min, from_max = -low / scale, qmax - high / scale
    # fbgemm picks the zero point whose end is represented with less error (|qmin| - |min/s| vs |qmax| - |max/s|)
    zero_point = torch.where(-(low / scale).abs() < qmax - (high / scale).abs(), from_min, from_max)
    return scale, torch.round(zero_point).clamp(0, qmax)


def int8_linear_ref(x, weight_int8, weight_scale, bias=None, qmax=ACTIVATION_QMAX):
    """What the int8 kernels compute, in plain aten ops (export, tests): x quantized to uint8 in
    [0, qmax] with activation_qparams, times the int8 weights, rescaled, plus bias. oneDNN's path
    quantizes identically; fbgemm's own quantization puts a few values one step apart."""
    scale, zero_point = activation_qparams(x, qmax)
    xq = torch.clamp(torch.round(x * (1.0 / scale)) + zero_point, 0, 255) - zero_point  # integer values, as float
    # on rows (2-D): torch 2.6's ONNX export reruns aten.linear by its C++ kernel on symbolic sizes, where a
    # 3-D input without bias reaches matmul's should_fold and its numel() ("Cannot call numel() on tensor with
    # symbolic sizes"); 2-D, linear is mm. Same products: eager matmul folds a contiguous 3-D input to mm too
    rows = F.linear(xq.reshape(-1, xq.shape[-1]), weight_int8.to(x.dtype))  # exact integer products, fp32 sums
    out = rows.reshape(*x.shape[:-1], rows.shape[-1]) * (scale * weight_scale)
    return out if bias is None else out + bias


# int8_linear_ref as one operator, which torch.export keeps as a node of its graph: run (and lowered
# by torch.onnx without a translation) as its plain aten ops, translated to ONNX's integer ops by
# onnx_translation_table().
torch.library.define("roberta_fast::int8_linear",
                     "(Tensor x, Tensor weight_int8, Tensor weight_scale, Tensor? bias, int qmax=127) -> Tensor")
torch.library.impl("roberta_fast::int8_linear", "CompositeImplicitAutograd")(int8_linear_ref)


@functools.lru_cache(maxsize=None)
def onnx_export_decomposes_custom_ops() -> bool:
    """Whether torch.onnx.export decomposes roberta_fast::int8_linear even where a custom_translation_table
    translates it: torch 2.6's exporter spared from decomposition only the aten and prims ops its registry
    translates (torch/onnx/_internal/exporter/_decomp.py, get_onnx_implemented_overloads; pytorch#150367,
    fixed by #151826 for 2.8). Asked of that function itself, with a registry holding this op alone."""
    try:
        from torch.onnx._internal.exporter import _decomp
    except ImportError:
        return False
    op = torch.ops.roberta_fast.int8_linear.default

    class Registry:  # what get_onnx_implemented_overloads reads of an ONNXRegistry, before and after the fix
        functions = {op.name(): [type("Decomp", (), {"fx_target": op})]}

        def is_registered(self, target):
            return target is op
    try:
        return op not in _decomp.get_onnx_implemented_overloads(Registry())
    except Exception:  # another exporter: no claim
        return False


def onnx_translation_table():
    """{operator: ONNX translation} for torch.onnx.export(..., dynamo=True, custom_translation_table=...):
    each int8 layer of a quantized model becomes ONNX's integer matmul (QuantizeLinear, MatMulInteger),
    which ONNX Runtime runs at int8 speed with int8_linear_ref's numerics. Without it the export
    runs the same arithmetic with fp32 MatMuls (same outputs, fp32 speed)."""
    try:
        from onnxscript import opset18 as op
    except ImportError as error:
        raise ImportError("the int8 ONNX translation needs onnxscript: pip install -e .[export]") from error
    if onnx_export_decomposes_custom_ops():
        warnings.warn(f"this torch's ONNX exporter ({torch.__version__}) decomposes roberta_fast::int8_linear "
                      "before it reads the custom_translation_table (pytorch#150367, fixed in 2.8): the int8 "
                      "layers export as fp32 MatMuls (the same outputs, at fp32 speed); export with torch >= 2.8 "
                      "for ONNX's integer matmul", stacklevel=2)

    def int8_linear_onnx(x, weight_int8, weight_scale, bias=None, qmax: int = ACTIVATION_QMAX):
        """int8_linear_ref in ONNX ops: activation_qparams, then uint8 x times int8 weights in int32."""
        if qmax == 255:  # 8 bits: ONNX's own dynamic quantization, which ONNX Runtime fuses with the matmul
            xq, scale, zero_point = op.DynamicQuantizeLinear(x)  # (no 6.1e-5 floor on the scale: ~0 apart)
        else:
            xq, scale, zero_point = _seven_bit_quantization(op, x)
        acc = op.MatMulInteger(xq, op.Transpose(weight_int8, perm=[1, 0]), zero_point)  # int32 (folded: constant)
        out = op.Mul(op.Cast(acc, to=1), op.Mul(scale, weight_scale))  # fp32
        return out if bias is None else op.Add(out, bias)

    return {torch.ops.roberta_fast.int8_linear.default: int8_linear_onnx}


def _seven_bit_quantization(op, x):
    """(uint8 x, scale, zero point) of activation_qparams at qmax 127, in ONNX ops."""
    qmax, zero = op.Constant(value_float=float(ACTIVATION_QMAX)), op.Constant(value_float=0.0)
    low = op.Min(op.ReduceMin(x, keepdims=0), zero)
    high = op.Max(op.ReduceMax(x, keepdims=0), zero)
    scale = op.Max(op.Div(op.Sub(high, low), qmax), op.Constant(value_float=6.1e-5))
    low_steps, high_steps = op.Div(low, scale), op.Div(high, scale)
    nearer_min = op.Less(op.Neg(op.Abs(low_steps)), op.Sub(qmax, op.Abs(high_steps)))
    zero_point = op.Clip(op.Round(op.Where(nearer_min, op.Neg(low_steps), op.Sub(qmax, high_steps))), zero, qmax)
    zero_point = op.Cast(zero_point, to=2)  # uint8
    return op.QuantizeLinear(x, scale, zero_point), scale, zero_point  # round half to even, + zero point, saturate


QUANTIZED_LAYERS = (Int8Linear, Fp16WeightLinear)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QUANTIZED_LAYERS) for m in model.modules())


def default_engine() -> str:
    """oneDNN where this torch has it (faster here, see the module docstring), else torch's engine."""
    return "onednn" if _has_onednn() else torch.backends.quantized.engine


def _has_onednn() -> bool:
    return ("onednn" in torch.backends.quantized.supported_engines and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.onednn, "qlinear_pointwise"))


def quantize(model: nn.Module, engine: str | None = None, dtype: torch.dtype = torch.qint8,
             activation_bits: int | None = None) -> nn.Module:
    """Swap each encoder block's four Linear layers for Int8Linear (or, with dtype=torch.float16,
    Fp16WeightLinear), in place, and run an MLM head's decoder on such a copy of the word
    embeddings (prepacked.TiedDecoder); returns the model (eval mode, parameters frozen). A model
    already quantized the same way is returned as it is, but for the decoder's copy, quantized
    afresh from the current tables.

    engine: the kernel library that packs and runs the int8 weights, one of
    torch.backends.quantized.supported_engines, or "auto"; None picks default_engine()
    ("onednn": faster on batches on the CPU measured, 0.28x the fp32 layers' memory against
    fbgemm's 0.32x). On a CPU without VNNI pass "fbgemm" for single short requests: oneDNN's
    int8 matmul costs ~0.4 ms per call there whatever the length (measured 2.2x the latency at
    1 x 16 tokens). With VNNI the default is the faster one from ~24 tokens per call, and fbgemm
    only below (1.02-1.16x at 1 x 16 and 1 x 8 in one record). "auto" for mixed traffic: both
    packings (0.6x), each call run by fbgemm below AUTO_FBGEMM_BELOW_TOKENS tokens and by
    oneDNN from there.
    dtype: torch.qint8 (int8 weights and activations) or torch.float16 (fp16 weights, fp32
    activations and sums: near fp32's outputs, for single short requests; fbgemm's kernel, so
    engine None or "fbgemm").
    activation_bits: 8, 7, or None (the default): 8 where this CPU's kernels sum 8-bit u8*s8
    products exactly (VNNI or AMX; sums_8bit_activations_exactly), else 7. An ONNX export keeps
    the bits: for CPUs without VNNI, export a model quantized with 7. qnnpack runs 8 on every
    CPU (it ignores reduce_range): its default is 8, and 7 is refused there.
    """
    slots = encoder_linears(model, "rf.quantize")
    if dtype not in (torch.qint8, torch.float16):
        raise ValueError(f"rf.quantize(dtype={dtype}): pass torch.qint8 (int8 weights and activations, the "
                         "default) or torch.float16 (fp16 weights, fp32 activations)")
    resolved = _checked_engine(engine, dtype)
    bits = _checked_activation_bits(activation_bits, resolved, dtype)
    if is_quantized(model):
        done = _quantized_as(model)
        if done[1] != dtype or engine not in (None, done[0]) or activation_bits not in (None, done[2]):
            raise ValueError(f"rf.quantize(engine={engine!r}, dtype={dtype}, activation_bits={activation_bits}): "
                             f"this model is already quantized (engine={done[0]!r}, dtype={done[1]}, "
                             f"activation_bits={done[2]}); quantize a fresh fp32 copy instead")
        head = mlm_head(model)
        if head is not None:  # afresh, for the edits a call cannot see (prepacked.TiedDecoder)
            attach_tied_decoder(model, head, head.packed_decoder.layer_class)
        return model
    head = mlm_head(model)
    if dtype == torch.float16:  # every layer checked before any is swapped: a refused model is left as it was
        for i, (layer, name) in enumerate(slots):
            _check_fp16_range(getattr(layer, name).weight, f"{name} of encoder block {i // len(LAYER_LINEARS)}")
        if head is not None:
            _check_fp16_range(model.get_input_embeddings().weight, "the word embeddings (the MLM decoder)")
    layer_class, kwargs = ((Fp16WeightLinear, {}) if dtype == torch.float16
                           else (Int8Linear, dict(engine=resolved, activation_bits=bits)))
    for layer, name in slots:  # nn.Linear, or rf.prepack's PackedLinear (its weight reads back)
        setattr(layer, name, layer_class(getattr(layer, name), **kwargs))
    if head is not None:
        head.packed_decoder = None  # rf.prepack's fp32 copy, if any, gives way to this one
        attach_tied_decoder(model, head, layer_class, **kwargs)
    model.requires_grad_(False)
    return model.eval()


def _checked_engine(engine: str | None, dtype: torch.dtype) -> str:
    """The engine rf.quantize runs `dtype` on: `engine`, or the default when None; a clear error
    when this torch lacks it."""
    kernel = "linear_dynamic_fp16" if dtype == torch.float16 else "linear_dynamic"
    if not hasattr(torch.ops.quantized, kernel):
        raise RuntimeError(f"this torch ({torch.__version__}) has no quantized Linear kernel "
                           f"torch.ops.quantized.{kernel}, which rf.quantize runs: use a torch that ships it "
                           "(2.13 does)")
    supported = torch.backends.quantized.supported_engines
    if dtype == torch.float16:
        if engine not in (None, "fbgemm") or "fbgemm" not in supported:
            raise ValueError(f"rf.quantize(engine={engine!r}, dtype=torch.float16): fp16 weights run on fbgemm's "
                             f"kernel (this torch's engines: {supported}); pass engine=None or \"fbgemm\"")
        return "fbgemm"
    engine = default_engine() if engine is None else engine
    if engine == "auto" and not (_has_onednn() and "fbgemm" in supported):
        raise ValueError(f"rf.quantize(engine='auto') switches between fbgemm and oneDNN, and this torch's "
                         f"quantized engines are {supported} (oneDNN's int8 ops: {_has_onednn()}); pass one of them")
    if engine != "auto" and (engine not in supported or (engine == "onednn" and not _has_onednn())):
        raise ValueError(f"rf.quantize(engine={engine!r}): this torch's quantized engines are "
                         f"{supported}; pass one of them, \"auto\" (fbgemm for short calls, oneDNN for long ones) "
                         "or None for the default")
    return engine


def _checked_activation_bits(bits: int | None, engine: str, dtype: torch.dtype) -> int | None:
    """The activations' bits rf.quantize uses (None for fp16 weights, whose activations stay fp32)."""
    if dtype == torch.float16:
        if bits is not None:
            raise ValueError(f"rf.quantize(dtype=torch.float16, activation_bits={bits}): fp16 weights keep fp32 "
                             "activations; leave activation_bits out")
        return None
    if bits not in (None, 7, 8):
        raise ValueError(f"rf.quantize(activation_bits={bits!r}): pass 8, 7, or None (8 where this CPU's int8 "
                         "kernels sum 8-bit activations exactly, else 7)")
    if bits is None:
        return default_activation_bits(engine)
    _check_activation_range(engine, 2**bits - 1)
    return bits


def default_activation_bits(engine: str) -> int:
    """rf.quantize's activation bits on `engine` when none are asked: 8 where this CPU's kernels sum
    them exactly (sums_8bit_activations_exactly), else 7."""
    return 8 if sums_8bit_activations_exactly(engine) else 7


def _quantized_as(model: nn.Module) -> tuple[str, torch.dtype, int | None]:
    """(engine, dtype, activation bits) of a quantized model's first quantized layer."""
    layer = next(m for m in model.modules() if isinstance(m, QUANTIZED_LAYERS))
    if isinstance(layer, Fp16WeightLinear):
        return layer._kernel.engine, torch.float16, None
    return layer._kernel.engine, torch.qint8, layer.activation_bits


# a quantized layer's state_dict names (its bias is named as nn.Linear's)
QUANTIZED_STATE = tuple(sorted({name for layer in QUANTIZED_LAYERS for name in layer.STATE} - {"bias"}))


def refuse_quantized(model: nn.Module, action: str, state_dict: dict | None = None):
    """ValueError when `model`, or a `state_dict` given in place of its own (by its key names), is
    quantized: `action` (e.g. saving) needs the fp32 weights."""
    if is_quantized(model):
        raise ValueError(f"cannot {action} a quantized model: its Linear layers hold int8 or fp16 weights, which "
                         "transformers and the fp32 classes do not read; keep the fp32 model and quantize after loading")
    quantized = [key for key in state_dict or {} if key.rsplit(".", 1)[-1] in QUANTIZED_STATE]
    if quantized:
        raise ValueError(f"cannot {action} a quantized model's state_dict (it holds {quantized[0]!r} and "
                         f"{len(quantized) - 1} more such keys): transformers and the fp32 classes read no int8 or "
                         "fp16 weights; pass the fp32 model's state_dict and quantize after loading")
