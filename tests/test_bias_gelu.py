"""Tests of kernels/bias_gelu.py: the Triton bias + erf GELU against plain PyTorch.

Outputs and the gradients of x and bias on awkward shapes, judged the
flash-attention way (error against fp64 gold <= 2x PyTorch's own error in the
tested dtype + a small atol; helpers shared with test_layer_norm.py). On the CPU
the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""
import os

import pytest
import torch

from roberta_fast.kernels import bias_gelu, bias_gelu_ref
from test_layer_norm import ATOL, DTYPES, assert_fa_close, triton_or_skip

# rows 1, 7, 130 (2 leading dims), 257, 131 (prime, 3 leading dims); hidden 32, 768, 1000, 96, 48, 4100
SHAPES = [(1, 32), (7, 768), (2, 65, 1000), (257, 96), (1, 1, 131, 48), (2, 4100)]
if torch.cuda.is_available():  # the model's FFN shapes where they are cheap
    SHAPES += [(4, 512, 3072), (2, 512, 4096)]


def _inputs(shape, dtype, device, bias_dtype=None, scale=1.0):
    x = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=device).to(bias_dtype or dtype).requires_grad_()
    return x, b


def _out_and_grads(fn, x, b, dy):
    y = fn(x, b)
    return y, torch.autograd.grad(y, (x, b), dy)


def _check_against_reference(x, b, gold_as_base=False):
    """Compare output and grads with fp64 gold, bounded by PyTorch's own error (or fp16 rounding)."""
    dy = torch.randn_like(x)
    out = _out_and_grads(bias_gelu, x, b, dy)
    up = lambda t: t.detach().double().requires_grad_()
    gold = _out_and_grads(bias_gelu_ref, up(x), up(b), dy.double())
    base = _out_and_grads(bias_gelu_ref, x, b, dy)
    if gold_as_base:  # PyTorch's own path overflows: bound by rounding the gold value
        base = (gold[0].to(x.dtype), [g.to(x.dtype) for g in gold[1]])
    atol = ATOL[x.dtype]
    assert out[0].dtype == x.dtype
    assert_fa_close(out[0], gold[0], base[0], "output", atol)
    for name, leaf, g, g_gold, g_base in zip(["x", "bias"], (x, b), out[1], gold[1], base[1]):
        assert g.dtype == leaf.dtype, f"grad of {name} has dtype {g.dtype}, not {leaf.dtype}"
        assert_fa_close(g, g_gold, g_base, f"grad of {name}", atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(device, shape, dtype):
    triton_or_skip(device, dtype)
    _check_against_reference(*_inputs(shape, dtype, device))


def test_more_than_65536_rows(device):
    triton_or_skip(device)
    _check_against_reference(*_inputs((65_600, 32), torch.float32, device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_bias_with_low_precision_input(device, dtype):
    triton_or_skip(device, dtype)
    _check_against_reference(*_inputs((7, 768), dtype, device, bias_dtype=torch.float32))


def test_non_contiguous_input(device):
    triton_or_skip(device)
    x = torch.randn(96, 13, device=device).t().requires_grad_()  # (13, 96), strided
    _check_against_reference(x, _inputs((96,), torch.float32, device)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_strided_bias(device, dtype):
    """A bias with stride 2 (every other element of a buffer) is read, and its grad
    written, at its own elements: the kernels index the bias densely."""
    triton_or_skip(device, dtype)
    x, _ = _inputs((7, 96), dtype, device)
    b = torch.randn(2 * 96, device=device).to(dtype)[::2].requires_grad_()  # a strided leaf
    _check_against_reference(x, b)

    parent = torch.randn(96, 2, device=device).to(dtype).requires_grad_()  # the bias is its column 0
    dy = torch.randn_like(x)
    bias_gelu(x, parent[:, 0]).backward(dy)
    gold = parent.detach().double().requires_grad_()
    bias_gelu_ref(x.detach().double(), gold[:, 0]).backward(dy.double())
    assert_fa_close(parent.grad, gold.grad, gold.grad.to(dtype), "grad of the bias' parent", ATOL[dtype])
    assert (parent.grad[:, 1] == 0).all()


def test_fp16_large_activations(device):
    """|x + bias| up to ~6e4 in fp16: the fp32 math must not overflow (z * z, exp)."""
    triton_or_skip(device)
    x, b = _inputs((7, 768), torch.float16, device, scale=1.5e4)
    _check_against_reference(x, b, gold_as_base=True)


def test_bias_grad_is_deterministic(device):
    triton_or_skip(device)
    x, b = _inputs((130, 768), torch.float32, device)
    dy = torch.randn_like(x)
    assert torch.equal(_out_and_grads(bias_gelu, x, b, dy)[1][1], _out_and_grads(bias_gelu, x, b, dy)[1][1])


def test_torch_compile_fullgraph(device):
    triton_or_skip(device)
    x, b = _inputs((5, 48), torch.float32, device)
    torch._dynamo.reset()
    dy = torch.randn_like(x)
    eager = _out_and_grads(bias_gelu, x, b, dy)
    compiled = _out_and_grads(torch.compile(bias_gelu, backend="aot_eager", fullgraph=True), x, b, dy)
    torch.testing.assert_close(compiled[0], eager[0], atol=0, rtol=0)
    for g_c, g_e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(g_c, g_e, atol=0, rtol=0)


def test_bad_inputs_raise_clear_errors(device):
    triton_or_skip(device)
    x, b = _inputs((3, 8), torch.float32, device)
    with pytest.raises(ValueError, match="bias must have shape"):
        bias_gelu(x, b[:4])
    with pytest.raises(ValueError, match="non-empty last dimension"):
        bias_gelu(torch.zeros(3, 0, device=device), b[:0])
    with pytest.raises(TypeError, match="dtype"):
        bias_gelu(torch.ones(3, 8, dtype=torch.int32, device=device), b)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        bias_gelu(x, [0.0] * 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mismatch_and_cpu_tensors_raise():
    x, b = _inputs((3, 8), torch.float32, "cuda")
    with pytest.raises(ValueError, match="move all inputs to one device"):
        bias_gelu(x, b.detach().cpu())
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="bias_gelu_ref"):
            bias_gelu(x.detach().cpu(), b.detach().cpu())


def test_reference_linear_gelu_in_place_only_without_autograd():
    """ops.linear_gelu's plain path runs GELU in place on the matmul's fresh output when autograd does
    not need it (same values as F.gelu, inf, -inf and nan included), out of place when it does."""
    from roberta_fast.ops import gelu_fresh, linear_gelu
    x, w, b = torch.randn(5, 7, 24), torch.randn(40, 24), torch.randn(40)
    x[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
    with torch.inference_mode():
        torch.testing.assert_close(linear_gelu(x, w, b, "reference"), expected, rtol=0, atol=0, equal_nan=True)
        h = torch.randn(3, 4100)
        assert gelu_fresh(h) is h
    w.requires_grad_()
    out = linear_gelu(x[1:], w, b, "reference")
    torch.testing.assert_close(out, expected[1:], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), w)  # an in-place GELU here would overwrite what backward reads
    w_ref = w.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(torch.nn.functional.gelu(torch.nn.functional.linear(x[1:], w_ref, b)).sum(), w_ref)
    torch.testing.assert_close(grad, grad_ref)
