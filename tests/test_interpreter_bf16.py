"""tests/interpreter_bf16.py: with its patch, Triton's CPU interpreter computes a bf16 dot and
bf16 casts as torch (and a GPU) do, so the kernels' bf16 tests can run without a GPU."""
import numpy as np
import pytest
import torch

import interpreter_bf16


def test_rounding_matches_torch():
    x = torch.randn(4096) * 10.0 ** torch.randint(-30, 30, (4096,))
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    x[4:8] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895e38])  # ties, overflow
    bits = interpreter_bf16.fp32_to_bf16_bits(x.numpy())
    widened = interpreter_bf16.bf16_bits_to_fp32(bits)
    expected = x.to(torch.bfloat16)
    assert np.array_equal(widened, expected.float().numpy(), equal_nan=True)  # NaN payloads may differ
    number = ~expected.isnan().numpy()
    assert np.array_equal(bits[number], expected.view(torch.int16).numpy().view(np.uint16)[number])


def test_interpreted_bf16_dot_and_casts_match_torch():
    if torch.cuda.is_available():
        pytest.skip("the patch is for Triton's CPU interpreter; with a CUDA GPU present the kernels compile")
    if not interpreter_bf16.ACTIVE:
        pytest.skip(interpreter_bf16.SKIP_REASON)
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(A, B, C, C16, W, N: tl.constexpr):
        i = tl.arange(0, N)
        tile = i[:, None] * N + i[None, :]
        a, b = tl.load(A + tile), tl.load(B + tile)
        c = tl.dot(a, b)  # bf16 operands, fp32 accumulator
        tl.store(C + tile, c)
        tl.store(C16 + tile, c)  # implicit fp32 -> bf16 cast of the store
        tl.store(W + tile, a.to(tl.float32) * 3.0)  # explicit widening

    n = 16
    a, b = (torch.randn(n, n).to(torch.bfloat16) for _ in range(2))
    c, c16, w = torch.empty(n, n), torch.empty(n, n, dtype=torch.bfloat16), torch.empty(n, n)
    dot_kernel[(1,)](a, b, c, c16, w, N=n)
    expected = a.double() @ b.double()  # bf16 products are exact in fp32; only the sum rounds
    assert (c.double() - expected).abs().max() < 1e-5 * expected.abs().max()
    assert torch.equal(c16, c.to(torch.bfloat16))
    assert torch.equal(w, a.float() * 3.0)
