"""`roberta_fast.patch(model)`: speed up an existing `transformers` RoBERTa model in place.

    model = transformers.AutoModelForMaskedLM.from_pretrained(path).cuda()
    roberta_fast.patch(model)   # same weights, same outputs, fused kernels

Attention goes through transformers' own extension point: an attention function and
a mask function registered under the name "roberta_fast" (the mask stays the 2-D
padding mask, as for flash-attention), selected with `set_attn_implementation`. The
feed-forward's dense+GELU and the sublayers' dropout+residual+LayerNorm get fused
forwards. No parameter is touched; the model keeps working with HF's trainer, saving
and loading, and gives transformers' outputs at every position, padded ones included.

The kernels run on CUDA tensors (and on CPU ones under TRITON_INTERPRET=1); a patched
model on the CPU, or in float64 (which no kernel takes), computes with transformers' SDPA
and roberta_fast's reference ops.
`output_attentions=True` runs transformers' eager attention for that call, with a
warning (no fused kernel stores the probabilities). `model.set_attn_implementation("sdpa")`
(or "eager") switches attention back to transformers' own, and ("roberta_fast") to the
fused one again; the fused feed-forward and LayerNorm, the same functions, stay.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import ops
from .config import DECODER_SETTINGS, decoder_error
from .model import _has_hooks, key_padding_mask

IMPLEMENTATION = "roberta_fast"


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fused(tensor) -> bool:
    """Whether the kernels take tensor: on CUDA, or the CPU under Triton's interpreter, and in
    a dtype they compute in (a float64 model runs the reference ops, as transformers would);
    not under torch.jit.trace or torch.export, which record plain aten ops, as the drop-in models'
    do: TorchScript cannot hold the kernels' arguments (a bool mask viewed as uint8), and ONNX has
    no translation of the kernels."""
    return (ops._kernel_device(tensor.device) and tensor.dtype in _KERNEL_DTYPES
            and not (torch.jit.is_tracing() or ops.exporting()))


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-interface function: q, k, v (batch, heads, seqlen, head_dim).

    attention_mask: the 2-D (batch, seqlen) padding mask, transformers' 4-D key-padding form
    (batch, 1, 1, seqlen) of it (a caller's own mask, passed through as it is), or None.
    Returns the output in (batch, seqlen, heads, head_dim), as transformers' own
    implementations do, and the attention probabilities when output_attentions asks for them.
    """
    mask = key_padding_mask(attention_mask, query.shape[0], key.shape[2])  # (batch, seqlen) or None
    output_attentions = kwargs.get("output_attentions")  # the call's, else the config's (set while eager)
    if output_attentions is None:
        output_attentions = getattr(getattr(module, "config", None), "output_attentions", False)
    if output_attentions:
        from transformers.models.roberta.modeling_roberta import eager_attention_forward

        ops._warn_once("output_attentions=True: no fused kernel stores attention probabilities, so this "
                       "call runs transformers' eager attention")
        additive = None
        if mask is not None:  # transformers' eager form: 0 to attend, the dtype's minimum to mask
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive = additive.masked_fill(~mask.bool(), torch.finfo(query.dtype).min)[:, None, None, :]
        return eager_attention_forward(module, query, key, value, additive, dropout=dropout, scaling=scaling)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, head_dim)
    fused = _fused(q)
    below_sm80 = fused and ops.attention_impl(q.device) == "sdpa"  # SDPA's efficient kernel: tensor cores
    if (not fused or below_sm80 or q.shape[-1] not in ops._kernels().ATTENTION_HEAD_DIMS
            or q.shape[1] != k.shape[1]):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        mask = None if mask is None else mask[:, None, None, :].bool()
        with ops.efficient_sdpa() if below_sm80 else contextlib.nullcontext():
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
    out = ops._kernels().attention(q, k, v, mask, dropout_p=dropout, softmax_scale=scaling)
    return out, None


def _padding_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """transformers mask-interface function: the 2-D padding mask, None when nothing is padded (as
    flash attention's), but the mask itself while tracing, compiling or exporting: there the
    data-dependent "nothing padded" check would be frozen into the graph (jit.trace then ignores
    the padding of later batches) or fail (torch.export). Every argument is optional: transformers
    5.0-5.4 pass cache_position and no q_length, later ones q_length and no cache_position."""
    if attention_mask is None:
        return None
    kv_length = attention_mask.shape[1] if kv_length is None else kv_length
    attention_mask = attention_mask[:, -kv_length:]  # (batch, kv_length)
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or ops.exporting():
        return attention_mask
    return None if attention_mask.shape[1] == kv_length and attention_mask.all() else attention_mask


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _padding_mask)


def _backend(tensor) -> str:
    return "fused" if _fused(tensor) else "reference"


def _unobserved(*modules) -> bool:
    """Whether nothing observes or wraps these modules' calls: no forward or backward hooks (global
    ones included) and no instance `forward` (accelerate's offloading), so a fused forward may skip
    calling them."""
    return not any(_has_hooks(m) for m in modules)


def _plain(*modules) -> bool:
    """Whether a fused forward may read these modules' weights instead of calling them: each is
    exactly an nn.Linear / nn.LayerNorm / nn.Dropout, unobserved. PEFT's LoRA layers, quantized and
    bitsandbytes layers are other classes: for those, transformers' own forward runs."""
    return all(type(m) in (nn.Linear, nn.LayerNorm, nn.Dropout) for m in modules) and _unobserved(*modules)


def _dense_dropout_add_norm(self, hidden_states, input_tensor):
    """RobertaSelfOutput / RobertaOutput: LayerNorm(dropout(dense(h)) + residual). The dropout
    follows its own module's training flag, as transformers' (Monte Carlo dropout in eval)."""
    if not _plain(self.LayerNorm, self.dropout):
        return self._rf_original.forward(self, hidden_states, input_tensor)
    p = self.dropout.p if self.dropout.training else 0.0
    return ops.dropout_add_layer_norm(self.dense(hidden_states), input_tensor, self.LayerNorm.weight,
                                      self.LayerNorm.bias, self.LayerNorm.eps, p, _backend(hidden_states))


def _dense_gelu(self, hidden_states):
    """RobertaIntermediate: erf GELU(dense(h)) with the bias add fused into the GELU; a hooked GELU
    module, or another activation put in its place (ReLU, tanh GELU), runs as transformers runs it."""
    if not (_plain(self.dense) and _is_erf_gelu(self.intermediate_act_fn) and _unobserved(self.intermediate_act_fn)):
        return self._rf_original.forward(self, hidden_states)
    return ops.linear_gelu(hidden_states, self.dense.weight, self.dense.bias, _backend(hidden_states))


def _is_erf_gelu(activation) -> bool:
    """Whether `activation` is transformers' GELUActivation (the erf GELU the fused op computes)."""
    from transformers.activations import GELUActivation

    return type(activation) is GELUActivation


def _lm_head(self, features, **kwargs):
    """RobertaLMHead: dense + GELU fused, LayerNorm fused, then the (tied) decoder."""
    if not _plain(self.dense, self.layer_norm):
        return self._rf_original.forward(self, features, **kwargs)
    backend = _backend(features)
    x = ops.linear_gelu(features, self.dense.weight, self.dense.bias, backend)
    x = ops.dropout_add_layer_norm(x, None, self.layer_norm.weight, self.layer_norm.bias,
                                  self.layer_norm.eps, 0.0, backend)
    return self.decoder(x)


class _Patched:
    """Base of the patched classes: pickles (torch.save, copy.deepcopy) as its original
    class plus the fused forward, since a class made at run time cannot be found by name."""

    def __reduce_ex__(self, protocol):
        reduced = list(super().__reduce_ex__(protocol))  # (constructor, args, state, ...)
        cls = type(self)  # through the class: self._rf_forward would be a bound method
        reduced[0], reduced[1] = _new_patched, (cls._rf_original, cls._rf_forward)
        return tuple(reduced)


_PATCHED_CLASSES = {}


def _patched_class(original, forward):
    """The subclass of original whose forward is `forward`, made once per pair. The forward
    lives on the class, not the instance, so DataParallel replicas and copies, which get
    their own __dict__, compute with their own weights."""
    key = (original, forward)
    if key not in _PATCHED_CLASSES:
        _PATCHED_CLASSES[key] = type(original.__name__, (_Patched, original), {
            "forward": forward, "_rf_original": original, "_rf_forward": forward,
            "__qualname__": original.__qualname__, "__doc__": original.__doc__})
    return _PATCHED_CLASSES[key]


def _new_patched(original, forward):
    """Unpickling: an empty instance of the patched class (pickle then restores its state).
    Registers the attention too: the model's config names it, in a fresh process as well."""
    _register()
    cls = _patched_class(original, forward)
    return cls.__new__(cls)


def _swap_forward(module, forward):
    """Give module the fused forward by moving it to the patched subclass of its class."""
    original = getattr(type(module), "_rf_original", type(module))  # patching twice: the same class
    module.__class__ = _patched_class(original, forward)


def _needs_attention_interface() -> str:
    import transformers

    return (f"patch() needs transformers >= 5.0, whose RoBERTa runs attention through AttentionInterface; "
            f"transformers {transformers.__version__} keeps its own attention classes and ignores a "
            "registered one. Upgrade transformers, or load the weights into roberta_fast's encoder, "
            "which needs no particular version: rf.RobertaModel.from_pretrained(model)")


def patch(model):
    """Swap attention, dense+GELU and dropout+residual+LayerNorm of a transformers RoBERTa
    model (RobertaModel, RobertaForMaskedLM, RobertaForSequenceClassification, ...) for
    roberta_fast's fused ops, in place; returns the model. Weights are untouched."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in ("roberta", "xlm-roberta", "camembert"):
        raise ValueError(
            f"patch() takes a transformers RoBERTa model; got {type(model).__name__} with model_type "
            f"{getattr(config, 'model_type', None)!r}"
        )
    decoder = decoder_error({name: getattr(config, name, False) for name in DECODER_SETTINGS},
                            f"patch(): {type(model).__name__}'s config")
    if decoder:
        raise ValueError(decoder)
    ops.check_backend("fused")  # a clear error when triton is missing
    try:
        _register()
    except ImportError as err:
        raise RuntimeError(_needs_attention_interface()) from err
    model.set_attn_implementation(IMPLEMENTATION)
    if getattr(model.config, "_attn_implementation", None) != IMPLEMENTATION:  # nothing patched yet
        raise RuntimeError(_needs_attention_interface())
    gelu = config.hidden_act == "gelu"  # the fused GELU is the erf form RoBERTa uses
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith(("SelfOutput", "Output")) and hasattr(module, "LayerNorm") and hasattr(module, "dense"):
            _swap_forward(module, _dense_dropout_add_norm)
        elif kind.endswith("Intermediate") and gelu:
            _swap_forward(module, _dense_gelu)
        elif kind.endswith("LMHead") and hasattr(module, "layer_norm"):
            _swap_forward(module, _lm_head)
    return model
