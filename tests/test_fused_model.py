"""The whole model: backend="fused" against backend="reference" on the same weights.

On a CPU the fused kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the model is tiny; on a GPU the same test runs on CUDA too.
"""
import os
import re
import subprocess
import sys
import textwrap

import interpreter_bf16
import pytest
import torch

import roberta_fast as rf
from roberta_fast import ops

pytest.importorskip("triton")

CONFIG = dict(vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=96, max_position_embeddings=40)


def models(device, dtype):
    torch.manual_seed(0)
    cfg = rf.RobertaConfig(**CONFIG)
    reference = rf.RobertaForMaskedLM(cfg, backend="reference")
    with torch.no_grad():  # biases and LayerNorms start at 0 and 1: make them random too
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fused = rf.RobertaForMaskedLM(cfg, backend="fused")
    fused.load_state_dict(reference.state_dict())
    return [m.to(device=device, dtype=dtype).eval() for m in (reference, fused)]


def inputs(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (3, 19), generator=g)
    ids[1, 11:] = 1  # right padding
    ids[2, 4:] = 1  # mostly padding
    mask = (ids != 1).long()
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, -100)
    labels[:, 1] = ids[:, 1]
    labels[ids == 1] = -100
    return ids.to(device), mask.to(device), labels.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_fused_model_matches_reference(device, dtype):
    interpreter_bf16.skip_unless_computed(device, dtype)
    reference, fused = models(device, dtype)
    ids, mask, labels = inputs(device)
    outs = []
    for model in (reference, fused):
        model.zero_grad()
        out = model(ids, mask, labels=labels)
        out.loss.backward()
        outs.append((out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_logits, ref_grads), (fused_logits, fused_grads) = outs
    valid = mask.bool()  # padded query rows differ by design: the kernel gives them no weight
    tol = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    scale = ref_logits[valid].abs().max()
    assert (fused_logits[valid] - ref_logits[valid]).abs().max() <= tol * scale
    for name, grad in ref_grads.items():
        err = (fused_grads[name] - grad).abs().max()
        assert err <= tol * grad.abs().max() + 1e-6, f"{name}: {err}"


def test_auto_picks_reference_on_cpu_and_fused_on_cuda():
    assert ops.resolve_backend("auto", torch.device("cpu")) == "reference"
    if torch.cuda.is_available():
        assert ops.resolve_backend("auto", torch.device("cuda")) == "fused"


def test_float64_runs_the_reference_ops_on_every_backend(device):
    """No kernel computes in float64: a float64 model runs the reference ops on backend "fused"
    and "auto", as rf.patch does, instead of failing inside a kernel."""
    assert ops.resolve_backend("auto", torch.device("cuda"), torch.float64) == "reference"
    assert ops.resolve_backend("fused", torch.device("cuda"), torch.float64) == "reference"
    reference, fused = models(device, torch.float64)
    ids, mask, labels = inputs(device)
    outs = []
    for model in (reference, fused):
        out = model(ids, mask, labels=labels)
        out.loss.backward()
        outs.append((out.logits, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_fused_on_tensors_the_kernels_cannot_take_is_refused_with_the_fix(monkeypatch):
    """Without TRITON_INTERPRET=1 the kernels take no CPU tensor: backend="fused" says so at the
    model, with the fix, not inside the first kernel."""
    monkeypatch.setattr(ops._kernels()._utils, "INTERPRET", False)  # as imported without it
    model = rf.RobertaForMaskedLM(rf.RobertaConfig(**CONFIG), backend="fused").eval()
    with pytest.raises(ValueError, match='backend="fused" runs Triton kernels.*backend="auto"'):
        model(torch.randint(3, 61, (1, 5)))
    assert ops.resolve_backend("auto", torch.device("cpu")) == "reference"


def test_interpreter_set_after_the_kernels_were_imported_is_named():
    """TRITON_INTERPRET=1 set after the kernels were imported (decorated for a GPU then) changes
    nothing: the fused model and every kernel refuse CPU tensors with the fix, where they once
    reached Triton's "0 active drivers"."""
    code = textwrap.dedent(f"""
        import os, torch
        import roberta_fast as rf
        from roberta_fast import kernels
        os.environ["TRITON_INTERPRET"] = "1"
        model = rf.RobertaModel(rf.RobertaConfig(**{CONFIG!r}), backend="fused").eval()
        x, w, t = torch.randn(2, 8), torch.ones(8), torch.zeros(2, dtype=torch.long)
        q = torch.randn(1, 4, 1, 32)
        calls = {{"model": lambda: model(torch.randint(3, 61, (2, 10))),
                  "layer_norm": lambda: kernels.layer_norm(x, w, w),
                  "bias_gelu": lambda: kernels.bias_gelu(x, w),
                  "cross_entropy": lambda: kernels.cross_entropy(x, t),
                  "attention": lambda: kernels.attention(q, q, q)}}
        for name, call in calls.items():
            try:
                call()
                print(name, "ran")
            except Exception as ex:
                print(name, type(ex).__name__, " ".join(str(ex).split()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["model", "layer_norm", "bias_gelu", "cross_entropy", "attention"]
    for line in lines:
        assert line.split()[1] == "ValueError", line
        assert re.search(r"TRITON_INTERPRET=1 (set )?before importing triton", line), line


def test_unsupported_head_dim_falls_back_with_a_warning():
    cfg = rf.RobertaConfig(**{**CONFIG, "hidden_size": 48, "num_attention_heads": 3})  # head dim 16
    model = rf.RobertaForMaskedLM(cfg, backend="fused").eval()
    with pytest.warns(UserWarning, match="head dims"):
        model(torch.randint(3, 61, (1, 5)))


def test_top_level_kernels_import_registers_nothing(monkeypatch):
    """From the repository root `kernels/` is also a top-level `kernels` (HF's kernel-hub name,
    which transformers imports to probe for it); that import must not run the kernel files
    again, which would re-register the roberta_fast:: torch ops and crash the next call."""
    import importlib
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1]))
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    top_level = importlib.import_module("kernels")
    assert top_level.__all__ == [] and "kernels.attention" not in sys.modules
    from roberta_fast.kernels import attention, attention_ref

    q = torch.randn(1, 5, 1, 32)
    torch.testing.assert_close(attention(q, q, q), attention_ref(q, q, q))


def _loss_logits_grads(model, ids, mask, labels, autocast_dtype, seed=0):
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout seeds for every model
    with torch.autocast(ids.device.type, dtype=autocast_dtype):
        out = model(ids, mask, labels=labels)
    out.loss.backward()
    return out.logits.float(), {n: p.grad.clone() for n, p in model.named_parameters()}


AUTOCAST_DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


@AUTOCAST_DTYPES
def test_fused_model_under_autocast_matches_reference(device, dtype):
    """The trainer's setting: fp32 weights under autocast (the fused LayerNorms then also write
    the half copies the next matmuls read, ops.autocast_copy_dtype)."""
    interpreter_bf16.skip_unless_computed(device, dtype)
    reference, fused = models(device, torch.float32)
    ids, mask, labels = inputs(device)
    ref_logits, ref_grads = _loss_logits_grads(reference, ids, mask, labels, dtype)
    fused_logits, fused_grads = _loss_logits_grads(fused, ids, mask, labels, dtype)
    valid = mask.bool()
    tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    scale = ref_logits[valid].abs().max()
    assert (fused_logits[valid] - ref_logits[valid]).abs().max() <= tol * scale
    for name, grad in ref_grads.items():
        assert fused_grads[name].dtype == torch.float32
        err = (fused_grads[name] - grad).abs().max()
        assert err <= tol * grad.abs().max() + 1e-6, f"{name}: {err}"


@pytest.mark.parametrize("gain", [1.0, 3e4, 1e6], ids=["in-range", "near-fp16-max", "logits-overflow"])
def test_fp16_overflow_is_the_references(device, gain):
    """fp16 autocast, as on a V100: with MLM logits beyond fp16's 65504 (the tied word embeddings
    scaled up; the embedding LayerNorm undoes that on the input side) the reference's loss is not finite, and the fused one's is not either, so the loss scaler
    skips the same step; in range, both are finite and agree. The post-LN activations stay fp32
    (the residual stream under autocast) in both paths."""
    reference, fused = models(device, torch.float32)
    with torch.no_grad():
        for model in (reference, fused):
            model.roberta.embeddings.word_embeddings.weight.mul_(gain)
    ids, mask, labels = inputs(device)
    losses = []
    for model in (reference, fused):
        with torch.autocast(device.type, dtype=torch.float16):
            out = model(ids, mask, labels=labels)
        losses.append(out.loss.float())
    ref_loss, fused_loss = losses
    assert bool(torch.isfinite(ref_loss)) == bool(torch.isfinite(fused_loss)) == (gain < 1e6), losses
    if gain < 1e6:
        torch.testing.assert_close(fused_loss, ref_loss, rtol=2e-2, atol=0)


@AUTOCAST_DTYPES
def test_layer_norm_cast_copies_change_no_bit(device, dtype, monkeypatch):
    """Training under autocast with dropout: the LayerNorm-written half copies give exactly
    the logits and grads of letting autocast cast the fp32 residual stream itself."""
    interpreter_bf16.skip_unless_computed(device, dtype)
    copy_dtypes = []
    copy_dtype = ops.autocast_copy_dtype

    def recording(x, backend):
        copy_dtypes.append(copy_dtype(x, backend))
        return copy_dtypes[-1]

    _, fused = models(device, torch.float32)
    fused.train()
    ids, mask, labels = inputs(device)
    monkeypatch.setattr(ops, "autocast_copy_dtype", recording)
    with_copies = _loss_logits_grads(fused, ids, mask, labels, dtype, seed=3)
    assert dtype in copy_dtypes, "the fused LayerNorms wrote no half copy under autocast"
    monkeypatch.setattr(ops, "autocast_copy_dtype", lambda x, backend: None)
    without = _loss_logits_grads(fused, ids, mask, labels, dtype, seed=3)
    assert torch.equal(with_copies[0], without[0])
    for name, grad in without[1].items():
        assert torch.equal(with_copies[1][name], grad), f"grad of {name} differs"


def test_torch_compile_of_the_fused_model(device, recwarn):
    """torch.compile (aot_eager: the fused ops stay opaque custom ops) gives eager's training
    step under autocast, with dropout and the masked-only head (a graph break at its nonzero),
    and without warnings about how the fused ops are reached."""
    _, fused = models(device, torch.float32)
    fused.train()
    fused.check_inputs = False
    ids, mask, labels = inputs(device)
    dtype = torch.bfloat16  # the trainer's default
    interpreter_bf16.skip_unless_computed(device, dtype)
    torch._dynamo.reset()
    targets = []  # what the compiled graphs call: the fused kernels, not the reference ops (torch 2.11's fault)

    def recording_aot_eager(graph, example_inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    compiled = torch.compile(fused, backend=recording_aot_eager)
    results = []
    for model in (compiled, fused):
        model.zero_grad()
        torch.manual_seed(3)
        with torch.autocast(device.type, dtype=dtype):
            loss = model(ids, mask, labels=labels, masked_only=True).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in fused.named_parameters()}))
    (loss_c, grads_c), (loss_e, grads_e) = results
    torch.testing.assert_close(loss_c, loss_e)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, msg=name)
    assert not [w for w in recwarn if "lru_cache" in str(w.message)]
    assert any("attention_qkvpacked" in target for target in targets), sorted(set(targets))
