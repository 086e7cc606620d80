"""Tests of kernels/layer_norm.py: the Triton residual+LayerNorm(+dropout) against plain PyTorch.

Outputs and the gradients of x, residual, weight and bias are compared on awkward
shapes the flash-attention way: the kernel's error against an fp64 gold value must
be at most 2x the error of PyTorch's own path in the same dtype, plus a small atol.
On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
`assert_fa_close` and `triton_or_skip` are also used by test_bias_gelu.py.
"""
import math
import os

import interpreter_bf16
import pytest
import torch
import torch.nn.functional as F

from roberta_fast.kernels import layer_norm, layer_norm_ref
from roberta_fast.kernels.layer_norm import MAX_HIDDEN

ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# rows 1, 7, 130 (2 leading dims), 257, 131 (prime, 3 leading dims); hidden 32, 768, 1000, 96, 48, 4100
SHAPES = [(1, 32), (7, 768), (2, 65, 1000), (257, 96), (1, 1, 131, 48), (2, 4100)]
if torch.cuda.is_available():  # real model shapes where they are cheap
    SHAPES += [(4, 512, 768), (2, 512, 1024), (64, 4096)]


def triton_or_skip(device, dtype=torch.float32):
    """Skip what this process cannot run: CPU tensors need the interpreter (and for bf16 its patch)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run Triton only under TRITON_INTERPRET=1; this run targets the CUDA GPU")
    interpreter_bf16.skip_unless_computed(device, dtype)


def assert_fa_close(out, gold, base, what, atol):
    """|out - gold| <= 2 |base - gold| + atol * max(1, |gold|), elementwise maxima.

    gold: fp64 reference; base: PyTorch's own computation in the tested dtype.
    """
    assert out.shape == gold.shape, f"{what}: shape {tuple(out.shape)} != {tuple(gold.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = (out.double() - gold).abs().max().item()
    base_err = (base.double() - gold).abs().max().item()
    bound = 2 * base_err + atol * max(1.0, gold.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > 2 x PyTorch's {base_err:.3g} + atol"


def _inputs(shape, dtype, device, residual=True, param_dtype=None, scale=1.0, shift=0.0):
    """x, residual (or None), weight, bias as leaf tensors needing grads."""
    n = shape[-1]
    make = lambda *s, dt=dtype: (torch.randn(*s, device=device) * scale + shift).to(dt).requires_grad_()
    x = make(*shape)
    r = make(*shape) if residual else None
    w = (1 + 0.5 * torch.randn(n, device=device)).to(param_dtype or dtype).requires_grad_()
    b = (0.5 * torch.randn(n, device=device)).to(param_dtype or dtype).requires_grad_()
    return x, r, w, b


def _out_and_grads(fn, x, r, w, b, dy):
    """Output and grads of x, residual, weight, bias (residual's omitted when None)."""
    leaves = [t for t in (x, r, w, b) if t is not None]
    y = fn(x, r, w, b)
    return y, torch.autograd.grad(y, leaves, dy)


def _gold_and_base(x, r, w, b, dy, eps=1e-5):
    """fp64 gold (layer_norm_ref) and PyTorch's own path in the inputs' dtype."""
    up = lambda t: None if t is None else t.detach().double().requires_grad_()
    gold = _out_and_grads(lambda *a: layer_norm_ref(a[0], a[2], a[3], eps, residual=a[1]),
                          up(x), up(r), up(w), up(b), dy.double())

    def torch_own(x, r, w, b):
        z = x if r is None else x + r
        return F.layer_norm(z, (x.shape[-1],), w.to(z.dtype), b.to(z.dtype), eps)

    return gold, _out_and_grads(torch_own, x, r, w, b, dy)


def _check_against_reference(x, r, w, b, eps=1e-5):
    dy = torch.randn_like(x)
    out = _out_and_grads(lambda x, r, w, b: layer_norm(x, w, b, eps, residual=r), x, r, w, b, dy)
    gold, base = _gold_and_base(x, r, w, b, dy, eps)
    names = ["x", "residual", "weight", "bias"] if r is not None else ["x", "weight", "bias"]
    assert out[0].dtype == base[0].dtype, "output dtype must be that of x + residual"
    assert_fa_close(out[0], gold[0], base[0], "output", ATOL[out[0].dtype])
    for name, leaf, g, g_gold, g_base in zip(names, [t for t in (x, r, w, b) if t is not None],
                                             out[1], gold[1], base[1]):
        assert g.dtype == leaf.dtype, f"grad of {name} has dtype {g.dtype}, not {leaf.dtype}"
        assert_fa_close(g, g_gold, g_base, f"grad of {name}", ATOL[g.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
def test_matches_reference(device, shape, dtype, residual):
    triton_or_skip(device, dtype)
    _check_against_reference(*_inputs(shape, dtype, device, residual))


def test_more_than_65536_rows(device):
    triton_or_skip(device)
    _check_against_reference(*_inputs((65_600, 32), torch.float32, device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_params_with_low_precision_input(device, dtype):
    triton_or_skip(device, dtype)
    _check_against_reference(*_inputs((7, 768), dtype, device, param_dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_residual_with_low_precision_input(device, dtype):
    """An fp32 residual stream (autocast) with half x: y in fp32, each grad in its own dtype."""
    triton_or_skip(device, dtype)
    x, _, w, b = _inputs((2, 7, 96), dtype, device, param_dtype=torch.float32)
    r = torch.randn(x.shape, device=device).requires_grad_()
    _check_against_reference(x, r, w, b)


def test_non_contiguous_input(device):
    triton_or_skip(device)
    x = torch.randn(96, 13, device=device).t().requires_grad_()  # (13, 96), strided
    _, r, w, b = _inputs((13, 96), torch.float32, device)
    _check_against_reference(x, r, w, b)


def test_leaf_x_and_residual_get_grads_of_their_own(device):
    """Without dropout dresidual equals dx; two leaves must still not share one .grad buffer,
    or a second backward (gradient accumulation) adds into both and zeroing one zeroes both.
    Non-leaf inputs (the model's) still get the one buffer, with no copy."""
    triton_or_skip(device)
    x, r, w, b = _inputs((4, 32), torch.float32, device)
    x2, r2 = (t.detach().clone().requires_grad_() for t in (x, r))
    for _ in range(2):
        dy = torch.randn_like(x)
        layer_norm(x, w, b, residual=r).backward(dy)
        layer_norm_ref(x2, w.detach(), b.detach(), residual=r2).backward(dy)
    assert x.grad.untyped_storage().data_ptr() != r.grad.untyped_storage().data_ptr()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(r.grad, r2.grad)
    x.grad.zero_()
    torch.testing.assert_close(r.grad, r2.grad)

    seen = {}
    xn, rn = x * 1, r * 1  # non-leaves: their grads only pass on
    xn.register_hook(lambda g: seen.setdefault("x", g))
    rn.register_hook(lambda g: seen.setdefault("r", g))
    layer_norm(xn, w, b, residual=rn).backward(torch.randn_like(x))
    assert seen["x"].data_ptr() == seen["r"].data_ptr()


def test_fp16_large_activations_stay_finite(device):
    """|x| ~ 4e4: x + residual (~8e4) and the variance overflow fp16, fp32 statistics do not."""
    triton_or_skip(device)
    x, r, w, b = _inputs((7, 768), torch.float16, device, scale=2e3, shift=4e4)
    assert x.abs().max() < 65504 and torch.isinf(x.detach() + r.detach()).any()
    dy = torch.randn_like(x)
    out = _out_and_grads(lambda x, r, w, b: layer_norm(x, w, b, residual=r), x, r, w, b, dy)
    gold, base = _gold_and_base(x, r, w, b, dy)
    assert not torch.isfinite(base[0]).all(), "PyTorch's fp16 path was expected to overflow here"
    # The bound is the rounding of the gold value to fp16, since PyTorch's own path has no finite error.
    assert_fa_close(out[0], gold[0], gold[0].half(), "output", ATOL[torch.float16])
    for name, g, g_gold in zip(["x", "residual", "weight", "bias"], out[1], gold[1]):
        assert_fa_close(g, g_gold, g_gold.half(), f"grad of {name}", ATOL[torch.float16])


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
def test_dropout_matches_reference_and_keep_rate(device, residual):
    triton_or_skip(device)
    p = 0.3
    x, r, w, b = _inputs((2, 257, 250), torch.float32, device, residual)  # 250: a ragged last group of 8
    dy = torch.randn_like(x)
    y, keep = layer_norm(x, w, b, residual=r, dropout_p=p, seed=1234, return_dropout_mask=True)
    assert keep.dtype == torch.bool and keep.shape == x.shape
    n = keep.numel()
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), f"keep rate {rate:.4f}, expected {1 - p}"
    # one Philox call serves 8 columns (16-bit halves of 4 words): neighbours and halves 4 apart independent
    for gap in (1, 4):
        a, c = keep[..., :-gap].double() - (1 - p), keep[..., gap:].double() - (1 - p)
        corr = ((a * c).mean() / (p * (1 - p))).item()
        assert abs(corr) < 5 / math.sqrt(a.numel()), f"columns {gap} apart correlate: {corr:.4f}"

    leaves = [t for t in (x, r, w, b) if t is not None]
    grads = torch.autograd.grad(y, leaves, dy)  # the backward regenerates the mask from the seed
    y_ref = layer_norm_ref(x, w, b, residual=r, dropout_p=p, dropout_mask=keep)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_dropout_hidden_smaller_than_a_philox_group(device, n):
    """Hidden sizes below 8 (one Philox call's columns) run in a block of 8, extra columns masked."""
    triton_or_skip(device)
    x, r, w, b = _inputs((5, 3, n), torch.float32, device)
    dy = torch.randn_like(x)
    y, keep = layer_norm(x, w, b, residual=r, dropout_p=0.5, seed=3, return_dropout_mask=True)
    assert keep.shape == x.shape and 0 < keep.sum() < keep.numel()
    grads = torch.autograd.grad(y, (x, r, w, b), dy)
    y_ref = layer_norm_ref(x, w, b, residual=r, dropout_p=0.5, dropout_mask=keep)
    grads_ref = torch.autograd.grad(y_ref, (x, r, w, b), dy)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-5)


def test_dropout_seeding(device):
    triton_or_skip(device)
    x, r, w, b = _inputs((4, 64), torch.float32, device)
    mask = lambda **kw: layer_norm(x, w, b, residual=r, dropout_p=0.5, return_dropout_mask=True, **kw)[1]
    assert torch.equal(mask(seed=1), mask(seed=1))
    assert not torch.equal(mask(seed=1), mask(seed=2))
    m = mask(seed=1)
    assert not torch.equal(m[0], m[1]), "every row must get its own random stream"
    torch.manual_seed(7)
    m1 = mask()
    torch.manual_seed(7)
    assert torch.equal(m1, mask()), "seed=None must follow torch's generator"


def test_dropout_p_one_drops_all_of_x(device):
    triton_or_skip(device)
    x, r, w, b = _inputs((3, 40), torch.float32, device)
    y = layer_norm(x, w, b, residual=r, dropout_p=1.0, seed=0)
    torch.testing.assert_close(y, layer_norm_ref(torch.zeros_like(x), w, b, residual=r))


def test_weight_grads_are_deterministic(device):
    triton_or_skip(device)
    x, r, w, b = _inputs((130, 768), torch.float32, device)
    dy = torch.randn_like(x)
    first = _out_and_grads(lambda x, r, w, b: layer_norm(x, w, b, residual=r), x, r, w, b, dy)[1]
    second = _out_and_grads(lambda x, r, w, b: layer_norm(x, w, b, residual=r), x, r, w, b, dy)[1]
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("cast_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("used", ["both", "copy_only", "y_only"])
def test_cast_copy_equals_a_separate_cast_bitwise(device, cast_dtype, used):
    """cast_dtype: y and y.to(cast_dtype) from one pass, the grads summed in one. The autocast
    residual stream (half x, fp32 residual) must give exactly what LayerNorm, then a cast,
    then autograd's sum of the two grads gives: the same bits, with dropout too."""
    triton_or_skip(device, cast_dtype)
    x, _, w, b = _inputs((3, 41, 96), cast_dtype, device, param_dtype=torch.float32)
    r = torch.randn(x.shape, device=device).requires_grad_()
    dy, dy_cast = torch.randn_like(r), torch.randn_like(r).to(cast_dtype)

    def loss(y, y_cast):  # what the model does: y feeds the next residual, y_cast a matmul
        terms = {"both": [(y, dy), (y_cast, dy_cast)], "copy_only": [(y_cast, dy_cast)],
                 "y_only": [(y, dy)]}[used]
        return sum((t.float() * g.float()).sum() for t, g in terms)

    kwargs = dict(residual=r, dropout_p=0.25, seed=5)
    y, y_cast = layer_norm(x, w, b, cast_dtype=cast_dtype, **kwargs)
    grads = torch.autograd.grad(loss(y, y_cast), (x, r, w, b))
    y_sep = layer_norm(x, w, b, **kwargs)
    grads_sep = torch.autograd.grad(loss(y_sep, y_sep.to(cast_dtype)), (x, r, w, b))

    assert y.dtype == torch.float32 and y_cast.dtype == cast_dtype and y_cast.shape == x.shape
    assert torch.equal(y, y_sep) and torch.equal(y_cast, y_sep.to(cast_dtype))
    for name, g, g_sep in zip(["x", "residual", "weight", "bias"], grads, grads_sep):
        assert torch.equal(g, g_sep), f"grad of {name} differs from LayerNorm + a separate cast"
    y_ref, y_ref_cast = layer_norm_ref(x, w, b, residual=r, dropout_p=0.25,
                                       dropout_mask=layer_norm(x, w, b, return_dropout_mask=True,
                                                               **kwargs)[1], cast_dtype=cast_dtype)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert y_ref_cast.dtype == cast_dtype


def test_cast_copy_rejects_a_non_float_dtype(device):
    triton_or_skip(device)
    x, r, w, b = _inputs((3, 8), torch.float32, device)
    with pytest.raises(ValueError, match="cast_dtype must be"):
        layer_norm(x, w, b, residual=r, cast_dtype=torch.int8)


@pytest.mark.parametrize("cast_dtype", [None, torch.float16], ids=["no_copy", "fp16_copy"])
def test_torch_compile_fullgraph(device, cast_dtype):
    triton_or_skip(device)
    x, r, w, b = _inputs((5, 48), torch.float32, device)

    def fn(x, r, w, b):
        out = layer_norm(x, w, b, 1e-5, residual=r, dropout_p=0.2, seed=11, cast_dtype=cast_dtype)
        return out if cast_dtype is None else out[0] + 2 * out[1].float()  # both grads reach x

    torch._dynamo.reset()
    dy = torch.randn_like(x)
    eager = _out_and_grads(fn, x, r, w, b, dy)
    compiled = _out_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x, r, w, b, dy)
    torch.testing.assert_close(compiled[0], eager[0], atol=0, rtol=0)
    for g_c, g_e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(g_c, g_e, atol=0, rtol=0)


def test_bad_inputs_raise_clear_errors(device):
    triton_or_skip(device)
    x, r, w, b = _inputs((3, 8), torch.float32, device)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, w[:4], b)
    with pytest.raises(ValueError, match="residual must match x"):
        layer_norm(x, w, b, residual=r[:2])
    with pytest.raises(TypeError, match="dtype"):
        layer_norm(torch.ones(3, 8, dtype=torch.int64, device=device), w, b)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        layer_norm([1.0, 2.0], w, b)
    with pytest.raises(ValueError, match="dropout_p"):
        layer_norm(x, w, b, dropout_p=1.5)
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, w, b, eps=0.0)
    with pytest.raises(TypeError, match="seed"):
        layer_norm(x, w, b, dropout_p=0.1, seed=1.5)
    big = torch.zeros(1, MAX_HIDDEN + 1, device=device)
    with pytest.raises(ValueError, match="hidden size"):
        layer_norm(big, big[0], big[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mismatch_and_cpu_tensors_raise():
    x, r, w, b = _inputs((3, 8), torch.float32, "cuda")
    with pytest.raises(ValueError, match="move all inputs to one device"):
        layer_norm(x, w.detach().cpu(), b)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="layer_norm_ref"):
            layer_norm(x.detach().cpu(), w.detach().cpu(), b.detach().cpu())
