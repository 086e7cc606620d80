"""The drop-in encoder: same outputs as transformers for the same weights.

RobertaModel and RobertaForSequenceClassification against HF on padded batches of every
pattern, with the reference backend and with the fused one (padded and unpadded), and
output_attentions / hidden states as HF returns them; inputs_embeds and 4-D key-padding
masks in every class and in rf.patch; decoder configurations refused; rf.patch's fidelity
(padded positions, output_attentions, set_attn_implementation, a CPU without the interpreter).
"""
import copy
import dataclasses
import os
import subprocess
import sys

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
    model = getattr(transformers, cls)(transformers.RobertaConfig(**{**FIELDS, **extra})).eval()
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
        # left padding masks position 0, which the pooler reads: that batch runs padded
        assert (actual.last_hidden_state[~valid] == 0).all() == (unpad and pattern != "left")
    for got, want in zip(actual.hidden_states, expected.hidden_states, strict=True):
        assert rel_err(got[valid], want[valid]) < 1e-5
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


@pytest.mark.parametrize("cls", ["RobertaForMaskedLM", "RobertaForTokenClassification"])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_labels_at_padded_positions_count_as_in_transformers(cls, backend):
    """transformers ignores only -100, not the mask: labels padded with a real class (or labels=input_ids)
    count the pad positions, which it computes from the pad tokens. Such a batch runs padded here too,
    also where it would run unpadded (no_grad on the CPU, the fused backend)."""
    hf = hf_model(cls, num_labels=3)
    ours = getattr(rf, cls).from_pretrained(hf, backend=backend).eval()
    ids, mask = padded_batch("right", seed=2)
    labels = ids.clone() if cls == "RobertaForMaskedLM" else ids % 3  # every position labelled, pads included
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
        actual = ours(ids, attention_mask=mask, labels=labels)
        assert rel_err(actual.loss, expected.loss) < 1e-5
        assert rel_err(actual.logits, expected.logits) < 1e-5  # the pad positions included
        if cls == "RobertaForMaskedLM":  # the head on the labelled positions only: the same loss
            assert rel_err(ours(ids, attention_mask=mask, labels=labels, masked_only=True).loss, expected.loss) < 1e-5
        labels[~mask.bool()] = -100  # the usual collators' labels: the batch runs unpadded, the same loss
        torch.testing.assert_close(ours(ids, attention_mask=mask, labels=labels).loss,
                                   hf(input_ids=ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("cls", ["RobertaForMaskedLM", "RobertaForTokenClassification"])
def test_labels_at_padded_positions_count_as_in_transformers_under_torch_compile(cls):
    """The same under torch.compile (Dynamo's tracing; inductor would compute alike), where the check once
    was skipped: the CPU's no_grad batch ran unpadded, its pad positions' logits from zeros (5e-4 off)."""
    hf = hf_model(cls, num_labels=3)
    ours = getattr(rf, cls).from_pretrained(hf).eval()
    compiled = torch.compile(ours, backend="eager")
    ids, mask = padded_batch("right", seed=2)
    labels = ids.clone() if cls == "RobertaForMaskedLM" else ids % 3
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
        actual = compiled(ids, attention_mask=mask, labels=labels)
        assert rel_err(actual.loss, expected.loss) < 1e-5
        assert rel_err(actual.logits, expected.logits) < 1e-5


HOOKED = {  # our module: transformers' (norms and embeddings our layers use by their tensors when unhooked)
    "roberta.embeddings.token_type_embeddings": "roberta.embeddings.token_type_embeddings",
    "roberta.embeddings.LayerNorm": "roberta.embeddings.LayerNorm",
    "roberta.encoder.layer.0.attn_LayerNorm": "roberta.encoder.layer.0.attention.output.LayerNorm",
    "roberta.encoder.layer.1.ffn_LayerNorm": "roberta.encoder.layer.1.output.LayerNorm",
    "lm_head.layer_norm": "lm_head.layer_norm",
    "roberta.embeddings": "roberta.embeddings",  # modules transformers users hook for features
    "roberta.encoder.layer.0": "roberta.encoder.layer.0",
    "roberta.encoder.layer.1": "roberta.encoder.layer.1",
}


@pytest.mark.parametrize("name", HOOKED)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
def test_hooks_on_norms_embeddings_and_layers_fire_and_change_the_output_as_in_transformers(name, grad):
    hf = hf_model("RobertaForMaskedLM")
    ours = rf.RobertaForMaskedLM.from_pretrained(hf)
    ids, mask = padded_batch("right")
    valid = mask.bool()
    with torch.inference_mode():
        unhooked = ours(ids, attention_mask=mask).logits
    for model, module in ((hf, HOOKED[name]), (ours, name)):
        model.get_submodule(module).register_forward_hook(lambda module, args, out: out * 0)
    seen = []
    ours.get_submodule(name).register_forward_pre_hook(  # (the embeddings are called with keywords, as there)
        lambda module, args, kwargs: seen.append((args or tuple(kwargs.values()))[0].shape), with_kwargs=True)
    with torch.set_grad_enabled(grad):  # without gradients: the C++ inference layer's condition
        expected = hf(input_ids=ids, attention_mask=mask).logits
        actual = ours(ids, attention_mask=mask).logits
    assert seen and rel_err(actual[valid], expected[valid]) < 1e-5
    assert not torch.allclose(actual[valid], unhooked[valid])


@pytest.mark.parametrize("name", ["roberta.encoder.layer.1.ffn_LayerNorm", "roberta.embeddings.LayerNorm",
                                  "roberta.encoder.layer.0", "roberta.embeddings"])
def test_a_hook_sees_the_tensors_transformers_hook_sees(name):
    """Without gradients on the CPU a batch runs unpadded and in row groups of cpu_group_tokens: a hook
    recording its module's output got (tokens, hidden) rows, or one call per group. A hooked encoder
    runs its batch whole and padded, so the hook sees transformers' (batch, seqlen, hidden) tensor."""
    hf = hf_model("RobertaForMaskedLM")
    ours = rf.RobertaForMaskedLM.from_pretrained(hf).eval()
    ours.roberta.cpu_group_tokens = 8  # several groups for this batch
    ids, mask = padded_batch("right")
    seen = {"ours": [], "hf": []}
    hf.get_submodule(HOOKED[name]).register_forward_hook(lambda module, args, out: seen["hf"].append(out))
    ours.get_submodule(name).register_forward_hook(lambda module, args, out: seen["ours"].append(out))
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask)
        ours(ids, attention_mask=mask)
    assert len(seen["ours"]) == len(seen["hf"]) == 1
    assert rel_err(seen["ours"][0], seen["hf"][0]) < 1e-5  # the pad positions included


def test_a_hooked_layer_still_gives_the_attentions_and_an_encoder_hook_is_refused():
    """A layer with a hook returns its hidden states alone (transformers' layer output), yet the model still
    returns output_attentions' probabilities. A hook on model.encoder, which roberta_fast never calls (it
    runs the layers itself), is refused, not silently skipped."""
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf)
    ids, mask = padded_batch("right")
    ours.encoder.layer[0].register_forward_hook(lambda module, args, out: None)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, output_attentions=True)
        actual = ours(ids, attention_mask=mask, output_attentions=True)
    assert len(actual.attentions) == FIELDS["num_hidden_layers"]
    for got, want in zip(actual.attentions, expected.attentions):
        assert rel_err(got, want) < 1e-5
    ours.encoder.register_forward_hook(lambda module, args, out: None)
    with pytest.raises(ValueError, match=r"a hook on the encoder \(model.encoder\) would never be called: "
                                         r".*Hook model.encoder.layer\[-1\] instead"):
        ours(ids, attention_mask=mask)


def test_from_pretrained_refuses_a_torch_ao_quantized_model_naming_the_fix():
    """A transformers model quantized by torch's quantize_dynamic (packed weights, not tensors) crashed
    with an AttributeError: refused, saying to load the fp32 model and call rf.quantize."""
    hf = hf_model("RobertaForSequenceClassification", num_labels=3)
    quantized = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(ValueError, match=r"quantized by torch\.ao\.quantization .*load the fp32 transformers "
                                         r"model, pass it to from_pretrained, then call rf\.quantize\(model\)"):
        rf.RobertaForSequenceClassification.from_pretrained(quantized)


def test_from_pretrained_refuses_a_roberta_fast_or_an_unmerged_peft_model_naming_the_fix():
    """Both were read as checkpoints lacking encoder weights: refused, each with its fix."""
    ours = rf.RobertaForMaskedLM(rf.RobertaConfig(**FIELDS)).eval()
    for model in (ours, rf.prepack(copy.deepcopy(ours))):
        with pytest.raises(ValueError, match="already a roberta_fast model; copy it with copy.deepcopy"):
            rf.RobertaModel.from_pretrained(model)
    with pytest.raises(ValueError, match="quantized by rf.quantize .* copy.deepcopy.* or from_pretrained the fp32 "
                                         "model it came from and rf.quantize that"):
        rf.RobertaModel.from_pretrained(rf.quantize(copy.deepcopy(ours)))  # its state_dict loads into no fp32 model
    peft = pytest.importorskip("peft")
    hf = hf_model("RobertaForSequenceClassification", num_labels=3)
    lora = peft.LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False)
    wrapped = peft.get_peft_model(copy.deepcopy(hf), lora)
    for adapted in (wrapped, peft.inject_adapter_in_model(lora, copy.deepcopy(hf))):  # with and without PeftModel
        with pytest.raises(ValueError, match=r"PEFT adapters .*merge_and_unload\(\)"):
            rf.RobertaForSequenceClassification.from_pretrained(adapted)
    merged = wrapped.merge_and_unload()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        got = rf.RobertaForSequenceClassification.from_pretrained(merged)(ids, attention_mask=mask).logits
        assert rel_err(got, merged(input_ids=ids, attention_mask=mask).logits) < 1e-5


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


# ------------------------------------------------------- decoder configurations (issue 16 §2)
DECODERS = [{"is_decoder": True}, {"is_decoder": True, "add_cross_attention": True}]


@pytest.mark.parametrize("flags", DECODERS, ids=["is_decoder", "add_cross_attention"])
@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification"])
def test_dropin_refuses_a_decoder_from_a_model_or_a_directory(cls, flags, tmp_path):
    """A RobertaForCausalLM body computes causal attention: loading it into the bidirectional
    encoder would silently give other outputs, so every way in refuses it, naming the setting."""
    decoder = hf_model("RobertaForCausalLM", **flags)
    decoder.save_pretrained(tmp_path)
    expected = " and ".join(f"{name}=True" for name in flags)
    with pytest.raises(ValueError, match=f"(?s)RobertaForCausalLM's config: .*{expected}.*bidirectional encoder"):
        getattr(rf, cls).from_pretrained(decoder)
    with pytest.raises(ValueError, match=f"(?s)config.json: .*{expected}"):
        getattr(rf, cls).from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=expected):
        rf.RobertaConfig.from_dict(decoder.config.to_dict())
    with pytest.raises(ValueError, match=expected):
        rf.patch(decoder)


@pytest.mark.parametrize("flag", ["is_decoder", "add_cross_attention"])
def test_a_decoder_flag_on_roberta_fasts_own_config_is_refused(flag):
    """README: a decoder configuration is refused with a ValueError wherever it comes from. Before,
    RobertaConfig(is_decoder=True) was a TypeError, and `config.is_decoder = True` was kept and the
    model built on it ran the bidirectional encoder without a word."""
    with pytest.raises(ValueError, match=f"{flag}=True.*bidirectional encoder"):
        rf.RobertaConfig(**{flag: True})
    config = rf.RobertaConfig.preset("tiny")
    with pytest.raises(ValueError, match=f"{flag}=True"):
        setattr(config, flag, True)
    setattr(config, flag, False)  # what transformers code sets on an encoder's config
    assert getattr(config, flag) is False
    config.extra[flag] = True
    with pytest.raises(ValueError, match=f"{flag}=True"):
        rf.RobertaModel(config)


def test_roberta_config_takes_transformers_config_keywords():
    """RobertaConfig(num_labels=3, ...) as transformers.RobertaConfig takes them (they were a TypeError);
    a misspelt field is still one."""
    ours = rf.RobertaConfig(num_labels=3, problem_type="regression", architectures=["X"])
    hf = transformers.RobertaConfig(num_labels=3, problem_type="regression", architectures=["X"])
    assert (ours.num_labels, ours.id2label, ours.label2id, ours.problem_type, ours.architectures) == (
        hf.num_labels, hf.id2label, hf.label2id, hf.problem_type, hf.architectures)
    named = rf.RobertaConfig(id2label={0: "neg", 1: "pos"}, tie_word_embeddings=True)
    assert named.label2id == {"neg": 0, "pos": 1} and named.tie_word_embeddings
    with pytest.raises(ValueError, match="decoder that is not its word embeddings"):
        rf.RobertaForMaskedLM(rf.RobertaConfig(tie_word_embeddings=False))
    with pytest.raises(TypeError, match="hiden_size"):
        rf.RobertaConfig(hiden_size=64)
    # a label count against names of another size wins (LABEL_i), as transformers'; new names get their inverse
    for config in (rf.RobertaConfig(num_labels=5, id2label={0: "a", 1: "b"}),
                   dataclasses.replace(named, num_labels=5)):
        assert config.num_labels == 5 and config.id2label == transformers.RobertaConfig(num_labels=5).id2label
        assert rf.RobertaForSequenceClassification(config).classifier.out_proj.out_features == 5
    assert dataclasses.replace(named, num_labels=2).id2label == {0: "neg", 1: "pos"}  # the same count: names kept
    renamed = dataclasses.replace(rf.RobertaConfig(id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1}),
                                  id2label={0: "neg", 1: "neu", 2: "pos"})
    assert renamed.label2id == {"neg": 0, "neu": 1, "pos": 2}


def test_an_untied_decoder_is_refused_not_dropped(tmp_path):
    """RobertaForMaskedLM here reads its decoder from the word embeddings; an HF masked LM
    trained with tie_word_embeddings=false has its own decoder, which loading would silently
    drop (other logits). It is refused from a model and a directory; its encoder still loads."""
    untied = hf_model("RobertaForMaskedLM", tie_word_embeddings=False)
    assert not torch.equal(untied.lm_head.decoder.weight, untied.roberta.embeddings.word_embeddings.weight)
    untied.save_pretrained(tmp_path)
    for source in (untied, tmp_path):
        with pytest.raises(ValueError, match="decoder that is not its word embeddings.*tie_word_embeddings=false"):
            rf.RobertaForMaskedLM.from_pretrained(source)
    encoder = rf.RobertaModel.from_pretrained(tmp_path, backend="reference")
    ids, mask = padded_batch("right")
    with torch.no_grad():
        expected = untied.roberta(input_ids=ids, attention_mask=mask).last_hidden_state
        got = encoder(ids, attention_mask=mask).last_hidden_state
    assert (got - expected)[mask.bool()].abs().max() < 1e-5
    tied = hf_model("RobertaForMaskedLM")  # the usual checkpoint still loads
    rf.RobertaForMaskedLM.from_pretrained(tied)


@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForSequenceClassification"])
def test_an_unused_mlm_head_is_reported_as_transformers_reports_it(cls, tmp_path):
    """An untied MLM checkpoint loaded into a class without an MLM head: its decoder was once skipped
    silently and lm_head.bias named twice; the unused weights are those transformers names, once each."""
    hf_model("RobertaForMaskedLM", tie_word_embeddings=False).save_pretrained(tmp_path)
    _, want = getattr(transformers, cls).from_pretrained(tmp_path, output_loading_info=True)
    with pytest.warns(UserWarning, match="not used") as caught:
        _, got = getattr(rf, cls).from_pretrained(tmp_path, output_loading_info=True)
    assert got["unexpected_keys"] == want["unexpected_keys"]
    assert {"lm_head.decoder.weight", "lm_head.decoder.bias"} <= got["unexpected_keys"]
    unused = next(str(w.message) for w in caught if "not used" in str(w.message))
    assert unused.count("'lm_head.bias'") == 1


def test_an_untied_config_is_refused_by_the_masked_lm(tmp_path):
    """tie_word_embeddings=False, kept in config.extra, was once never read: the MLM was built tied and
    its save told transformers to draw a random decoder. It is refused as a keyword, in a config and at
    construction; the encoder classes, which have no decoder, still take it."""
    hf_model("RobertaForMaskedLM").save_pretrained(tmp_path)
    untied = rf.RobertaConfig.from_dict({**FIELDS, "tie_word_embeddings": False})
    assert untied.tie_word_embeddings is False and rf.RobertaConfig(**FIELDS).tie_word_embeddings is True
    refused = "decoder that is not its word embeddings.*tie_word_embeddings=false"
    for build in (lambda: rf.RobertaForMaskedLM.from_pretrained(tmp_path, tie_word_embeddings=False),
                  lambda: rf.RobertaForMaskedLM.from_pretrained(tmp_path, config=untied),
                  lambda: rf.RobertaForMaskedLM(untied),
                  lambda: rf.RobertaForMaskedLM(transformers.RobertaConfig(**FIELDS, tie_word_embeddings=False))):
        with pytest.raises(ValueError, match=refused):
            build()
    assert rf.RobertaModel.from_pretrained(tmp_path, tie_word_embeddings=False).config.tie_word_embeddings is False

# ---------------------------------------------------------- inputs_embeds (issue 16 §3)
@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification"])
@pytest.mark.parametrize("backend, unpad", [("reference", False), ("fused", True)], ids=["reference", "fused"])
def test_inputs_embeds_matches_transformers(cls, backend, unpad):
    """inputs_embeds as transformers takes it: positions count every token from padding_idx + 1,
    token type 0 is added; outputs and gradients (the embeddings' too) match."""
    hf = hf_model(cls, type_vocab_size=2) if cls == "RobertaModel" else hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend=backend).eval()
    if cls == "RobertaModel":
        ours.unpad = unpad
    ids, mask = padded_batch("right", seed=4)
    embeds = [hf.get_input_embeddings()(ids).detach().requires_grad_() for _ in range(2)]
    extra = {"token_type_ids": (torch.arange(22) > 10).long().expand(4, 22)} if cls == "RobertaModel" else {}
    want = hf(inputs_embeds=embeds[0], attention_mask=mask, **extra)
    got = ours(inputs_embeds=embeds[1], attention_mask=mask, **extra)
    name = "last_hidden_state" if cls == "RobertaModel" else "logits"
    want, got = getattr(want, name), getattr(got, name)
    valid = mask.bool() if want.dim() == 3 else torch.ones(want.shape[0], dtype=torch.bool)
    assert rel_err(got[valid], want[valid]) < 1e-5
    weight = torch.randn_like(want) * (valid[..., None] if want.dim() == 3 else 1)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    assert rel_err(embeds[1].grad, embeds[0].grad) < 2e-5
    grads = native_to_hf({n: p.grad for n, p in ours.named_parameters()},
                         prefix="" if cls == "RobertaModel" else "roberta.")
    for n, p in hf.named_parameters():
        if p.grad is not None and n in grads:
            assert rel_err(grads[n], p.grad) < 2e-5, n


def test_inputs_embeds_needs_exactly_one_input_and_the_hidden_size():
    ours = rf.RobertaModel(rf.RobertaConfig(**FIELDS)).eval()
    ids, _ = padded_batch("none")
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        ours(ids, inputs_embeds=torch.zeros(4, 22, 32))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        ours()
    with pytest.raises(ValueError, match=r"inputs_embeds must have shape \(batch, seqlen, hidden_size=32\)"):
        ours(inputs_embeds=torch.zeros(4, 22, 16))


# ------------------------------------------------------- 4-D key-padding masks (issue 16 §3)
def extended_masks(mask):
    """transformers' 4-D (batch, 1, 1, seqlen) forms of a 2-D 0/1 mask."""
    keep = mask.bool()[:, None, None, :]
    return {"additive-fp32-min": (~keep).float() * torch.finfo(torch.float32).min,
            "additive-fp16-min": (~keep).half() * torch.finfo(torch.float16).min,
            "additive-inf": torch.zeros(keep.shape).masked_fill(~keep, float("-inf")),
            "additive-bert-10000": (~keep).float() * -10000.0,
            "bool": keep}


@pytest.mark.parametrize("form", list(extended_masks(torch.ones(1, 1))))
@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification"])
def test_a_4d_key_padding_mask_is_the_2d_mask(cls, form):
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference").eval()
    patched = rf.patch(hf_model(cls))
    ids, mask = padded_batch("holes", seed=5)
    mask4 = extended_masks(mask)[form]
    name = "last_hidden_state" if cls == "RobertaModel" else "logits"
    with torch.no_grad():
        want = getattr(hf(input_ids=ids, attention_mask=mask), name)
        valid = mask.bool() if want.dim() == 3 else slice(None)  # ours runs unpadded: zeros at masked positions
        assert rel_err(getattr(ours(ids, attention_mask=mask4), name)[valid], want[valid]) < 1e-5
        assert rel_err(getattr(patched(input_ids=ids, attention_mask=mask4), name), want) < 1e-5


@pytest.mark.parametrize("bad, message", [
    (lambda m: m.bool()[:, None, :, None].expand(4, 1, 22, 22), r"key-padding form \(batch, 1, 1, seqlen\)"),
    (lambda m: m.bool()[:, None, None, :].expand(4, 2, 1, 22), r"key-padding form \(batch, 1, 1, seqlen\)"),
    (lambda m: m[:, None, None, :], "must be bool .* or additive float"),
    (lambda m: (1.0 - m[:, None, None, :].float()) * -0.5, "holds other values"),
])
def test_other_4d_masks_are_refused(bad, message):
    ours = rf.RobertaModel.from_pretrained(hf_model("RobertaModel"), backend="reference").eval()
    patched = rf.patch(hf_model("RobertaModel"))
    ids, mask = padded_batch("holes", seed=5)
    with pytest.raises(ValueError, match=message):
        ours(ids, attention_mask=bad(mask))
    with pytest.raises(ValueError, match=message):
        patched(input_ids=ids, attention_mask=bad(mask))


# ------------------------------------------------------ rf.patch fidelity (issue 16 §5, §7)
def test_patch_gives_transformers_outputs_at_padded_positions_on_every_input_path():
    """Unpadding is a speed-up, not a change of outputs: a patched model matches transformers
    everywhere, masked positions included, from input_ids and from inputs_embeds."""
    original = hf_model("RobertaModel")
    patched = rf.patch(copy.deepcopy(original))
    ids, mask = padded_batch("holes", seed=6)
    embeds = original.get_input_embeddings()(ids)
    with torch.no_grad():
        for inputs in ({"input_ids": ids}, {"inputs_embeds": embeds}):
            want = original(**inputs, attention_mask=mask).last_hidden_state
            assert rel_err(patched(**inputs, attention_mask=mask).last_hidden_state, want) < 1e-5


def test_patch_output_attentions_falls_back_to_eager_with_a_warning():
    original = hf_model("RobertaForMaskedLM")
    original.set_attn_implementation("eager")
    patched = rf.patch(copy.deepcopy(original))
    ids, mask = padded_batch("right", seed=7)
    want = original(input_ids=ids, attention_mask=mask, output_attentions=True)
    rf.ops._warn_once.cache_clear()
    with pytest.warns(UserWarning, match="output_attentions=True"):
        got = patched(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == FIELDS["num_hidden_layers"]
    for a, b in zip(got.attentions, want.attentions):
        assert rel_err(a, b) < 1e-5
    assert rel_err(got.logits, want.logits) < 1e-5
    original.config.output_attentions = True  # asked through the config (set while eager), then patched
    assert len(rf.patch(original)(input_ids=ids, attention_mask=mask).attentions) == FIELDS["num_hidden_layers"]


def test_set_attn_implementation_switches_a_patched_model(tmp_path):
    """After patch(), set_attn_implementation switches attention everywhere, and back; the
    saved model names no roberta_fast attention, so it loads anywhere."""
    model = rf.patch(hf_model("RobertaForSequenceClassification"))
    ids, mask = padded_batch("right", seed=8)
    fused = model(input_ids=ids, attention_mask=mask).logits
    for name in ("eager", "sdpa", "roberta_fast"):
        model.set_attn_implementation(name)
        configs = [m.config for m in model.modules() if hasattr(m, "config")]
        assert {c._attn_implementation for c in configs} == {name}
        assert rel_err(model(input_ids=ids, attention_mask=mask).logits, fused) < 1e-5
    model.save_pretrained(tmp_path)
    assert "roberta_fast" not in (tmp_path / "config.json").read_text()
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "sdpa"


def test_patch_on_a_cpu_without_the_interpreter_runs_the_reference_ops():
    """Without TRITON_INTERPRET (a plain CPU install) the Triton kernels cannot run on the CPU:
    a patched CPU model computes with SDPA and the reference ops, as transformers would."""
    code = (
        "import torch, transformers, roberta_fast as rf\n"
        "torch.manual_seed(0)\n"
        "cfg = transformers.RobertaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, "
        "num_attention_heads=1, intermediate_size=40)\n"
        "model = transformers.RobertaForMaskedLM(cfg).eval()\n"
        "ids = torch.randint(3, 50, (2, 9)); mask = torch.ones(2, 9, dtype=torch.long); mask[1, 5:] = 0\n"
        "want = model(input_ids=ids, attention_mask=mask).logits\n"
        "got = rf.patch(model)(input_ids=ids, attention_mask=mask).logits\n"
        "print('max diff', (got - want).abs().max().item())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split("max diff")[1]) < 1e-5


# --------------------------------------------- behaving as transformers' models do (issue 26)
DROPIN = ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForTokenClassification",
          "RobertaForQuestionAnswering", "RobertaForMultipleChoice"]


def dropin_inputs(cls, seed=0):
    """(input_ids, attention_mask) for `cls`: a padded (4, 22) batch; multiple choice (2, 2, 22)."""
    ids, mask = padded_batch("right", seed)
    if cls == "RobertaForMultipleChoice":
        return ids.view(2, 2, 22), mask.view(2, 2, 22)
    return ids, mask


def main_output(out):
    """The first tensor an output leads with (logits, start_logits or last_hidden_state)."""
    return out[1] if getattr(out, "loss", None) is not None else out[0]


@pytest.mark.parametrize("cls", DROPIN)
def test_from_pretrained_returns_eval_mode_and_transformers_outputs(cls, tmp_path):
    """transformers' from_pretrained returns model.eval(): dropout off, the same outputs every call,
    and those of transformers' model. A model built from a config stays in training mode, as there."""
    hf = hf_model(cls, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    hf.save_pretrained(tmp_path)
    ids, mask = dropin_inputs(cls)
    with torch.no_grad():
        want = main_output(hf(input_ids=ids, attention_mask=mask))
        for source in (hf, str(tmp_path)):
            ours = getattr(rf, cls).from_pretrained(source, backend="reference")
            assert not ours.training and not any(m.training for m in ours.modules())
            getattr(ours, "roberta", ours).unpad = False  # padded positions computed, as transformers does
            got = [main_output(ours(ids, attention_mask=mask)) for _ in range(2)]
            assert torch.equal(got[0], got[1])
            assert rel_err(got[0], want) < 1e-5
    assert getattr(rf, cls)(rf.RobertaConfig(**FIELDS)).training


def label_kwargs(cls, seed=0):
    """Labels for `cls`'s loss (none for the bare encoder)."""
    g = torch.Generator().manual_seed(seed)
    if cls == "RobertaForMaskedLM":
        return {"labels": torch.randint(3, FIELDS["vocab_size"], (4, 22), generator=g)}
    if cls == "RobertaForSequenceClassification" or cls == "RobertaForMultipleChoice":
        return {"labels": torch.randint(0, 2, (4 if cls != "RobertaForMultipleChoice" else 2,), generator=g)}
    if cls == "RobertaForTokenClassification":
        return {"labels": torch.randint(0, 2, (4, 22), generator=g)}
    if cls == "RobertaForQuestionAnswering":
        return {"start_positions": torch.tensor([1, 0, 3, 2]), "end_positions": torch.tensor([4, 0, 5, 9])}
    return {}


def assert_same_outputs(got, want):
    """got behaves as transformers' ModelOutput `want`: the same keys, in order, and values."""
    assert isinstance(got, transformers.utils.ModelOutput)  # Trainer and pipelines test it
    assert list(got.keys()) == list(want.keys()) == list(got) == [k for k, _ in got.items()]
    assert len(got) == len(want) and len(got.to_tuple()) == len(want.to_tuple()) == len(got.values())
    for key, value in want.items():
        assert key in got and got.get(key) is got[key] is getattr(got, key)
        for g, w in zip(*(v if isinstance(v, tuple) else (v,) for v in (got[key], value)), strict=True):
            assert rel_err(g, w) < 1e-5, key
    for i, value in enumerate(got.to_tuple()):
        assert got[i] is value
    absent = {"hidden_states", "attentions"} - set(want.keys())
    for key in absent:
        assert key not in got and got.get(key) is None
        with pytest.raises(KeyError):
            got[key]


def test_outputs_are_dicts_and_export_without_transformers_installed():
    script = os.path.join(os.path.dirname(__file__), "dropin_without_transformers.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("cls", DROPIN)
def test_outputs_behave_as_model_outputs_and_the_config_flags_are_honoured(cls):
    """keys / values / items / iteration / `in` over the fields that are not None, in transformers'
    order; config.output_hidden_states, output_attentions and return_dict apply when the call leaves
    them None, as in transformers."""
    hf = hf_model(cls, num_labels=2) if cls != "RobertaModel" else hf_model(cls)
    hf.set_attn_implementation("eager")  # transformers takes config.output_attentions only there
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
    getattr(ours, "roberta", ours).unpad = False
    ids, mask = dropin_inputs(cls)
    labels = label_kwargs(cls)
    with torch.no_grad():
        assert_same_outputs(ours(ids, attention_mask=mask, **labels), hf(input_ids=ids, attention_mask=mask, **labels))
        for model in (hf, ours):
            model.config.output_hidden_states = True
            model.config.output_attentions = True
        want, got = hf(input_ids=ids, attention_mask=mask), ours(ids, attention_mask=mask)
        assert "hidden_states" in got and "attentions" in got
        assert_same_outputs(got, want)
        for model in (hf, ours):
            model.config.return_dict = False
        want, got = hf(input_ids=ids, attention_mask=mask), ours(ids, attention_mask=mask)
        assert isinstance(got, tuple) and len(got) == len(want)
        assert not isinstance(ours(ids, attention_mask=mask, return_dict=True, output_hidden_states=False), tuple)


@pytest.mark.parametrize("cls", DROPIN)
def test_model_methods_as_transformers(cls):
    """The methods transformers users call, one shared implementation for every class: embeddings
    accessors, the tied decoder, num_parameters (both filters), device, dtype, tie_weights."""
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
    for exclude in (False, True):
        assert ours.num_parameters(exclude_embeddings=exclude) == hf.num_parameters(exclude_embeddings=exclude)
    for model in (hf, ours):
        model.get_input_embeddings().weight.requires_grad_(False)
    assert ours.num_parameters(only_trainable=True) == hf.num_parameters(only_trainable=True) < ours.num_parameters()
    assert ours.device == hf.device and ours.dtype == hf.dtype == torch.float32
    assert ours.to(torch.float64).dtype == torch.float64
    assert ours.get_input_embeddings() is ours.base_model.embeddings.word_embeddings
    decoder, hf_decoder = ours.get_output_embeddings(), hf.get_output_embeddings()
    if hf_decoder is None:
        assert decoder is None
    else:
        assert isinstance(decoder, torch.nn.Linear)
        assert decoder.weight is ours.get_input_embeddings().weight and decoder.bias is ours.lm_head.bias
    ours.tie_weights()
    replacement = torch.nn.Embedding(FIELDS["vocab_size"], FIELDS["hidden_size"], padding_idx=1, dtype=torch.float64)
    ours.set_input_embeddings(replacement)
    assert ours.get_input_embeddings() is replacement
    if decoder is not None:
        assert ours.get_output_embeddings().weight is replacement.weight  # still tied


@pytest.mark.parametrize("cls", ["RobertaForMaskedLM", "RobertaForSequenceClassification"])
@pytest.mark.parametrize("new_size", [FIELDS["vocab_size"] + 9, FIELDS["vocab_size"] - 20])
def test_resize_token_embeddings_matches_transformers(cls, new_size, tmp_path):
    """Grown (new rows around the old mean, transformers' default) or shrunk: the outputs equal
    transformers' model resized the same way, new tokens included; the decoder and its bias are
    resized and stay tied; the resized model saves and loads in transformers."""
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
    ours.roberta.unpad = False
    for model in (hf, ours):
        torch.manual_seed(11)  # the same draws for the new rows
        resized = model.resize_token_embeddings(new_size)
        assert resized is model.get_input_embeddings() and resized.num_embeddings == new_size
        assert model.config.vocab_size == new_size
    if cls == "RobertaForMaskedLM":
        assert ours.lm_head.bias.shape == (new_size,)
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    ids, mask = padded_batch("right", seed=9)
    ids = ids % new_size  # new tokens included when grown
    ids[:, -1] = new_size - 1
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        assert rel_err(ours(ids, attention_mask=mask).logits, want) < 1e-5
        ours.save_pretrained(tmp_path)
        back = getattr(transformers, cls).from_pretrained(tmp_path)
        assert rel_err(back(input_ids=ids, attention_mask=mask).logits, want) < 1e-5
    assert ours.resize_token_embeddings(pad_to_multiple_of=8).num_embeddings == -(-new_size // 8) * 8


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_gradient_checkpointing_gives_the_same_gradients(backend):
    """Each layer recomputed in the backward pass (it runs twice), with dropout on: the recompute
    replays the same RNG state, so loss and gradients equal those without checkpointing."""
    config = rf.RobertaConfig(**{**FIELDS, "hidden_size": 64, "num_attention_heads": 2})  # head dim 32: fused attention
    model = rf.RobertaForMaskedLM(config, backend=backend).train()
    ids, mask = padded_batch("right", seed=10)
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    calls, layer = [], model.roberta.encoder.layer[0]
    forward = layer.forward
    layer.forward = lambda *args: calls.append(1) or forward(*args)  # counts recomputes (hooks do not see them)
    results = []
    for enabled in (False, True):
        model.gradient_checkpointing_enable() if enabled else model.gradient_checkpointing_disable()
        assert model.is_gradient_checkpointing == enabled
        model.zero_grad()
        torch.manual_seed(1)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(calls) == 3  # once without checkpointing, twice with
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    model.eval()
    with torch.no_grad():  # inference never checkpoints
        model(ids, attention_mask=mask)
    assert len(calls) == 4


def test_checkpointing_every_n_layers_and_offloaded_as_transformers_5():
    """transformers 5's Trainer passes every_n_layers and offload: every_n_layers=2 recomputes layers
    0, 2, ... only; offload keeps the saved inputs on the host; the gradients stay the same."""
    config = rf.RobertaConfig(**{**FIELDS, "num_hidden_layers": 3})
    model = rf.RobertaForMaskedLM(config, backend="reference").train()
    ids, mask = padded_batch("right", seed=10)
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    calls = [0] * 3
    for i, layer in enumerate(model.roberta.encoder.layer):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    grads = []
    for options in ({}, {"every_n_layers": 2}, {"every_n_layers": 2, "offload": True}):
        calls[:] = [0] * 3
        model.activation_checkpointing_enable(**options)
        model.zero_grad()
        torch.manual_seed(1)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        assert calls == ([2, 2, 2] if not options else [2, 1, 2]), options
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="every_n_layers must be a positive integer, got 0"):
        model.gradient_checkpointing_enable(every_n_layers=0)


@pytest.mark.parametrize("new_size", [FIELDS["vocab_size"] + 9, FIELDS["vocab_size"] - 5])
def test_set_input_embeddings_resizes_the_tied_decoder_bias_as_transformers(new_size):
    """A new embedding table of another size: the MLM decoder reads it, so its bias follows
    (kept entries, zeros added), as transformers' tie_weights pads or cuts the re-tied bias."""
    hf = hf_model("RobertaForMaskedLM")
    ours = rf.RobertaForMaskedLM.from_pretrained(hf, backend="reference").eval()
    torch.manual_seed(3)
    table = torch.randn(new_size, FIELDS["hidden_size"])
    for model in (hf, ours):
        model.set_input_embeddings(torch.nn.Embedding.from_pretrained(table.clone(), freeze=False, padding_idx=1))
    hf.tie_weights()
    ids = torch.randint(3, min(new_size, FIELDS["vocab_size"]), (2, 9))
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, ours(ids).logits
    assert got.shape == want.shape == (2, 9, new_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ours.lm_head.bias.requires_grad


def test_push_to_hub_uploads_what_transformers_loads(tmp_path, monkeypatch):
    """push_to_hub creates the repository and uploads save_pretrained's files (a fake Hub API here:
    no network), which transformers loads to the same logits."""
    import shutil

    import huggingface_hub

    calls = {}

    class FakeHub:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["repo"] = (repo_id, private, exist_ok)
            return huggingface_hub.RepoUrl(f"https://huggingface.co/me/{repo_id}")

        def create_branch(self, repo_id, branch, exist_ok=False):
            calls["branch"] = (repo_id, branch, exist_ok)

        def upload_folder(self, repo_id, folder_path, **options):
            calls["upload"] = (repo_id, options)
            shutil.copytree(folder_path, tmp_path / "hub")
            return "commit"

    def no_card(repo_id, token=None):
        raise huggingface_hub.errors.EntryNotFoundError(f"{repo_id} has no README.md")

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", no_card)
    hf = hf_model("RobertaForSequenceClassification", num_labels=3)
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf, backend="reference")
    assert ours.push_to_hub("my-model", private=True, token="t", commit_message="first", revision="v2",
                            tags=["biomedical"]) == "commit"
    assert calls["token"] == "t" and calls["repo"] == ("my-model", True, True)
    assert calls["branch"] == ("me/my-model", "v2", True)  # upload_folder does not create a branch
    assert calls["upload"][0] == "me/my-model" and calls["upload"][1]["commit_message"] == "first"
    ids = torch.randint(3, FIELDS["vocab_size"], (2, 7))
    with torch.no_grad():
        want = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hub")(input_ids=ids).logits
        torch.testing.assert_close(ours(ids).logits, want)
    # a model card, as transformers' push_to_hub uploads: a new one here, or the repository's own with the tags added
    card = huggingface_hub.ModelCard((tmp_path / "hub" / "README.md").read_text())
    assert card.data.tags == ["biomedical"] and card.data.library_name == "transformers"
    existing = huggingface_hub.ModelCard("---\ntags:\n- legal\n---\n# Our encoder\n")
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", lambda repo_id, token=None: existing)
    shutil.rmtree(tmp_path / "hub")
    ours.push_to_hub("my-model", tags=["legal", "roberta"])
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "# Our encoder" in card and huggingface_hub.ModelCard(card).data.tags == ["legal", "roberta"]
    ours.add_model_tags(["from-trainer", "legal", "legal"])  # (transformers.Trainer adds its tags so)
    ours.add_model_tags("from-trainer")
    monkeypatch.setattr(huggingface_hub.ModelCard, "load",
                        lambda repo_id, token=None: huggingface_hub.ModelCard("---\ntags:\n- legal\n---\n"))
    shutil.rmtree(tmp_path / "hub")
    ours.push_to_hub("my-model", tags="roberta")  # one tag as a string, as transformers takes it
    card = huggingface_hub.ModelCard((tmp_path / "hub" / "README.md").read_text())
    assert ours.model_tags == ["from-trainer", "legal"] and card.data.tags == ["legal", "from-trainer", "roberta"]


@pytest.mark.parametrize("cls", DROPIN)
def test_positional_arguments_are_transformers(cls):
    """forward's parameters take transformers' positions through the labels (export recipes and user
    code pass input_ids, attention_mask, token_type_ids positionally; labels once came third here)."""
    import inspect

    def names(forward):
        return [n for n in inspect.signature(forward).parameters if n not in ("self", "kwargs")]

    theirs = names(getattr(transformers, cls).forward)
    last = max(i for i, n in enumerate(theirs) if n in ("labels", "end_positions", "inputs_embeds"))
    assert names(getattr(rf, cls).forward)[:last + 1] == theirs[:last + 1]
    if cls in ("RobertaForMaskedLM", "RobertaForSequenceClassification"):
        hf = hf_model(cls, type_vocab_size=2)
        ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
        ours.roberta.unpad = False  # transformers' values at the pads too
        ids, mask = dropin_inputs(cls)
        types = torch.ones_like(ids)
        with torch.no_grad():
            got, want = ours(ids, mask, types), hf(ids, mask, types)
        assert got.get("loss") is None and rel_err(got.logits, want.logits) < 1e-5


@pytest.mark.parametrize("cls", DROPIN)
def test_dropout_lives_in_dropout_modules_as_in_transformers(cls):
    """Dropout is applied by nn.Dropout modules, as transformers': p = 0 set on all of them turns it off in
    training mode, and Monte Carlo dropout (.eval(), then .train() on the Dropout modules alone) samples
    a new output per call, also without gradients (where the C++ inference layer would have run without
    dropout). Before, the modules did not exist: their p and mode changed nothing, silently."""
    hf = hf_model(cls, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    ours = getattr(rf, cls).from_pretrained(hf)
    ids, mask = dropin_inputs(cls)
    for model in (hf, ours):
        dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        assert len(dropouts) >= 2 * FIELDS["num_hidden_layers"] + 1
        with torch.no_grad():
            evaluated = main_output(model(ids, attention_mask=mask))
            for m in dropouts:
                m.train()
            sampled = [main_output(model(ids, attention_mask=mask)) for _ in range(2)]
            assert not torch.allclose(sampled[0], sampled[1]) and not torch.allclose(sampled[0], evaluated)
            for m in dropouts:
                m.p = 0.0
            model.train()
            torch.testing.assert_close(main_output(model(ids, attention_mask=mask)), evaluated, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replace", ["identity", "subclass"])
def test_a_replaced_dropout_or_layer_norm_module_is_called_as_in_transformers(replace):
    """A module swapped in for a Dropout or a LayerNorm is called, as transformers calls it: an
    nn.Identity turns dropout off, and a LayerNorm subclass with its own forward changes the output the
    same way in both. The attention probabilities' dropout is read for its p in both (the attention
    kernels apply it); one of another kind, which they cannot call, is refused."""
    class ScaledNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    hf = hf_model("RobertaForSequenceClassification")
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf)
    ids, mask = dropin_inputs("RobertaForSequenceClassification")
    for model in (hf, ours):
        model.train()
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if name == "attention_dropout" or type(parent).__name__.endswith("SelfAttention"):
                    child.p = 0.0  # transformers reads the attention dropout's p too (for SDPA), never calls it
                elif isinstance(child, torch.nn.Dropout):
                    setattr(parent, name, torch.nn.Identity())
                elif replace == "subclass" and type(child) is torch.nn.LayerNorm:
                    norm = ScaledNorm(child.normalized_shape, eps=child.eps)
                    norm.load_state_dict(child.state_dict())
                    setattr(parent, name, norm)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        actual = ours(ids, attention_mask=mask).logits
        assert rel_err(actual, expected) < 1e-5
        if replace == "subclass":  # the swap changed the function
            assert not torch.allclose(actual, rf.RobertaForSequenceClassification.from_pretrained(hf)(
                ids, attention_mask=mask).logits, atol=1e-3)
    ours.roberta.encoder.layer[0].attention_dropout = torch.nn.Dropout1d(0.1)
    with pytest.raises(ValueError, match="attention_dropout is Dropout1d: the attention kernels apply"):
        ours(ids, attention_mask=mask)


@pytest.mark.parametrize("cls", DROPIN[1:])
def test_a_heads_encoder_is_called_as_a_module_where_transformers_code_expects_it(cls):
    """A head calls model.roberta as transformers' heads do where that shows: a forward hook on it fires
    and its returned outputs are used (the same logits as transformers' with the same hook), and
    torch.compile(model.roberta) is what runs. Before, the heads called its encode method: the hook never
    fired and the compiled module was bypassed, silently."""
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf)
    ids, mask = dropin_inputs(cls)

    def doubled(module, args, out):
        return type(out)(**{name: value * 2 for name, value in out.items() if isinstance(value, torch.Tensor)})

    with torch.no_grad():
        unhooked = main_output(ours(ids, attention_mask=mask))
        hooks = [model.roberta.register_forward_hook(doubled) for model in (hf, ours)]
        expected, actual = (main_output(model(ids, attention_mask=mask)) for model in (hf, ours))
        valid = mask.bool() if actual.shape[:2] == mask.shape else ...  # per token: pads are computed from zeros here
        assert rel_err(actual[valid], expected[valid]) < 1e-5 and not torch.allclose(actual, unhooked)
        for hook in hooks:
            hook.remove()
        graphs = []

        def backend(graph, example_inputs):  # torch.compile's backend: called for each graph it compiles
            graphs.append(graph)
            return graph.forward

        ours.roberta = torch.compile(ours.roberta, backend=backend)
        torch.testing.assert_close(main_output(ours(ids, attention_mask=mask)), unhooked, rtol=1e-5, atol=1e-6)
        assert graphs


def test_the_pooler_is_transformers_module():
    """model.pooler is transformers' RobertaPooler (pooler.dense, tanh): a hook on it sees the same
    (batch, seqlen, hidden) input and its returned output is the pooler_output, as there. Before, it was a
    bare Linear called on the first token, its output taken before tanh."""
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf)
    ids, mask = padded_batch("right")
    seen = {}
    for name, model in (("hf", hf), ("ours", ours)):
        model.pooler.register_forward_hook(lambda module, args, out, name=name: seen.update({name: args[0]}) or out + 1)
    with torch.no_grad():
        expected, actual = hf(input_ids=ids, attention_mask=mask), ours(ids, attention_mask=mask)
    assert seen["ours"].shape == seen["hf"].shape == (4, 22, FIELDS["hidden_size"])
    assert rel_err(actual.pooler_output, expected.pooler_output) < 1e-5
    assert bool((actual.pooler_output > 1).any())  # tanh's range, shifted by the hook


def test_a_full_backward_hook_on_a_layer_sees_transformers_gradients():
    """register_full_backward_hook on encoder.layer[i]: grad_output is the one gradient of the layer's
    hidden states (batch, seqlen, hidden), the same as transformers'. Before, the layer's internal
    (x, its half copy, probabilities) output gave a 3-tuple."""
    hf = hf_model("RobertaForSequenceClassification")
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf).train()
    ours.roberta.unpad = False
    ids, mask = padded_batch("right")
    seen = {}
    for name, model in (("hf", hf.train()), ("ours", ours)):
        model.roberta.encoder.layer[0].register_full_backward_hook(
            lambda module, grad_input, grad_output, name=name: seen.update({name: grad_output}))
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    assert len(seen["ours"]) == len(seen["hf"]) == 1
    assert rel_err(seen["ours"][0][mask.bool()], seen["hf"][0][mask.bool()]) < 1e-4


def test_a_layer_replaced_by_another_module_is_refused():
    """A user's block put in place of encoder.layer[i] would be called with the encoder's own arguments
    and its output read as (hidden, half copy, probabilities): a block returning a (3, seqlen, hidden)
    tensor was silently taken apart row by row. It is refused, naming what to change instead; a layer
    compiled by torch.compile still runs."""
    class Block(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states

    ours = rf.RobertaModel.from_pretrained(hf_model("RobertaModel"))
    ids, mask = padded_batch("right")
    with torch.no_grad():
        expected = ours(ids, attention_mask=mask).last_hidden_state
        ours.encoder.layer[0] = torch.compile(ours.encoder.layer[0], backend="eager")
        torch.testing.assert_close(ours(ids, attention_mask=mask).last_hidden_state, expected)
        ours.encoder.layer[1] = Block(ours.encoder.layer[1])
        with pytest.raises(ValueError, match=r"encoder.layer\[1\] is a Block, not a RobertaLayer: .* or hook the "
                                             r"layer: its hooks see transformers' tensors"):
            ours(ids[:3], attention_mask=mask[:3])


def test_a_hook_on_the_output_embeddings_fires_as_in_transformers():
    """get_output_embeddings() is one object (while the tied tensors are the same), and a forward hook on
    it fires in forward and its output is the logits, as on transformers' lm_head.decoder. Before, each
    call built a new Linear that forward never called."""
    hf = hf_model("RobertaForMaskedLM")
    ours = rf.RobertaForMaskedLM.from_pretrained(hf)
    ids, mask = padded_batch("right")
    assert ours.get_output_embeddings() is ours.get_output_embeddings()
    for model in (hf, ours):
        model.get_output_embeddings().register_forward_hook(lambda module, args, out: out * 2)
    with torch.no_grad():
        expected, actual = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert rel_err(actual[valid], expected[valid]) < 1e-5


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
def test_a_forward_replaced_on_the_instance_is_called_as_in_transformers(grad):
    """accelerate's hooks (add_hook_to_module: offloading, dispatch_model) and plain patches set `forward`
    on a module instance and register no torch hook; such a module is called, as transformers calls it.
    Before, Linear layers and norms were computed from their tensors (and the C++ inference layer ran),
    so the patch changed nothing."""
    hf = hf_model("RobertaForSequenceClassification")
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf)
    ids, mask = padded_batch("right")
    for model in (hf, ours):
        layer = model.roberta.encoder.layer[0]
        for module in ((layer.intermediate.dense, layer.output.LayerNorm) if model is hf
                       else (layer.ffn_in, layer.ffn_LayerNorm)):
            module.forward = (lambda original: lambda *args, **kwargs: original(*args, **kwargs) * 1.5)(module.forward)
    with torch.set_grad_enabled(grad):
        expected = hf(input_ids=ids, attention_mask=mask).logits
        actual = ours(ids, attention_mask=mask).logits
    assert rel_err(actual, expected) < 1e-5
    assert not torch.allclose(actual, rf.RobertaForSequenceClassification.from_pretrained(hf)(
        ids, attention_mask=mask).logits, atol=1e-4)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_masked_lm_runs_under_accelerate_offloading_as_transformers(offload, tmp_path):
    """accelerate's cpu_offload / disk_offload keep each module's weights on the meta device outside its
    own forward. transformers' tied decoder is a module with its own hook; here the head reads the word
    embeddings' weight, which is brought in by their hook. Before: "Cannot copy out of meta tensor"."""
    from accelerate import cpu_offload, disk_offload  # (peft's dependency: in the test extras)
    hf = hf_model("RobertaForMaskedLM")
    ids, mask = padded_batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
    ours = rf.RobertaForMaskedLM.from_pretrained(hf).eval()
    if offload == "cpu":
        cpu_offload(ours, execution_device="cpu")
    else:
        disk_offload(ours, str(tmp_path), execution_device="cpu")
    with torch.no_grad():
        actual = ours(ids, attention_mask=mask, labels=labels)
    assert ours.roberta.embeddings.word_embeddings.weight.is_meta  # offloaded again after the call
    assert rel_err(actual.logits, expected.logits) < 1e-5  # every position: hooks run the batch padded
    assert abs(actual.loss.item() - expected.loss.item()) < 1e-5


def test_transformers_call_conventions_hold_for_hooks_wrappers_and_replaced_modules(tmp_path):
    """What code written for transformers' calls relies on: a pre-hook on model.roberta finds input_ids
    in args[0]; a with_kwargs pre-hook on the embeddings finds them in kwargs; a wrapper with transformers'
    RobertaModel signature (no **kwargs) runs under a head; a token-type embedding of another class is
    called (when no token_type_ids are given, RoBERTa's usual case); save_function (accelerate's
    save) is accepted as transformers ignores it; `embeddings.position_ids` may be set (transformers'
    buffer name) without breaking forward."""
    hf = hf_model("RobertaForTokenClassification")
    ours = rf.RobertaForTokenClassification.from_pretrained(hf)
    ids, mask = padded_batch("right")
    seen = {}
    ours.roberta.register_forward_pre_hook(lambda module, args: seen.update(positional=args[0]))
    ours.roberta.embeddings.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(keyword=kwargs["input_ids"]), with_kwargs=True)
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    assert seen["positional"] is ids and torch.equal(seen["keyword"], ids)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                    inputs_embeds=None, output_attentions=None, output_hidden_states=None, return_dict=None):
            return self.inner(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                              output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                              return_dict=return_dict)

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return 3 * super().forward(ids)

    for model in (hf, ours):
        model.roberta = Wrapper(model.roberta)
        types = model.roberta.inner.embeddings.token_type_embeddings
        scaled = Scaled(types.num_embeddings, types.embedding_dim)
        scaled.load_state_dict(types.state_dict())
        model.roberta.inner.embeddings.token_type_embeddings = scaled
    with torch.no_grad():
        expected, actual = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert rel_err(actual[mask.bool()], expected[mask.bool()]) < 1e-5
    plain = rf.RobertaModel.from_pretrained(hf_model("RobertaModel"))
    plain.embeddings.position_ids = torch.arange(24)[None]
    with torch.no_grad():
        plain(ids, attention_mask=mask)
    plain.save_pretrained(tmp_path, save_function=torch.save)
    assert (tmp_path / "model.safetensors").is_file()


def test_the_attention_dropout_follows_the_layers_mode_as_in_transformers():
    """transformers' self-attention drops attention probabilities while the attention module trains, with
    its Dropout's p, whatever that Dropout's own mode: Monte Carlo dropout (.train() on the Dropout modules
    of an eval model) leaves attention probabilities whole in both."""
    hf = hf_model("RobertaModel", attention_probs_dropout_prob=0.5)
    ours = rf.RobertaModel.from_pretrained(hf)
    ids, mask = padded_batch("right")
    with torch.no_grad():
        for model in (hf, ours):
            evaluated = model(ids, attention_mask=mask).last_hidden_state
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Dropout):
                    m.train()
                    if not (name.endswith("attention_dropout") or name.endswith("attention.self.dropout")):
                        m.p = 0.0
            sampled = model(ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(sampled[mask.bool()], evaluated[mask.bool()], rtol=1e-5, atol=1e-6)
