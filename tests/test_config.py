"""RobertaConfig: presets, HF config.json round trip, and readable validation errors."""
import json

import pytest
import torch

import roberta_fast as rf

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name, millions", [("base", 124.7), ("large", 355.4)])
def test_presets_match_the_published_sizes(name, millions):
    """DESIGN.md: base 124.7M, large 355M parameters (MLM head tied); HF counts the same."""
    cfg = rf.RobertaConfig.preset(name)
    model_class = transformers.RobertaForMaskedLM  # imported outside the meta context: transformers 5.0's lazy
    with torch.device("meta"):                      # import makes tensors (.item() fails on meta ones)
        hf = model_class(transformers.RobertaConfig(**cfg.to_dict()))
    hf.tie_weights()  # transformers 5.0 leaves the decoder untied when built on the meta device (later ones tie it)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert cfg.num_parameters() / 1e6 == pytest.approx(millions, abs=0.05)


def test_tiny_preset_is_small_and_valid():
    cfg = rf.RobertaConfig.preset("tiny")
    assert cfg.num_parameters() < 5_000_000
    assert cfg.max_seq_len == 128


def test_unknown_preset_names_choices():
    with pytest.raises(ValueError, match="base"):
        rf.RobertaConfig.preset("huge")


def test_hf_config_json_round_trip(tmp_path):
    hf = transformers.RobertaConfig(vocab_size=123, hidden_size=48, num_attention_heads=3,
                                    max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5)
    hf.save_pretrained(tmp_path)
    cfg = rf.RobertaConfig.from_pretrained(tmp_path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.max_seq_len) == (123, 48, 3, 64)
    out = tmp_path / "ours"
    cfg.save_pretrained(out)
    back = transformers.AutoConfig.from_pretrained(out)
    for key, value in cfg.to_dict().items():
        if key != "architectures":
            assert getattr(back, key) == value, key
    assert json.loads((out / "config.json").read_text())["model_type"] == "roberta"


@pytest.mark.parametrize("fields, message", [
    (dict(hidden_size=100, num_attention_heads=12), "divisible by num_attention_heads"),
    (dict(max_position_embeddings=2), "leaves no position"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob must be a probability"),
    (dict(hidden_act="relu"), "hidden_act 'relu' is not supported"),
    (dict(position_embedding_type="relative_key"), "only RoBERTa's learned 'absolute'"),
    (dict(pad_token_id=60000), r"pad_token_id \(60000\) must be a token id"),
    (dict(layer_norm_eps=0), "layer_norm_eps must be > 0"),
])
def test_invalid_configs_raise_readable_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        rf.RobertaConfig(**fields)


def test_non_roberta_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        rf.RobertaConfig.from_pretrained(tmp_path)


def test_explicit_nulls_are_written_back(tmp_path):
    """bos_token_id / eos_token_id None (and any key read as null) were once left out of config.json,
    so transformers read its defaults 0 and 2; they are written as null, as transformers writes them.
    The Nones transformers leaves out (architectures, dtype, problem_type unset) stay out."""
    transformers.RobertaConfig(bos_token_id=None, eos_token_id=None, my_flag=None).save_pretrained(tmp_path)
    cfg = rf.RobertaConfig.from_pretrained(tmp_path)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (None, None)
    cfg.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert {k: saved[k] for k in ("bos_token_id", "eos_token_id", "my_flag")} == dict.fromkeys(
        ("bos_token_id", "eos_token_id", "my_flag"))
    back = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    assert (back.bos_token_id, back.eos_token_id) == (None, None)
    assert not {"architectures", "dtype", "problem_type"} & set(rf.RobertaConfig().to_dict())


def test_a_transformers_config_object_saves_as_transformers_saves_it(tmp_path):
    """From a transformers config's to_dict, _name_or_path (a local path), chunk_size_feed_forward and
    is_encoder_decoder were once written into config.json; transformers writes none of them."""
    hf = transformers.RobertaConfig(vocab_size=123, hidden_size=48, num_attention_heads=3)
    hf.name_or_path = str(tmp_path / "hf")  # as transformers' from_pretrained sets it
    assert hf.to_dict()["_name_or_path"] == str(tmp_path / "hf")
    rf.RobertaConfig.from_dict(hf.to_dict()).save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert not {"_name_or_path", "chunk_size_feed_forward", "is_encoder_decoder"} & set(saved)
    assert rf.RobertaConfig.from_dict({"chunk_size_feed_forward": 64}).to_dict()["chunk_size_feed_forward"] == 64


@pytest.mark.parametrize("hf_class", ["RobertaConfig", "XLMRobertaConfig", "CamembertConfig"])
def test_model_type_reads_as_transformers_config_says_it(tmp_path, hf_class):
    """`config.model_type`, which sentence-transformers (its Transformer module's preprocess), PEFT and
    optimum read off a model's config, was missing: an rf model inside a SentenceTransformer failed."""
    hf = getattr(transformers, hf_class)(vocab_size=123, hidden_size=48, num_attention_heads=3)
    hf.save_pretrained(tmp_path)
    for ours in (rf.RobertaConfig.from_json_file(tmp_path / "config.json"), rf.RobertaConfig.from_dict(hf.to_dict())):
        assert ours.model_type == hf.model_type == ours.to_dict()["model_type"]
    assert rf.RobertaConfig.preset("tiny").model_type == "roberta"
    assert ours.is_decoder is ours.add_cross_attention is ours.is_encoder_decoder is False  # read as flags, too
