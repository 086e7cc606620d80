"""Tests of kernels/cross_entropy.py: the Triton cross-entropy against PyTorch's.

The loss and the logits' grad are compared the flash-attention way: the kernel's
error against an fp64 gold value must be at most 2x the error of PyTorch's own path
(fp32 math, as autocast runs cross_entropy) plus a small atol. Small vocabulary
chunks make the kernels loop over several chunks with a ragged last one, as they do
over RoBERTa's 50,265 ids on a GPU.
"""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from roberta_fast.kernels import cross_entropy, cross_entropy_ref
from test_layer_norm import assert_fa_close, triton_or_skip

ce_module = importlib.import_module("roberta_fast.kernels.cross_entropy")  # the name alone is the function

# (rows, vocab): one row and one class, odd vocabularies, more rows than a GPU wave
SHAPES = [(1, 1), (7, 50), (33, 1000), (5, 5003)]
if torch.cuda.is_available():
    SHAPES += [(2458, 50265), (40_000, 128)]


@pytest.fixture
def small_chunks(monkeypatch):
    """Vocabulary chunks of 16 (64 under the interpreter): several loop steps and a ragged tail."""
    monkeypatch.setattr(ce_module, "MAX_BLOCK_V", 16)


def _logits_and_target(rows, vocab, dtype, device, scale=3.0, ignored=0.25):
    logits = (torch.randn(rows, vocab, device=device) * scale).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device=device)
    target[torch.rand(rows, device=device) < ignored] = -100
    return logits, target


def _check(logits, target, reduction, atol):
    out = cross_entropy(logits, target, reduction=reduction)
    base = cross_entropy_ref(logits, target, reduction=reduction)
    gold_logits = logits.detach().double().requires_grad_()
    gold = F.cross_entropy(gold_logits, target, reduction=reduction)
    dy = torch.randn_like(gold) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, logits, dy.to(out.dtype))
    (grad_base,) = torch.autograd.grad(base, logits, dy.to(base.dtype))
    (grad_gold,) = torch.autograd.grad(gold, gold_logits, dy)
    assert out.dtype == torch.float32 and grad.dtype == logits.dtype
    assert_fa_close(out, gold, base, "loss", atol)
    assert_fa_close(grad, grad_gold, grad_base, "grad of logits", atol)


# Every dtype with per-row losses and per-row upstream gradients ("none", the most demanding);
# the mean and sum reductions (the same kernel, scaled after it) in fp16, the V100's training dtype.
@pytest.mark.parametrize("reduction, dtype", [
    ("none", torch.float32), ("none", torch.float16), ("none", torch.bfloat16),
    ("mean", torch.float16), ("sum", torch.float16)], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_pytorch(device, small_chunks, shape, dtype, reduction):
    triton_or_skip(device, dtype)
    _check(*_logits_and_target(*shape, dtype, device), reduction, atol=1e-5)


def test_large_fp16_logits_stay_finite(device, small_chunks):
    """|logits| up to ~4e4, near fp16's limit: exp overflows unless the max is taken first."""
    triton_or_skip(device)
    logits, target = _logits_and_target(6, 300, torch.float16, device, scale=1e4)
    assert torch.isfinite(logits).all()
    _check(logits, target, "mean", atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_minus_inf_logits(device, small_chunks, dtype):
    """-inf logits (a sub-vocabulary): a first chunk all -inf once gave exp(-inf - -inf) = NaN.

    Rows: the first chunk -inf; all -inf but the target (loss 0, grad 0); -inf in the
    first and a middle chunk; a plain row. A row entirely -inf gives NaN, as PyTorch's.
    """
    triton_or_skip(device, dtype)
    logits, target = _logits_and_target(4, 200, dtype, device, ignored=0.0)
    logits = logits.detach()
    target[:3] = torch.tensor([150, 130, 199])
    logits[0, :64] = float("-inf")  # 64: the chunk under the interpreter (16 on a GPU)
    logits[1, :130] = logits[1, 131:] = float("-inf")
    logits[2, :70] = logits[2, 100:190] = float("-inf")
    _check(logits.requires_grad_(), target, "none", atol=1e-5)

    every = torch.full((1, 200), float("-inf"), dtype=dtype, device=device)
    t = torch.tensor([7], device=device)
    assert torch.isnan(cross_entropy(every, t, reduction="none")).all()
    assert torch.isnan(F.cross_entropy(every.float(), t, reduction="none")).all()


def test_every_row_ignored(device):
    triton_or_skip(device)
    logits = torch.randn(4, 10, device=device, requires_grad=True)
    target = torch.full((4,), -100, device=device)
    assert torch.isnan(cross_entropy(logits, target)) and torch.isnan(cross_entropy_ref(logits, target))
    loss = cross_entropy(logits, target, reduction="sum")
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_custom_ignore_index_and_int32_targets(device):
    triton_or_skip(device)
    logits, target = _logits_and_target(9, 31, torch.float32, device, ignored=0.0)
    target[::3] = 5  # class 5 is the ignored one
    out = cross_entropy(logits, target.int(), ignore_index=5)
    torch.testing.assert_close(out, F.cross_entropy(logits, target, ignore_index=5))


def test_bad_targets_raise_or_give_nan(device):
    triton_or_skip(device)
    logits, target = _logits_and_target(4, 10, torch.float32, device, ignored=0.0)
    target[2] = 10
    with pytest.raises(ValueError, match=r"target holds 10, outside \[0, 10\)"):
        cross_entropy(logits, target)
    per_row = cross_entropy(logits, target, reduction="none", validate=False)  # no out-of-bounds read
    assert torch.isnan(per_row[2]) and torch.isfinite(per_row[[0, 1, 3]]).all()
    with pytest.raises(TypeError, match="int64 or int32"):
        cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="must be \\(rows, vocab\\)"):
        cross_entropy(logits[None], target)
    with pytest.raises(ValueError, match="shape \\(4,\\)"):
        cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, target, reduction="avg")


def test_non_contiguous_logits(device):
    triton_or_skip(device)
    logits = torch.randn(50, 6, device=device).t().requires_grad_()  # (6, 50), column-major
    target = torch.randint(0, 50, (6,), device=device)
    _check(logits, target, "mean", atol=1e-5)


def test_torch_compile_fullgraph(device):
    triton_or_skip(device)
    logits, target = _logits_and_target(6, 40, torch.float32, device)

    def fn(logits, target):
        return cross_entropy(logits * 2.0, target, validate=False)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    value_c, value = compiled(logits, target), fn(logits, target)
    torch.testing.assert_close(value_c, value)
    torch.testing.assert_close(torch.autograd.grad(value_c, logits)[0], torch.autograd.grad(value, logits)[0])
    assert math.isfinite(value.item())
