"""The drop-in encoder: same outputs as transformers for the same weights.

RobertaModel and RobertaForSequenceClassification against HF on padded batches of every
pattern, with the reference backend and with the fused one (padded and unpadded), and
output_attentions / hidden states as HF returns them.
"""
import pytest
import torch

import roberta_fast as rf
from roberta_fast.hf import native_to_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

FIELDS = dict(vocab_size=71, hidden_size=32, num_hidden_layers=2, num_attention_heads=1,
              intermediate_size=48, max_position_embeddings=24, type_vocab_size=1, layer_norm_eps=1e-5)
PATTERNS = ["none", "right", "left", "holes"]


def hf_model(cls, **extra):
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.RobertaConfig(**FIELDS, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def padded_batch(pattern, seed=0):
    """(ids, mask) of 4 rows of 22 tokens; every row keeps its first token attended."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, FIELDS["vocab_size"], (4, 22), generator=g)
    lengths = torch.tensor([22, 1, 9, 17])
    pos = torch.arange(22)[None]
    mask = {"none": torch.ones(4, 22, dtype=torch.bool),
            "right": pos < lengths[:, None],
            "left": pos >= 22 - lengths[:, None],
            "holes": torch.rand(4, 22, generator=g) < 0.5}[pattern]
    mask[:, 0] |= pattern != "left"
    if pattern in ("right", "left"):
        ids[~mask] = 1
    return ids, mask.long()


def rel_err(a, b, floor=1e-6):
    """max |a - b| relative to max |b|; `floor` keeps mathematically-zero gradients
    (the key bias: softmax ignores it) from dividing rounding noise by ~0."""
    return ((a - b).abs().max() / max(b.abs().max().item(), floor / 1e-5)).item()


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("backend, unpad", [("reference", False), ("fused", False), ("fused", True)],
                         ids=["reference", "fused-padded", "fused-unpadded"])
def test_encoder_matches_transformers(pattern, backend, unpad):
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf, backend=backend).eval()
    ours.unpad = unpad
    ids, mask = padded_batch(pattern)
    expected = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    actual = ours(ids, attention_mask=mask, output_hidden_states=True)
    valid = mask.bool()
    assert rel_err(actual.last_hidden_state[valid], expected.last_hidden_state[valid]) < 1e-5
    if not valid.all():  # the unpadded path ran (it re-pads with zeros); the padded one computes them
        assert (actual.last_hidden_state[~valid] == 0).all() == unpad
    for got, want in zip(actual.hidden_states, expected.hidden_states, strict=True):
        assert rel_err(got[valid], want[valid]) < 1e-5
    if pattern != "left":  # the pooler reads position 0, which left padding masks
        assert rel_err(actual.pooler_output, expected.pooler_output) < 1e-5
    # gradients through the valid outputs, for every parameter
    weight = torch.randn_like(expected.last_hidden_state) * valid[..., None]
    (expected.last_hidden_state * weight).sum().backward()
    (actual.last_hidden_state * weight).sum().backward()
    grads = native_to_hf({n: p.grad for n, p in ours.named_parameters()})
    for name, p in hf.named_parameters():
        if p.grad is None:  # the pooler: not part of this loss
            assert grads[name] is None, name
            continue
        assert rel_err(grads[name], p.grad) < 2e-5, name


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_sequence_classification_matches_transformers(backend, tmp_path):
    hf = hf_model("RobertaForSequenceClassification", num_labels=3)
    hf.save_pretrained(tmp_path)
    ours = rf.RobertaForSequenceClassification.from_pretrained(tmp_path, backend=backend).eval()
    assert ours.num_labels == 3
    ids, mask = padded_batch("right", seed=1)
    labels = torch.tensor([0, 2, 1, 2])
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
    actual = ours(ids, attention_mask=mask, labels=labels)
    assert rel_err(actual.logits, expected.logits) < 1e-5
    assert rel_err(actual.loss, expected.loss) < 1e-5
    expected.loss.backward()
    actual.loss.backward()
    grads = native_to_hf({n: p.grad for n, p in ours.named_parameters()}, prefix="roberta.")
    for name, p in hf.named_parameters():
        assert rel_err(grads[name], p.grad) < 2e-5, name
    ours.save_pretrained(tmp_path / "resaved")
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "resaved", output_loading_info=True)
    assert all(not v for v in info.values()), info
    torch.testing.assert_close(back.eval()(input_ids=ids, attention_mask=mask).logits, expected.logits)


def test_regression_and_multilabel_losses_follow_transformers():
    for num_labels, labels in ((1, torch.randn(4)), (3, torch.randint(0, 2, (4, 3)).float())):
        hf = hf_model("RobertaForSequenceClassification", num_labels=num_labels)
        ours = rf.RobertaForSequenceClassification.from_pretrained(hf).eval()
        ids, mask = padded_batch("right", seed=2)
        expected = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        assert rel_err(ours(ids, attention_mask=mask, labels=labels).loss, expected) < 1e-5


def test_output_attentions_falls_back_to_reference_with_a_warning():
    hf = hf_model("RobertaModel")
    hf.set_attn_implementation("eager")
    ours = rf.RobertaModel.from_pretrained(hf, backend="fused").eval()
    ids, mask = padded_batch("right")
    expected = hf(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    with pytest.warns(UserWarning, match="output_attentions"):
        actual = ours(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert rel_err(got, want) < 1e-5


def test_return_dict_false_gives_a_tuple():
    ours = rf.RobertaModel(rf.RobertaConfig(**FIELDS)).eval()
    ids, mask = padded_batch("right")
    out = ours(ids, attention_mask=mask, return_dict=False)
    assert isinstance(out, tuple) and torch.equal(out[0], ours(ids, attention_mask=mask).last_hidden_state)


@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification"])
@pytest.mark.parametrize("pattern", ["right", "holes"])
def test_patch_keeps_outputs_and_gradients(cls, pattern):
    import copy

    original = hf_model(cls)
    patched = rf.patch(copy.deepcopy(original))
    assert patched.config._attn_implementation == "roberta_fast"
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    ids, mask = padded_batch(pattern, seed=3)
    outs = []
    for model in (original, patched):
        out = model(input_ids=ids, attention_mask=mask)
        result = out.last_hidden_state if cls == "RobertaModel" else out.logits
        result = result[mask.bool()] if result.dim() == 3 else result
        result.square().sum().backward()
        outs.append((result, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = outs
    assert rel_err(got, want) < 1e-5
    for name, grad in want_grads.items():
        if grad is not None:
            assert rel_err(got_grads[name], grad) < 2e-5, name
    assert all(torch.equal(before[k], v) for k, v in patched.state_dict().items())


def test_patch_refuses_other_models():
    with pytest.raises(ValueError, match="RoBERTa"):
        rf.patch(torch.nn.Linear(2, 2))


def test_patch_refuses_a_transformers_whose_roberta_ignores_attention_interface(monkeypatch):
    """transformers 4.x logs and keeps its own attention on set_attn_implementation: patch()
    must say so and leave the model as it was, not half-patch it silently."""
    model = hf_model("RobertaModel")
    forwards = {name: module.forward for name, module in model.named_modules()}
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: None)  # what 4.x amounts to
    with pytest.raises(RuntimeError, match="transformers >= 5.0"):
        rf.patch(model)
    assert model.config._attn_implementation != "roberta_fast"
    assert all(module.forward == forwards[name] for name, module in model.named_modules())
