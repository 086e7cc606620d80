"""The reference model against Hugging Face `transformers` itself (random weights, no downloads).

Forward outputs and the gradient of every parameter must match HF's RobertaForMaskedLM
in fp32 on batches with right padding, left padding and random attention masks; saving
and loading must round-trip in both directions.
"""
import json
import warnings

import pytest
import torch

import roberta_fast as rf
from roberta_fast.hf import native_to_hf

transformers = pytest.importorskip("transformers")

# (name, HF config fields): a regular small model, odd sizes, and a pad id other than 1.
CONFIGS = {
    "small": dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=40),
    "odd": dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=3,
                intermediate_size=80, max_position_embeddings=27),
    "pad5": dict(vocab_size=61, hidden_size=24, num_hidden_layers=1, num_attention_heads=4,
                 intermediate_size=40, max_position_embeddings=30, pad_token_id=5,
                 bos_token_id=0, eos_token_id=2),
}
PADDINGS = ["right", "left", "random"]


def hf_model(fields, cls="RobertaForMaskedLM", seed=0):
    config = transformers.RobertaConfig(type_vocab_size=1, layer_norm_eps=1e-5, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():  # HF zero-initialises biases and LayerNorms: make every weight random
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def batch(fields, padding, batch_size=4, seed=1):
    """(input_ids, attention_mask, labels) with the given padding pattern; every row keeps a token."""
    g = torch.Generator().manual_seed(seed)
    pad = fields.get("pad_token_id", 1)
    seqlen = fields["max_position_embeddings"] - pad - 1  # the longest the position table allows
    ids = torch.randint(0, fields["vocab_size"], (batch_size, seqlen), generator=g)
    ids[ids == pad] = pad + 1
    lengths = torch.tensor([seqlen, 1, seqlen // 2, seqlen - 3])[:batch_size]
    positions = torch.arange(seqlen)[None, :]
    if padding == "right":
        mask = positions < lengths[:, None]
    elif padding == "left":
        mask = positions >= seqlen - lengths[:, None]
    else:  # random holes in the mask, ids unpadded
        mask = torch.rand(batch_size, seqlen, generator=g) < 0.6
        mask[:, 0] = True
    if padding != "random":
        ids[~mask] = pad
    labels = torch.where(torch.rand(batch_size, seqlen, generator=g) < 0.3, ids, -100)
    labels[~mask] = -100
    labels[:, 0] = ids[:, 0]
    return ids, mask.long(), labels


def assert_close_rel(actual, expected, rel=1e-5, what=""):
    """max |a - e| <= rel * max |e| (+ a float32 floor for all-zero tensors)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale + 1e-7, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    fields = CONFIGS[request.param]
    hf = hf_model(fields)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = rf.RobertaForMaskedLM.from_pretrained(path, backend="reference").eval()
    return fields, hf, ours


@pytest.mark.parametrize("padding", PADDINGS)
def test_forward_matches_transformers(pair, padding):
    fields, hf, ours = pair
    ids, mask, labels = batch(fields, padding)
    labels = labels.masked_fill(~mask.bool(), -100)  # left padding labels position 0: padded, so not predicted
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        actual = ours(ids, mask, labels=labels, output_hidden_states=True)
    real = mask.bool()  # no_grad on the CPU runs unpadded: zeros at padded positions (test_cpu_inference.py)
    assert_close_rel(actual.logits[real], expected.logits[real], what="logits")
    assert_close_rel(actual.hidden_states[-1][real], expected.hidden_states[-1][real], what="last hidden state")
    assert len(actual.hidden_states) == len(expected.hidden_states)
    assert_close_rel(actual.loss, expected.loss, what="loss")


@pytest.mark.parametrize("padding", PADDINGS)
def test_gradients_match_transformers(pair, padding):
    fields, hf, ours = pair
    ids, mask, labels = batch(fields, padding, seed=2)
    hf.zero_grad()
    ours.zero_grad()
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ours(ids, mask, labels=labels).loss.backward()
    ours_grads = native_to_hf({n: p.grad for n, p in ours.named_parameters()}, prefix="roberta.")
    hf_params = dict(hf.named_parameters())
    assert set(ours_grads) == set(hf_params)
    for name, p in hf_params.items():
        assert_close_rel(ours_grads[name], p.grad, what=f"grad of {name}")


def test_masked_only_head_matches_full_head(pair):
    fields, _, ours = pair
    ids, mask, labels = batch(fields, "right", seed=3)
    with torch.no_grad():
        full = ours(ids, mask, labels=labels)
        sparse = ours(ids, mask, labels=labels, masked_only=True)
        summed = ours(ids, mask, labels=labels, masked_only=True, loss_reduction="sum")
    predicted = labels != -100
    torch.testing.assert_close(sparse.logits, full.logits[predicted])
    torch.testing.assert_close(sparse.loss, full.loss)
    torch.testing.assert_close(summed.loss, full.loss * predicted.sum())


def test_save_pretrained_loads_in_transformers(pair, tmp_path):
    fields, hf, ours = pair
    ours.save_pretrained(tmp_path)
    reloaded, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not v for v in info.values()), info
    ids, mask, _ = batch(fields, "left")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=ids, attention_mask=mask).logits,
                                   hf(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_from_transformers_object_and_bin(tmp_path):
    fields = CONFIGS["small"]
    hf = hf_model(fields, seed=4)
    from_object = rf.RobertaForMaskedLM.from_pretrained(hf).eval()
    ids, mask, _ = batch(fields, "right")
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()  # no_grad on the CPU runs unpadded: zeros at padded positions
        assert_close_rel(from_object(ids, mask).logits[real], expected[real], what="from a transformers object")
    # pytorch_model.bin, as older checkpoints (roberta-base itself) ship
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(hf.state_dict(), bin_dir / "pytorch_model.bin")
    hf.config.to_json_file(bin_dir / "config.json")
    from_bin = rf.RobertaForMaskedLM.from_pretrained(bin_dir).eval()
    with torch.no_grad():
        assert_close_rel(from_bin(ids, mask).logits[real], expected[real], what="from pytorch_model.bin")
    # a .bin whose pickle would run code: refused, nothing run, with a fix that can be followed
    from malicious_checkpoint import write_malicious_checkpoint

    marker = tmp_path / "ran"
    write_malicious_checkpoint(bin_dir / "pytorch_model.bin", marker)
    for kwargs in ({}, {"weights_only": False}):
        with pytest.raises(ValueError, match=r"refusing to load .*pytorch_model\.bin.*unsupported GLOBAL posix\.system"
                                             r".*model\.safetensors"):
            rf.RobertaForMaskedLM.from_pretrained(bin_dir, **kwargs)
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["gamma_beta", "stale_bias", "decoder_only"])
def test_older_checkpoint_layouts_load_as_transformers_loads_them(layout, tmp_path):
    """LayerNorm gamma / beta (transformers' legacy names), an MLM bias kept as lm_head.decoder.bias beside a
    stale lm_head.bias (transformers' decoder computes with its own), and the tied embeddings kept only as
    lm_head.decoder.weight (safetensors' save_model keeps a shared tensor under the name that sorts first)."""
    from safetensors.torch import save_file

    fields = CONFIGS["odd"]
    hf = hf_model(fields, seed=7)
    ids, mask, _ = batch(fields, "random")
    real = mask.bool()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    if layout == "stale_bias":
        state["lm_head.bias"] = torch.randn_like(state["lm_head.bias"])  # the decoder's bias is the one used
    elif layout == "decoder_only":
        del state["roberta.embeddings.word_embeddings.weight"]
    else:
        state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                 for k, v in state.items()}
    save_file(state, tmp_path / "model.safetensors")
    hf.config.to_json_file(tmp_path / "config.json")
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ours = rf.RobertaForMaskedLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask).logits
        assert_close_rel(expected, hf(input_ids=ids, attention_mask=mask).logits, what="transformers' reading")
        assert_close_rel(ours(ids, mask).logits[real], expected[real], what="older layouts")


def test_encoder_matches_transformers_with_pooler(tmp_path):
    fields = CONFIGS["odd"]
    hf = hf_model(fields, cls="RobertaModel", seed=5)
    hf.save_pretrained(tmp_path)
    ours = rf.RobertaModel.from_pretrained(tmp_path).eval()
    ids, mask, _ = batch(fields, "random")
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask)
        actual = ours(ids, attention_mask=mask)
    real = mask.bool()  # no_grad on the CPU runs unpadded: zeros at padded positions
    assert_close_rel(actual.last_hidden_state[real], expected.last_hidden_state[real], what="last hidden state")
    assert_close_rel(actual.pooler_output, expected.pooler_output, what="pooler output")
    out_dir = tmp_path / "resaved"
    ours.save_pretrained(out_dir)
    reloaded, info = transformers.AutoModel.from_pretrained(out_dir, output_loading_info=True)
    assert all(not v for v in info.values()), info


def test_encoder_from_mlm_checkpoint_reports_new_pooler(tmp_path):
    hf = hf_model(CONFIGS["small"])
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="pooler"):
        encoder = rf.RobertaModel.from_pretrained(tmp_path)
    torch.testing.assert_close(encoder.embeddings.word_embeddings.weight,
                               hf.roberta.embeddings.word_embeddings.weight)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_save_pretrained_writes_the_saved_weights_dtype(key, tmp_path):
    """The source's dtype (transformers 5's "dtype", 4's "torch_dtype") was once copied into the saved
    config.json while the weights were saved in fp32, so transformers reloaded them in fp16. The
    saved weights' dtype is written, as transformers writes it ("dtype" only)."""
    hf_model(CONFIGS["small"]).half().save_pretrained(tmp_path / "fp16")
    config = json.loads((tmp_path / "fp16" / "config.json").read_text())
    config[key] = config.pop("dtype", None) or config.pop("torch_dtype")
    (tmp_path / "fp16" / "config.json").write_text(json.dumps(config))
    ours = rf.RobertaForMaskedLM.from_pretrained(tmp_path / "fp16")
    for dtype in (torch.float32, torch.bfloat16):  # the default fp32 model, then one cast to bf16
        ours.to(dtype).save_pretrained(tmp_path / "out")
        saved = json.loads((tmp_path / "out" / "config.json").read_text())
        assert saved["dtype"] == str(dtype).removeprefix("torch.") and "torch_dtype" not in saved
        assert transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out").dtype == dtype


def test_missing_and_mismatched_weights_are_named_as_in_the_checkpoint(tmp_path):
    """The errors once named roberta_fast's own keys (layers.1.ffn_out, a fused qkv), which the checkpoint
    does not have; they name the checkpoint's (transformers') weights."""
    from safetensors.torch import load_file, save_file

    hf_model(CONFIGS["small"]).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    layer = "roberta.encoder.layer"
    cases = [
        ({f"{layer}.1.output.dense.weight": None}, {},
         rf"lacks encoder weights: \['{layer}\.1\.output\.dense\.weight'\]"),
        ({f"{layer}.0.attention.self.{n}.bias": None for n in ("query", "key", "value")}, {},
         rf"lacks encoder weights: \['{layer}\.0\.attention\.self\.key\.bias', .*query.*value\.bias'\]"),
        ({f"{layer}.0.attention.self.{n}.weight": torch.zeros(16, 32) for n in ("query", "key", "value")}, {},
         rf"weight {layer}\.0\.attention\.self\.query\.weight / .*key.* / .*value\.weight has shape \(16, 32\), "
         r"the config implies \(32, 32\)"),
        ({}, dict(intermediate_size=48), rf"weight {layer}\.0\.intermediate\.dense\.\w+ has shape \(64"),
    ]
    for i, (changes, kwargs, message) in enumerate(cases):
        changed = {k: v for k, v in {**weights, **changes}.items() if v is not None}
        (tmp_path / str(i)).mkdir()
        save_file(changed, tmp_path / str(i) / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / str(i) / "config.json").write_text((tmp_path / "config.json").read_text())
        with pytest.raises(ValueError, match=message):
            rf.RobertaForMaskedLM.from_pretrained(tmp_path / str(i), **kwargs)


def test_backend_switch_changes_no_weight():
    model = rf.RobertaForMaskedLM(rf.RobertaConfig.preset("tiny", vocab_size=50))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.backend = "reference"
    assert model.roberta.backend == "reference"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_training_dropout_is_active_and_eval_is_deterministic():
    model = rf.RobertaForMaskedLM(rf.RobertaConfig.preset("tiny", vocab_size=50))
    ids = torch.randint(3, 50, (2, 9))
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids)
