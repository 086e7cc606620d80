"""Triton kernels of roberta_fast, importable as `roberta_fast.kernels`.

One kernel per file, each with a plain-PyTorch `*_ref` beside it. On a machine
without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`,
set before triton is imported).
"""
from .attention import SUPPORTED_HEAD_DIMS as ATTENTION_HEAD_DIMS
from .attention import attention, attention_dropout_mask, attention_ref, attention_varlen
from .bias_gelu import bias_gelu, bias_gelu_ref
from .layer_norm import layer_norm, layer_norm_ref

__all__ = [
    "ATTENTION_HEAD_DIMS",
    "attention",
    "attention_dropout_mask",
    "attention_varlen",
    "attention_ref",
    "bias_gelu",
    "bias_gelu_ref",
    "layer_norm",
    "layer_norm_ref",
]
