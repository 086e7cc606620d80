"""Cross-entropy over a large vocabulary (the MLM loss) in Triton, forward and backward.

    loss[i] = logsumexp(logits[i]) - logits[i, target[i]]   (0 where target[i] == ignore_index)

The MLM head's logits are (predicted tokens, vocab) in bf16/fp16 under autocast.
PyTorch's path (autocast runs cross_entropy in fp32) writes an fp32 copy of the
logits and their log-softmax, and in the backward a zero-filled fp32 grad, the
log-softmax grad and a cast back: about 18 bytes moved per logit for 2-byte logits.
Here the forward reads the logits once (an online logsumexp over vocabulary chunks,
fp32) and keeps one fp32 per row; the backward reads them once more and writes
dlogits = (softmax - onehot) * dloss in the logits' dtype: 6 bytes per logit, the
same fp32 math. The op gives per-row losses; the reduction (mean over the rows not
ignored, or sum) is plain torch on an (M,) vector.

A target outside [0, vocab) that is not ignore_index is reported by `cross_entropy`
(one host sync; validate=False skips it) and in the kernel gives a NaN loss, never
an out-of-bounds read. Layout as kernels/bias_gelu.py: kernels, custom-op launchers
with fake implementations (torch.compile-safe), one autograd.Function, a functional
alias, and `cross_entropy_ref` in plain PyTorch. Runs on CUDA tensors, and on CPU
tensors under TRITON_INTERPRET=1 (tests). Not yet measured on a GPU.
"""
import torch
import triton
import triton.language as tl

from ._utils import LAUNCH_OPTIONS, check_tensor, check_triton_device, on_device

MAX_BLOCK_V = 4096  # vocabulary chunk per loop step on a GPU (16 fp32 per thread at 8 warps)


@triton.jit
def _cross_entropy_fwd_kernel(LOGITS, TARGET, LOSS, LSE, V, stride_row, ignore_index,
                              BLOCK_V: tl.constexpr):
    """One program per row: online max / sum of exp over BLOCK_V-wide chunks, fp32."""
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), -float("inf"), tl.float32)  # running max
    s = tl.zeros((), tl.float32)  # running sum of exp(x - m)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every logit so far -inf: avoid inf - inf
        s = s * tl.exp(m - m_new_safe) + tl.sum(tl.exp(x - m_new_safe), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(TARGET + row).to(tl.int64)
    in_range = (target >= 0) & (target < V)
    x_target = tl.load(base + target, mask=in_range, other=float("nan")).to(tl.float32)
    loss = tl.where(target == ignore_index, 0.0, lse - x_target)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(DLOSS, LOGITS, TARGET, LSE, DLOGITS, V, stride_row, stride_drow, ignore_index,
                              BLOCK_V: tl.constexpr):
    """One program per row: dlogits = (exp(x - lse) - onehot(target)) * dloss (0 for an ignored row)."""
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    dbase = DLOGITS + row.to(tl.int64) * stride_drow
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(TARGET + row).to(tl.int64)
    dloss = tl.where(target == ignore_index, 0.0, tl.load(DLOSS + row).to(tl.float32))
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        col_ok = offs < V
        x = tl.load(base + offs, mask=col_ok, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)) * dloss
        tl.store(dbase + offs, grad.to(DLOGITS.dtype.element_ty), mask=col_ok)


def _launch_shape(V: int, device: torch.device):
    """(BLOCK_V, num_warps): whole rows per step under the interpreter (fewer Python loops)."""
    if device.type == "cuda":
        return min(triton.next_power_of_2(V), MAX_BLOCK_V), 8
    return min(triton.next_power_of_2(V), 4 * MAX_BLOCK_V), 1


@torch.library.custom_op("roberta_fast::cross_entropy_fwd", mutates_args=())
def _cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor,
                       ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (M, V), target (M,) -> per-row loss (M,) fp32, logsumexp (M,) fp32."""
    M, V = logits.shape
    loss = torch.empty(M, dtype=torch.float32, device=logits.device)
    lse = torch.empty(M, dtype=torch.float32, device=logits.device)
    if M:
        block_v, num_warps = _launch_shape(V, logits.device)
        with on_device(logits.device):
            _cross_entropy_fwd_kernel[(M,)](logits, target, loss, lse, V, logits.stride(0), ignore_index,
                                            BLOCK_V=block_v, num_warps=num_warps, **LAUNCH_OPTIONS)
    return loss, lse


@_cross_entropy_fwd.register_fake
def _(logits, target, ignore_index):
    stats = logits.new_empty((logits.shape[0],), dtype=torch.float32)
    return stats, torch.empty_like(stats)


@torch.library.custom_op("roberta_fast::cross_entropy_bwd", mutates_args=())
def _cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                       ignore_index: int) -> torch.Tensor:
    """-> dlogits (M, V) in the logits' dtype."""
    M, V = logits.shape
    dlogits = torch.empty((M, V), dtype=logits.dtype, device=logits.device)
    if M:
        block_v, num_warps = _launch_shape(V, logits.device)
        with on_device(logits.device):
            _cross_entropy_bwd_kernel[(M,)](dloss.contiguous(), logits, target, lse, dlogits, V, logits.stride(0),
                                            dlogits.stride(0), ignore_index, BLOCK_V=block_v, num_warps=num_warps,
                                            **LAUNCH_OPTIONS)
    return dlogits


@_cross_entropy_bwd.register_fake
def _(dloss, logits, target, lse, ignore_index):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


class CrossEntropyFn(torch.autograd.Function):
    """Per-row losses; saves the logits (no copy), the targets and one fp32 per row."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        loss, lse = _cross_entropy_fwd(logits, target, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse = ctx.saved_tensors
        return _cross_entropy_bwd(dloss, logits, target, lse, ctx.ignore_index), None, None


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", validate=True):
    """Cross-entropy of logits (M, V) against integer targets (M,), fp32 math, fp32 result.

    As `F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)`
    (what autocast runs): reduction "mean" over the rows whose target is not
    ignore_index (NaN when there is none, as PyTorch's), "sum", or "none" (per-row,
    0 for ignored rows). The grad of logits comes back in their dtype. validate=False
    skips the target range check, which synchronises with the GPU.
    """
    op = "cross_entropy"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a torch.Tensor, got {type(logits).__name__}")
    check_tensor(logits, "logits", logits.device, op)
    check_triton_device(logits.device, op)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{op}: logits must be (rows, vocab) with vocab > 0, got shape {tuple(logits.shape)}; "
                         "flatten leading dimensions with logits.reshape(-1, vocab)")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: target must be an int64 or int32 tensor of class indices, got "
                        f"{target.dtype if isinstance(target, torch.Tensor) else type(target).__name__}")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"{op}: target must have shape ({logits.shape[0]},) to match logits' rows, "
                         f"got {tuple(target.shape)}")
    if target.device != logits.device:
        raise ValueError(f"{op}: target is on {target.device} but logits are on {logits.device}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    V = logits.shape[1]
    if validate and target.numel() and not torch.compiler.is_compiling():
        bad = ((target < 0) | (target >= V)) & (target != ignore_index)
        if bool(bad.any()):
            value = int(target[bad][0])
            raise ValueError(f"{op}: target holds {value}, outside [0, {V}) for {V} classes and not "
                             f"ignore_index ({ignore_index}); check the labels against the vocabulary")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    losses = CrossEntropyFn.apply(logits, target.contiguous(), int(ignore_index))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()


def cross_entropy_ref(logits, target, ignore_index=-100, reduction="mean"):
    """Plain PyTorch, as autocast computes it: F.cross_entropy in fp32 (fp64 stays fp64)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    return torch.nn.functional.cross_entropy(logits.to(acc), target, ignore_index=ignore_index,
                                             reduction=reduction)
