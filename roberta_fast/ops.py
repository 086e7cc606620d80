"""The model's hot operations, each with a reference and a fused implementation.

The model calls only these functions; each picks the plain-PyTorch reference or the
Triton kernel from `roberta_fast.kernels` by backend. Both compute the same function
on the same weights, so switching a model's backend changes no parameter.

backend: "reference" (plain PyTorch, any device), "fused" (Triton kernels), or
"auto" (fused on a CUDA device when triton is importable, reference elsewhere).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "fused", "reference")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "fused":
        raise NotImplementedError(
            "backend='fused' is not available yet: the Triton kernels are wired into the model "
            "in issue 3. Use backend='reference' (or 'auto', which picks reference)."
        )
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that actually runs for tensors on `device`."""
    if backend == "auto":
        return "reference"
    return backend


def attention(q, k, v, attention_mask, dropout_p: float, backend: str):
    """Softmax attention over keys not masked out; q, k, v: (batch, seqlen, heads, head_dim).

    attention_mask: (batch, seqlen), 1 = attend, or None. Returns (batch, seqlen, heads, head_dim).
    The reference adds finfo.min to masked scores, as Hugging Face does, so a row with
    every key masked attends uniformly instead of producing NaN.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seqlen, head_dim)
    additive = None
    if attention_mask is not None:
        # (batch, seqlen) -> (batch, 1, 1, seqlen), 0 where attended, finfo.min where masked
        keep = attention_mask[:, None, None, :].to(torch.bool)
        additive = torch.zeros(keep.shape, dtype=q.dtype, device=q.device)
        additive = additive.masked_fill(~keep, torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout_p)
    return out.transpose(1, 2)  # (batch, seqlen, heads, head_dim)


def linear_gelu(x, weight, bias, backend: str):
    """erf GELU(x @ weight.T + bias): the feed-forward's first half."""
    return F.gelu(F.linear(x, weight, bias))


def dropout_add_layer_norm(x, residual, weight, bias, eps: float, dropout_p: float, backend: str):
    """LayerNorm(dropout(x) + residual): the post-LN sublayer ending. residual may be None."""
    x = F.dropout(x, p=dropout_p, training=dropout_p > 0)
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
