"""Import a fairseq RoBERTa checkpoint, with no fairseq installed.

    python -m roberta_fast.fairseq checkpoint_best.pt --out roberta_hf/ \\
        [--dict dict.txt --encoder-json encoder.json --vocab-bpe vocab.bpe] [--classification-head mnli]

writes an HF model directory (config.json + model.safetensors, and the tokenizer when
the three tokenizer files are given) that `rf.RobertaForMaskedLM.from_pretrained`,
`--init-from` and `transformers` load. fairseq's RoBERTa is the same function as HF's
(post-LN, learned positions offset by padding_idx + 1, erf GELU, tied decoder), so the
conversion only renames weights, as transformers' own converter does
(convert_roberta_original_pytorch_checkpoint_to_pytorch.py), but reads the checkpoint
file directly: newer fairseq names (`encoder.sentence_encoder.layernorm_embedding`)
and older ones (`decoder.` prefix, `emb_layer_norm`, and the released 2019 files' `in_proj_weight`
holding q, k and v, split as fairseq splits it on load) all work. What would convert to another
function under the same names is refused by name: encoder_normalize_before=True (pre-LN), an
activation_fn other than "gelu" (gelu_accurate is the tanh approximation, which hidden_act "gelu"
is not), a classification head's pooler_activation_fn other than tanh, and any encoder weight the conversion has no place for (a pre-LN final layer_norm).

The checkpoint is unpickled with a restricted unpickler: tensors and plain containers
are rebuilt, every other class (fairseq's meters, omegaconf, numpy RNG state) becomes an
inert stand-in, so no code from the file runs and fairseq/omegaconf need not be
importable (a `cfg` pickled as omegaconf's DictConfig is read from its stand-in's state). The head count comes from the checkpoint's `args`/`cfg` (it is not in the
weight shapes); `--heads` overrides it.

Tokenizer: fairseq's dictionary (dict.txt) lists GPT-2 BPE ids by frequency after
<s> <pad> </s> <unk>; with GPT-2's encoder.json (token -> GPT-2 id) and vocab.bpe
(merges), vocab.json maps each token to its fairseq index, as roberta-base's does. A
pruned dict.txt, lacking tokens the merges make or byte tokens, is refused by name: fairseq encodes those
as <unk>, which a Hugging Face BPE tokenizer cannot express.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import types

import torch

from .config import RobertaConfig

_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq Dictionary's first four ids
_LAYER = {  # fairseq layer module -> HF layer module
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "self_attn_layer_norm": "attention.output.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "final_layer_norm": "output.LayerNorm",
}


# ------------------------------------------------------------------ reading the file
class _Inert:
    """Stand-in for a class the checkpoint names but this process must not import or run."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state


# torch._utils' functions that rebuild a (dense) tensor or parameter, as torch's weights-only loader allows
_TENSOR_REBUILDERS = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                      "_rebuild_parameter_with_state")


def _is_safe(module: str, name: str) -> bool:
    """What a checkpoint of tensors and plain containers needs, as torch's weights-only loader allows:
    exact names only. A dotted name is never safe: from pickle protocol 4 the unpickler follows it
    attribute by attribute, so `_rebuild_tensor.__builtins__.get` would reach `exec`."""
    if "." in name:
        return False
    if module == "torch._utils":
        return name in _TENSOR_REBUILDERS
    if module == "torch":
        return name in ("Size", "device") or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch._tensor", "_rebuild_from_type_v2"), ("torch.nn.parameter", "Parameter"),
        ("collections", "OrderedDict"), ("argparse", "Namespace"), ("copyreg", "_reconstructor"),
        ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "object"),
        ("_codecs", "encode")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if _is_safe(module, name):
            return super().find_class(module, name)
        return type(name, (_Inert,), {"__module__": "roberta_fast.fairseq.inert." + module})


# What torch.load needs of a pickle module (torch subclasses its Unpickler for the storages).
_restricted_pickle = types.ModuleType("roberta_fast_restricted_pickle")
_restricted_pickle.Unpickler = _Unpickler
_restricted_pickle.load = lambda f, **kwargs: _Unpickler(f, **kwargs).load()


def read_checkpoint(path) -> dict:
    """The checkpoint's dict ({"model": state dict, "args" or "cfg": ...}), tensors on the CPU."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no fairseq checkpoint at {str(path)!r}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_restricted_pickle)
    except Exception as err:
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {err}") from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise ValueError(f"{path} is not a fairseq checkpoint: it has no 'model' state dict")
    if "cfg" in ckpt:
        ckpt["cfg"] = _plain(ckpt["cfg"])
    return ckpt


def _plain(value):
    """A config as plain Python. Hydra-era fairseq pickled `cfg` as omegaconf's DictConfig, which
    loads here as stand-ins: a container's state holds its `_content`, a value node's its `_val`,
    and an enum member (fairseq's ChoiceEnum) is rebuilt from its one argument, the value."""
    if isinstance(value, _Inert):
        state = getattr(value, "state", None)
        if isinstance(state, dict) and ("_content" in state or "_val" in state):
            return _plain(state["_content"] if "_content" in state else state["_val"])
        if len(value.args) == 1 and not value.kwargs and not hasattr(value, "state"):
            return _plain(value.args[0])
        return value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def _model_setting(ckpt: dict, name: str):
    """A model option from `cfg["model"]` (fairseq >= 0.10: a plain dict) or `args` (a Namespace); None if unset."""
    cfg = ckpt.get("cfg")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), (dict, argparse.Namespace)):
        model = cfg["model"]
        value = model.get(name) if isinstance(model, dict) else getattr(model, name, None)
        if value is not None:
            return value
    return getattr(ckpt.get("args"), name, None)


def _attention_heads(ckpt: dict) -> int | None:
    """encoder_attention_heads from the checkpoint's `cfg` or `args`."""
    heads = _model_setting(ckpt, "encoder_attention_heads")
    return int(heads) if heads else None


def _check_architecture(ckpt: dict) -> None:
    """Refuse the fairseq options that change RoBERTa's function but not its weight names: the
    conversion would give wrong logits without an error."""
    if _model_setting(ckpt, "encoder_normalize_before"):
        raise ValueError("this checkpoint was trained with encoder_normalize_before=True (pre-LN layers), "
                         "which is not RoBERTa's post-LN architecture and cannot be converted to it")
    activation = _model_setting(ckpt, "activation_fn")
    if activation not in (None, "gelu"):
        raise ValueError(f"this checkpoint was trained with activation_fn={activation!r}; only 'gelu' (the erf "
                         "form, fairseq's RoBERTa default) converts, as RoBERTa's hidden_act 'gelu' "
                         "(gelu_accurate / gelu_fast are the tanh approximation, which would change the logits)")


def _check_classification_head(ckpt: dict) -> None:
    """Refuse a classification head whose pooler activation is not tanh (--pooler-activation-fn):
    transformers' RobertaClassificationHead applies tanh between dense and out_proj."""
    activation = _model_setting(ckpt, "pooler_activation_fn")
    if activation not in (None, "tanh"):
        raise ValueError(f"this checkpoint's classification heads were trained with pooler_activation_fn="
                         f"{activation!r}; only 'tanh' (fairseq's default) converts, as transformers' "
                         "RobertaClassificationHead applies tanh (another one would change the logits)")


def _split_in_proj(state: dict) -> dict:
    """The state dict with each `in_proj_weight` / `in_proj_bias` (fairseq < 0.9, as in the released
    roberta.base / roberta.large files: q, k and v stacked in that order) split into q_proj, k_proj
    and v_proj, as fairseq's MultiheadAttention.upgrade_state_dict_named splits them on load."""
    out = {}
    for key, value in state.items():
        stem, _, kind = key.rpartition(".in_proj_")
        if stem and kind in ("weight", "bias"):
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3)):  # (3 * hidden, ...) -> 3 x (hidden, ...)
                out[f"{stem}.{name}.{kind}"] = part
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------ the model
def to_hf(ckpt: dict, heads: int | None = None,
          classification_head: str | None = None) -> tuple[RobertaConfig, dict]:
    """(config, HF-named state dict) from a fairseq checkpoint dict: RobertaForMaskedLM's, or with
    `classification_head` (a fine-tuned model's head name, e.g. "mnli") RobertaForSequenceClassification's."""
    state = _split_in_proj(ckpt["model"])
    prefix = next((p for p in ("encoder.sentence_encoder.", "decoder.sentence_encoder.")
                   if p + "embed_tokens.weight" in state), None)
    if prefix is None:
        raise ValueError("not a fairseq RoBERTa checkpoint: no encoder.sentence_encoder.embed_tokens.weight")
    head = prefix.replace("sentence_encoder.", "lm_head.")
    _check_architecture(ckpt)
    if state.get(prefix + "layernorm_embedding.weight") is None and state.get(prefix + "emb_layer_norm.weight") \
            is None:
        raise ValueError("this checkpoint has no embedding LayerNorm: a pre-LN model "
                         "(roberta_prenorm), which is not RoBERTa's architecture")
    used = set()

    def take(key):
        if key not in state:
            raise ValueError(f"the checkpoint lacks {key}")
        used.add(key)
        return state[key]

    words, positions = take(prefix + "embed_tokens.weight"), take(prefix + "embed_positions.weight")
    layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", k)))
    hidden = words.shape[1]
    if heads is not None and heads < 1:
        raise ValueError(f"--heads must be a positive number of attention heads, got {heads}")
    heads = heads or _attention_heads(ckpt)
    if heads is None:
        raise ValueError("the checkpoint does not record encoder_attention_heads; pass it with --heads "
                         f"(RoBERTa uses head size 64: {hidden // 64} for hidden size {hidden})")
    config = RobertaConfig(vocab_size=words.shape[0], hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads,
                           intermediate_size=state[prefix + "layers.0.fc1.weight"].shape[0],
                           max_position_embeddings=positions.shape[0], type_vocab_size=1,
                           layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)

    norm = "layernorm_embedding" if prefix + "layernorm_embedding.weight" in state else "emb_layer_norm"
    out = {"roberta.embeddings.word_embeddings.weight": words,
           "roberta.embeddings.position_embeddings.weight": positions,
           "roberta.embeddings.token_type_embeddings.weight": torch.zeros(1, hidden, dtype=words.dtype),
           "roberta.embeddings.LayerNorm.weight": take(f"{prefix}{norm}.weight"),
           "roberta.embeddings.LayerNorm.bias": take(f"{prefix}{norm}.bias")}
    for i in range(layers):
        for theirs, ours in _LAYER.items():
            for kind in ("weight", "bias"):
                out[f"roberta.encoder.layer.{i}.{ours}.{kind}"] = take(f"{prefix}layers.{i}.{theirs}.{kind}")
    if classification_head is not None:
        names = sorted({k.split(".")[1] for k in state if k.startswith("classification_heads.")})
        if classification_head not in names:
            raise ValueError(f"no classification head {classification_head!r} in the checkpoint; it has "
                             f"{names or 'none'}")
        _check_classification_head(ckpt)
        for name in ("dense", "out_proj"):
            for kind in ("weight", "bias"):
                out[f"classifier.{name}.{kind}"] = take(f"classification_heads.{classification_head}.{name}.{kind}")
        _refuse_unused(state, used, (prefix,))
        return config, out
    for name in ("dense", "layer_norm"):
        for kind in ("weight", "bias"):
            out[f"lm_head.{name}.{kind}"] = take(f"{head}{name}.{kind}")
    out["lm_head.bias"] = take(head + "bias")
    decoder = take(head + "weight") if head + "weight" in state else None
    if decoder is not None and not torch.equal(decoder, words):
        raise ValueError("the MLM decoder is not tied to the word embeddings (untie_weights_roberta); "
                         "RoBERTa ties them and so does this model")
    _refuse_unused(state, used, (prefix, head))
    return config, out


def _refuse_unused(state: dict, used: set, prefixes: tuple) -> None:
    """Refuse weights of the encoder (and MLM head) that the conversion did not use, e.g. a pre-LN
    model's final sentence_encoder.layer_norm: dropping them would change the model's function.
    fairseq's `version` markers and `_float_tensor` buffers are not weights."""
    unused = sorted(k for k in state if k.startswith(prefixes) and k not in used
                    and not k.endswith((".version", "._float_tensor")))
    if unused:
        shown = ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "")
        raise ValueError(f"the checkpoint has {len(unused)} encoder weights that RoBERTa's architecture has no "
                         f"place for ({shown}): it is another model (a pre-LN encoder's final layer_norm, "
                         "segment embeddings, ...) and cannot be converted without changing its function")


def convert(checkpoint, out_dir, dictionary=None, encoder_json=None, vocab_bpe=None,
            heads: int | None = None, classification_head: str | None = None):
    """Write an HF model directory for a fairseq RoBERTa checkpoint (and its tokenizer when the
    dictionary and GPT-2 BPE files are given). Returns the loaded model: a RobertaForMaskedLM,
    or with `classification_head` a RobertaForSequenceClassification."""
    from .hf import hf_to_native
    from .model import RobertaForMaskedLM, RobertaForSequenceClassification

    config, hf_state = to_hf(read_checkpoint(checkpoint), heads, classification_head)
    if classification_head is None:
        model = RobertaForMaskedLM(config, backend="reference")
    else:
        labels = hf_state["classifier.out_proj.weight"].shape[0]
        model = RobertaForSequenceClassification(config, num_labels=labels, backend="reference")
    native, unknown = hf_to_native(hf_state, "roberta.")
    assert not unknown, unknown
    model.load_state_dict({k: v.float() for k, v in native.items()}, strict=False)
    missing = set(model.state_dict()) - set(native)
    if missing:
        raise ValueError(f"conversion left weights unset: {sorted(missing)}")
    tokenizer_files = (dictionary, encoder_json, vocab_bpe)
    if any(tokenizer_files) and not all(tokenizer_files):
        raise ValueError("the tokenizer needs all three of dict.txt, encoder.json and vocab.bpe")
    os.makedirs(out_dir, exist_ok=True)
    if all(tokenizer_files):
        write_tokenizer(dictionary, encoder_json, vocab_bpe, out_dir, config.vocab_size, config.max_seq_len)
    model.save_pretrained(out_dir)
    return model


# ------------------------------------------------------------------ the tokenizer
def fairseq_vocab(dictionary, encoder_json, vocab_size: int) -> dict:
    """token -> fairseq id: <s> <pad> </s> <unk>, dict.txt's GPT-2 ids in its order, <mask> last."""
    with open(encoder_json, encoding="utf-8") as f:
        gpt2_token = {int(i): tok for tok, i in json.load(f).items()}
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    with open(dictionary, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            fields = line.rstrip("\n").split(" ")
            if len(fields) < 2 or not fields[0]:
                raise ValueError(f"{dictionary}:{line_no}: expected '<symbol> <count>', got {line.strip()!r}")
            symbol = fields[0]
            token = gpt2_token.get(int(symbol)) if symbol.isdigit() else symbol  # madeupwordNNNN stay
            if token is None:
                raise ValueError(f"{dictionary}:{line_no}: GPT-2 id {symbol} is not in {encoder_json}")
            vocab.setdefault(token, len(vocab))
    if "<mask>" not in vocab:
        vocab["<mask>"] = len(vocab)  # fairseq's masked-LM task appends it
    if len(vocab) != vocab_size:
        raise ValueError(f"the dictionary gives {len(vocab)} ids (with <mask>) but the checkpoint's embedding "
                         f"has {vocab_size} rows; pass the dict.txt the model was trained with")
    return vocab


def _check_merges(vocab: dict, dictionary, vocab_bpe) -> None:
    """Refuse a dict.txt lacking tokens that vocab.bpe's merges use or make, or any of the 256 byte
    tokens (a pruned dictionary): fairseq encodes them as <unk>, which a Hugging Face BPE tokenizer
    cannot express (it needs every merge's parts and result in its vocabulary, and drops a byte
    it has no token for)."""
    from tokenizers.pre_tokenizers import ByteLevel

    missing = {t: None for t in sorted(ByteLevel.alphabet()) if t not in vocab}  # (a dict: ordered, no repeats)
    with open(vocab_bpe, encoding="utf-8") as f:
        for line in f:
            pair = line.rstrip("\r\n").split(" ")
            if line.startswith("#version") or len(pair) != 2:
                continue
            missing.update((t, None) for t in (*pair, "".join(pair)) if t not in vocab)
    if missing:
        shown = ", ".join(repr(t) for t in list(missing)[:10]) + (", ..." if len(missing) > 10 else "")
        raise ValueError(
            f"{dictionary} lacks {len(missing)} tokens that the GPT-2 tokenizer needs (byte tokens, or tokens "
            f"the merges of {vocab_bpe} use or make: {shown}): "
            "fairseq encodes them as <unk>, which a Hugging Face BPE tokenizer cannot express; pass the "
            "dict.txt holding every GPT-2 token (as roberta.base's does), or convert without the tokenizer")


def write_tokenizer(dictionary, encoder_json, vocab_bpe, out_dir, vocab_size: int, model_max_length: int = 512):
    """vocab.json (fairseq ids) + merges.txt (vocab.bpe), then the full tokenizer files via
    RobertaTokenizer, so the directory loads in roberta_fast and transformers alike;
    model_max_length: the model's longest sequence, which transformers truncates to."""
    from .tokenizer import RobertaTokenizer

    vocab = fairseq_vocab(dictionary, encoder_json, vocab_size)
    _check_merges(vocab, dictionary, vocab_bpe)
    with tempfile.TemporaryDirectory() as staging:
        with open(os.path.join(staging, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        shutil.copyfile(vocab_bpe, os.path.join(staging, "merges.txt"))
        RobertaTokenizer.from_pretrained(staging).save(out_dir, model_max_length=model_max_length)


def build_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m roberta_fast.fairseq`."""
    parser = argparse.ArgumentParser(prog="python -m roberta_fast.fairseq", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="fairseq RoBERTa checkpoint (model.pt, checkpoint_best.pt)")
    parser.add_argument("--out", required=True, help="directory for the HF model")
    no_tokenizer = "(default: none; the tokenizer needs all three of --dict, --encoder-json, --vocab-bpe)"
    parser.add_argument("--dict", help=f"fairseq dict.txt, for the tokenizer {no_tokenizer}")
    parser.add_argument("--encoder-json", help=f"GPT-2 encoder.json, for the tokenizer {no_tokenizer}")
    parser.add_argument("--vocab-bpe", help=f"GPT-2 vocab.bpe, for the tokenizer {no_tokenizer}")
    parser.add_argument("--heads", type=int,
                        help="attention heads, when the checkpoint does not record them (default: the checkpoint's)")
    parser.add_argument("--classification-head", metavar="NAME",
                        help="export a fine-tuned model's classification head NAME (e.g. mnli) as "
                             "RobertaForSequenceClassification (default: the MLM model)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model = convert(args.checkpoint, args.out, args.dict, args.encoder_json, args.vocab_bpe, args.heads,
                        args.classification_head)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    c = model.config
    print(f"wrote {args.out}: L={c.num_hidden_layers} H={c.hidden_size} A={c.num_attention_heads} "
          f"vocab={c.vocab_size}" + ("" if args.dict else " (no tokenizer: pass --dict, --encoder-json, --vocab-bpe)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
