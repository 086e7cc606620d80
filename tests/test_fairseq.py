"""roberta_fast.fairseq: fairseq RoBERTa checkpoints in, HF directories out, without fairseq.

The checkpoints are written here in fairseq's own layout (module names of fairseq's
RobertaModel / TransformerEncoder, `args` or `cfg` beside the weights, training state
with classes this process cannot import) from a transformers model, and the converted
directory must give that model's logits.
"""
import argparse
import enum
import json
import os
import random
import re
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roberta_fast as rf  # noqa: E402
from roberta_fast import fairseq  # noqa: E402

SIZES = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=34, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1)


def hf_model(vocab_size=SIZES["vocab_size"]):
    torch.manual_seed(0)
    model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**{**SIZES, "vocab_size": vocab_size}))
    with torch.no_grad():
        model.roberta.embeddings.token_type_embeddings.weight.zero_()  # fairseq has no token types
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # no LayerNorm left at exactly 1 / 0
        model.roberta.embeddings.token_type_embeddings.weight.zero_()
    return model.eval()


def fairseq_state(hf, old_names=False):
    """HF weights under fairseq's names (as fairseq's RobertaModel.state_dict() has them)."""
    sd = hf.state_dict()
    enc = "decoder.sentence_encoder." if old_names else "encoder.sentence_encoder."
    head = "decoder.lm_head." if old_names else "encoder.lm_head."
    emb_norm = "emb_layer_norm" if old_names else "layernorm_embedding"
    out = {enc + "embed_tokens.weight": sd["roberta.embeddings.word_embeddings.weight"],
           enc + "embed_positions.weight": sd["roberta.embeddings.position_embeddings.weight"],
           enc + emb_norm + ".weight": sd["roberta.embeddings.LayerNorm.weight"],
           enc + emb_norm + ".bias": sd["roberta.embeddings.LayerNorm.bias"],
           enc + "version": torch.tensor([2.0]),
           head + "dense.weight": sd["lm_head.dense.weight"], head + "dense.bias": sd["lm_head.dense.bias"],
           head + "layer_norm.weight": sd["lm_head.layer_norm.weight"],
           head + "layer_norm.bias": sd["lm_head.layer_norm.bias"],
           head + "weight": sd["roberta.embeddings.word_embeddings.weight"], head + "bias": sd["lm_head.bias"]}
    for i in range(SIZES["num_hidden_layers"]):
        hf_layer, fs_layer = f"roberta.encoder.layer.{i}.", f"{enc}layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{fs_layer}self_attn.q_proj.{kind}"] = sd[f"{hf_layer}attention.self.query.{kind}"]
            out[f"{fs_layer}self_attn.k_proj.{kind}"] = sd[f"{hf_layer}attention.self.key.{kind}"]
            out[f"{fs_layer}self_attn.v_proj.{kind}"] = sd[f"{hf_layer}attention.self.value.{kind}"]
            out[f"{fs_layer}self_attn.out_proj.{kind}"] = sd[f"{hf_layer}attention.output.dense.{kind}"]
            out[f"{fs_layer}self_attn_layer_norm.{kind}"] = sd[f"{hf_layer}attention.output.LayerNorm.{kind}"]
            out[f"{fs_layer}fc1.{kind}"] = sd[f"{hf_layer}intermediate.dense.{kind}"]
            out[f"{fs_layer}fc2.{kind}"] = sd[f"{hf_layer}output.dense.{kind}"]
            out[f"{fs_layer}final_layer_norm.{kind}"] = sd[f"{hf_layer}output.LayerNorm.{kind}"]
    return {k: v.clone() for k, v in out.items()}


class _Meter:
    """Stands for fairseq's logging meters, pickled into extra_state, unimportable at load time."""

    def __init__(self):
        self.sum, self.count = 3.0, 2


def save_checkpoint(path, state, **extra):
    """torch.save a fairseq-shaped checkpoint whose extra_state names a module that will not exist."""
    module = types.ModuleType("fairseq_logging_meters_for_test")
    _Meter.__module__ = module.__name__
    module._Meter = _Meter
    sys.modules[module.__name__] = module
    try:
        torch.save({"model": state, "extra_state": {"metrics": {"train": _Meter()}}, "optimizer_history": [],
                    **extra}, path)
    finally:
        del sys.modules[module.__name__]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.tensor([[0, 5, 17, 33, 59, 2, 1, 1], [0, 44, 8, 9, 10, 11, 12, 2]])


@pytest.mark.parametrize("layout", ["cfg", "args-old-names"])
def test_converted_checkpoint_gives_the_models_logits(tmp_path, layout):
    hf = hf_model()
    if layout == "cfg":  # fairseq >= 0.10: the config as a plain dict
        save_checkpoint(tmp_path / "ckpt.pt", fairseq_state(hf), cfg={"model": {"encoder_attention_heads": 4}})
    else:  # fairseq 0.9: argparse args, decoder.* names, emb_layer_norm
        save_checkpoint(tmp_path / "ckpt.pt", fairseq_state(hf, old_names=True),
                        args=argparse.Namespace(encoder_attention_heads=4, arch="roberta_base"))
    assert fairseq.main([str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf")]) == 0
    ours = rf.RobertaForMaskedLM.from_pretrained(tmp_path / "hf", backend="reference").eval()
    assert ours.config.num_attention_heads == 4 and ours.config.num_hidden_layers == 2
    torch.testing.assert_close(logits(ours, IDS), logits(hf, IDS), rtol=1e-5, atol=1e-5)
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits(reloaded, IDS), logits(hf, IDS), rtol=1e-5, atol=1e-5)


def test_released_2019_checkpoints_keep_qkv_as_one_in_proj(tmp_path):
    """roberta.base / roberta.large as released (fairseq < 0.9) stack each layer's q, k, v in one
    self_attn.in_proj_weight / in_proj_bias: split in that order, as fairseq does on load."""
    hf = hf_model()
    state = fairseq_state(hf, old_names=True)
    for i in range(SIZES["num_hidden_layers"]):
        attn = f"decoder.sentence_encoder.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            state[f"{attn}in_proj_{kind}"] = torch.cat([state.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"])
    save_checkpoint(tmp_path / "model.pt", state, args=argparse.Namespace(encoder_attention_heads=4))
    ours = fairseq.convert(tmp_path / "model.pt", tmp_path / "hf").eval()
    torch.testing.assert_close(logits(ours, IDS), logits(hf, IDS), rtol=1e-5, atol=1e-5)


class _Choices(str, enum.Enum):
    """Stands for fairseq's ChoiceEnum values (activation_fn) inside a pickled omegaconf config."""
    gelu = "gelu"
    gelu_accurate = "gelu_accurate"


class _DictConfig:
    """Pickles as omegaconf's DictConfig does: its state holds `_content`, a dict of value nodes."""

    def __init__(self, content):
        self._content, self._metadata, self._parent = content, None, None


class _AnyNode:
    def __init__(self, value):
        self._val, self._metadata, self._parent = value, None, None


def save_omegaconf_checkpoint(path, state, model_options):
    """A hydra-era fairseq checkpoint: `cfg` is the pickled DictConfig, whose module will not exist at load time."""
    module = types.ModuleType("omegaconf_for_test")
    for cls in (_Choices, _DictConfig, _AnyNode):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    sys.modules[module.__name__] = module
    model = _DictConfig({k: _AnyNode(v) for k, v in model_options.items()})
    try:
        torch.save({"model": state, "args": None, "cfg": _DictConfig({"model": model, "task": _DictConfig({})})}, path)
    finally:
        del sys.modules[module.__name__]


def test_a_cfg_pickled_as_omegaconf_is_read(tmp_path):
    """Its settings are read from the stand-ins' state: the head count, and an activation that
    would change the logits is refused, not converted under another --heads."""
    hf = hf_model()
    save_omegaconf_checkpoint(tmp_path / "tanh.pt", fairseq_state(hf),
                              {"encoder_attention_heads": 4, "activation_fn": _Choices.gelu_accurate})
    with pytest.raises(ValueError, match="activation_fn='gelu_accurate'"):
        fairseq.convert(tmp_path / "tanh.pt", tmp_path / "x", heads=4)
    save_omegaconf_checkpoint(tmp_path / "ok.pt", fairseq_state(hf),
                              {"encoder_attention_heads": 4, "activation_fn": _Choices.gelu})
    ours = fairseq.convert(tmp_path / "ok.pt", tmp_path / "hf").eval()
    assert ours.config.num_attention_heads == 4
    torch.testing.assert_close(logits(ours, IDS), logits(hf, IDS), rtol=1e-5, atol=1e-5)


def test_heads_must_be_known_and_bad_files_are_named(tmp_path, capsys):
    save_checkpoint(tmp_path / "ckpt.pt", fairseq_state(hf_model()))
    with pytest.raises(ValueError, match="--heads"):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "out")
    with pytest.raises(ValueError, match="--heads must be a positive number"):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "out", heads=0)
    model = fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "out", heads=4)
    torch.testing.assert_close(logits(model.eval(), IDS), logits(hf_model(), IDS), rtol=1e-5, atol=1e-5)

    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert fairseq.main([str(tmp_path / "other.pt"), "--out", str(tmp_path / "x")]) == 2
    assert "not a fairseq checkpoint" in capsys.readouterr().err
    state = fairseq_state(hf_model())
    del state["encoder.sentence_encoder.layers.1.fc2.bias"]
    save_checkpoint(tmp_path / "cut.pt", state, cfg={"model": {"encoder_attention_heads": 4}})
    with pytest.raises(ValueError, match="lacks encoder.sentence_encoder.layers.1.fc2.bias"):
        fairseq.convert(tmp_path / "cut.pt", tmp_path / "y")


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_reading_a_checkpoint_runs_none_of_its_code(tmp_path):
    marker = tmp_path / "ran"
    state = fairseq_state(hf_model())
    torch.save({"model": state, "cfg": {"model": {"encoder_attention_heads": 4}}, "x": _Exploit(marker)},
               tmp_path / "ckpt.pt")
    ckpt = fairseq.read_checkpoint(tmp_path / "ckpt.pt")
    assert not marker.exists()
    assert isinstance(ckpt["x"], fairseq._Inert)


def test_tokenizer_from_the_dictionary_and_gpt2_files(tmp_path):
    """dict.txt lists GPT-2 ids by frequency; the converted tokenizer gives each token its
    dictionary index (+4 for <s> <pad> </s> <unk>), <mask> last."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40 + "pack my box with five dozen jugs\n")
    gpt2 = rf.RobertaTokenizer.train([str(corpus)], vocab_size=300)
    gpt2.save(tmp_path / "gpt2")
    vocab = json.loads((tmp_path / "gpt2" / "vocab.json").read_text())
    encoder = {tok: i for tok, i in vocab.items() if tok not in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")}  # GPT-2 ids
    (tmp_path / "encoder.json").write_text(json.dumps(encoder))
    order = list(encoder.values())
    random.Random(0).shuffle(order)  # fairseq orders by frequency, not by GPT-2 id
    (tmp_path / "dict.txt").write_text("".join(f"{i} {1000 - n}\n" for n, i in enumerate(order)))
    vocab_size = 4 + len(order) + 1

    hf = hf_model(vocab_size)
    save_checkpoint(tmp_path / "ckpt.pt", fairseq_state(hf), cfg={"model": {"encoder_attention_heads": 4}})
    assert fairseq.main([str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf"), "--dict",
                         str(tmp_path / "dict.txt"), "--encoder-json", str(tmp_path / "encoder.json"),
                         "--vocab-bpe", str(tmp_path / "gpt2" / "merges.txt")]) == 0
    text = "the lazy fox packs five boxes"
    gpt2_ids = gpt2.encode(text)[1:-1]  # without <s> </s>
    expected = [0] + [4 + order.index(i) for i in gpt2_ids] + [2]
    assert rf.RobertaTokenizer.from_pretrained(tmp_path / "hf").encode(text) == expected
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(text)["input_ids"] == expected
    assert hf_tok.mask_token_id == vocab_size - 1

    (tmp_path / "short.txt").write_text("".join(f"{i} 1\n" for i in order[:-1]))
    with pytest.raises(ValueError, match="gives .* ids .* but the checkpoint's embedding has"):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "z", tmp_path / "short.txt", tmp_path / "encoder.json",
                        tmp_path / "gpt2" / "merges.txt")

    # a pruned dict.txt lacking a token the merges make (a filler token keeps the checkpoint's size):
    # the error names dict.txt, vocab.bpe and the token, not a temporary merges.txt
    made = "".join(gpt2.merges()[-1])
    (tmp_path / "encoder.json").write_text(json.dumps({**encoder, "filler": 99_999}))
    (tmp_path / "pruned.txt").write_text("".join(f"{i} 1\n" for i in order if i != encoder[made]) + "99999 1\n")
    with pytest.raises(ValueError, match=re.escape(f"pruned.txt lacks 1 tokens that the GPT-2 tokenizer needs (byte "
                                                   f"tokens, or tokens the merges of {tmp_path / 'gpt2' / 'merges.txt'} "
                                                   f"use or make: {made!r})")):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "p", tmp_path / "pruned.txt", tmp_path / "encoder.json",
                        tmp_path / "gpt2" / "merges.txt")
    # a byte token that no merge uses: fairseq gives <unk>, a BPE tokenizer without it would drop the byte
    from tokenizers.pre_tokenizers import ByteLevel

    merged = {t for pair in gpt2.merges() for t in (*pair, "".join(pair))}
    byte = sorted(set(ByteLevel.alphabet()) - merged)[0]
    (tmp_path / "no_byte.txt").write_text("".join(f"{i} 1\n" for i in order if i != encoder[byte]) + "99999 1\n")
    with pytest.raises(ValueError, match=re.escape(f"no_byte.txt lacks 1 tokens") + f".*{re.escape(repr(byte))}"):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "b", tmp_path / "no_byte.txt", tmp_path / "encoder.json",
                        tmp_path / "gpt2" / "merges.txt")


def test_a_fine_tuned_classification_head(tmp_path):
    """fairseq keeps fine-tuned heads as classification_heads.<name>.{dense,out_proj} beside the MLM head."""
    torch.manual_seed(1)
    hf = transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**SIZES, num_labels=3)).eval()
    with torch.no_grad():
        hf.roberta.embeddings.token_type_embeddings.weight.zero_()
    mlm = hf_model()
    mlm.roberta.load_state_dict(hf.roberta.state_dict(), strict=False)
    state = fairseq_state(mlm)
    sd = hf.state_dict()
    for name in ("dense", "out_proj"):
        for kind in ("weight", "bias"):
            state[f"classification_heads.mnli.{name}.{kind}"] = sd[f"classifier.{name}.{kind}"].clone()
    save_checkpoint(tmp_path / "ckpt.pt", state, cfg={"model": {"encoder_attention_heads": 4}})
    with pytest.raises(ValueError, match=r"no classification head 'sst2'.*\['mnli'\]"):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "x", classification_head="sst2")
    # fairseq's --pooler-activation-fn: transformers' head applies tanh, so another one is refused
    save_checkpoint(tmp_path / "relu.pt", state, cfg={"model": {"encoder_attention_heads": 4,
                                                                "pooler_activation_fn": "relu"}})
    with pytest.raises(ValueError, match="pooler_activation_fn='relu'"):
        fairseq.convert(tmp_path / "relu.pt", tmp_path / "x", classification_head="mnli")
    assert fairseq.main([str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "cls"),
                         "--classification-head", "mnli"]) == 0
    ours = rf.RobertaForSequenceClassification.from_pretrained(tmp_path / "cls", backend="reference").eval()
    assert ours.num_labels == 3
    torch.testing.assert_close(logits(ours, IDS), logits(hf, IDS), rtol=1e-5, atol=1e-5)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls").eval()
    torch.testing.assert_close(logits(reloaded, IDS), logits(hf, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting, match", [
    ({"encoder_normalize_before": True}, "encoder_normalize_before=True"),
    ({"activation_fn": "gelu_accurate"}, "activation_fn='gelu_accurate'"),
    ({"activation_fn": "relu"}, "activation_fn='relu'"),
])
@pytest.mark.parametrize("layout", ["cfg", "args"])
def test_options_that_change_the_function_are_refused(tmp_path, setting, match, layout):
    """Pre-LN layers and another activation keep RoBERTa's weight names: the converter reads the
    options from cfg/args and refuses them, naming the option, instead of giving other logits."""
    options = {"encoder_attention_heads": 4, **setting}
    extra = {"cfg": {"model": options}} if layout == "cfg" else {"args": argparse.Namespace(**options)}
    save_checkpoint(tmp_path / "ckpt.pt", fairseq_state(hf_model()), **extra)
    with pytest.raises(ValueError, match=re.escape(match)):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "out")
    # RoBERTa's own settings convert
    ok = {"encoder_attention_heads": 4, "encoder_normalize_before": False, "activation_fn": "gelu"}
    save_checkpoint(tmp_path / "ok.pt", fairseq_state(hf_model()), cfg={"model": ok})
    fairseq.convert(tmp_path / "ok.pt", tmp_path / "ok")


def test_encoder_weights_the_conversion_does_not_use_are_refused(tmp_path):
    """A pre-LN encoder's final LayerNorm (sentence_encoder.layer_norm.*), even with no option saying
    so, would be dropped silently: the error names the keys."""
    state = fairseq_state(hf_model())
    state["encoder.sentence_encoder.layer_norm.weight"] = torch.ones(SIZES["hidden_size"])
    state["encoder.sentence_encoder.layer_norm.bias"] = torch.zeros(SIZES["hidden_size"])
    save_checkpoint(tmp_path / "ckpt.pt", state, cfg={"model": {"encoder_attention_heads": 4}})
    with pytest.raises(ValueError, match=r"2 encoder weights .*encoder\.sentence_encoder\.layer_norm\.bias, "
                                         r"encoder\.sentence_encoder\.layer_norm\.weight"):
        fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "out")


@pytest.mark.parametrize("payload", ["reduce", "dotted_name"])
def test_a_malicious_fairseq_checkpoint_runs_no_code(tmp_path, payload):
    """fairseq checkpoints are pickles with argparse / omegaconf objects, read by a restricted
    unpickler: a payload calling os.system, or escaping the allow-list through a dotted name
    (`_rebuild_tensor.__builtins__.get`, which a name-prefix check once let through to `exec`), runs
    nothing."""
    from malicious_checkpoint import write_dotted_name_checkpoint, write_malicious_checkpoint

    marker, path = tmp_path / "PWNED", tmp_path / "evil" / "model.pt"
    if payload == "reduce":
        write_malicious_checkpoint(path, marker)
    else:
        path.parent.mkdir()
        write_dotted_name_checkpoint(path, marker)
    try:
        fairseq.read_checkpoint(path)
    except ValueError:
        pass  # refusing it is fine too; running it is not
    assert not marker.exists()
