"""Bias add + erf GELU (RoBERTa's "gelu") in Triton, forward and backward in one pass each.

    y = gelu(x + bias),  gelu(z) = z * Phi(z) = 0.5 * z * (1 + erf(z / sqrt(2)))

The FFN-in matmul runs without its bias and this kernel adds it, so the
pre-activation is read once and the activation written once. The backward
recomputes z = x + bias from the saved inputs (storing nothing extra) and
applies gelu'(z) = Phi(z) + z * phi(z); dbias is reduced without atomics
(partial sums per program over rows, then a sum over programs: deterministic).
Math is fp32 whatever the input dtype; the output is in x's dtype.

Layout as kernels/layer_norm.py (whose device/dtype helpers it shares): kernels,
custom-op launchers with fake implementations (torch.compile-safe), one
autograd.Function, a functional alias, and `bias_gelu_ref` in plain PyTorch.
Runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (tests).
Not yet measured on a GPU: see benchmarks/bench_bias_gelu.py.
"""
import torch
import triton
import triton.language as tl

from ._utils import LAUNCH_OPTIONS, check_tensor, check_triton_device, num_programs, on_device, tile_shape

MAX_BLOCK_N = 256  # column tile; divides 768, 1024, 3072 and 4096


@triton.jit
def _gelu_parts(z):
    """(Phi(z), phi(z)): the standard normal CDF and density, fp32."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return cdf, pdf


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program computes one (BLOCK_M, BLOCK_N) tile of y."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]  # (BLOCK_M, BLOCK_N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
    cdf, _ = _gelu_parts(z)
    tl.store(Y + offs, (z * cdf).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, DB_PART, M, N, rows_per_program,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (i, j) walks rows [i * rows_per_program, ...) of column tile j.

    dx = dy * gelu'(x + b); this program's column sums of dx go to row i of DB_PART.
    """
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = pid_m * rows_per_program  # rows_per_program is a multiple of BLOCK_M
    for row0 in range(start, start + rows_per_program, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]  # (BLOCK_M, BLOCK_N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        cdf, pdf = _gelu_parts(z)
        dz = dy * (cdf + z * pdf)  # zero where masked, since dy is
        db_acc += dz
        tl.store(DX + offs, dz.to(DX.dtype.element_ty), mask=mask)
    tl.store(DB_PART + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


@torch.library.custom_op("roberta_fast::bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x: (M, N), bias: (N,) -> gelu(x + bias) (M, N) in x's dtype."""
    x, bias = x.contiguous(), bias.contiguous()  # the kernels index both densely (a bias slice may be strided)
    M, N = x.shape
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    block_m, block_n, num_warps = tile_shape(N, M, x.device, MAX_BLOCK_N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    with on_device(x.device):
        _bias_gelu_fwd_kernel[grid](x, bias, y, M, N, BLOCK_M=block_m, BLOCK_N=block_n,
                                    num_warps=num_warps, **LAUNCH_OPTIONS)
    return y


@_bias_gelu_fwd.register_fake
def _(x, bias):
    return torch.empty_like(x)


@torch.library.custom_op("roberta_fast::bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> dx (M, N) in x's dtype, dbias (N,) fp32."""
    dy, x, bias = dy.contiguous(), x.contiguous(), bias.contiguous()
    M, N = x.shape
    dx = torch.empty_like(x)
    block_m, block_n, num_warps = tile_shape(N, M, x.device, MAX_BLOCK_N)
    col_tiles = triton.cdiv(N, block_n)
    row_programs = max(1, num_programs(x.device) // col_tiles)
    rows_per_program = block_m * triton.cdiv(M, block_m * row_programs)
    row_programs = triton.cdiv(M, rows_per_program) if M else 0
    # every program writes its row of partial sums for its columns: no zero-fill needed
    db_part = torch.empty((row_programs, N), dtype=torch.float32, device=x.device)
    if x.numel():
        with on_device(x.device):
            _bias_gelu_bwd_kernel[(row_programs, col_tiles)](
                dy, x, bias, dx, db_part, M, N, rows_per_program,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **LAUNCH_OPTIONS,
            )
    return dx, db_part.sum(0)


@_bias_gelu_bwd.register_fake
def _(dy, x, bias):
    return torch.empty_like(x), x.new_empty((x.shape[1],), dtype=torch.float32)


class BiasGeluFn(torch.autograd.Function):
    """gelu(x + bias); saves only x and bias, the backward recomputes x + bias."""

    @staticmethod
    def forward(ctx, x, bias):
        x2 = x.reshape(-1, x.shape[-1])  # (..., N) -> (M, N)
        ctx.save_for_backward(x2, bias)
        ctx.shape = x.shape
        return _bias_gelu_fwd(x2, bias).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, db = _bias_gelu_bwd(dy.reshape(x2.shape), x2, bias)  # (..., N) -> (M, N)
        return dx.view(ctx.shape), db.to(bias.dtype)


def bias_gelu(x, bias):
    """erf GELU of x + bias for x (..., N) and bias (N,); output in x's dtype.

    bias may be fp32 while x is fp16/bf16 (its grad comes back in its own dtype).
    """
    op = "bias_gelu"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    check_tensor(x, "x", x.device, op)
    check_tensor(bias, "bias", x.device, op)
    check_triton_device(x.device, op)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if bias.shape != (x.shape[-1],):
        raise ValueError(
            f"{op}: bias must have shape (N,) with N = x.shape[-1]; got x {tuple(x.shape)}, "
            f"bias {tuple(bias.shape)}"
        )
    return BiasGeluFn.apply(x, bias)


def bias_gelu_ref(x, bias):
    """Plain PyTorch, as Hugging Face computes it: gelu(x + bias) in x's dtype."""
    return torch.nn.functional.gelu(x + bias.to(x.dtype))
