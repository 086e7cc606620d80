"""RoBERTa in one readable file: embeddings, post-LN encoder, pooler, MLM head and the task
heads (sequence and token classification, question answering, multiple choice).

Computes exactly Hugging Face's `RobertaModel`, `RobertaForMaskedLM` and `RobertaFor*` heads
(tested against `transformers` itself; outputs are dicts as transformers', and pytree nodes, so torch.export takes them), with two layout differences that `roberta_fast.hf` converts:
Q, K and V are one fused (3·hidden, hidden) projection, and the MLM decoder has no
weight of its own (it reads the word embeddings, i.e. is tied by construction).

The hot operations go through `roberta_fast.ops`, which runs the plain-PyTorch
reference or the fused Triton kernels (`backend`); the weights are the same either way.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import _ext, ops
from .ops import _warn_once
from .config import RobertaConfig, attn_implementation_error, decoder_error, untied_decoder_error

IGNORE_INDEX = -100  # label of a position that is not predicted
CPU_GROUP_TOKENS = 1024  # RobertaModel.encode: CPU inference runs larger batches in groups of rows of this many tokens


# ----------------------------------------------------------------------- outputs
class DictOutput(collections.OrderedDict):
    """transformers' ModelOutput where transformers is not installed: a dataclass that is also a
    dict of its fields that are not None. Attributes, out["logits"], out[0] and slices, keys() /
    values() / items(), "logits" in out, len(out), to_tuple(), out["key"] = value."""

    def __post_init__(self):  # the dataclass __init__ has filled the dict through __setattr__
        names = list(self.__dataclass_fields__)
        first = getattr(self, names[0])
        if isinstance(first, Mapping) and all(getattr(self, n) is None for n in names[1:]):
            setattr(self, names[0], None)  # Output({"logits": ...}), as transformers' pipelines rebuild one
            for key, value in first.items():
                if key not in names:
                    raise TypeError(f"{type(self).__name__} has no field {key!r}")
                setattr(self, key, value)

    def __setattr__(self, name, value):
        if name in self.__dataclass_fields__:
            if value is None:
                self.pop(name, None)
            else:
                super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)  # as transformers': a key that is no field is kept in the dict only
        if key in self.__dataclass_fields__:
            super().__setattr__(key, value)

    def __getitem__(self, key):
        if isinstance(key, str):
            return super().__getitem__(key)  # KeyError for a field that is None, as transformers'
        return self.to_tuple()[key]

    def __reduce__(self):  # pickle / copy by fields (a dict's reduce would call cls() and set items)
        return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def to_tuple(self):
        return tuple(self.values())


try:  # transformers' own base where installed: its Trainer and pipelines test isinstance(out, ModelOutput)
    from transformers.utils import ModelOutput as _OutputBase
except ImportError:
    _OutputBase = DictOutput


class ModelOutput(_OutputBase):
    """The models' outputs: dataclasses that are dicts of their fields that are not None, on
    transformers' ModelOutput (DictOutput without transformers), so what transformers' code does
    with an output (out.logits, out["logits"], out[0], isinstance(out, dict), rebuilding one from
    a dict) works. Pytree nodes, so torch.export returns them; under torch.jit.trace the models
    return to_tuple() instead (TorchScript takes tuples; _PreTrained._result)."""


def _output(cls):
    """@dataclass, registered as a pytree node so torch.export / torch.onnx.export can return it
    (transformers' ModelOutput registers its subclasses itself)."""
    cls = dataclass(cls)
    if cls not in torch.utils._pytree.SUPPORTED_NODES:
        torch.utils._pytree.register_pytree_node(
            cls, lambda out: (list(out.values()), list(out.keys())),
            lambda values, keys: cls(**dict(zip(keys, values))),
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            flatten_with_keys_fn=lambda out: ([(torch.utils._pytree.MappingKey(k), v) for k, v in out.items()],
                                              list(out.keys())))
    return cls


@_output
class BaseModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[()] | None = None  # () with attentions, as transformers' encoder returns


@_output
class MaskedLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@_output
class SequenceClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@_output
class TokenClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@_output
class QuestionAnsweringModelOutput(ModelOutput):
    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None
    end_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@_output
class MultipleChoiceModelOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


# ----------------------------------------------------------------- input checks
def _tracing() -> bool:
    """Whether values are symbolic (torch.export, torch.compile, torch.jit.trace / the TorchScript ONNX
    exporter): checks on values, which need a host sync, are skipped; shapes are still checked."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def check_inputs(config: RobertaConfig, input_ids, attention_mask=None, token_type_ids=None,
                 position_ids=None, cu_seqlens=None, labels=None, inputs_embeds=None, max_seqlen=None,
                 vocab_size: int | None = None):
    """Raise ValueError naming the problem for inputs that would index out of range.

    Runs before any kernel, so a user mistake never becomes a device-side assert. On a
    GPU this costs one host synchronisation (the id range); models fed by a validated
    data pipeline can turn it off with `model.check_inputs = False`.
    inputs_embeds (batch, seqlen, hidden) replaces input_ids, as in transformers.
    max_seqlen, given with cu_seqlens, must be at least the longest segment. vocab_size: the word
    embeddings' rows, where a table set with set_input_embeddings differs from config.vocab_size.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds (the word embeddings of the tokens)")
    if inputs_embeds is not None:
        _check_inputs_embeds(config, inputs_embeds)
        input_ids = inputs_embeds[..., 0]  # stands for the ids in the shape and device checks below
    elif not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    elif input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; "
            "convert with input_ids.long()"
        )
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must have shape (batch, seqlen), got {tuple(input_ids.shape)}; "
            "for a single sequence use input_ids.unsqueeze(0)"
        )
    batch, seqlen = input_ids.shape
    if batch == 0 or seqlen == 0:
        raise ValueError(f"the batch is empty: input_ids has shape {tuple(input_ids.shape)}; pass at least one row "
                         "of at least one token")
    if seqlen > config.max_seq_len:
        raise ValueError(
            f"sequence length {seqlen} exceeds the position table: this model takes at most "
            f"{config.max_seq_len} tokens (max_position_embeddings={config.max_position_embeddings} "
            f"minus pad_token_id + 1); truncate the input"
        )
    for name, extra in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                        ("position_ids", position_ids), ("labels", labels)):
        if extra is None:
            continue
        if not isinstance(extra, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(extra).__name__}")
        one_row = name in _BROADCAST_ROWS and tuple(extra.shape) == (1, seqlen)  # broadcast, as in transformers
        if tuple(extra.shape) != (batch, seqlen) and not one_row:
            also = f" (or {(1, seqlen)}, one row for every sequence)" if name in _BROADCAST_ROWS else ""
            raise ValueError(
                f"{name} must have the shape of input_ids {(batch, seqlen)}{also}, got {tuple(extra.shape)}"
            )
        if extra.device != input_ids.device:
            raise ValueError(f"{name} is on {extra.device} but input_ids is on {input_ids.device}")
    if attention_mask is not None and attention_mask.dtype.is_complex:
        raise ValueError("attention_mask must be 0/1 (bool, integer or float), got a complex tensor")

    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, input_ids, attention_mask, position_ids, max_seqlen)

    ranges = []
    if inputs_embeds is None:
        ranges.append(("input_ids", input_ids, vocab_size or config.vocab_size, "vocab_size"))
    if token_type_ids is not None:
        ranges.append(("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size"))
    if position_ids is not None:
        ranges.append(("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings"))
    if labels is not None:  # IGNORE_INDEX (nothing predicted) checks as 0
        ranges.append(("labels", labels.masked_fill(labels == IGNORE_INDEX, 0), config.vocab_size, "vocab_size"))
    if input_ids.numel() == 0 or not ranges:
        return
    for name, t, _, _ in ranges:
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if _tracing():  # values are symbolic, shapes checked above
        return
    # One host sync for every range check: [min, max] of each tensor.
    bounds = torch.stack([torch.stack([t.min(), t.max()]).long() for _, t, _, _ in ranges]).tolist()
    for (name, _, limit, field), (low, high) in zip(ranges, bounds):
        if low < 0 or high >= limit:
            ignored = f" (or {IGNORE_INDEX} where nothing is predicted)" if name == "labels" else ""
            raise ValueError(
                f"{name} holds values in [{low}, {high}] but must lie in [0, {limit}){ignored} "
                f"({field}={limit}); check that the tokenizer matches the model"
            )


_BROADCAST_ROWS = ("token_type_ids", "position_ids")  # inputs that may be one (1, seqlen) row for the batch


def _batch_rows(t, batch: int):
    """A (1, seqlen) row of _BROADCAST_ROWS expanded to the batch, as transformers' embeddings broadcast it."""
    return t.expand(batch, -1) if t is not None and t.shape[0] == 1 else t


def _check_inputs_embeds(config: RobertaConfig, inputs_embeds):
    if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.dtype.is_floating_point:
        raise ValueError("inputs_embeds must be a float tensor (batch, seqlen, hidden_size), got "
                         f"{getattr(inputs_embeds, 'dtype', type(inputs_embeds).__name__)}")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(f"inputs_embeds must have shape (batch, seqlen, hidden_size={config.hidden_size}), "
                         f"got {tuple(inputs_embeds.shape)}")


def key_padding_mask(attention_mask, batch: int, seqlen: int):
    """transformers' 4-D key-padding mask (batch or 1, 1, 1, seqlen) as the 2-D (batch, seqlen) bool
    mask, True = attend; a mask of fewer dimensions is returned as it is.

    The 4-D forms are those transformers' attention takes: additive float (0 = attend, a
    large negative number or -inf = masked, any float dtype; one host sync checks that) or
    bool (True = attend, as SDPA reads it). Masks that differ per query or per head, and
    integer 4-D masks (which transformers' eager attention would add to the scores), are refused.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return attention_mask
    shape = tuple(attention_mask.shape)
    if shape[1:] != (1, 1, seqlen) or shape[0] not in (1, batch):
        raise ValueError(
            f"a 4-D attention_mask must be transformers' key-padding form (batch, 1, 1, seqlen) = "
            f"{(batch, 1, 1, seqlen)}, got {shape}: masks that differ per query or per head are not "
            "supported; pass the 2-D (batch, seqlen) mask, 1 = attend")
    mask = attention_mask[:, 0, 0, :].expand(batch, seqlen)
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise ValueError(
            f"a 4-D attention_mask must be bool (True = attend) or additive float (0 = attend, a large "
            f"negative number or -inf = masked), got dtype {mask.dtype}; pass a 0/1 mask in the 2-D "
            "(batch, seqlen) form")
    keep = mask == 0
    if not _tracing() and bool((~keep & ~(mask <= -1e4)).any()):
        raise ValueError(
            "a 4-D float attention_mask must be additive: 0 where attended and a large negative number "
            "(<= -1e4, e.g. torch.finfo(dtype).min) or -inf where masked; this one holds other values, an "
            "attention bias roberta_fast does not compute. Pass the 2-D (batch, seqlen) mask, 1 = attend")
    return keep


def _check_cu_seqlens(cu_seqlens, input_ids, attention_mask, position_ids, max_seqlen=None):
    """Packed rows: int32 boundaries over the flattened batch·seqlen tokens, positions given, and
    max_seqlen (when given) no less than the longest segment: the variable-length attention
    kernel covers only max_seqlen tokens of each segment."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor of segment boundaries over the "
                         "flattened batch·seqlen tokens, e.g. [0, 7, 16, 32] for two rows of 16")
    if cu_seqlens.device != input_ids.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but input_ids is on {input_ids.device}")
    if attention_mask is not None:
        raise ValueError("pass either attention_mask or cu_seqlens: with packed rows the segments "
                         "say what attends to what (a padding tail is a segment of its own)")
    if position_ids is None:
        raise ValueError("packed rows need position_ids that restart at every document "
                         "(the dataset's packed batches carry them)")
    total, seqlen = input_ids.numel(), input_ids.shape[1]
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens needs at least two boundaries, 0 and batch·seqlen")
    if _tracing():  # the boundaries' values are symbolic
        return
    row_starts = torch.arange(0, total + 1, seqlen, device=cu_seqlens.device, dtype=torch.int32)
    steps = cu_seqlens.diff()
    first, last, smallest_step, longest, rows_kept = torch.stack([
        cu_seqlens[0], cu_seqlens[-1], steps.min(), steps.max(), torch.isin(row_starts, cu_seqlens).all().int()
    ]).tolist()
    if first != 0 or last != total or smallest_step < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to batch·seqlen = {total}; got first {first}, "
                         f"last {last}, smallest step {smallest_step}")
    if not rows_kept:
        raise ValueError(f"a cu_seqlens segment crosses a row boundary: every multiple of seqlen "
                         f"({seqlen}) must be a boundary (each row's documents stay in that row)")
    if max_seqlen is not None and int(max_seqlen) < longest:
        raise ValueError(f"max_seqlen={int(max_seqlen)} is less than the longest cu_seqlens segment "
                         f"({longest} tokens), so the fused attention would compute that segment wrongly; pass "
                         f"max_seqlen={longest} (the largest step of cu_seqlens), or None to have it computed")


# ------------------------------------------------------------------------ model
class RobertaEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: RobertaConfig):
        super().__init__()
        h, pad = config.hidden_size, config.pad_token_id
        self.padding_idx = pad
        self.word_embeddings = nn.Embedding(config.vocab_size, h, padding_idx=pad)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, padding_idx=pad)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)  # transformers' name (see RobertaLayer)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def create_position_ids(self, input_ids, inputs_embeds=None):
        """RoBERTa positions: pads get padding_idx, tokens padding_idx + 1, + 2, ... (fairseq).
        (Not `position_ids`: transformers' name for a buffer its RoBERTa never reads for these.)

        From inputs_embeds, where pads cannot be told apart, every position counts, as in
        transformers' create_position_ids_from_inputs_embeds."""
        if input_ids is None:
            batch, seqlen = inputs_embeds.shape[:2]
            start = self.padding_idx + 1
            return torch.arange(start, start + seqlen, device=inputs_embeds.device).expand(batch, seqlen)
        not_pad = input_ids.ne(self.padding_idx).int()
        return (torch.cumsum(not_pad, dim=1).int() * not_pad).long() + self.padding_idx

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, backend="reference"):
        if position_ids is None:
            position_ids = self.create_position_ids(input_ids, inputs_embeds)
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        x = words + self.position_embeddings(position_ids)
        types = self.token_type_embeddings
        if token_type_ids is None and type(types) is nn.Embedding and not _has_hooks(types):
            x = x + types.weight[0]
        else:  # another or a hooked embedding is called (on type 0 everywhere when not given), as transformers does
            if token_type_ids is None:
                token_type_ids = words.new_zeros(words.shape[:-1], dtype=torch.long)
            x = x + self.token_type_embeddings(token_type_ids)
        x = _add_norm(self.LayerNorm, x, None, 0.0, backend)
        return _dropout(self.dropout, x)


def _dropout_p(dropout: nn.Module) -> float | None:
    """The probability `dropout` applies now, for the fused ops that take it as a number: an nn.Dropout's p
    in training mode, else 0 (an nn.Identity: 0). None for any other module, or one with hooks:
    the caller calls it as a module. The modules are transformers' (p set on them, MC dropout's .train()
    on them alone, a replacement all take effect), the fused kernels still get a float."""
    if _has_hooks(dropout):
        return None
    if type(dropout) is nn.Dropout:
        return dropout.p if dropout.training else 0.0
    return 0.0 if type(dropout) is nn.Identity else None


def _dropout(dropout: nn.Module, x):
    """dropout(x) as the module applies it (F.dropout, as nn.Dropout calls it, and no call when it is off)."""
    p = _dropout_p(dropout)
    return dropout(x) if p is None else F.dropout(x, p=p, training=p > 0)


def _attention_dropout_p(dropout: nn.Module, training: bool) -> float:
    """The attention probabilities' dropout, applied inside the attention kernels: an nn.Dropout's p while
    the layer is `training` (its flag, not the Dropout's, as transformers' self-attention reads it), 0
    for an nn.Identity; a module of another kind, or hooked, is refused rather than silently not called
    (global hooks are not this module's: they are left uncalled)."""
    if (dropout._forward_hooks or dropout._forward_pre_hooks or "forward" in dropout.__dict__
            or type(dropout) not in (nn.Dropout, nn.Identity)):
        raise ValueError(f"an encoder layer's attention_dropout is {type(dropout).__name__}"
                         f"{' with forward hooks' if type(dropout) is nn.Dropout else ''}: the attention kernels "
                         "apply the attention probabilities' dropout themselves, from an nn.Dropout's p; set its p "
                         "(0 turns it off) or call .eval() on it instead")
    return dropout.p if type(dropout) is nn.Dropout and training else 0.0


def _linear_gelu(linear: nn.Module, x, backend: str):
    """erf GELU(linear(x)), the bias add fused into the GELU for a plain nn.Linear, the GELU fused
    into the matmul for rf.prepack's and rf.quantize's packed layers (their forward_gelu); any other
    module (a PEFT LoRA layer, which keeps the base weight as .weight), or one with forward hooks
    (a calibration observer sees the Linear's output, before GELU), is called as a module."""
    if _has_hooks(linear):
        return F.gelu(linear(x))
    if type(linear) is nn.Linear:
        return ops.linear_gelu(x, linear.weight, linear.bias, backend)
    if hasattr(linear, "forward_gelu"):
        return linear.forward_gelu(x)
    return F.gelu(linear(x))


def _plain_norm(norm: nn.Module) -> bool:
    """Whether `norm` is exactly an nn.LayerNorm with weight and bias, unhooked: the fused ops compute it."""
    return type(norm) is nn.LayerNorm and norm.weight is not None and norm.bias is not None and not _has_hooks(norm)


def _add_norm(norm: nn.Module, x, residual, dropout_p: float, backend: str, cast_dtype=None):
    """ops.dropout_add_layer_norm with `norm`'s parameters. Any other norm is called as a module on
    dropout(x) + residual, as transformers calls it: one with forward (pre-)hooks (they fire, a hook's
    returned output is used), a replacement (an RMSNorm, a subclass with its own forward) or a LayerNorm
    without weight or bias (cast_dtype: the copy the next matmul reads, cast from that output)."""
    if _plain_norm(norm):
        return ops.dropout_add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps, dropout_p, backend,
                                          cast_dtype)
    if dropout_p > 0:
        x = F.dropout(x, p=dropout_p)
    y = norm(x if residual is None else x + residual)
    return y if cast_dtype is None else (y, y.to(cast_dtype))


def _inference_spec(linear: nn.Module, tokens: int) -> tuple | None:
    """What the C++ inference layer runs for `linear` on `tokens` rows: a packed layer's kernel
    (rf.quantize, rf.prepack: its inference_spec), F.linear for a plain nn.Linear, None for
    anything else (an adapter layer runs its own forward)."""
    if type(linear) is nn.Linear:
        return ("linear", linear.weight, linear.bias)
    return linear.inference_spec(tokens) if hasattr(linear, "inference_spec") else None


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would call hooks: forward (pre-)hooks or (full) backward hooks, its own or
    the global ones (nn.modules.module.register_module_forward_hook, ...), or a forward set on the instance
    (accelerate's hooks, a patch); where it would, the model calls it as a module, with the inputs and
    outputs transformers' would have."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or any(_GLOBAL_HOOKS)
                or ("forward" in module.__dict__ and not hasattr(module, "_orig_mod")))  # (torch.compile's own)


@contextlib.contextmanager
def _weight_outside_forward(module: nn.Module):
    """module.weight, read outside module's forward (the MLM decoder reads the word embeddings').
    Where accelerate's offloading (cpu_offload, disk_offload) keeps it on the meta device between
    calls, the module's own hook brings it in for the block and takes it out after, as around the
    module's forward (transformers' tied decoder is a module with its own hook)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None or not module.weight.is_meta:
        yield module.weight
        return
    hook.pre_forward(module)
    try:
        yield module.weight
    finally:
        hook.post_forward(module, None)


_GLOBAL_HOOKS = tuple(getattr(nn.modules.module, name, {})  # torch's dicts, mutated in place
                      for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                                   "_global_backward_pre_hooks"))


class RobertaLayer(nn.Module):
    """One post-LN encoder layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)).

    Names: the Linear layers are the fused layout's (qkv, attn_out, ffn_in, ffn_out: PEFT's LoRA
    targets); the norms carry transformers' `LayerNorm`, so that parameter groups written for
    transformers' names (weight decay off for `["bias", "LayerNorm.weight"]`, or for
    `"layer_norm.weight"`: the MLM head's only) pick the same parameters here.

    In fp32 CPU inference (plain, rf.prepack or rf.quantize) the layer runs as one C++ op
    (csrc/inference_layer.cpp): the same ops as the Python path below, bit for bit, without the
    Python between them (on a short int8 request, up to a fifth of its time; docs/inference.md).
    """

    cpu_inference_layer = True  # False: always the Python path (the C++ layer's reference: tests, profiling)

    def __init__(self, config: RobertaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)  # rows: [query; key; value]
        self.attn_out = nn.Linear(h, h)
        self.attn_LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(h, i)
        self.ffn_out = nn.Linear(i, h)
        self.ffn_LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.attention_dropout = nn.Dropout(config.attention_probs_dropout_prob)  # of the attention probabilities
        self.hidden_dropout = nn.Dropout(config.hidden_dropout_prob)  # of each sublayer's output, before add + norm

    def forward(self, x, attention_mask=None, backend="reference", packed=None, output_attentions=False,
                x_cast=None, cast_dtype=None, hooked=False):
        """x: (batch, seqlen, hidden), or (total_tokens, hidden) when `packed` = (cu_seqlens, max_seqlen,
        min_seqlen) (_Packing.attention_args).

        Under autocast the residual stream x stays fp32 (as HF's) and each matmul reads a
        half copy. x_cast: that copy of x, written by the previous fused LayerNorm, read by
        the QKV projection instead of autocast casting x again; cast_dtype: have the last
        LayerNorm write such a copy of the output too (ops.autocast_copy_dtype).
        Returns (x, x's copy in cast_dtype or None, attention probabilities or None); hooked=True
        (the layer has hooks) returns x alone, as transformers' layer does, so that a hook sees
        and may replace the tensor it would there (the probabilities then in self.attention_probs).
        """
        if hooked:
            x, _, self.attention_probs = self._run(x, attention_mask, backend, packed, output_attentions)
            return x
        return self._run(x, attention_mask, backend, packed, output_attentions, x_cast, cast_dtype)

    def _run(self, x, attention_mask, backend, packed, output_attentions, x_cast=None, cast_dtype=None):
        """forward's computation: (x, x_cast, probs)."""
        specs = self._inference_specs(x, backend, output_attentions, x_cast, cast_dtype)
        if specs is not None:
            mask, cu_seqlens = (attention_mask, None) if packed is None else (None, packed[0])
            norms = [self.attn_LayerNorm.weight, self.attn_LayerNorm.bias,
                     self.ffn_LayerNorm.weight, self.ffn_LayerNorm.bias]
            x = _ext.optional("inference_layer")(x, specs, norms, self.attn_LayerNorm.eps, self.ffn_LayerNorm.eps,
                                                 self.num_heads, mask, cu_seqlens)
            return x, None, None

        hidden = x.shape[-1]
        hidden_p = _dropout_p(self.hidden_dropout)  # None: a module to call on each sublayer's output
        attention_p = _attention_dropout_p(self.attention_dropout, self.training)

        qkv = self.qkv(x if x_cast is None else x_cast)
        # (batch, seqlen, 3, heads, head_dim), or (tokens, 3, heads, head_dim) when packed
        qkv = qkv.view(*x.shape[:-1], 3, self.num_heads, hidden // self.num_heads)
        probs = None
        if packed is not None:
            cu_seqlens, max_seqlen, min_seqlen = packed
            a = ops.attention_varlen(qkv, cu_seqlens, max_seqlen, attention_p, backend, min_seqlen)
        elif output_attentions:
            a, probs = ops.attention_with_probs(qkv, attention_mask, attention_p)
        else:
            a = ops.attention(qkv, attention_mask, attention_p, backend)
        a = self.attn_out(a.reshape(*x.shape[:-1], hidden))
        if hidden_p is None:
            a = self.hidden_dropout(a)
        ffn_cast_dtype = ops.autocast_copy_dtype(x, backend)
        out = _add_norm(self.attn_LayerNorm, a, x, hidden_p or 0.0, backend, ffn_cast_dtype)
        x, x_ffn = out if ffn_cast_dtype is not None else (out, out)

        f = _linear_gelu(self.ffn_in, x_ffn, backend)
        f = self.ffn_out(f)
        if hidden_p is None:
            f = self.hidden_dropout(f)
        out = _add_norm(self.ffn_LayerNorm, f, x, hidden_p or 0.0, backend, cast_dtype)
        x, x_cast = out if cast_dtype is not None else (out, None)
        return x, x_cast, probs

    def _inference_specs(self, x, backend: str, output_attentions: bool, x_cast, cast_dtype) -> list | None:
        """The four Linear layers' kernel specs when this call can run as the C++ inference layer:
        CPU inference in fp32 (plain or packed Linear layers) under torch.no_grad or inference_mode,
        no autocast, nothing exported, traced or compiled, no hook to call, no attention
        probabilities asked for, the extension built with the op; else None, and the Python path
        runs (the same ops, or its clear errors; autograd records only there)."""
        if (not self.cpu_inference_layer or self.training or backend != "reference" or output_attentions
                or x_cast is not None or cast_dtype is not None or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or _tracing()
                or ops.exporting() or _ext.optional("inference_layer") is None):
            return None
        linears = (self.qkv, self.attn_out, self.ffn_in, self.ffn_out)
        norms = (self.attn_LayerNorm, self.ffn_LayerNorm)
        if any(map(_has_hooks, linears)) or not all(map(_plain_norm, norms)):
            return None  # the C++ op calls no module
        _attention_dropout_p(self.attention_dropout, False)  # refuses what the Python path refuses (0 here)
        if _dropout_p(self.hidden_dropout) != 0.0:
            return None  # dropout in an eval-mode model (Monte Carlo dropout: .train() on the Dropout modules)
        tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0  # (..., hidden) -> rows
        specs = [_inference_spec(linear, tokens) for linear in linears]
        return None if None in specs else specs  # None: an adapter, or a packed layer in training


# transformers' forward inputs that only a decoder reads (transformers 5 names the cache `cache`)
_DECODER_INPUTS = ("past_key_values", "cache", "encoder_hidden_states", "encoder_attention_mask")


class RobertaEncoder(nn.Module):
    """The layer stack, at transformers' path (`encoder.layer[i]`, parameters `encoder.layer.{i}.…`),
    so that code freezing or grouping layers by that path selects the same layers here."""

    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.layer = nn.ModuleList(RobertaLayer(config) for _ in range(config.num_hidden_layers))


class RobertaPooler(nn.Module):
    """tanh(dense(the first token's hidden state)), transformers' module (a hook on it sees the same
    (batch, seqlen, hidden) input and (batch, hidden) output)."""

    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


# The encoder's native names before they took transformers' paths and norm names: state dicts of older
# training checkpoints and of transformers.Trainer's save_model load under the current names.
_LEGACY_KEYS = ((re.compile(r"layers\.(\d+)\.attn_norm\."), r"encoder.layer.\1.attn_LayerNorm."),
                (re.compile(r"layers\.(\d+)\.ffn_norm\."), r"encoder.layer.\1.ffn_LayerNorm."),
                (re.compile(r"layers\.(\d+)\."), r"encoder.layer.\1."),
                (re.compile(r"embeddings\.layer_norm\."), "embeddings.LayerNorm."),
                (re.compile(r"pooler\.(weight|bias)$"), r"pooler.dense.\1"))


# A key only transformers' RobertaModel has: its separate query/key/value and sublayer modules, or a buffer.
_TRANSFORMERS_KEY = re.compile(r"encoder\.layer\.\d+\.(attention\.|intermediate\.|output\.)"
                               r"|embeddings\.(position_ids|token_type_ids)$")


def _load_other_names(state_dict, prefix, *_):
    """load_state_dict pre-hook of RobertaModel: its keys under the older native names, or under
    transformers' (model.load_state_dict(torch.load("pytorch_model.bin")), as transformers users load
    one: query, key and value fused into qkv, its buffers dropped, by hf.hf_to_native) are renamed to the
    current ones. A key of neither kind is left for load_state_dict to report."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        for old, new in _LEGACY_KEYS:
            if old.match(rest):
                state_dict[prefix + old.sub(new, rest, count=1)] = state_dict.pop(key)
                break
    ours = {key[len(prefix):]: key for key in state_dict if key.startswith(prefix)}
    if any(_TRANSFORMERS_KEY.match(rest) for rest in ours):
        from .hf import hf_to_native

        theirs = {rest: state_dict.pop(key) for rest, key in ours.items()}
        native, unknown = hf_to_native(theirs)
        state_dict.update({prefix + rest: value for rest, value in (*native.items(),
                                                                   *((k, theirs[k]) for k in unknown))})


def _load_transformers_decoder(state_dict, prefix, *_):
    """load_state_dict pre-hook of RobertaForMaskedLM: transformers' MLM head also holds the tied decoder
    (lm_head.decoder.weight, the word embeddings; lm_head.decoder.bias, the head's bias). An untied one is
    refused: this head always reads the word embeddings."""
    head = prefix + "lm_head."
    weight, bias = state_dict.pop(head + "decoder.weight", None), state_dict.pop(head + "decoder.bias", None)
    words = state_dict.get(prefix + "roberta.embeddings.word_embeddings.weight")
    if weight is not None and words is not None and not torch.equal(weight, words):
        raise ValueError(untied_decoder_error("the state dict has"))
    if bias is not None:
        state_dict.setdefault(head + "bias", bias)


class _PreTrained(nn.Module):
    """Weight init (as HF's), backend choice, input checks, HF load/save and the model methods
    transformers users call (embeddings, resizing, num_parameters, gradient checkpointing),
    shared by the six drop-in classes (and SpanBERT's)."""

    config: RobertaConfig
    base_model_prefix = "roberta"  # transformers' name of the encoder inside a head model
    _keep_in_fp32_modules, _keep_in_fp32_modules_strict = [], []  # transformers' hooks: nothing kept in fp32
    _keys_to_ignore_on_load_missing = None
    # transformers.Trainer reads this (else a **kwargs forward) as "the loss takes num_items_in_batch and is
    # already normalised for gradient accumulation": ours is a mean per call, so the Trainer must divide it
    accepts_loss_kwargs = False
    main_input_name = "input_ids"
    # accelerate's device maps (infer_auto_device_map, dispatch_model) keep each of these on one device
    _no_split_modules = ["RobertaEmbeddings", "RobertaLayer"]
    supports_gradient_checkpointing = True
    _vocab_bias_heads = ("lm_head",)  # heads whose bias has one entry per token (resized with the vocabulary)

    _ENCODE_ARGS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "output_hidden_states",
                    "output_attentions", "cu_seqlens", "max_seqlen", "inputs_embeds", "padded")

    def _encoded(self, *args, **kwargs) -> BaseModelOutput:
        """A head's encoder outputs: self.roberta.encode(*args, **kwargs) on inputs the head has checked, or
        the call transformers' heads make, self.roberta(...), where code written for them expects it: forward
        hooks on model.roberta, a wrapper (torch.compile(model.roberta)), a replaced forward."""
        encoder = self.roberta
        if type(encoder) is RobertaModel and not _has_hooks(encoder):
            return encoder.encode(*args, **kwargs)
        call = {**dict(zip(self._ENCODE_ARGS, args)), **kwargs}
        for internal in ("cu_seqlens", "max_seqlen", "padded"):  # roberta_fast's own: passed only when set
            if not call.get(internal):
                call.pop(internal, None)
        return encoder(call.pop("input_ids"), **call, return_dict=True)  # input_ids positional, as transformers

    def _setup(self, config: RobertaConfig, backend: str) -> RobertaConfig:
        """Keep the config (a transformers RobertaConfig is read through its to_dict) and the backend;
        returns the RobertaConfig the model is built from."""
        # transformers' attribute (PEFT writes it as the adapter's base model): from_pretrained's path or Hub name
        self.name_or_path = str(getattr(config, "name_or_path", "") or "")
        if not isinstance(config, RobertaConfig) and hasattr(config, "to_dict"):
            config = RobertaConfig.from_dict(config.to_dict())
        decoder = decoder_error(config.extra, "the config")  # (also set in `extra` after the config was made)
        if decoder:
            raise ValueError(decoder)
        self.config = config
        self.backend = backend
        self.check_inputs = True
        return config

    @property
    def backend(self) -> str:
        """"auto" | "fused" | "reference"; setting it sets every submodel's too."""
        return self._backend

    @backend.setter
    def backend(self, value: str):
        value = ops.check_backend(value)
        for module in self.modules():
            if isinstance(module, _PreTrained):
                object.__setattr__(module, "_backend", value)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def _backend_for(self, tensor) -> str:
        """The backend for `tensor`'s device and the model's dtype (a float64 model runs the reference
        ops, ops.resolve_backend); torch.export and torch.jit.trace trace the reference one (plain aten
        ops, which ONNX and any device take; the fused path's unpadding syncs on data)."""
        if ops.exporting() or torch.jit.is_tracing():
            return "reference"
        return ops.resolve_backend(self.backend, tensor.device, self.dtype)

    def _result(self, out: ModelOutput, return_dict: bool | None):
        """`out`, or its to_tuple() when return_dict (else the config's) is False, and under
        torch.jit.trace (which takes tuples, not objects; the ONNX TorchScript exporter traces too)."""
        if return_dict is None:
            return_dict = self.config.return_dict
        return out if return_dict and not torch.jit.is_tracing() else out.to_tuple()

    def _decoder_inputs(self, kwargs: dict):
        """forward's other keywords: transformers' decoder inputs. use_cache is ignored, as transformers'
        encoder ignores it; a cache or encoder states (cross-attention), which only a decoder reads, are
        refused when given; any other keyword is a TypeError, as for any function."""
        others = {k: v for k, v in kwargs.items() if k != "use_cache"}
        given = [k for k in _DECODER_INPUTS if others.pop(k, None) is not None]
        if given:
            raise ValueError(f"{type(self).__name__} got {', '.join(given)}: a decoder's inputs (a cache, or "
                             "cross-attention to an encoder's states); roberta_fast computes only RoBERTa's "
                             "bidirectional encoder, which takes none of them")
        if others:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword arguments {sorted(others)}")

    def _checked_mask(self, input_ids, inputs_embeds, attention_mask, token_type_ids=None, position_ids=None,
                      cu_seqlens=None, labels=None, max_seqlen=None):
        """The attention mask in its 2-D form (a 4-D key-padding mask reduced), once the inputs are
        checked (when `check_inputs` is on)."""
        shaped = input_ids if input_ids is not None else inputs_embeds
        if isinstance(shaped, torch.Tensor) and shaped.dim() >= 2:
            attention_mask = key_padding_mask(attention_mask, *shaped.shape[:2])
        if self.check_inputs:
            # the table the ids index (none to read behind a user's wrapper of model.roberta: the config's)
            words = getattr(getattr(getattr(self.base_model, "embeddings", None), "word_embeddings", None),
                            "num_embeddings", None)
            check_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens, labels,
                         inputs_embeds, max_seqlen, vocab_size=words)
        return attention_mask

    # ------------------------------------------------- transformers' model methods
    @property
    def base_model(self) -> "RobertaModel":
        """The encoder: `self.roberta` in a head model, the model itself for RobertaModel."""
        return getattr(self, self.base_model_prefix, self)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter, as transformers reports it."""
        return next(p.dtype for p in self.parameters() if p.dtype.is_floating_point)

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """Bytes of the model's weights, as transformers counts them: its parameters (and buffers). The
        Linear layers rf.prepack or rf.quantize packed (and the MLM decoder's packed copy), whose weights
        are no parameters, count their state's tensors (fp32, int8 or fp16 weights, scales, bias); the
        kernel library's own layout may pad them, and engine="auto" holds two layouts."""
        from .prepacked import TiedDecoder, _InferenceLinear

        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if return_buffers:
            total += sum(b.numel() * b.element_size() for b in self.buffers())
        for module in self.modules():
            packed = module.layer if isinstance(module, TiedDecoder) else module
            if isinstance(packed, _InferenceLinear):
                total += sum(math.prod(shape) * dtype.itemsize for shape, dtype in packed._expected_state().values())
        return total

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (the tied decoder is the word embeddings); exclude_embeddings
        leaves out the nn.Embedding tables, as transformers does. The Linear layers that rf.prepack
        and rf.quantize hold packed count as the parameters they replaced (frozen: not trainable)."""
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        packed = sum(m.replaced_numel() for m in self.modules() if hasattr(m, "replaced_numel"))
        return (0 if only_trainable else packed) + sum(
            p.numel() for p in self.parameters()
            if (p.requires_grad or not only_trainable) and not (exclude_embeddings and id(p) in embeddings))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.base_model.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding):
        """Replace the word embeddings; the MLM decoder reads them, so it stays tied, and its bias
        follows their size (kept entries, zeros added), as transformers' re-tied bias."""
        self.base_model.embeddings.word_embeddings = value
        for name in self._vocab_bias_heads:
            head = getattr(self, name, None)
            if head is not None and head.bias.shape[0] != value.num_embeddings:  # (vocab,) -> (new vocab,)
                with torch.no_grad():
                    bias = F.pad(head.bias.detach()[:value.num_embeddings],
                                 (0, max(value.num_embeddings - head.bias.shape[0], 0)))
                head.bias = nn.Parameter(bias, requires_grad=head.bias.requires_grad)
        packed = getattr(getattr(self, "lm_head", None), "packed_decoder", None)
        if packed is not None:  # rf.prepack's / rf.quantize's copy of the decoder, now of this table
            packed.rebuild(value.weight, self.lm_head.bias)

    def get_output_embeddings(self) -> nn.Linear | None:
        """The MLM decoder as transformers exposes it: a Linear whose weight IS the word embeddings'
        parameter and whose bias is the head's (not a copy: changing either changes the model; on a
        prepacked or quantized model, `.data` writes are seen only after rf.prepack / rf.quantize
        again, docs/inference.md); None for models without an MLM head. The same object every call while
        those two are the head's tensors, so a hook registered on it fires in forward, as transformers'."""
        head = getattr(self, "lm_head", None)
        if head is None:
            return None
        weight = self.get_input_embeddings().weight
        decoder = head.__dict__.get("decoder_view")
        if decoder is None or decoder.weight is not weight or decoder.bias is not head.bias:
            decoder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            decoder.weight, decoder.bias = weight, head.bias
            head.__dict__["decoder_view"] = decoder  # not a submodule: its tensors are the embeddings' and the head's
        return decoder

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        """transformers' setter of the MLM decoder. Here the decoder is always the word embeddings: a
        Linear whose weight is that table's parameter is taken (its bias becomes the head's), another
        is refused, as it would be a decoder of its own (set_input_embeddings changes both)."""
        head = getattr(self, "lm_head", None)
        if head is None:
            raise ValueError(f"{type(self).__name__} has no MLM decoder to set")
        if getattr(new_embeddings, "weight", None) is not self.get_input_embeddings().weight:
            raise ValueError(untied_decoder_error("set_output_embeddings would give the model"))
        if getattr(new_embeddings, "bias", None) is not None:
            head.bias = new_embeddings.bias

    def tie_weights(self, *args, **kwargs):
        """Nothing to do: the decoder reads the word embeddings, so it is tied by construction."""

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """Grow or shrink the vocabulary as transformers does: old rows kept, new rows drawn around the
        old embeddings' mean (mean_resizing, transformers' default: a normal with 1e-9 times their
        covariance) or from N(0, initializer_range); the decoder bias kept, new entries 0 (as transformers'
        re-tied bias).
        The decoder stays tied (it reads the embeddings); config.vocab_size follows."""
        old = self.get_input_embeddings()
        if pad_to_multiple_of is not None:
            wanted = old.num_embeddings if new_num_tokens is None else new_num_tokens
            new_num_tokens = -(-wanted // pad_to_multiple_of) * pad_to_multiple_of
        if new_num_tokens is None or new_num_tokens == old.num_embeddings:
            return old
        if new_num_tokens <= max(self.config.pad_token_id, self.config.bos_token_id or 0, self.config.eos_token_id or 0):
            raise ValueError(f"resize_token_embeddings({new_num_tokens}) would drop the special tokens' ids "
                             f"(pad {self.config.pad_token_id}, bos {self.config.bos_token_id}, eos "
                             f"{self.config.eos_token_id}); keep at least {self.config.pad_token_id + 1} tokens")
        kept, added = min(old.num_embeddings, new_num_tokens), new_num_tokens - old.num_embeddings
        new = nn.Embedding(new_num_tokens, old.embedding_dim, padding_idx=old.padding_idx,
                           device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight[:kept] = old.weight[:kept]
            if added > 0:
                new.weight[kept:] = _added_embeddings(old.weight, added, mean_resizing, self.config.initializer_range)
        new.weight.requires_grad_(old.weight.requires_grad)
        self.set_input_embeddings(new)  # resizes the decoder bias too
        self.config.vocab_size = new_num_tokens
        return new

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      activation_checkpointing_kwargs: dict | None = None,
                                      every_n_layers: int = 1, offload: bool = False):
        """Recompute encoder layers' activations in the backward pass instead of storing them:
        the same gradients (dropout replays the same RNG state), less activation memory.
        torch.utils.checkpoint with use_reentrant=False unless the kwargs (either name) say. As
        transformers 5: every_n_layers=n checkpoints layers 0, n, 2n, ... only; offload=True keeps
        the inputs saved for the recompute in host memory (torch.autograd.graph.save_on_cpu)."""
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive integer, got {every_n_layers!r}")
        kwargs = gradient_checkpointing_kwargs or activation_checkpointing_kwargs or {}
        self.base_model.checkpointing = {"use_reentrant": False, **kwargs}
        self.base_model.checkpoint_every, self.base_model.checkpoint_offload = every_n_layers, bool(offload)

    def gradient_checkpointing_disable(self):
        self.base_model.checkpointing = None

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.base_model.checkpointing is not None

    # transformers 5's names for the same
    activation_checkpointing_enable = gradient_checkpointing_enable
    activation_checkpointing_disable = gradient_checkpointing_disable
    is_activation_checkpointing = is_gradient_checkpointing

    def enable_input_require_grads(self):
        """Make the word embeddings' output require grad (PEFT calls it for gradient checkpointing
        on a frozen model, so the checkpointed layers still get a graph)."""
        self._input_grads_hook = self.get_input_embeddings().register_forward_hook(
            lambda module, inputs, output: output.requires_grad_(True))

    def disable_input_require_grads(self):
        self._input_grads_hook.remove()

    def init_weights(self):
        """(Re-)initialise every weight as transformers does (normal(0, initializer_range), zero
        biases, unit LayerNorms, zero pad rows)."""
        self.apply(self._init_weights)

    def post_init(self):
        """Nothing to do: __init__ has initialised every weight, and the decoder is tied by construction
        (transformers' post_init likewise leaves initialised weights as they are)."""

    @classmethod
    def can_generate(cls) -> bool:
        """An encoder: no generate()."""
        return False

    @classmethod
    def _from_config(cls, config, attn_implementation: str | None = None, **kwargs):
        """transformers' constructor from a config. There is one attention implementation here (fused or
        reference by `backend`, each the same function as transformers' eager / SDPA), so
        attn_implementation picks nothing; output_attentions works with any."""
        error = attn_implementation_error(attn_implementation, f"_from_config(attn_implementation={attn_implementation!r})")
        if error:
            raise ValueError(error)
        return cls(config, **kwargs)

    # transformers' PreTrainedModel members that code around a model reads or calls
    config_class = RobertaConfig
    model_tags: list[str] | None = None  # added to the model card by push_to_hub

    def set_attn_implementation(self, attn_implementation: str | dict):
        """transformers' switch: "eager" and "sdpa" (or {"": either}) are accepted and change nothing (this
        model computes their function with its own kernels); other implementations are refused."""
        name = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
        error = attn_implementation_error(name, f"set_attn_implementation({attn_implementation!r})")
        if error:
            raise ValueError(error)

    def get_encoder(self, modality: str | None = None) -> nn.Module:
        """transformers' lookup of the encoder module: model.roberta.encoder (its layers)."""
        if modality is not None:
            raise ValueError(f"get_encoder(modality={modality!r}): RoBERTa has a text encoder only")
        return self.base_model.encoder

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for the model card push_to_hub writes (transformers.Trainer adds its own); kept once each."""
        self.model_tags = list(self.model_tags or [])
        for tag in [tags] if isinstance(tags, str) else tags:
            if tag not in self.model_tags:
                self.model_tags.append(tag)

    @property
    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        """transformers' example batch for tracing tools."""
        return {"input_ids": torch.tensor([[7, 6, 0, 0, 1], [1, 2, 3, 0, 0], [0, 0, 0, 4, 5]])}

    def get_parameter_or_buffer(self, target: str) -> torch.Tensor:
        """The parameter or buffer at dotted path `target`."""
        try:
            return self.get_parameter(target)
        except AttributeError:
            return self.get_buffer(target)

    @classmethod
    def from_pretrained(cls, path_or_model, backend: str = "auto", **kwargs):
        """Load an HF model directory (config.json + safetensors/bin) or a `transformers` model."""
        from .hf import load_pretrained

        return load_pretrained(cls, path_or_model, backend=backend, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        state_dict: dict | None = None, max_shard_size: int | str = "50GB",
                        safe_serialization: bool = True, push_to_hub: bool = False, variant: str | None = None,
                        save_original_format: bool = True, **kwargs):
        """Write config.json + model.safetensors that `transformers` loads with no missing keys.

        transformers' arguments: is_main_process=False writes nothing (the other ranks of a
        distributed run); state_dict (this model's names) is saved instead of the model's own;
        past max_shard_size the weights are sharded with transformers' index (hf.save_pretrained).
        Only safetensors in transformers' names are written, and nothing is pushed to the Hub:
        the arguments asking otherwise are refused. Hub-only ones (token, commit_message),
        save_peft_format (a PEFT model's) and save_function (accelerate's save, as transformers 5
        ignores it: the files are safetensors) change nothing here."""
        refused = {"safe_serialization=False": not safe_serialization, "push_to_hub=True": push_to_hub,
                   f"variant={variant!r}": variant is not None,
                   "save_original_format=False": not save_original_format,
                   "distributed_checkpoint=True": kwargs.pop("distributed_checkpoint", False)}
        for name in ("token", "commit_message", "save_peft_format", "save_function"):
            kwargs.pop(name, None)
        if kwargs:
            raise TypeError(f"save_pretrained got unexpected keyword arguments {sorted(kwargs)}")
        asked = [name for name, on in refused.items() if on]
        if asked:
            raise ValueError(f"save_pretrained({', '.join(asked)}) is not supported: roberta_fast writes "
                             "model.safetensors (sharded past max_shard_size) in transformers' names, locally; "
                             "push with model.push_to_hub(repo_id)")
        if is_main_process:
            self._write_pretrained(save_directory, state_dict, max_shard_size)

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                    private: bool | None = None, token: bool | str | None = None, revision: str | None = None,
                    create_pr: bool = False, max_shard_size: int | str | None = "50GB", tags: list[str] | str | None = None):
        """Upload save_pretrained's files (what transformers loads) and the model card, with `tags`
        added, to the Hub repository `repo_id`, created if missing, as transformers' push_to_hub;
        returns the commit."""
        import tempfile

        from huggingface_hub import HfApi

        from .hub import model_card

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        card = model_card(repo_id, [*(self.model_tags or []), *([tags] if isinstance(tags, str) else tags or [])], token)
        if revision and not revision.startswith("refs/pr"):  # upload_folder needs the branch (transformers makes it too)
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with tempfile.TemporaryDirectory() as directory:
            self.save_pretrained(directory, max_shard_size=max_shard_size or "50GB")
            card.save(os.path.join(directory, "README.md"))
            return api.upload_folder(repo_id=repo_id, folder_path=directory, revision=revision, create_pr=create_pr,
                                     commit_message=commit_message or "Upload model",
                                     commit_description=commit_description)

    def _write_pretrained(self, directory, state_dict: dict | None, max_shard_size: int | str):
        """save_pretrained's writing, once its arguments are checked (a model with extra files extends it)."""
        from .hf import save_pretrained

        save_pretrained(self, directory, state_dict=state_dict, max_shard_size=max_shard_size)


class RobertaModel(_PreTrained):
    """The encoder, with Hugging Face `RobertaModel`'s call signature and outputs."""

    def __init__(self, config: RobertaConfig, add_pooling_layer: bool = True, backend: str = "auto"):
        super().__init__()
        config = self._setup(config, backend)
        self.embeddings = RobertaEmbeddings(config)
        self.encoder = RobertaEncoder(config)
        self._register_load_state_dict_pre_hook(_load_other_names)
        self.pooler = RobertaPooler(config) if add_pooling_layer else None
        self.unpad = True
        self.cpu_group_tokens = CPU_GROUP_TOKENS  # None: CPU inference runs each batch whole
        # torch.utils.checkpoint's kwargs while gradient checkpointing is on (transformers' config flag too)
        self.checkpointing = {"use_reentrant": False} if config.extra.get("gradient_checkpointing") else None
        self.checkpoint_every, self.checkpoint_offload = 1, False  # gradient_checkpointing_enable's options
        self.apply(self._init_weights)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None, cu_seqlens=None, max_seqlen: int | None = None,
                padded: bool = False, **kwargs):
        """transformers' RobertaModel call (padded: encode's, when a head calls it as a module)."""
        self._decoder_inputs(kwargs)
        attention_mask = self._checked_mask(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids,
                                            cu_seqlens, max_seqlen=max_seqlen)
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids,
                          output_hidden_states, output_attentions, cu_seqlens, max_seqlen, inputs_embeds, padded)
        return self._result(out, return_dict)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
               output_hidden_states: bool | None = None, output_attentions: bool | None = None,
               cu_seqlens=None, max_seqlen: int | None = None, inputs_embeds=None,
               padded: bool = False) -> BaseModelOutput:
        """forward() without the input checks (for callers that have done them).

        inputs_embeds (batch, seqlen, hidden) stands in for the word embeddings of
        input_ids, as in transformers (positions then count every token, pads included).

        With the fused backend, and on the CPU under torch.no_grad / torch.inference_mode
        (ops.unpad_impl decides), a padded batch runs unpadded: masked tokens are dropped
        once before the embeddings, the layers run on the packed tokens with
        variable-length attention, and the outputs are re-padded with zeros at masked
        positions (set `model.unpad = False` to compute those positions as HF does). A batch
        with a row whose first token is masked (left padding) runs padded: the pooler and
        the classification head read position 0, which HF computes from the pad token.
        padded=True runs the batch padded too (a head with labels at masked positions), and so does
        a batch when a module of the encoder has forward hooks (whole, not in row groups): each
        hook then sees the (batch, seqlen, ...) tensors transformers' would.

        Packed rows (several documents per row, DOC-SENTENCES packing): `cu_seqlens`
        (int32, flash-attention's convention over the batch·seqlen flattened tokens)
        keeps attention inside each segment, and `position_ids` restart per document.

        On the CPU without gradients (ops.unpad_impl's "sdpa" case) a batch of more than
        `model.cpu_group_tokens` tokens (None: no limit) runs as consecutive groups of rows of at
        most that many (a longer row alone), their outputs concatenated. Rows are independent,
        so this is the same function (an int8 model quantizes each group's activations on their
        own). Why: a 4096-token batch's largest activations (the FFN's 50 MB, the QKV's 38 MB)
        are above glibc's 32 MB mmap ceiling, so each is mapped afresh and page-faulted in at
        every call; groups of 1024 tokens reuse heap memory (docs/inference.md).
        """
        shaped = input_ids if inputs_embeds is None else inputs_embeds
        token_type_ids, position_ids = (_batch_rows(t, shaped.shape[0]) for t in (token_type_ids, position_ids))
        self._check_layers()
        hooked = self._hooked()  # then the batch runs whole and padded: hooks see transformers' shapes
        padded = padded or (hooked and attention_mask is not None)
        groups = None if hooked else self._row_groups(shaped, attention_mask, cu_seqlens, padded)
        if groups is None:
            return self._encode(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                                output_attentions, cu_seqlens, max_seqlen, inputs_embeds, unpad=not padded)
        batch = groups[-1].stop

        def rows_of(t, rows):  # a per-row input's rows; None, or one row broadcast over the batch, as it is
            return t[rows] if t is not None and t.shape[0] == batch else t

        # a batch that runs padded (a row's first token masked: from_mask) runs padded in every group
        unpad = not padded and (attention_mask is None or _first_tokens_attended(attention_mask))
        outs = [self._encode(*(rows_of(t, rows) for t in (input_ids, attention_mask, token_type_ids, position_ids)),
                             output_hidden_states, output_attentions, inputs_embeds=rows_of(inputs_embeds, rows),
                             unpad=unpad)
                for rows in groups]
        return BaseModelOutput(*(_cat_rows([getattr(out, name) for out in outs])
                                 for name in ("last_hidden_state", "pooler_output", "hidden_states", "attentions",
                                              "cross_attentions")))

    def runs_unpadded(self, shaped) -> bool:
        """Whether a padded batch like `shaped` (input_ids or inputs_embeds) runs unpadded (ops.unpad_impl)."""
        return self.unpad and ops.unpad_impl(self._backend_for(shaped), shaped.device, self.config.head_dim) is not None

    def _check_layers(self) -> None:
        """Refuse a layer replaced by another kind of module (a user's block written for transformers'
        layer): the encoder calls its layers with its own arguments and reads their own outputs, which
        another module would take and give differently, silently. Wrappers around a RobertaLayer
        (torch.compile's, FSDP's, a checkpoint wrapper) are its own."""
        for i, layer in enumerate(self.encoder.layer):
            inner = layer
            for attribute in ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
                inner = getattr(inner, attribute, inner)
            if not isinstance(inner, RobertaLayer):
                raise ValueError(f"encoder.layer[{i}] is a {type(layer).__name__}, not a RobertaLayer: roberta_fast's "
                                 "encoder calls its layers with its own arguments (a fused qkv, a boolean mask, "
                                 "unpadded tokens) and reads their own outputs. Change the layer's modules instead "
                                 "(qkv, attn_out, ffn_in, ffn_out, the LayerNorms), or hook the layer: its hooks see "
                                 "transformers' tensors")

    def _hooked(self) -> bool:
        """Whether a module of the encoder has forward (pre-)hooks (or global ones are set): then the batch
        runs whole and padded, so each hook sees the (batch, seqlen, ...) tensors transformers' would,
        not row groups or unpadded tokens."""
        embeddings, encoder = self.embeddings, self.encoder
        if any((encoder._forward_hooks, encoder._forward_pre_hooks, encoder._backward_hooks,
                encoder._backward_pre_hooks)):
            raise ValueError("a hook on the encoder (model.encoder) would never be called: roberta_fast runs "
                             "its layers from RobertaModel itself. Hook model.encoder.layer[-1] instead (its output "
                             "is the last hidden state), or pass output_hidden_states=True")
        modules = [embeddings, embeddings.word_embeddings, embeddings.position_embeddings,
                   embeddings.token_type_embeddings, embeddings.LayerNorm, embeddings.dropout]
        for layer in encoder.layer:
            modules += (layer, layer.qkv, layer.attn_out, layer.ffn_in, layer.ffn_out,
                        layer.attn_LayerNorm, layer.ffn_LayerNorm, layer.hidden_dropout)
        if self.pooler is not None:  # called on the whole batch, as transformers' pooler
            modules += (self.pooler, self.pooler.dense)
        return any(map(_has_hooks, modules))

    def _row_groups(self, shaped, attention_mask, cu_seqlens, padded: bool = False) -> list[slice] | None:
        """encode's groups: consecutive row ranges of at most `cpu_group_tokens` tokens each (the
        attended ones when the batch runs unpadded); None: the batch runs whole."""
        batch, seqlen = shaped.shape[:2]
        if (self.cpu_group_tokens is None or batch * seqlen <= self.cpu_group_tokens or cu_seqlens is not None
                or torch.compiler.is_compiling()
                or ops.unpad_impl(self._backend_for(shaped), shaped.device, self.config.head_dim) != "sdpa"):
            return None
        if attention_mask is not None and self.unpad and not padded and _first_tokens_attended(attention_mask):
            lengths = attention_mask.bool().sum(dim=1).expand(batch).tolist()
        else:
            lengths = [seqlen] * batch
        groups, start, tokens = [], 0, 0
        for row, length in enumerate(lengths):
            if tokens and tokens + length > self.cpu_group_tokens:
                groups.append(slice(start, row))
                start, tokens = row, 0
            tokens += length
        groups.append(slice(start, batch))
        return groups if len(groups) > 1 else None

    def _encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                cu_seqlens=None, max_seqlen: int | None = None, inputs_embeds=None,
                unpad: bool = True) -> BaseModelOutput:
        """encode() on one batch, or one group of its rows (unpad=False: a group of a batch that runs padded)."""
        if output_hidden_states is None:  # the config's, as transformers reads them
            output_hidden_states = self.config.output_hidden_states
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        shaped = input_ids if inputs_embeds is None else inputs_embeds
        shape = tuple(shaped.shape[:2])  # (batch, seqlen)
        backend = self._backend_for(shaped)
        if output_attentions and backend == "fused":
            _warn_once("output_attentions=True: no fused kernel stores attention probabilities, "
                       "so this call runs the reference attention")
        if position_ids is None:
            position_ids = self.embeddings.create_position_ids(input_ids, inputs_embeds)
        if attention_mask is not None:
            attention_mask = attention_mask.bool()  # once here, not a 0/1 check in every layer's kernel
        impl = None if output_attentions else ops.unpad_impl(backend, shaped.device, self.config.head_dim)
        varlen = impl is not None
        packing = None
        if cu_seqlens is not None:
            if varlen:
                packing = _Packing(shape, cu_seqlens, max_seqlen)
            else:  # the same attention as a dense (batch, seqlen, seqlen) block-diagonal mask
                attention_mask = _segment_mask(cu_seqlens, *shape)
        elif varlen and self.unpad and unpad and attention_mask is not None:
            packing, attention_mask = _Packing.from_mask(attention_mask)
        if packing is not None:
            input_ids, position_ids, token_type_ids, inputs_embeds = (
                packing.pack(t) for t in (input_ids, position_ids, token_type_ids, inputs_embeds))
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, backend=backend)  # keywords, as transformers calls it
        packed = packing.attention_args(impl) if packing is not None else None
        cast_dtype = ops.autocast_copy_dtype(x, backend)  # None unless fused under autocast
        if (self.checkpointing is not None and self.checkpointing.get("use_reentrant") and self.training
                and torch.is_grad_enabled() and not x.requires_grad):
            # frozen embeddings: reentrant checkpointing would give the layers no gradient (transformers
            # calls enable_input_require_grads for it; a hook would send the batch down the padded path)
            x = x.requires_grad_(True)
        states, attentions, x_cast = [x], [], None
        for i, layer in enumerate(self.encoder.layer):
            last = i == len(self.encoder.layer) - 1  # the head casts its own (fewer) rows
            hooked = _has_hooks(layer)  # its hooks see transformers' output: x alone (its half copy dropped)
            args = (x, attention_mask, backend, packed, output_attentions,
                    *((None, None, True) if hooked else (x_cast, None if last else cast_dtype)))
            if (self.checkpointing is not None and self.training and torch.is_grad_enabled()
                    and i % self.checkpoint_every == 0):
                with (torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda) if self.checkpoint_offload
                      else contextlib.nullcontext()):
                    out = torch.utils.checkpoint.checkpoint(layer, *args, **self.checkpointing)
            else:
                out = layer(*args)
            x, x_cast, probs = (out, None, layer.__dict__.pop("attention_probs", None)) if hooked else out
            states.append(x)
            if output_attentions:
                attentions.append(probs)
        if packing is not None:
            x = packing.unpack(x)
            states = [packing.unpack(h) for h in states] if output_hidden_states else states
        pooled = self.pooler(x) if self.pooler is not None else None
        return BaseModelOutput(x, pooled, tuple(states) if output_hidden_states else None,
                               tuple(attentions) if output_attentions else None, () if output_attentions else None)


def _cat_rows(parts: list):
    """One output field of encode's row groups joined along the batch: tensors concatenated,
    tuples (of per-layer tensors) field by field, None and () kept."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    if parts[0]:
        return tuple(torch.cat(layer) for layer in zip(*parts))
    return parts[0]


def _labels_on_padding(encoder, shaped, labels, attention_mask) -> bool:
    """Whether a label (not -100) falls on a masked position of a batch the encoder would run unpadded.
    transformers computes those positions from the pad tokens and counts them in the loss, so such a
    batch runs padded, as there (unpadded, their logits would come from zeros). Asked under torch.compile
    too, whose graph already breaks where the batch is unpadded (export and tracing run padded); a batch of
    our own trainer never has such a label."""
    if (labels is None or attention_mask is None or not isinstance(labels, torch.Tensor)
            or labels.shape != attention_mask.shape or not hasattr(encoder, "runs_unpadded")
            or not encoder.runs_unpadded(shaped)):
        return False
    return bool(((labels != IGNORE_INDEX) & ~attention_mask.bool()).any())


def _first_tokens_attended(attention_mask) -> bool:
    """Whether every row's first token is attended: _Packing.from_mask's rule for a batch that may run
    unpadded (left padding runs padded), which encode's row groups follow too."""
    return bool(attention_mask[:, :1].bool().all())


class _Packing:
    """How a (batch, seqlen) batch maps to packed tokens for variable-length attention.

    indices: the kept positions of the flattened batch·seqlen tokens (None: all of them).
    max_seqlen / min_seqlen: the longest / shortest sequence (min_seqlen None when not known: only
    SDPA's nested attention below sm_80 needs it, see min_seqlen_for).
    """

    def __init__(self, shape, cu_seqlens, max_seqlen: int | None = None, indices=None, min_seqlen: int | None = None):
        self.shape, self.cu_seqlens, self.indices = tuple(shape), cu_seqlens, indices
        if max_seqlen is None:  # one host sync for both
            steps = cu_seqlens.diff()
            max_seqlen, min_seqlen = torch.stack([steps.max(), steps.min()]).tolist()
        self.max_seqlen, self.min_seqlen = int(max_seqlen), min_seqlen

    def attention_args(self, impl: str | None) -> tuple:
        """(cu_seqlens, max_seqlen, min_seqlen) for ops.attention_varlen. Under SDPA's nested
        attention (impl "sdpa-nested") an unknown min_seqlen is read here, once per forward;
        otherwise SDPA's backend choice reads it from the device three times per layer."""
        if impl == "sdpa-nested" and self.min_seqlen is None:
            self.min_seqlen = int(self.cu_seqlens.diff().min())
        return self.cu_seqlens, self.max_seqlen, self.min_seqlen

    @classmethod
    def from_mask(cls, attention_mask):
        """(packing, the mask the layers still need): each row's attended tokens packed as one
        sequence, no mask; (None, None) when every token is attended; (None, attention_mask) when
        a row's first token is masked (left padding): the pooler and the classification head read
        position 0, whose hidden state transformers computes from the pad token, so that batch
        runs padded, as transformers runs it."""
        keep = attention_mask.bool()
        lengths = keep.sum(dim=1, dtype=torch.int32)
        # the one host sync
        total, longest, shortest, first_kept = torch.stack(
            [lengths.sum(), lengths.max(), lengths.min(), keep[:, :1].all()]).tolist()
        if total == keep.numel():
            return None, None
        if not first_kept:
            return None, attention_mask
        cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # (batch + 1,)
        # the kept positions in order, as nonzero() gives them, without its second sync:
        # a stable sort of "masked" (0 before 1) puts them first
        indices = torch.argsort(keep.flatten().logical_not().to(torch.uint8), stable=True)[:total]
        return cls(keep.shape, cu_seqlens, longest, indices, shortest), None  # indices: (total_tokens,) into batch·seqlen

    def pack(self, t):
        """(batch, seqlen, ...) -> (total_tokens, ...); None stays None."""
        if t is None:
            return None
        t = t.flatten(0, 1)
        return t if self.indices is None else t.index_select(0, self.indices)

    def unpack(self, t):
        """(total_tokens, ...) -> (batch, seqlen, ...), zeros at positions not kept."""
        if self.indices is not None:
            out = t.new_zeros(self.shape[0] * self.shape[1], *t.shape[1:])
            t = out.index_copy(0, self.indices, t)
        return t.view(*self.shape, *t.shape[1:])


def _segment_mask(cu_seqlens, batch: int, seqlen: int):
    """(batch, seqlen, seqlen) bool: token i may attend to j when both lie in one segment."""
    tokens = torch.arange(batch * seqlen, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens[1:], tokens, right=True).view(batch, seqlen)
    return segment[:, :, None] == segment[:, None, :]


class RobertaLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder (the word embeddings, transposed) + bias."""

    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.packed_decoder = None  # rf.prepack's or rf.quantize's copy of the decoder (prepacked.TiedDecoder)

    @property
    def decoder(self) -> nn.Linear:
        """transformers' lm_head.decoder: the model's get_output_embeddings(), a Linear on the word
        embeddings and this head's bias (not a submodule: no state of its own)."""
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError("this RobertaLMHead belongs to no RobertaForMaskedLM: its decoder is that model's "
                                 "word embeddings (get_output_embeddings())")
        return model.get_output_embeddings()

    def __setattr__(self, name, value):
        if name == "decoder":  # lm_head.decoder = ..., as transformers' set_output_embeddings does
            self.__dict__["model"].set_output_embeddings(value)
        else:
            super().__setattr__(name, value)

    def forward(self, x, decoder_weight, backend="reference"):
        x = _linear_gelu(self.dense, x, backend)
        x = _add_norm(self.layer_norm, x, None, 0.0, backend)
        decoder = self.__dict__.get("decoder_view")  # get_output_embeddings' Linear: called where hooked
        if decoder is not None and _has_hooks(decoder) and decoder.weight is decoder_weight:
            return decoder(x)
        if self.packed_decoder is not None:
            return self.packed_decoder(x, decoder_weight, self.bias)
        return F.linear(x, decoder_weight, self.bias)


class RobertaForMaskedLM(_PreTrained):
    """Encoder + MLM head; loss = cross-entropy over positions whose label is not -100."""

    def __init__(self, config: RobertaConfig, backend: str = "auto"):
        super().__init__()
        config = self._setup(config, backend)
        if not config.tie_word_embeddings:
            raise ValueError(untied_decoder_error("the config asks for"))
        self.roberta = RobertaModel(config, add_pooling_layer=False, backend=backend)
        self.lm_head = RobertaLMHead(config)
        self.lm_head.__dict__["model"] = self  # for lm_head.decoder (not a submodule: no cycle in modules())
        self._register_load_state_dict_pre_hook(_load_transformers_decoder)
        self.apply(self._init_weights)
        nn.init.zeros_(self.lm_head.bias)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None, labels=None,
                output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                masked_only: bool = False, loss_reduction: str = "mean", return_dict: bool | None = None,
                cu_seqlens=None, max_seqlen: int | None = None, **kwargs):
        """Logits (batch, seqlen, vocab) and, given labels, the MLM loss.

        masked_only=True (training): the head runs only on positions with a label, and
        `logits` is (num_predicted, vocab) in row-major order of those positions; the same loss
        as without it (labels on padding run the batch padded, as then).
        loss_reduction: "mean" over predicted tokens (HF's) or "sum" (for callers that
        normalise over several micro-batches or ranks themselves).
        cu_seqlens / max_seqlen (with position_ids, without attention_mask): packed rows,
        several documents per row attending only within themselves (RobertaModel.encode).
        inputs_embeds (batch, seqlen, hidden) replaces input_ids, as in transformers.
        """
        self._decoder_inputs({**kwargs, "encoder_hidden_states": encoder_hidden_states,  # transformers' positions
                             "encoder_attention_mask": encoder_attention_mask})
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        shaped = input_ids if input_ids is not None else inputs_embeds
        if labels is not None and isinstance(shaped, torch.Tensor):
            if not isinstance(labels, torch.Tensor) or labels.shape != shaped.shape[:2]:
                raise ValueError(
                    f"labels must be a tensor shaped like input_ids {tuple(shaped.shape[:2])}, got "
                    f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}"
                )
        elif masked_only and labels is None:
            raise ValueError("masked_only=True needs labels: they say which positions to predict")
        attention_mask = self._checked_mask(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids,
                                            cu_seqlens, labels, max_seqlen)
        if masked_only:
            # Flat indices of the predicted positions, found before the encoder runs: the host
            # sync (for their count; and _labels_on_padding's) then waits for the masking, not the encoder.
            predicted = labels.reshape(-1).ne(IGNORE_INDEX).nonzero().squeeze(1)  # (num_predicted,)
        encoded = self._encoded(input_ids, attention_mask, token_type_ids, position_ids,
                                output_hidden_states, output_attentions, cu_seqlens, max_seqlen,
                                inputs_embeds, padded=_labels_on_padding(self.roberta, shaped, labels,
                                                                         attention_mask))
        x = encoded.last_hidden_state
        backend = self._backend_for(x)
        if masked_only:
            x = x.reshape(-1, x.shape[-1]).index_select(0, predicted)  # (num_predicted, hidden), row-major order
            target = labels.reshape(-1).index_select(0, predicted)
        else:
            target = labels
        with _weight_outside_forward(self.roberta.embeddings.word_embeddings) as decoder_weight:
            logits = self.lm_head(x, decoder_weight, backend)
        loss = None
        if labels is not None:
            loss = ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), loss_reduction,
                                     backend)
        out = MaskedLMOutput(loss, logits, encoded.hidden_states, encoded.attentions)
        return self._result(out, return_dict)


def _added_embeddings(old, added: int, mean_resizing: bool, std: float):
    """(added, hidden) new rows for resize_token_embeddings, as transformers draws them."""
    if not mean_resizing:
        return torch.randn(added, old.shape[1], device=old.device).mul_(std).to(old.dtype)
    dtype, old = old.dtype, old.float()
    mean = old.mean(0)
    centered = old - mean
    covariance = 1e-9 * (centered.T @ centered / old.shape[0])  # transformers' epsilon, in its order
    if torch.distributions.constraints.positive_definite.check(covariance).all():
        rows = torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance).sample((added,))
    else:  # too few tokens for a full-rank covariance: the mean itself
        rows = mean.expand(added, -1)
    return rows.to(dtype)


def _num_labels(config: RobertaConfig, num_labels: int | None) -> int:
    """The argument, else the config's (len(id2label), 2 by default); config.num_labels is made
    to match, so the config reports the head's size (and names its classes)."""
    if num_labels is None:
        num_labels = config.num_labels
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    config.num_labels = num_labels
    return num_labels


def _check_class_labels(labels, num_classes: int, name: str = "labels"):
    """Class ids must lie in [0, num_classes) or be -100 (ignored, as cross-entropy does), not become a
    device-side assert; one host sync, skipped under torch.export / torch.compile (data-dependent)."""
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"{name} must be integer class ids, got dtype {labels.dtype}; convert with .long()")
    if _tracing() or not labels.numel():
        return
    low, high = torch.stack([labels.masked_fill(labels == IGNORE_INDEX, 0).min(), labels.max()]).tolist()
    if low < 0 or high >= num_classes:
        raise ValueError(f"{name} must lie in [0, {num_classes}) for {num_classes} classes (or be "
                         f"{IGNORE_INDEX} where ignored), got values in [{low}, {high}]")


class RobertaClassificationHead(nn.Module):
    """HF's sentence head on the <s> token: dropout, dense, tanh, dropout, out_proj."""

    def __init__(self, config: RobertaConfig, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)

    def forward(self, x):
        x = _dropout(self.dropout, x[:, 0])  # (batch, hidden) at <s>
        x = _dropout(self.dropout, torch.tanh(self.dense(x)))
        return self.out_proj(x)


class RobertaForSequenceClassification(_PreTrained):
    """Encoder + classification head, as HF's; the loss follows HF's `problem_type` rules.

    num_labels comes from the argument, else the config's `id2label` (HF config.json),
    else 2. problem_type ("regression", "single_label_classification",
    "multi_label_classification") comes from the config, else is inferred from the first labels
    and stored in the config, as HF does.
    """

    def __init__(self, config: RobertaConfig, num_labels: int | None = None, backend: str = "auto"):
        super().__init__()
        config = self._setup(config, backend)
        self.num_labels = _num_labels(config, num_labels)
        self.roberta = RobertaModel(config, add_pooling_layer=False, backend=backend)
        self.classifier = RobertaClassificationHead(config, self.num_labels)
        self.apply(self._init_weights)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None, **kwargs):
        self._decoder_inputs(kwargs)
        attention_mask = self._checked_mask(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids)
        encoded = self._encoded(input_ids, attention_mask, token_type_ids, position_ids,
                                output_hidden_states, output_attentions, inputs_embeds=inputs_embeds)
        logits = self.classifier(encoded.last_hidden_state)
        loss = None if labels is None else self._loss(logits, labels)
        out = SequenceClassifierOutput(loss, logits, encoded.hidden_states, encoded.attentions)
        return self._result(out, return_dict)

    def _loss(self, logits, labels):
        if self.config.problem_type is None:  # transformers infers it from the first labels and keeps it
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        problem = self.config.problem_type
        if problem == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
            return F.mse_loss(logits, labels.to(logits.dtype))
        if problem == "single_label_classification":
            _check_class_labels(labels, self.num_labels)
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        if problem == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        raise ValueError(f"unknown problem_type {problem!r}")


class RobertaForTokenClassification(_PreTrained):
    """Encoder + dropout + a linear classifier on every token, as HF's (NER, POS tagging).

    num_labels as RobertaForSequenceClassification; loss = cross-entropy over the tokens
    whose label is not -100 (sub-tokens after the first, special tokens, padding)."""

    def __init__(self, config: RobertaConfig, num_labels: int | None = None, backend: str = "auto"):
        super().__init__()
        config = self._setup(config, backend)
        self.num_labels = _num_labels(config, num_labels)
        self.roberta = RobertaModel(config, add_pooling_layer=False, backend=backend)
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.apply(self._init_weights)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None, **kwargs):
        """Logits (batch, seqlen, num_labels); labels (batch, seqlen) give the loss."""
        self._decoder_inputs(kwargs)
        attention_mask = self._checked_mask(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids)
        encoded = self._encoded(input_ids, attention_mask, token_type_ids, position_ids,
                                output_hidden_states, output_attentions, inputs_embeds=inputs_embeds,
                                padded=_labels_on_padding(
                                    self.roberta, input_ids if input_ids is not None else inputs_embeds,
                                    labels, attention_mask))
        logits = self.classifier(_dropout(self.dropout, encoded.last_hidden_state))
        loss = None
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:2]:
                raise ValueError(f"labels must be a tensor shaped like input_ids {tuple(logits.shape[:2])}, got "
                                 f"{tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
            _check_class_labels(labels, self.num_labels)
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.reshape(-1))
        out = TokenClassifierOutput(loss, logits, encoded.hidden_states, encoded.attentions)
        return self._result(out, return_dict)


class RobertaForQuestionAnswering(_PreTrained):
    """Encoder + a linear layer giving each token a start and an end logit (extractive QA, SQuAD), as HF's.

    The loss is HF's: the mean of the start and end cross-entropies, positions clamped to
    [0, seqlen] and seqlen ignored (an answer outside this window of a long context).
    Run unpadded (the fused backend, and the CPU under torch.no_grad / torch.inference_mode:
    ops.unpad_impl; not a left-padded batch, RobertaModel.encode), padded positions' logits are
    the qa_outputs bias (a zero hidden state), not HF's values from the pad tokens. The loss's
    softmax spans them, so the loss differs from HF's there; set `model.roberta.unpad = False`
    to reproduce HF's loss (and logits) on padded batches.
    """

    def __init__(self, config: RobertaConfig, backend: str = "auto"):
        super().__init__()
        config = self._setup(config, backend)
        self.num_labels = _num_labels(config, 2)  # start, end (transformers sizes qa_outputs by num_labels)
        self.roberta = RobertaModel(config, add_pooling_layer=False, backend=backend)
        self.qa_outputs = nn.Linear(config.hidden_size, self.num_labels)
        self.apply(self._init_weights)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None, **kwargs):
        """start_logits, end_logits (batch, seqlen); start/end_positions (batch,) give the loss."""
        self._decoder_inputs(kwargs)
        attention_mask = self._checked_mask(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids)
        encoded = self._encoded(input_ids, attention_mask, token_type_ids, position_ids,
                                output_hidden_states, output_attentions, inputs_embeds=inputs_embeds)
        logits = self.qa_outputs(encoded.last_hidden_state)  # (batch, seqlen, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]  # seqlen: where clamped out-of-window answers land
            losses = []
            for name, positions, scores in (("start_positions", start_positions, start_logits),
                                            ("end_positions", end_positions, end_logits)):
                positions = _answer_positions(name, positions, start_logits.shape[0])
                losses.append(F.cross_entropy(scores, positions.clamp(0, ignored), ignore_index=ignored))
            loss = (losses[0] + losses[1]) / 2
        out = QuestionAnsweringModelOutput(loss, start_logits, end_logits, encoded.hidden_states, encoded.attentions)
        return self._result(out, return_dict)


def _answer_positions(name: str, positions, batch: int):
    """(batch,) or (batch, 1) integer token indices -> (batch,)."""
    if isinstance(positions, torch.Tensor) and positions.dim() > 1:
        positions = positions.squeeze(-1)
    if (not isinstance(positions, torch.Tensor) or positions.shape != (batch,) or positions.dtype.is_floating_point
            or positions.dtype == torch.bool):
        got = f"{getattr(positions, 'dtype', type(positions).__name__)} {tuple(getattr(positions, 'shape', ()))}"
        raise ValueError(f"{name} must be an integer tensor of one token index per sequence, shape ({batch},), "
                         f"got {got}")
    return positions


class RobertaForMultipleChoice(_PreTrained):
    """Encoder with pooler + dropout + one score per choice, as HF's (RACE, SWAG).

    Inputs are (batch, num_choices, seqlen), each choice encoded as its own sequence
    (batch·num_choices rows); logits (batch, num_choices); labels (batch,) the right choice.
    """

    def __init__(self, config: RobertaConfig, backend: str = "auto"):
        super().__init__()
        config = self._setup(config, backend)
        self.roberta = RobertaModel(config, add_pooling_layer=True, backend=backend)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.apply(self._init_weights)

    def forward(self, input_ids=None, token_type_ids=None, attention_mask=None, labels=None, position_ids=None,
                inputs_embeds=None, output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None, **kwargs):
        self._decoder_inputs(kwargs)
        shaped = input_ids if input_ids is not None else inputs_embeds
        dims = 3 if input_ids is not None else 4
        if not isinstance(shaped, torch.Tensor) or shaped.dim() != dims:
            name = "input_ids" if input_ids is not None else "inputs_embeds"
            want = "(batch, num_choices, seqlen)" + (", hidden" if dims == 4 else "")
            raise ValueError(f"{name} must have shape {want} for multiple choice, got "
                             f"{tuple(getattr(shaped, 'shape', ())) or type(shaped).__name__}")
        batch, num_choices, seqlen = shaped.shape[:3]

        def flat(t):  # (batch, num_choices, seqlen, ...) -> (batch·num_choices, seqlen, ...)
            if t is None or (isinstance(t, torch.Tensor) and tuple(t.shape) == (1, seqlen)):
                return t  # (1, seqlen): one row for every sequence, as transformers broadcasts it
            if not isinstance(t, torch.Tensor) or tuple(t.shape[:3]) != (batch, num_choices, seqlen)[:t.dim()]:
                raise ValueError(f"every input must have the shape of input_ids {(batch, num_choices, seqlen)}, "
                                 f"got {tuple(getattr(t, 'shape', ())) or type(t).__name__}")
            return t.reshape(batch * num_choices, *t.shape[2:])

        input_ids, token_type_ids, attention_mask, position_ids, inputs_embeds = (
            flat(t) for t in (input_ids, token_type_ids, attention_mask, position_ids, inputs_embeds))
        attention_mask = self._checked_mask(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids)
        encoded = self._encoded(input_ids, attention_mask, token_type_ids, position_ids,
                                output_hidden_states, output_attentions, inputs_embeds=inputs_embeds)
        logits = self.classifier(_dropout(self.dropout, encoded.pooler_output)).view(batch, num_choices)
        loss = None
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != (batch,):
                raise ValueError(f"labels must be a tensor of one choice index per question, shape ({batch},), got "
                                 f"{tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
            _check_class_labels(labels, num_choices)
            loss = F.cross_entropy(logits, labels)
        out = MultipleChoiceModelOutput(loss, logits, encoded.hidden_states, encoded.attentions)
        return self._result(out, return_dict)


# -------------------------------------------------------------------------- MFU
# Datasheet dense fp16/bf16 peaks, matched by substring of the device name, first match wins
# (so the PCIe and NVL H100s, the NVL H200 and the PCIe / "S" V100s are not taken for the SXM part).
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12),
              ("H200", 989e12), ("A100", 312e12), ("V100S", 130e12), ("V100-PCIE", 112e12), ("V100", 125e12),
              ("Tesla T4", 65e12))


def training_flops(config: RobertaConfig, tokens: int, predicted_tokens: int, seq_len: int,
                   sbo_predicted_tokens: int = 0, attended_pairs: float | None = None) -> float:
    """Model FLOPs of one training step, PaLM convention (DESIGN.md).

    6 · (encoder matmul params · tokens + MLM-head matmul params · predicted tokens
         + SBO-head matmul params · SBO-predicted tokens)
    + 12 · L · H · T · tokens for attention. Embedding lookups are not matmuls. The span
    boundary head (--objective mlm+sbo) is two Linear layers (3H -> H, H -> H) and the tied decoder.
    attended_pairs: the (query, key) pairs attention computes, the sum of each sequence's length
    squared (shorter rows and packed documents attend only within themselves; padding is not work);
    T · tokens, every row full, when not given.
    """
    h, i, n, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    encoder_matmul = n * (4 * h * h + 2 * h * i)
    head_matmul = h * h + h * vocab
    sbo_matmul = 3 * h * h + h * h + h * vocab
    return (6 * (encoder_matmul * tokens + head_matmul * predicted_tokens + sbo_matmul * sbo_predicted_tokens)
            + 12 * n * h * (seq_len * tokens if attended_pairs is None else attended_pairs))


def estimate_mfu(config: RobertaConfig, tokens_per_s: float, predicted_per_s: float, seq_len: int,
                 device_name: str, sbo_predicted_per_s: float = 0.0, attended_pairs_per_s: float | None = None
                 ) -> float:
    """Model FLOPs utilisation against the datasheet peak; NaN for an unknown device (a CPU)."""
    peak = next((v for k, v in PEAK_FLOPS if k in device_name), math.nan)
    return training_flops(config, tokens_per_s, predicted_per_s, seq_len, sbo_predicted_per_s,
                          attended_pairs_per_s) / peak
