"""Which attention the fused backend runs on which GPU: ops.attention_impl, the one place.

Below sm_80 (V100 sm_70, T4 sm_75) Triton >= 3.2 lowers tl.dot to FMA, so the fused
backend runs SDPA's memory-efficient kernel there (fp16 tensor cores) for padded,
unpadded and packed batches, and keeps the element-wise Triton kernels. Without a GPU
the capability is faked at ops.device_capability and the fused model runs on the CPU
(Triton's interpreter for the element-wise kernels, SDPA's CPU kernels for attention):
the dispatch and the layouts are what is tested here; the GPU kernels' arithmetic is
SDPA's own.
"""
import pytest
import torch

import roberta_fast as rf
from roberta_fast import ops

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")  # CPU fallback

CONFIG = dict(vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=96, max_position_embeddings=40)


@pytest.mark.parametrize("capability, impl", [((7, 0), "sdpa"), ((7, 5), "sdpa"), ((8, 0), "triton"),
                                              ((8, 6), "triton"), ((9, 0), "triton")])
def test_attention_impl_by_capability(monkeypatch, capability, impl):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(ops, "device_capability", lambda device: capability)
    assert ops.attention_impl(torch.device("cuda")) == impl
    assert ops.unpad_impl("fused", torch.device("cuda"), 64) == ("triton" if impl == "triton" else "sdpa-nested")
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: no MMAv1 question, Triton's dot has matrix cores
    assert ops.attention_impl(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("capability, words", [((7, 0), "memory-efficient kernel (sm_70"),
                                               ((7, 5), "memory-efficient kernel (sm_75"),
                                               ((8, 0), "Triton flash-style kernel"), ((9, 0), "Triton flash-style kernel")])
def test_a_faked_v100_or_t4_is_described_as_fp16_with_sdpa_attention(monkeypatch, capability, words):
    """What `python -m roberta_fast.train` prints at startup on each GPU: the precision auto chose and
    why (precision.explain), and the attention the fused backend runs (ops.describe_attention)."""
    from roberta_fast.precision import explain

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(ops, "device_capability", lambda device: capability)
    gpu = torch.device("cuda", 0)
    assert words in ops.describe_attention("fused", gpu)
    assert ops.describe_attention("reference", gpu) == "PyTorch SDPA (reference backend)"
    expected = "fp16 autocast with dynamic loss scaling" if capability < (8, 0) else "bf16 autocast"
    assert expected in explain("auto", gpu)


def test_cpu_keeps_the_triton_kernel_for_the_interpreter():
    assert ops.device_capability(torch.device("cpu")) is None
    assert ops.attention_impl(torch.device("cpu")) == "triton"


class Spy:
    """Counts calls of a function it stands in for (or refuses them)."""

    def __init__(self, fn=None):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fn is None:
            raise AssertionError("called where the dispatcher should not launch it")
        return self.fn(*args, **kwargs)


def models():
    torch.manual_seed(0)
    cfg = rf.RobertaConfig(**CONFIG)
    reference = rf.RobertaForMaskedLM(cfg, backend="reference")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fused = rf.RobertaForMaskedLM(cfg, backend="fused")
    fused.load_state_dict(reference.state_dict())
    return reference.eval(), fused.eval()  # no dropout: the two must agree


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (3, 19), generator=g)
    ids[1, 11:] = 1
    ids[2, 4:] = 1
    mask = (ids != 1).long()
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, -100)
    labels[ids == 1] = -100
    labels[:, 1] = ids[:, 1]
    return ids, mask, labels


def run(model, ids, mask, labels, **kwargs):
    model.zero_grad()
    out = model(ids, mask, labels=labels, **kwargs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["padded", "unpadded", "packed"])
def test_below_sm80_the_fused_model_runs_sdpa_attention_and_the_triton_elementwise_kernels(monkeypatch, layout):
    """Faked sm_70: no Triton attention launch, SDPA under the efficient-kernel preference,
    LayerNorm / bias+GELU / cross-entropy still Triton; logits and every gradient as the reference."""
    reference, fused = models()
    kernels = ops._kernels()
    monkeypatch.setattr(ops, "device_capability", lambda device: (7, 0))
    monkeypatch.setattr(kernels, "attention_qkvpacked", Spy())  # refuses: must not run below sm_80
    sdpa = Spy(ops._sdpa_tensor_cores)
    monkeypatch.setattr(ops, "_sdpa_tensor_cores", sdpa)
    nested = Spy(ops._attention_varlen_nested)
    monkeypatch.setattr(ops, "_attention_varlen_nested", nested)
    gelu = Spy(kernels.bias_gelu)
    monkeypatch.setattr(kernels, "bias_gelu", gelu)
    from torch.nested._internal import nested_tensor, sdpa as nested_sdpa

    # SDPA's nested backend choice on a GPU checks the shortest sequence of q, k and v for the
    # efficient kernel and reads it from the device when not given: a host sync each. Run that check
    # as on a GPU (then math, as the CPU has no efficient kernel) and count the reads.
    extreme_reads = Spy(nested_tensor._get_sdpa_extreme_seqlen)
    monkeypatch.setattr(nested_tensor, "_get_sdpa_extreme_seqlen", extreme_reads)
    jagged_check = nested_sdpa._can_use_efficient_sdpa_jagged

    def efficient_check_then_math(params, debug=False):
        jagged_check(params, debug)
        return False

    monkeypatch.setattr(nested_sdpa, "can_use_efficient_attention", lambda params, debug=False: True)
    monkeypatch.setattr(nested_sdpa, "_can_use_efficient_sdpa_jagged", efficient_check_then_math)
    ids, mask, labels = batch()
    kwargs, call_mask = {}, mask
    if layout == "padded":
        fused.roberta.unpad = False
    if layout == "packed":  # row 0 holds two documents: 7 + 12 tokens
        mask = torch.ones_like(mask)
        ids, labels = ids.clone(), labels.clone()
        ids[1:] = ids[0]
        labels[1:] = labels[0]
        cu_seqlens = torch.tensor([0, 7, 19, 26, 38, 45, 57], dtype=torch.int32)
        position_ids = torch.cat([torch.arange(7), torch.arange(12)]).repeat(3, 1) + 2
        kwargs, call_mask = dict(cu_seqlens=cu_seqlens, max_seqlen=12, position_ids=position_ids), None
    ref_logits, ref_grads = run(reference, ids, call_mask, labels, **kwargs)
    logits, grads = run(fused, ids, call_mask, labels, **kwargs)

    layers = CONFIG["num_hidden_layers"]
    assert sdpa.calls == layers and gelu.calls >= layers
    assert nested.calls == (0 if layout == "padded" else layers)
    assert extreme_reads.calls == 0  # both extremes passed in, forward and backward
    valid = mask.bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=2e-5, rtol=2e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-5, rtol=2e-4, msg=name)


def test_at_sm80_the_fused_model_launches_the_triton_attention(monkeypatch):
    """The check above can fail: at sm_80 the Triton kernel runs and SDPA does not."""
    _, fused = models()
    kernels = ops._kernels()
    monkeypatch.setattr(ops, "device_capability", lambda device: (8, 0))
    triton_attention = Spy(kernels.attention_qkvpacked)
    monkeypatch.setattr(kernels, "attention_qkvpacked", triton_attention)
    monkeypatch.setattr(ops, "_sdpa_tensor_cores", Spy())
    run(fused, *batch())
    assert triton_attention.calls == CONFIG["num_hidden_layers"]


def test_sdpa_tensor_cores_prefers_the_efficient_kernel(monkeypatch):
    """The backends SDPA may pick below sm_80: memory-efficient first, math only as the fallback
    (flash needs sm_80; cuDNN's is not asked for)."""
    from torch.nn import attention

    seen = []
    real = attention.sdpa_kernel

    def recording(backends, *args, **kwargs):
        seen.append(list(backends))
        return real(backends, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_kernel", recording)
    q = torch.randn(2, 2, 5, 8)
    out = ops._sdpa_tensor_cores(q, q, q)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert seen == [[attention.SDPBackend.EFFICIENT_ATTENTION, attention.SDPBackend.MATH]]


def test_nested_varlen_attention_keeps_documents_apart_with_dropout():
    """The packed layout below sm_80: each document attends only within itself, dropout included
    (a zero-length document, a fully padded row, is allowed)."""
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    qkv = torch.randn(12, 3, 2, 8)
    expected = ops.attention_varlen_sdpa(qkv, cu_seqlens, 0.0)
    torch.testing.assert_close(ops._attention_varlen_nested(qkv, cu_seqlens, 7, 0.0), expected)
    changed = qkv.clone()
    changed[5:, 1:] += 1.0  # keys and values of the last document only
    out = ops._attention_varlen_nested(changed, cu_seqlens, 7, 0.0)
    torch.testing.assert_close(out[:5], expected[:5])
    dropped = ops._attention_varlen_nested(qkv, cu_seqlens, 7, 0.5)
    assert dropped.shape == expected.shape and not torch.allclose(dropped, expected)


def test_patched_transformers_model_below_sm80_runs_sdpa_not_triton_attention(monkeypatch):
    """rf.patch on a (faked) V100: transformers' SDPA under the efficient-kernel preference, no Triton
    attention launch; outputs and gradients as the unpatched model's."""
    import copy

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=40)
    original = transformers.RobertaModel(cfg).eval()
    patched = rf.patch(copy.deepcopy(original))
    kernels = ops._kernels()
    monkeypatch.setattr(ops, "device_capability", lambda device: (7, 0))
    monkeypatch.setattr(kernels, "attention", Spy())  # refuses: must not run below sm_80
    preferred = Spy(ops.efficient_sdpa)
    monkeypatch.setattr(ops, "efficient_sdpa", preferred)
    ids, mask, _ = batch()
    weights = torch.randn(int(mask.sum()), cfg.hidden_size)
    outs = []
    for model in (original, patched):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        (hidden * weights).sum().backward()  # not a sum of squares: LayerNorm's output makes that constant
        outs.append((hidden, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = outs
    assert preferred.calls == cfg.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        if grad is not None:  # relative to the largest: sums of many rows round differently
            assert (got_grads[name] - grad).abs().max() <= 2e-5 * grad.abs().max() + 1e-7, name


def test_sm80_leaves_sdpa_its_own_choice_for_what_triton_does_not_take(monkeypatch):
    """On sm_80+ a head dim the Triton kernel lacks goes to plain SDPA (flash stays possible there),
    not to the below-sm_80 efficient-kernel preference."""
    monkeypatch.setattr(ops, "device_capability", lambda device: (8, 0))
    monkeypatch.setattr(ops, "_sdpa_tensor_cores", Spy())  # refuses
    qkv = torch.randn(2, 5, 3, 2, 8)  # head dim 8: not one of the kernel's
    ops._warn_once.cache_clear()  # the warning is given once per process
    with pytest.warns(UserWarning, match="head dims"):
        out = ops.attention(qkv, torch.ones(2, 5, dtype=torch.bool), 0.0, "fused")
    expected = ops.attention(qkv, torch.ones(2, 5, dtype=torch.bool), 0.0, "reference")
    torch.testing.assert_close(out, expected)


def test_exporting_reads_torch_exports_flag(monkeypatch):
    """ops.exporting() is True under torch.export only. torch 2.11's Dynamo folds
    torch.compiler.is_exporting() to True in every torch.compile trace (pytorch#176347), which made
    a compiled fused model run the reference ops and a compiled prepacked model fail to lower."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(ops.exporting())
            return x + 1

    torch.export.export(Probe(), (torch.ones(2),), strict=False)
    assert seen[-1] is True and ops.exporting() is False
    if hasattr(torch.compiler, "_is_exporting_flag"):  # (torch 2.6 has neither it nor is_exporting)
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # what torch 2.11 answers under compile
        assert ops.exporting() is False
        monkeypatch.delattr(torch.compiler, "_is_exporting_flag")  # a torch without the flag
        assert ops.exporting() is True
