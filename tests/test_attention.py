"""Tests of kernels/attention.py: the fused attention against attention_ref.

Tolerances follow flash-attention: the kernel's error against a higher-precision
reference (fp32 math for fp16/bf16 inputs, fp64 for fp32 inputs) must be at most
twice PyTorch's own error at the input precision plus a small atol derived from
the dtype's rounding. Every input's gradient is checked. On the CPU the kernels
run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there
is no GPU; bf16 there relies on tests/interpreter_bf16.py); larger shapes run only on a
CUDA GPU.
"""
import importlib

import interpreter_bf16
import pytest
import torch

from roberta_fast.kernels.attention import (
    SUPPORTED_HEAD_DIMS,
    _INTERPRET,
    attention,
    attention_dropout_mask,
    attention_qkvpacked,
    attention_ref,
    attention_varlen,
)

attn_module = importlib.import_module("roberta_fast.kernels.attention")  # the package's `attention` is the function

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (batch, seqlen, nheads, headdim, padding, softmax_scale): awkward lengths, 1 and 12 heads,
# each head dim, every padding pattern.
CASES = [
    (1, 1, 1, 32, "none", None),
    (1, 130, 3, 64, "none", None),  # whole key blocks (unmasked path) and a ragged tail
    (2, 7, 12, 64, "right", None),
    (3, 130, 1, 128, "left", 0.3),
    (3, 193, 2, 32, "holes", None),  # six 32-blocks and three 64-blocks, each with a one-token tail
    (3, 130, 2, 64, "all_masked_row", None),
]
if torch.cuda.is_available():
    CASES += [(4, 512, 12, 64, "right", None), (2, 1023, 3, 128, "holes", None), (3, 509, 16, 32, "none", None)]


@pytest.fixture(autouse=True)
def _default_configs(monkeypatch):
    """On a GPU run each kernel's default config: autotuning compiles every config per variant
    (minutes over this file); test_autotuned_matches_reference covers the tuned path."""
    monkeypatch.setenv("ROBERTA_FAST_AUTOTUNE", "0")


def _skip_unless_runnable(device, dtype=torch.float32, size=0):
    if device.type == "cpu" and not _INTERPRET:
        pytest.skip("CPU tensors need Triton's interpreter, which is off because a CUDA GPU is present")
    interpreter_bf16.skip_unless_computed(device, dtype)
    if device.type == "cpu" and size > 300:
        pytest.skip("needs a CUDA GPU: this shape is too slow for Triton's interpreter")


def _mask(kind, batch, seqlen, device):
    """(batch, seqlen) bool mask, 1 = attend, with the named padding pattern (None for 'none')."""
    if kind == "none":
        return None
    lengths = torch.randint(1, seqlen + 1, (batch,))
    pos = torch.arange(seqlen)
    if kind in ("right", "all_masked_row"):
        mask = pos[None, :] < lengths[:, None]
    elif kind == "left":
        mask = pos[None, :] >= seqlen - lengths[:, None]
    elif kind == "holes":
        mask = torch.rand(batch, seqlen) < 0.6
    else:
        raise AssertionError(kind)
    if kind == "all_masked_row":
        mask[0] = False
    return mask.to(device)


def _inputs(batch, seqlen, nheads, headdim, dtype, device, packed=False):
    """(leaves, split): split(leaves) -> q, k, v. packed=True makes q, k, v strided views of one
    (B, S, 3, H, D) leaf, as the model's fused QKV projection does."""
    if packed:
        qkv = torch.randn(batch, seqlen, 3, nheads, headdim, device=device, dtype=dtype, requires_grad=True)
        return (qkv,), lambda leaves: leaves[0].unbind(2)
    leaves = tuple(torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
    return leaves, lambda leaves: leaves


def _assert_flash_close(name, fast, ref, pt):
    """|fast - ref| <= 2 |pt - ref| + atol.

    atol: twice the dtype's rounding error at 0.3 (flash-attention's), plus 1e-5 of the
    magnitude, which matters only for fp32, where PyTorch's own error can be exactly 0.
    """
    ref = ref.double()
    rounded = ref.to(fast.dtype)
    atol = 2 * (rounded + 0.3 - 0.3 - rounded).abs().max().item() + 1e-5 * max(1.0, ref.abs().max().item())
    err = (fast.double() - ref).abs().max().item()
    pt_err = (pt.double() - ref).abs().max().item()
    assert err <= 2 * pt_err + atol, f"{name}: error {err:.3g} > 2 * PyTorch's {pt_err:.3g} + {atol:.3g}"


def _check_against_ref(leaves, split, mask, dout, out, grads, dropout_p=0.0, dropout_mask=None,
                       softmax_scale=None):
    """Output and gradients of `leaves` vs attention_ref in higher precision and at the input precision."""
    dtype = leaves[0].dtype
    kwargs = dict(dropout_p=dropout_p, dropout_mask=dropout_mask, softmax_scale=softmax_scale)
    results = []
    for prec, upcast in ((torch.float64 if dtype == torch.float32 else torch.float32, True), (dtype, False)):
        copies = tuple(x.detach().to(prec).requires_grad_() for x in leaves)
        o = attention_ref(*split(copies), mask, upcast=upcast, **kwargs)
        results.append((o, torch.autograd.grad(o, copies, dout.to(prec))))
    (ref, grads_ref), (pt, grads_pt) = results
    _assert_flash_close("out", out, ref, pt)
    for i, (g, g_ref, g_pt) in enumerate(zip(grads, grads_ref, grads_pt)):
        _assert_flash_close(f"grad {i}", g, g_ref, g_pt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(device, dtype, case):
    batch, seqlen, nheads, headdim, padding, scale = case
    _skip_unless_runnable(device, dtype, seqlen)
    leaves, split = _inputs(batch, seqlen, nheads, headdim, dtype, device, packed=padding == "right")
    q, k, v = split(leaves)
    mask = _mask(padding, batch, seqlen, device)
    out = attention(q, k, v, mask, softmax_scale=scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert out.shape == q.shape and out.dtype == dtype
    assert all(torch.isfinite(x).all() for x in (out, *grads))
    if padding == "all_masked_row":
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert all(torch.equal(g[0], torch.zeros_like(g[0])) for g in grads)
    _check_against_ref(leaves, split, mask, dout, out, grads, softmax_scale=scale)


def test_reference_matches_sdpa(device):
    """attention_ref itself, against torch's scaled_dot_product_attention (keys masked, no empty row)."""
    batch, seqlen, nheads, headdim = 2, 33, 3, 32
    (q, k, v), _ = _inputs(batch, seqlen, nheads, headdim, torch.float64, device)
    mask = _mask("holes", batch, seqlen, device)
    mask[:, 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask[:, None, None, :], scale=0.2).transpose(1, 2)
    torch.testing.assert_close(attention_ref(q, k, v, mask, softmax_scale=0.2), expected)
    keep = torch.rand(batch, nheads, seqlen, seqlen, device=device) > 0.25
    probs = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / headdim**0.5, dim=-1)
    torch.testing.assert_close(attention_ref(q, k, v, dropout_p=0.25, dropout_mask=keep),
                               torch.einsum("bhst,bthd->bshd", probs * keep / 0.75, v))


def test_autotuned_matches_reference(device, monkeypatch):
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU: Triton's interpreter does not autotune")
    monkeypatch.setenv("ROBERTA_FAST_AUTOTUNE", "1")
    batch, seqlen, nheads, headdim, p = 3, 300, 4, 64, 0.1
    (q, k, v), split = _inputs(batch, seqlen, nheads, headdim, torch.bfloat16, device)
    mask = _mask("holes", batch, seqlen, device)
    out = attention(q, k, v, mask, dropout_p=p, dropout_seed=21)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = attention_dropout_mask(batch, nheads, seqlen, seqlen, p, 21, device)
    _check_against_ref((q, k, v), split, mask, dout, out, grads, dropout_p=p, dropout_mask=keep)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_reference_with_exported_mask(device, dtype):
    _skip_unless_runnable(device, dtype)
    batch, seqlen, nheads, headdim, p = 2, 130, 2, 64, 0.17
    (q, k, v), split = _inputs(batch, seqlen, nheads, headdim, dtype, device)
    mask = _mask("right", batch, seqlen, device)
    out = attention(q, k, v, mask, dropout_p=p, dropout_seed=1234)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = attention_dropout_mask(batch, nheads, seqlen, seqlen, p, 1234, device)
    _check_against_ref((q, k, v), split, mask, dout, out, grads, dropout_p=p, dropout_mask=keep)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate(device, p):
    _skip_unless_runnable(device)
    keep = attention_dropout_mask(2, 3, 100, 101, p, 7, device).float()  # (B, H, Sq, Sk)
    groups = [keep, keep[..., 0::8], keep[..., 7::8], keep[:, 2], keep[1, :, :50]]  # all; column phases; head; rows
    for g in groups:
        n = g.numel()
        std = (p * (1 - p) / n) ** 0.5
        assert abs(g.mean().item() - (1 - p)) < 5 * std, f"keep rate {g.mean().item():.4f}, expected {1 - p}"
    # columns from one Philox call (8 per call: two 16-bit halves of each of its 4 words) are not
    # correlated: neighbours, and the two halves of one word (4 apart)
    for gap in (1, 4):
        a = keep[..., :-gap].flatten() - (1 - p)
        b = keep[..., gap:].flatten() - (1 - p)
        corr = (a * b).mean() / (p * (1 - p))
        assert abs(corr.item()) < 5 / a.numel() ** 0.5, f"columns {gap} apart correlate: {corr.item():.4f}"


def test_dropout_seeds_reproduce(device):
    _skip_unless_runnable(device)
    (q, k, v), _ = _inputs(2, 37, 2, 32, torch.float32, device)
    run = lambda **kw: attention(q, k, v, dropout_p=0.3, **kw)  # noqa: E731
    assert torch.equal(run(dropout_seed=5), run(dropout_seed=5))
    assert not torch.equal(run(dropout_seed=5), run(dropout_seed=6))
    torch.manual_seed(11)
    first = run()
    torch.manual_seed(11)
    assert torch.equal(first, run())
    assert not torch.equal(first, run())  # the generator advanced
    mask_a = attention_dropout_mask(1, 2, 37, 37, 0.3, 5, device)
    assert torch.equal(mask_a, attention_dropout_mask(1, 2, 37, 37, 0.3, 5, device))
    assert not torch.equal(mask_a, attention_dropout_mask(1, 2, 37, 37, 0.3, 5, device, offset=1))
    assert torch.equal(mask_a[:, :, :20, :9], attention_dropout_mask(1, 2, 20, 9, 0.3, 5, device))  # shape-free


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_varlen_equals_padded(device, dropout_p):
    _skip_unless_runnable(device)
    dtype = torch.float16
    batch, seqlen, nheads, headdim = 4, 70, 2, 32
    lengths = torch.tensor([70, 1, 33, 64])
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).to(device)
    (q, k, v), _ = _inputs(batch, seqlen, nheads, headdim, dtype, device)
    out = attention(q, k, v, mask, dropout_p=dropout_p, dropout_seed=3)
    dout = torch.randn_like(out) * mask[:, :, None, None]  # padded rows carry no gradient, as under an MLM loss
    grads = torch.autograd.grad(out, (q, k, v), dout)

    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
    packed = [x.detach()[mask].requires_grad_() for x in (q, k, v)]  # (total_tokens, H, D)
    out_v = attention_varlen(*packed, cu_seqlens, seqlen, dropout_p=dropout_p, dropout_seed=3)
    grads_v = torch.autograd.grad(out_v, packed, dout[mask])
    tol = dict(atol=2e-3, rtol=2e-3)  # same algorithm; block sizes may differ on a GPU (autotuning)
    torch.testing.assert_close(out_v, out[mask], **tol)
    for g_v, g in zip(grads_v, grads):
        torch.testing.assert_close(g_v, g[mask], **tol)


@pytest.mark.parametrize("dtype, score", [(torch.float16, -20.0), (torch.float32, -95.0)], ids=["fp16", "fp32"])
def test_rows_whose_scores_are_all_very_negative(device, dtype, score):
    """Every score ~ `score` (softmax is shift-invariant: the gradients are ordinary ones), lengths that
    end inside a key block and no key mask, as the model's unpadded batches run: keys past the end add
    nothing to dQ (they made it NaN: s = 0 there, exp(-lse) overflowed, times k = 0)."""
    _skip_unless_runnable(device, dtype)
    torch.manual_seed(0)
    headdim, lengths = 32, [100, 37]
    direction = torch.nn.functional.normalize(torch.randn(headdim), dim=0)

    def sequence(n):  # (1, n, 1, headdim) each: q . k / sqrt(headdim) ~ score for every pair
        k = direction * 4 + 0.05 * torch.randn(1, n, 1, headdim)
        q = (direction * score * headdim ** 0.5 / 4).expand(1, n, 1, headdim)
        return [x.to(device=device, dtype=dtype) for x in (q, k, torch.randn(1, n, 1, headdim))]

    seqs = [sequence(n) for n in lengths]
    douts = [torch.randn(1, n, 1, headdim, device=device, dtype=dtype) for n in lengths]
    leaves = [x.clone().requires_grad_() for x in seqs[0]]  # padded form, no mask: one sequence of 100
    out = attention(*leaves)
    _check_against_ref(leaves, lambda x: x, None, douts[0], out, torch.autograd.grad(out, leaves, douts[0]))

    packed = [torch.cat([s[i][0] for s in seqs]).requires_grad_() for i in range(3)]  # (137, 1, headdim)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    out_v = attention_varlen(*packed, cu_seqlens, max(lengths))
    grads_v = torch.autograd.grad(out_v, packed, torch.cat([d[0] for d in douts]))
    for i, (first, n) in enumerate(zip(cu_seqlens.tolist(), lengths)):
        rows = slice(first, first + n)
        _check_against_ref(seqs[i], lambda x: x, None, douts[i], out_v[rows][None], [g[rows][None] for g in grads_v])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_qkvpacked_equals_separate_tensors(device, dtype, varlen):
    """One (…, 3, H, D) tensor in, one dqkv out: the same bits as q, k, v = qkv.unbind(-3)."""
    _skip_unless_runnable(device, dtype)
    batch, seqlen, nheads, headdim = 3, 37, 2, 32
    mask = _mask("right", batch, seqlen, device)
    qkv = torch.randn(batch, seqlen, 3, nheads, headdim, device=device, dtype=dtype)
    kwargs = dict(dropout_p=0.2, dropout_seed=5)
    if varlen:  # the kept tokens of each row, packed: (total_tokens, 3, H, D)
        lengths = mask.sum(1)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        qkv = qkv[mask]
        kwargs.update(cu_seqlens=cu_seqlens, max_seqlen=seqlen)
    qkv.requires_grad_()
    out = attention_qkvpacked(qkv, None if varlen else mask, **kwargs)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    if varlen:
        cu, longest = kwargs.pop("cu_seqlens"), kwargs.pop("max_seqlen")
        out_sep = attention_varlen(*qkv.unbind(1), cu, longest, **kwargs)
    else:
        out_sep = attention(*qkv.unbind(2), mask, **kwargs)
    (dqkv_sep,) = torch.autograd.grad(out_sep, qkv, dout)
    assert torch.equal(out, out_sep) and torch.equal(dqkv, dqkv_sep)


def test_qkvpacked_torch_compile_and_bad_inputs(device):
    _skip_unless_runnable(device)
    qkv = torch.randn(2, 20, 3, 2, 32, device=device, requires_grad=True)
    mask = _mask("right", 2, 20, device)

    def loss(qkv, mask):
        return (attention_qkvpacked(qkv, mask, dropout_p=0.1, dropout_seed=4) * 2.0).square().sum()

    value_c = torch.compile(loss, backend="aot_eager", fullgraph=True)(qkv, mask)
    value = loss(qkv, mask)
    torch.testing.assert_close(value_c, value)
    torch.testing.assert_close(torch.autograd.grad(value_c, qkv)[0], torch.autograd.grad(value, qkv)[0])
    torch.library.opcheck(torch.ops.roberta_fast.attention_qkvpacked_fwd.default,
                          (qkv.detach(), mask.view(torch.uint8), None, 20, torch.tensor([3, 0], device=device),
                           0.1, 0.2))
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        attention_qkvpacked(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"qkv must be \(total_tokens, 3, nheads, headdim\)"):
        attention_qkvpacked(qkv, cu_seqlens=torch.tensor([0, 40], device=device, dtype=torch.int32), max_seqlen=20)
    with pytest.raises(ValueError, match="not both"):
        attention_qkvpacked(qkv.flatten(0, 1), mask, cu_seqlens=torch.tensor([0, 40], device=device,
                                                                             dtype=torch.int32), max_seqlen=20)


def test_deterministic_backward(device):
    _skip_unless_runnable(device)
    batch, seqlen = 2, 130
    (q, k, v), _ = _inputs(batch, seqlen, 2, 64, torch.float16, device)
    mask = _mask("holes", batch, seqlen, device)
    out = attention(q, k, v, mask, dropout_p=0.1, dropout_seed=9)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_mask_dtypes_agree(device):
    _skip_unless_runnable(device)
    (q, k, v), _ = _inputs(2, 20, 1, 32, torch.float32, device)
    mask = _mask("holes", 2, 20, device)
    outs = [attention(q, k, v, mask.to(dt)) for dt in (torch.bool, torch.int64, torch.int32, torch.float32)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_torch_compile_fullgraph(device):
    _skip_unless_runnable(device)
    (q, k, v), _ = _inputs(2, 20, 2, 32, torch.float32, device)
    mask = _mask("right", 2, 20, device)

    def loss(q, k, v, mask):
        return (attention(q, k, v, mask, dropout_p=0.1, dropout_seed=4) * 2.0).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    value_c = compiled(q, k, v, mask)
    grads_c = torch.autograd.grad(value_c, (q, k, v))
    value = loss(q, k, v, mask)
    grads = torch.autograd.grad(value, (q, k, v))
    torch.testing.assert_close(value_c, value)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)


def test_grid_keeps_batch_times_heads_off_cudas_second_axis(device, monkeypatch):
    """CUDA's second and third grid axes stop at 65,535: every launch puts batch * heads on the first
    (2^31 - 1), so 5,462 sequences of 12 heads run (they were refused). The grids are recorded by
    stand-in kernels (that many programs take minutes in the interpreter); the programs' arithmetic
    (_program_ids) is what every other test here runs."""
    _skip_unless_runnable(device)
    grids = []

    class Recorded:
        def __init__(self, meta):
            self.meta = meta

        def __getitem__(self, grid):
            grids.append(grid(self.meta) if callable(grid) else grid)
            return lambda *args, **kwargs: None

    meta = {"BLOCK_M": 16, "BLOCK_N": 16}
    monkeypatch.setattr(attn_module, "_KERNELS", {name: (Recorded(meta), configs)
                                                  for name, (_, configs) in attn_module._KERNELS.items()})
    for name in ("_attn_bwd_preprocess_kernel", "_dropout_mask_kernel"):
        monkeypatch.setattr(attn_module, name, Recorded(meta))
    batch, seqlen, nheads = 5462, 3, 12
    (q, k, v), _ = _inputs(batch, seqlen, nheads, 32, torch.float32, device)
    torch.autograd.grad(attention(q, k, v, dropout_p=0.1).sum(), (q, k, v))
    attention_dropout_mask(batch, nheads, seqlen, seqlen, 0.1, 0, device)
    assert len(grids) == 5  # forward, preprocess, dK/dV, dQ, the dropout mask
    for grid in grids:
        assert len(grid) == 1 and grid[0] % (batch * nheads) == 0 and grid[0] >= batch * nheads, grid


PAST_2_31 = """
import sys
import torch
from roberta_fast.kernels.attention import attention_qkvpacked, attention_ref

device, H, D = sys.argv[1], 2, 32
torch.manual_seed(0)


def run(storage, shape, strides, **kwargs):
    \"\"\"attention_qkvpacked on a (.., 3, H, D) view of `storage` with `strides` and its gradient, against
    attention_ref on a contiguous copy.\"\"\"
    qkv = storage.as_strided(shape, strides)
    values = torch.randn(shape, dtype=torch.float16, device=device)
    qkv.copy_(values)
    leaf = qkv.detach().requires_grad_()
    out = attention_qkvpacked(leaf, **kwargs)
    out.float().pow(2).sum().backward()
    copy = values.float().requires_grad_()
    if "cu_seqlens" in kwargs:  # packed: each sequence on its own
        cu = kwargs["cu_seqlens"].tolist()
        ref = torch.cat([attention_ref(*(t[None] for t in copy[a:b].unbind(1)))[0] for a, b in zip(cu, cu[1:])])
    else:
        ref = attention_ref(*copy.unbind(2), attention_mask=kwargs.get("attention_mask"))
    ref.pow(2).sum().backward()
    assert (out.float() - ref).abs().max() < 4e-3, (out.float() - ref).abs().max()
    assert (leaf.grad.float() - copy.grad).abs().max() < 4e-2, (leaf.grad.float() - copy.grad).abs().max()


# padded: batch 2 of (3, 5, 3, H, D) starts 2^31 elements in (batch stride 2^30); 4 GiB of address space,
# three small slabs touched
storage = torch.empty(2**31 + 5 * 3 * H * D, dtype=torch.float16, device=device)
mask = torch.ones(3, 5, dtype=torch.bool, device=device)
mask[2, 3:] = False
run(storage, (3, 5, 3, H, D), (2**30, 3 * H * D, H * D, D, 1), attention_mask=mask)
# packed: the second sequence's first token is 2^31 elements in (token stride 2^29)
cu = torch.tensor([0, 4, 5], dtype=torch.int32, device=device)
run(storage, (5, 3, H, D), (2**29, H * D, D, 1), cu_seqlens=cu, max_seqlen=4)
# one sequence spanning 2^31 elements is refused, not read wrongly
for shape, strides, kwargs in [((1, 3, 3, H, D), (0, 2**30, H * D, D, 1), {}),
                               ((5, 3, H, D), (2**29, H * D, D, 1), dict(cu_seqlens=cu, max_seqlen=5))]:
    try:
        attention_qkvpacked(storage.as_strided(shape, strides), **kwargs)
    except ValueError as err:
        assert "32-bit indexing within a sequence" in str(err), err
    else:
        raise AssertionError(f"{shape} {strides} was not refused")
print("ok")
"""


def test_offsets_past_2_31_elements(device):
    """A big batch (1M tokens of roberta-base's fused QKV: 2.4e9 elements) puts a sequence's Q, K, V more
    than 2^31 elements from the tensor's start: the kernels offset by batch and by a sequence's first token
    in 64 bits (in 32 they wrapped and read outside the tensor: a crash here, so this runs in a child
    process), and were refused before. A view with a 2^30 batch stride (2^29 token stride, packed) of 4 GiB
    of untouched memory puts a sequence there; outputs and gradients against attention_ref."""
    import subprocess
    import sys

    _skip_unless_runnable(device)
    child = subprocess.run([sys.executable, "-c", PAST_2_31, str(device)], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0 and child.stdout.strip() == "ok", (child.returncode, child.stderr[-2000:])


def test_custom_op_registration(device):
    _skip_unless_runnable(device)
    (q, k, v), _ = _inputs(1, 9, 2, 32, torch.float32, device)
    mask = _mask("holes", 1, 9, device).view(torch.uint8)
    rng = torch.tensor([3, 0], device=device)
    torch.library.opcheck(torch.ops.roberta_fast.attention_fwd.default, (q, k, v, mask, None, 9, rng, 0.1, 0.2))


def test_bad_inputs(device):
    _skip_unless_runnable(device)
    (q, k, v), _ = _inputs(2, 8, 2, 32, torch.float32, device)
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k[:, :4], v)
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k.half(), v)
    with pytest.raises(TypeError, match="dtype"):
        attention(*(x.long() for x in (q, k, v)))
    with pytest.raises(ValueError, match=r"supported head dims are \(32, 64, 128\)"):
        attention(*(torch.zeros(2, 8, 2, 48, device=device) for _ in range(3)))
    assert SUPPORTED_HEAD_DIMS == (32, 64, 128)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        attention(q, k, v, torch.ones(2, 9, device=device))
    with pytest.raises(ValueError, match="additive mask"):
        attention(q, k, v, torch.zeros(2, 8, device=device).masked_fill_(torch.rand(2, 8, device=device) < 0.5,
                                                                         float("-inf")))
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        attention(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="dropout_seed"):
        attention(q, k, v, dropout_p=0.1, dropout_seed=-3)
    packed = [x.reshape(16, 2, 32) for x in (q, k, v)]
    with pytest.raises(TypeError, match="int32"):
        attention_varlen(*packed, torch.tensor([0, 8, 16], device=device), 8)
    with pytest.raises(ValueError, match="total_tokens"):
        attention_varlen(*packed, torch.tensor([0, 8, 15], device=device, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="max_seqlen"):
        attention_varlen(*packed, torch.tensor([0, 4, 16], device=device, dtype=torch.int32), 8)


def test_fp32_dots_follow_torchs_matmul_precision():
    """IEEE fp32 by default (parity); TF32 (tensor cores) only where the user allows it for matmuls."""
    from roberta_fast.kernels.attention import _dot_precision

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert _dot_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert _dot_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_autotuning_off_tries_the_head_dims_default_then_smaller_tiles():
    """ROBERTA_FAST_AUTOTUNE=0: the head dim's spill-free default first (benchmarks/compile_report.py),
    then the configs after it, down to the 32x32 tile that fits any GPU's shared memory."""
    import importlib

    attn = importlib.import_module("roberta_fast.kernels.attention")  # the module, not the function

    def tiles(name, head_dim):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in attn.default_order(name, head_dim)]

    assert tiles("fwd", 64)[0] == (128, 64, 8, 3) and tiles("fwd", 128)[0] == (64, 64, 8, 3)
    assert tiles("dkdv", 64)[0] == (32, 128, 8, 2) and tiles("dkdv", 128)[0] == (32, 64, 8, 3)
    assert tiles("dq", 64)[0] == tiles("dq", 128)[0] == (128, 32, 8, 3)
    for name in ("fwd", "dkdv", "dq"):
        for head_dim in (32, 64, 128):
            assert tiles(name, head_dim)[-1] == (32, 32, 4, 2)
