"""The model's hot operations, each with a reference and a fused implementation.

The model calls only these functions; each picks the plain-PyTorch reference or the
Triton kernel from `roberta_fast.kernels` by backend. Both compute the same function
on the same weights, so switching a model's backend changes no parameter.

backend: "reference" (plain PyTorch, any device), "fused" (Triton kernels), or
"auto" (fused on a CUDA device when triton is importable, reference elsewhere).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "fused", "reference")


_KERNELS = None


def _kernels():
    """roberta_fast.kernels, imported on first use so CPU-only users never need triton.

    Kept in a module global, not an lru_cache, which torch.compile would warn about at
    every fused op it traces.
    """
    global _KERNELS
    if _KERNELS is None:
        try:
            from roberta_fast import kernels
        except ImportError as err:
            raise ImportError(
                f"backend='fused' needs triton, which failed to import ({err}); install it with "
                "`pip install triton` (Linux), or use backend='reference'"
            ) from err
        _KERNELS = kernels
    return _KERNELS


def _triton_available() -> bool:
    try:
        _kernels()
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "fused":
        _kernels()
    return backend


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the Triton kernels compute in


def exporting() -> bool:
    """Whether torch.export is tracing: torch.compiler.is_exporting(), except under torch.compile on
    torch 2.11 (and earlier), whose Dynamo folds is_exporting() to True in every trace (pytorch#176347),
    which made a compiled fused model run the reference ops and a compiled prepacked / int8 model fail
    to lower. The flag itself, where torch has it, is what later torch reads; torch 2.6 has neither."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is not None:
        return bool(flag)
    if hasattr(torch.compiler, "is_exporting"):
        return torch.compiler.is_exporting()
    # torch 2.6 (is_exporting came in 2.7): its non-strict torch.export sets this flag, and torch.compile
    # leaves it False (Dynamo folds is_compiling() instead, so that would be the 2.11 fault again)
    return bool(torch.compiler._is_compiling_flag)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The backend that runs for tensors on `device` computing in `dtype`.

    "auto" means fused on CUDA when triton imports. A dtype no kernel takes (float64) runs the
    reference ops whatever the backend, as rf.patch does. An explicit "fused" on a device the
    kernels cannot run on is refused here, before any kernel, with the fix.
    """
    if dtype is not None and dtype not in KERNEL_DTYPES:
        return "reference"
    if backend == "auto":
        return "fused" if device.type == "cuda" and _triton_available() else "reference"
    if backend == "fused" and not _kernel_device(device):
        raise ValueError(
            f'backend="fused" runs Triton kernels, which take CUDA tensors (CPU ones only under Triton\'s '
            f"slow interpreter for tests: TRITON_INTERPRET=1 set before importing triton or roberta_fast), "
            f"but the inputs are on {device}; "
            f'use backend="auto" (fused on a GPU, reference elsewhere) or backend="reference", or move '
            f"the model and inputs to a GPU")
    return backend


def _kernel_device(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device` in this process (kernels/_utils.check_triton_device):
    CPU tensors only where TRITON_INTERPRET=1 was set when the kernels were imported."""
    return device.type == "cuda" or (device.type == "cpu" and _kernels()._utils.interpreting())


# Triton >= 3.2 lowers tl.dot to FMA below sm_80 (triton-lang/triton PR #5066: MMAv1 dropped),
# so the Triton attention has no tensor cores on a V100 (sm_70) or T4 (sm_75).
TRITON_DOT_MIN_CAPABILITY = (8, 0)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device. Tests fake it here.

    Read from get_device_properties, which torch.compile folds to a constant: the layers
    ask for it inside compiled forwards."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor


def attention_impl(device: torch.device) -> str:
    """The one place that picks the fused backend's attention for a device:

    "triton": the flash-style Triton kernel (tensor cores through tl.dot) on CUDA sm_80+ and ROCm,
    and on the CPU (Triton's interpreter: the tests);
    "sdpa": PyTorch's memory-efficient SDPA kernel (fp16 tensor cores from sm_50, dropout,
    masks, cu_seqlens through nested tensors) on older CUDA GPUs (V100 sm_70, T4 sm_75),
    where Triton >= 3.2 lowers tl.dot to FMA. The element-wise kernels (LayerNorm, bias+GELU,
    cross-entropy: no tl.dot) run on every GPU; benchmarks/compile_report.py checks both claims.
    """
    capability = device_capability(device)
    if capability is None or torch.version.hip or capability >= TRITON_DOT_MIN_CAPABILITY:
        return "triton"
    return "sdpa"


def describe_attention(backend: str, device: torch.device) -> str:
    """The attention a model on `device` runs, in words, for startup descriptions."""
    if backend != "fused":
        return "PyTorch SDPA (reference backend)"
    if attention_impl(device) == "triton":
        return "Triton flash-style kernel"
    major, minor = device_capability(device)
    return (f"PyTorch SDPA, memory-efficient kernel (sm_{major}{minor}: Triton's tl.dot has no tensor cores "
            "below sm_80)")


def efficient_sdpa():
    """Context in which SDPA runs its memory-efficient kernel, math only where that cannot run (e.g. an
    unsupported head dim; math materialises every score): the fused backend's attention below
    sm_80, where flash (sm_80+) is not available."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _sdpa_tensor_cores(q, k, v, attn_mask=None, dropout_p: float = 0.0):
    """F.scaled_dot_product_attention under efficient_sdpa()."""
    with efficient_sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


def fused_head_dims() -> tuple[int, ...]:
    """Head dims the fused attention kernel supports."""
    return _kernels().ATTENTION_HEAD_DIMS


@functools.lru_cache(maxsize=None)
def _warn_once(message: str):
    warnings.warn(message, stacklevel=3)


def _broadcast_mask(attention_mask):
    """(batch, seqlen) key mask or (batch, seqlen, seqlen) pair mask -> bool (batch, 1, 1 or seqlen, seqlen)."""
    mask = attention_mask[:, None, None, :] if attention_mask.dim() == 2 else attention_mask[:, None]
    return mask.to(torch.bool)


def attention(qkv, attention_mask, dropout_p: float, backend: str):
    """Softmax attention over keys not masked out; qkv: (batch, seqlen, 3, heads, head_dim),
    the QKV projection's output as it is (q, k, v = qkv.unbind(2)).

    attention_mask: (batch, seqlen) over keys, or (batch, seqlen, seqlen) over (query, key)
    pairs, 1 = attend, or None. Returns (batch, seqlen, heads, head_dim). The reference
    adds finfo.min to masked scores, as Hugging Face does, so a row with every key
    masked attends uniformly instead of producing NaN. The fused backend runs the Triton
    kernel where attention_impl says so, else SDPA's memory-efficient kernel.
    """
    key_mask_only = attention_mask is None or attention_mask.dim() == 2
    impl = attention_impl(qkv.device) if backend == "fused" else None
    if impl == "triton" and key_mask_only:
        supported = fused_head_dims()
        if qkv.shape[-1] in supported:
            return _kernels().attention_qkvpacked(qkv, attention_mask, dropout_p)
        _warn_once(f"fused attention supports head dims {supported}, not {qkv.shape[-1]}: "
                   "using the reference attention for this model")
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each (batch, heads, seqlen, head_dim)
    additive = None
    if attention_mask is not None:
        keep = _broadcast_mask(attention_mask)
        additive = torch.zeros(keep.shape, dtype=q.dtype, device=q.device)
        additive = additive.masked_fill(~keep, torch.finfo(q.dtype).min)
    if impl == "sdpa":  # below sm_80; elsewhere SDPA's own choice (flash where it can)
        out = _sdpa_tensor_cores(q, k, v, additive, dropout_p)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout_p)
    return out.transpose(1, 2)  # (batch, seqlen, heads, head_dim)


def attention_varlen(qkv, cu_seqlens, max_seqlen: int, dropout_p: float, backend: str = "fused",
                     min_seqlen: int | None = None):
    """Attention over packed sequences; qkv: (total_tokens, 3, heads, head_dim) -> (total_tokens,
    heads, head_dim). Sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1] and attends only within itself.
    max_seqlen: the longest sequence; min_seqlen: the shortest, when known (the nested path
    below sm_80 needs it; None there costs a host sync).

    fused: the Triton variable-length kernel, or (attention_impl "sdpa", below sm_80) SDPA's
    memory-efficient kernel over a jagged nested tensor (cu_seqlens passed through, no padding);
    reference: one SDPA call per sequence (attention_varlen_sdpa, the CPU inference path).
    """
    if backend != "fused":
        return attention_varlen_sdpa(qkv, cu_seqlens, dropout_p)
    if attention_impl(qkv.device) == "sdpa":
        return _attention_varlen_nested(qkv, cu_seqlens, max_seqlen, dropout_p, min_seqlen)
    return _kernels().attention_qkvpacked(qkv, None, dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                          validate=False)


def _attention_varlen_nested(qkv, cu_seqlens, max_seqlen: int, dropout_p: float, min_seqlen: int | None = None):
    """attention_varlen through SDPA on jagged nested tensors: on CUDA the efficient kernel reads
    cu_seqlens itself (no padding, no per-sequence launches). Both extremes are given: SDPA's backend
    choice otherwise reads each from the device, one host sync per q, k and v (three per layer)."""
    offsets = cu_seqlens.to(torch.int64)
    if min_seqlen is None:
        min_seqlen = int(offsets.diff().min())  # one sync instead of SDPA's three

    def nested(t):  # (total_tokens, heads, head_dim) -> (batch, heads, jagged seqlen, head_dim)
        # contiguous: nested SDPA needs dense values under the transpose (a slice of qkv is strided)
        return torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets, max_seqlen=max_seqlen,
                                                min_seqlen=min_seqlen).transpose(1, 2)

    q, k, v = (nested(t) for t in qkv.unbind(1))
    out = _sdpa_tensor_cores(q, k, v, dropout_p=dropout_p)
    return out.transpose(1, 2).values()  # (total_tokens, heads, head_dim)


def unpad_impl(backend: str, device: torch.device, head_dim: int) -> str | None:
    """The one place that decides whether a padded batch runs unpadded (padding dropped at the
    embeddings, the layers on the packed real tokens) and whose attention then runs:

    "triton": the fused backend's variable-length kernel, training included (head dims it supports);
    "sdpa-nested": the fused backend below sm_80 (attention_impl), SDPA's efficient kernel on
    nested tensors, training included;
    "sdpa": the reference backend on the CPU when no gradient is recorded (torch.no_grad /
    torch.inference_mode, as inference and evaluation run), each sequence its own SDPA call
    (attention_varlen_sdpa; measured against nested tensors and re-padding per layer in
    docs/inference.md); None: the batch runs padded, as transformers runs it.
    Never under torch.export / tracing, whose graphs cannot depend on how much is padded.
    """
    if exporting() or torch.jit.is_tracing():
        return None
    if backend == "fused":
        if attention_impl(device) == "sdpa":
            return "sdpa-nested"
        return "triton" if head_dim in fused_head_dims() else None
    if backend == "reference" and device.type == "cpu" and not torch.is_grad_enabled():
        return "sdpa"
    return None


def _sdpa_per_sequence(q, k, v, cu_seqlens, dropout_p: float):
    """q, k, v: (total_tokens, heads, head_dim); sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    bounds = cu_seqlens.tolist()
    # 4-D (1, heads, length, head_dim): SDPA's CPU flash kernel takes only 4-D inputs; 3-D ones fall back to
    # the math path (3x slower for 12 heads x 300 tokens on the 2-core AVX2 CPU, docs/inference.md)
    outs = [F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)),
                                           dropout_p=dropout_p)[0]
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]  # each (heads, length, head_dim)
    if not outs:  # every row fully padded: no token to attend
        return torch.empty_like(q)
    return torch.cat(outs, dim=1).transpose(0, 1)  # (total_tokens, heads, head_dim)


@torch.library.custom_op("roberta_fast::sdpa_varlen", mutates_args=())
def _sdpa_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    dropout_p: float) -> torch.Tensor:
    return _sdpa_per_sequence(q, k, v, cu_seqlens, dropout_p).contiguous()


@_sdpa_varlen_op.register_fake
def _(q, k, v, cu_seqlens, dropout_p):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention_varlen_sdpa(qkv, cu_seqlens, dropout_p: float):
    """attention_varlen without Triton: qkv (total_tokens, 3, heads, head_dim) -> (total_tokens, heads,
    head_dim), one SDPA call per sequence, so no work or memory goes to padding.

    Under torch.compile it is one opaque op (roberta_fast::sdpa_varlen): the Python loop over
    sequences would otherwise make the graph depend on every length; eager runs it directly
    (autograd included).
    """
    q, k, v = qkv.unbind(1)  # each (total_tokens, heads, head_dim)
    if torch.compiler.is_compiling():
        return _sdpa_varlen_op(q, k, v, cu_seqlens, dropout_p)
    return _sdpa_per_sequence(q, k, v, cu_seqlens, dropout_p)


def attention_with_probs(qkv, attention_mask, dropout_p: float):
    """Reference attention that also returns the probabilities (batch, heads, seqlen, seqlen).

    For `output_attentions=True`, which no fused kernel provides (nothing seqlen² is stored).
    qkv: (batch, seqlen, 3, heads, head_dim).
    """
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each (batch, heads, seqlen, head_dim)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if attention_mask is not None:
        keep = _broadcast_mask(attention_mask)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1)
    out = F.dropout(probs, p=dropout_p, training=dropout_p > 0) @ v
    return out.transpose(1, 2), probs  # (batch, seqlen, heads, head_dim), probs


def cross_entropy(logits, target, reduction: str, backend: str):
    """The MLM loss: cross-entropy of logits (rows, vocab) against targets (rows,), -100 ignored.

    fp32 math and result in both paths (autocast's choice for cross_entropy); the fused
    kernel reads half logits as they are, with no fp32 copy or log-softmax stored. The
    targets are range-checked by the model's check_inputs; the kernel gives an
    unchecked bad target a NaN loss, never an out-of-bounds read.
    """
    if backend == "fused":
        return _kernels().cross_entropy(logits, target, -100, reduction, validate=False)
    return F.cross_entropy(logits.float(), target, ignore_index=-100, reduction=reduction)


def linear_gelu(x, weight, bias, backend: str):
    """erf GELU(x @ weight.T + bias): the feed-forward's first half."""
    if backend == "fused":
        h = F.linear(x, weight)
        return _kernels().bias_gelu(h, bias)
    return gelu_fresh(F.linear(x, weight, bias))


def gelu_fresh(h):
    """F.gelu(h) for an h nobody else holds (a matmul's output): in place where autograd does not
    need h and nothing traces it, the same values (gelu_ runs gelu's kernel). On the CPU a new
    tensor of the FFN's width is fresh memory from the OS, a page fault per 4 KB: at 4096 tokens
    (50 MB) F.gelu took 37 ms, gelu_ 11 ms (2-core AMD EPYC, docs/inference.md)."""
    if h.requires_grad or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return F.gelu(h)
    return torch.ops.aten.gelu_(h)


def dropout_add_layer_norm(x, residual, weight, bias, eps: float, dropout_p: float, backend: str,
                           cast_dtype=None):
    """LayerNorm(dropout(x) + residual): the post-LN sublayer ending. residual may be None.

    With mixed dtypes (autocast: x half, residual fp32) the output takes the dtype of
    `x + residual`, as PyTorch's would, in both paths. cast_dtype: return (y,
    y.to(cast_dtype)), the copy the next matmul reads under autocast; the fused kernel
    writes both in one pass (and sums their grads in one), so no cast kernel runs.
    """
    if backend == "fused":
        return _kernels().layer_norm(x, weight, bias, eps, residual=residual, dropout_p=dropout_p,
                                     cast_dtype=cast_dtype)
    if dropout_p > 0:  # not a no-op call per sublayer in inference
        x = F.dropout(x, p=dropout_p)
    if residual is not None:
        x = x + residual
    # the weight's shape, not x.shape[-1]: a traced shape becomes a Gather the TorchScript ONNX exporter refuses
    y = F.layer_norm(x, tuple(weight.shape) if weight is not None else (x.shape[-1],), weight, bias, eps)
    return y if cast_dtype is None else (y, y.to(cast_dtype))


def autocast_copy_dtype(x, backend: str):
    """The dtype the next matmul would cast x to under autocast, when the fused LayerNorm
    should write that copy itself; None outside autocast, when x has it already, or on
    the reference backend (which leaves the casting to autocast, as HF does)."""
    device = x.device.type
    if backend != "fused" or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype != x.dtype else None
