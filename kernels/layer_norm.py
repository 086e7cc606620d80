"""Residual + LayerNorm (optionally with the hidden dropout fused) in Triton.

    y = LayerNorm(dropout(x) + residual) over the last dimension

RoBERTa is post-LN: every encoder layer ends in `LayerNorm(dropout(dense(h)) + h)`,
so one kernel reads x and the residual once and writes y once. Statistics are fp32
whatever the input dtype, so fp16 activations whose sum or variance would overflow
in fp16 still normalise correctly. The backward recomputes `dropout(x) + residual`
from the saved inputs and the dropout mask from its Philox seed: nothing beyond the
per-row fp32 mean and rstd is stored. dweight/dbias are reduced without atomics
(partial sums per program, then a sum over programs), so they are deterministic.

Under autocast the residual stream is fp32 (as in Hugging Face's model) and the next
matmul reads a half copy of it: `cast_dtype` has the kernel write that copy in the
same pass and the backward add the two grads in the same pass, which saves a cast
kernel each way and autograd's separate grad sum (about 20 bytes per element moved),
with bitwise the same results.

Layout follows Liger-Kernel's ops/layer_norm.py and flash-attention's
ops/triton/layer_norm.py: kernels, launchers (registered as torch.library custom
ops with fake implementations, so torch.compile traces through them), one
autograd.Function, a functional alias, and `layer_norm_ref` in plain PyTorch.

Runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (tests).
Not yet measured on a GPU: see benchmarks/bench_layer_norm.py.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import (LAUNCH_OPTIONS, check_tensor, check_triton_device, dropout_threshold, num_programs,
                     on_device, philox_rand16, tile_shape)

MAX_HIDDEN = 16384  # one row lives in registers; larger rows would spill badly
MIN_BLOCK_N = 8  # philox_rand16 serves 8 columns per call: hidden sizes 1-7 get masked columns


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------
@triton.jit
def _sum_input(X, R, SEED, offs, rows, mask, thresh, dropout_scale,
               HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """z = dropout(x) + residual in fp32, and the keep mask (True without dropout)."""
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    keep = mask
    if HAS_DROPOUT:
        # 16-bit Philox randoms keyed by (seed, row, column): 8 columns per Philox call
        keep = philox_rand16(tl.load(SEED), rows, 0, 0, 0, BLOCK_N) >= thresh
        z = tl.where(keep, z * dropout_scale, 0.0)
    if HAS_RESIDUAL:
        z += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    return z, keep


@triton.jit
def _layer_norm_fwd_kernel(
    X, R, W, B, Y, Y_CAST, KEEP, MEAN, RSTD, SEED,
    M, N, eps, thresh, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_KEEP: tl.constexpr,
    HAS_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program normalises BLOCK_M whole rows (BLOCK_N >= N); Y_CAST gets y cast again."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]  # (BLOCK_M, BLOCK_N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]

    z, keep = _sum_input(X, R, SEED, offs, rows, mask, thresh, dropout_scale,
                         HAS_RESIDUAL, HAS_DROPOUT, BLOCK_N)
    if STORE_KEEP:
        tl.store(KEEP + offs, keep, mask=mask)
    mean = tl.sum(z, axis=1) / N  # (BLOCK_M,)
    diff = tl.where(mask, z - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(diff * diff, axis=1) / N + eps)  # two-pass variance, fp32

    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (diff * rstd[:, None] * w[None, :] + b[None, :]).to(Y.dtype.element_ty)
    tl.store(Y + offs, y, mask=mask)
    if HAS_CAST:  # from the stored value: exactly what y.to(cast_dtype) gives
        tl.store(Y_CAST + offs, y.to(Y_CAST.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, DY_CAST, X, R, W, MEAN, RSTD, SEED, DX, DR, DW_PART, DB_PART,
    M, N, rows_per_program, thresh, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DR: tl.constexpr,
    HAS_DY_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program walks `rows_per_program` rows in BLOCK_M-row tiles.

    dy is the sum of the grads of y and of its cast copy (one fp32 add, as autograd's).
    dz = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w; dresidual = dz,
    dx = dz through the dropout mask. dw/db partials of this program go to row pid
    of DW_PART/DB_PART (n_programs, N), summed afterwards.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = pid * rows_per_program  # rows_per_program is a multiple of BLOCK_M
    for row0 in range(start, start + rows_per_program, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]  # (BLOCK_M, BLOCK_N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]

        z, keep = _sum_input(X, R, SEED, offs, rows, mask, thresh, dropout_scale,
                             HAS_RESIDUAL, HAS_DROPOUT, BLOCK_N)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (z - mean[:, None]) * rstd[:, None], 0.0)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DY_CAST:
            dy += tl.load(DY_CAST + offs, mask=mask, other=0.0).to(tl.float32)
        dw_acc += dy * xhat
        db_acc += dy
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dz = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if STORE_DR:
            tl.store(DR + offs, dz.to(DR.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            dz = tl.where(keep, dz * dropout_scale, 0.0)
        tl.store(DX + offs, dz.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    tl.store(DB_PART + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


# ----------------------------------------------------------------------------
# Launchers (custom ops: torch.compile sees them as opaque, with fake shapes)
# ----------------------------------------------------------------------------
def _dropout_scale(dropout_p: float) -> float:
    return 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0


def _out_dtype(x, residual):
    """y's dtype: what `x + residual` gives in PyTorch (x's own dtype without a residual)."""
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _separate_dresidual(x, residual, dropout_p) -> bool:
    """dresidual equals dx unless dropout scales dx or the two dtypes differ."""
    return residual is not None and (dropout_p > 0.0 or residual.dtype != x.dtype)


@torch.library.custom_op("roberta_fast::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    residual: Optional[torch.Tensor], seed: Optional[torch.Tensor],
    eps: float, dropout_p: float, store_keep: bool, cast_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: (M, N) -> y (M, N), y in cast_dtype (M, N) or (0,), keep mask (M, N) or (0,),
    mean (M,), rstd (M,)."""
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    residual = residual.contiguous() if residual is not None else None
    M, N = x.shape
    y = torch.empty_like(x, dtype=_out_dtype(x, residual))
    y_cast = torch.empty((M, N) if cast_dtype is not None else (0,), dtype=cast_dtype or y.dtype,
                         device=x.device)
    keep = torch.empty((M, N) if store_keep else (0,), dtype=torch.bool, device=x.device)
    mean = torch.empty((M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return y, y_cast, keep, mean, rstd
    block_m, block_n, num_warps = tile_shape(N, M, x.device, MAX_HIDDEN, MIN_BLOCK_N)
    with on_device(x.device):
        _layer_norm_fwd_kernel[(triton.cdiv(M, block_m),)](
            x, residual, weight, bias, y, y_cast, keep, mean, rstd, seed,
            M, N, eps, dropout_threshold(dropout_p), _dropout_scale(dropout_p),
            HAS_RESIDUAL=residual is not None, HAS_DROPOUT=dropout_p > 0.0, STORE_KEEP=store_keep,
            HAS_CAST=cast_dtype is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
            **LAUNCH_OPTIONS,
        )
    return y, y_cast, keep, mean, rstd


@_layer_norm_fwd.register_fake
def _(x, weight, bias, residual, seed, eps, dropout_p, store_keep, cast_dtype):
    M, N = x.shape
    y = torch.empty_like(x, dtype=_out_dtype(x, residual))
    y_cast = x.new_empty((M, N) if cast_dtype is not None else (0,), dtype=cast_dtype or y.dtype)
    keep = x.new_empty((M, N) if store_keep else (0,), dtype=torch.bool)
    stats = x.new_empty((M,), dtype=torch.float32)
    return y, y_cast, keep, stats, torch.empty_like(stats)


@torch.library.custom_op("roberta_fast::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(
    dy: torch.Tensor, dy_cast: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
    residual: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
    seed: Optional[torch.Tensor], dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy, and dy_cast (the grad of y's cast copy) or None
    -> dx (M, N), dresidual (M, N) or (0,) when it equals dx, dweight (N,) fp32, dbias (N,) fp32."""
    dy, x, weight = dy.contiguous(), x.contiguous(), weight.contiguous()
    dy_cast = dy_cast.contiguous() if dy_cast is not None else None
    residual = residual.contiguous() if residual is not None else None
    M, N = x.shape
    store_dr = _separate_dresidual(x, residual, dropout_p)
    dx = torch.empty_like(x)
    dr = torch.empty((M, N) if store_dr else (0,), dtype=residual.dtype if store_dr else x.dtype,
                     device=x.device)
    # half the forward's elements per thread: the backward keeps ~6 fp32 values per element live
    # across its row sums; at 16 per thread ptxas took 145-155 registers (one 8-warp program per
    # SM) or, under Triton 3.7.1, spilled; at 8 it takes 64-96 on sm_70-90 (compile_report)
    block_m, block_n, num_warps = tile_shape(N, M, x.device, MAX_HIDDEN, MIN_BLOCK_N, per_thread=8)
    rows_per_program = block_m * triton.cdiv(M, block_m * num_programs(x.device))
    n_programs = triton.cdiv(M, rows_per_program) if M else 0
    # every program writes its whole row of partial sums: no zero-fill needed
    dw_part = torch.empty((n_programs, N), dtype=torch.float32, device=x.device)
    db_part = torch.empty((n_programs, N), dtype=torch.float32, device=x.device)
    if M:
        with on_device(x.device):
            _layer_norm_bwd_kernel[(n_programs,)](
                dy, dy_cast, x, residual, weight, mean, rstd, seed, dx, dr, dw_part, db_part,
                M, N, rows_per_program, dropout_threshold(dropout_p), _dropout_scale(dropout_p),
                HAS_RESIDUAL=residual is not None, HAS_DROPOUT=dropout_p > 0.0, STORE_DR=store_dr,
                HAS_DY_CAST=dy_cast is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                **LAUNCH_OPTIONS,
            )
    return dx, dr, dw_part.sum(0), db_part.sum(0)


@_layer_norm_bwd.register_fake
def _(dy, dy_cast, x, weight, residual, mean, rstd, seed, dropout_p):
    M, N = x.shape
    store_dr = _separate_dresidual(x, residual, dropout_p)
    dr = x.new_empty((M, N) if store_dr else (0,), dtype=residual.dtype if store_dr else x.dtype)
    dw = x.new_empty((N,), dtype=torch.float32)
    return torch.empty_like(x), dr, dw, torch.empty_like(dw)


# ----------------------------------------------------------------------------
# Autograd and the public function
# ----------------------------------------------------------------------------
class LayerNormFn(torch.autograd.Function):
    """LayerNorm(dropout(x) + residual), and optionally a cast copy of it; grads for x,
    weight, bias and residual."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, dropout_p, seed, store_keep, cast_dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (..., N) -> (M, N)
        r2 = residual.reshape(-1, shape[-1]) if residual is not None else None
        y, y_cast, keep, mean, rstd = _layer_norm_fwd(x2, weight, bias, r2, seed, eps, dropout_p,
                                                      store_keep, cast_dtype)
        ctx.save_for_backward(x2, weight, r2, mean, rstd, seed)
        ctx.mark_non_differentiable(keep)
        ctx.set_materialize_grads(False)  # an unused output's grad stays None: nothing to read
        ctx.shape, ctx.bias_dtype = shape, bias.dtype
        ctx.dropout_p, ctx.separate_dr = dropout_p, _separate_dresidual(x, residual, dropout_p)
        ctx.has_cast = cast_dtype is not None
        return (y.view(shape), y_cast.view(shape) if cast_dtype is not None else y_cast,
                keep.view(shape) if store_keep else keep)

    @staticmethod
    def backward(ctx, dy, dy_cast, _dkeep):
        x2, weight, r2, mean, rstd, seed = ctx.saved_tensors
        if dy is None:  # only the cast copy was used
            dy = x2.new_zeros(x2.shape, dtype=_out_dtype(x2, r2))
        dy2 = dy.reshape(x2.shape)  # (..., N) -> (M, N)
        # (torch.compile may hand a zero grad for the (0,) placeholder of an absent copy)
        dy_cast2 = dy_cast.reshape(x2.shape) if ctx.has_cast and dy_cast is not None else None
        dx, dr, dw, db = _layer_norm_bwd(dy2, dy_cast2, x2, weight, r2, mean, rstd, seed, ctx.dropout_p)
        dx = dx.view(ctx.shape)
        dres = None
        if r2 is not None:
            # Where dresidual equals dx, hand autograd the same tensor object for both, as
            # PyTorch's own `x + residual` does: autograd then copies it where both would keep
            # it (two leaves' .grad), and shares it, at no cost, where they only pass it on
            # (the model). Two views of one buffer would both become .grad, sharing storage.
            dres = dr.view(ctx.shape) if ctx.separate_dr else dx
        return (dx, dw.to(weight.dtype), db.to(ctx.bias_dtype), dres, None, None, None, None, None)


def layer_norm(x, weight, bias, eps=1e-5, residual=None, dropout_p=0.0, seed=None,
               return_dropout_mask=False, cast_dtype=None):
    """LayerNorm(dropout(x) + residual) over the last dim of x (..., N), fp32 statistics.

    weight, bias: (N,), any float dtype (grads come back in their dtype); residual: x's
    shape, any float dtype (an fp32 residual stream with bf16 x is fine), or None.
    dropout_p > 0 applies inverted dropout to x before the add, with a Philox stream
    keyed by `seed` (an int; None draws one from torch's generator, so torch.manual_seed
    reproduces it). Output in the dtype of `x + residual` (x's dtype when they match or
    without a residual).

    cast_dtype (e.g. torch.bfloat16): also return y.to(cast_dtype), written by the same
    pass. Under autocast the fp32 output feeds the residual and its half copy the next
    matmul, which then needs no cast of its own; the backward sums the two grads, as
    autograd would. Returns y, then y's copy with cast_dtype, then with
    return_dropout_mask=True the bool mask of kept elements of x.
    """
    op = "layer_norm"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    check_tensor(x, "x", x.device, op)
    check_tensor(weight, "weight", x.device, op)
    check_tensor(bias, "bias", x.device, op)
    check_triton_device(x.device, op)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    if N > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {N} exceeds the kernel's maximum {MAX_HIDDEN}; use layer_norm_ref")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (N,):
            raise ValueError(f"{op}: {name} must have shape ({N},) to match x's last dim, got {tuple(t.shape)}")
    if residual is not None:
        check_tensor(residual, "residual", x.device, op)
        if residual.shape != x.shape:
            raise ValueError(
                f"{op}: residual must match x in shape, got {tuple(residual.shape)} vs {tuple(x.shape)}"
            )
    if not eps > 0:
        raise ValueError(f"{op}: eps must be a positive float, got {eps}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1], got {dropout_p}")
    if cast_dtype is not None and cast_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{op}: cast_dtype must be torch.float16, torch.bfloat16, torch.float32 or None, "
                         f"got {cast_dtype}")
    seed_t = None
    if dropout_p > 0.0:
        seed_t = _seed_tensor(seed, x.device)
    y, y_cast, keep = LayerNormFn.apply(x, weight, bias, residual, float(eps), float(dropout_p), seed_t,
                                        bool(return_dropout_mask), cast_dtype)
    out = (y,) if cast_dtype is None else (y, y_cast)
    if return_dropout_mask:
        out += (keep if dropout_p > 0.0 else torch.ones_like(x, dtype=torch.bool),)
    return out[0] if len(out) == 1 else out


def _seed_tensor(seed, device):
    """(1,) int64 Philox seed on `device`: `seed`, or one drawn from torch's generator."""
    if seed is None:
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return torch.tensor([seed], dtype=torch.int64, device=device)


def layer_norm_ref(x, weight, bias, eps=1e-5, residual=None, dropout_p=0.0, dropout_mask=None,
                   cast_dtype=None):
    """Plain-PyTorch LayerNorm(dropout(x) + residual), computed in fp32 (fp64 inputs stay
    fp64, for gold values in tests), output in the dtype of `x + residual`.

    dropout_mask (bool, x's shape) gives the kept elements; without it torch's own
    dropout draws one when dropout_p > 0. cast_dtype: return (y, y.to(cast_dtype)).
    """
    out_dtype = _out_dtype(x, residual)
    acc = torch.promote_types(out_dtype, torch.float32)
    z = x.to(acc)
    if dropout_mask is not None:
        z = z * dropout_mask / (1.0 - dropout_p) if dropout_p < 1.0 else z * 0.0
    elif dropout_p > 0.0:
        z = torch.nn.functional.dropout(z, dropout_p)
    if residual is not None:
        z = z + residual.to(acc)
    y = torch.nn.functional.layer_norm(z, (x.shape[-1],), weight.to(acc), bias.to(acc), eps).to(out_dtype)
    return y if cast_dtype is None else (y, y.to(cast_dtype))
