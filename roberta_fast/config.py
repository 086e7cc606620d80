"""RobertaConfig: the model's hyperparameters, with Hugging Face's field names.

Reads and writes HF `config.json`, so a checkpoint moves between roberta_fast and
`transformers` unchanged. Values are checked at construction, so an impossible
config fails with a readable error before any weight is allocated.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Keys of an HF config.json that describe things this implementation does not model
# (generation, provenance). They are kept and written back unchanged.
_PASSTHROUGH_DEFAULTS = {"architectures": None, "tie_word_embeddings": True}
# Keys whose None is transformers' default, which its config.json leaves out; any other None is written
# (bos_token_id=None, a key read as null), as transformers writes it.
_NONE_LEFT_OUT = ("architectures", "dtype", "problem_type")
# Keys of a transformers config's to_dict that its config.json leaves out: these at their defaults (and
# _name_or_path, the local path it was loaded from, always).
_UNWRITTEN_DEFAULTS = {"chunk_size_feed_forward": 0, "is_encoder_decoder": False}
# The output flags, with the defaults config.json leaves out.
_OUTPUT_FLAGS = {"output_hidden_states": False, "output_attentions": False, "return_dict": True}
# transformers' problem_type values: the loss RobertaForSequenceClassification computes.
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
# HF settings that make RoBERTa a causal decoder (with cross-attention): another model.
DECODER_SETTINGS = ("is_decoder", "add_cross_attention")
# transformers' PretrainedConfig keywords RobertaConfig(...) takes beside its fields (kept in `extra`).
TRANSFORMERS_KEYWORDS = ("num_labels", "id2label", "label2id", "problem_type", "tie_word_embeddings",
                         "architectures", *DECODER_SETTINGS)


def decoder_error(settings: dict, what: str) -> str | None:
    """The error for a config that makes RoBERTa a decoder (`settings`: HF field -> value), else None.

    roberta_fast computes the bidirectional encoder only: run on a decoder's weights it
    would silently give other outputs, so such configs are refused wherever they enter."""
    on = [f"{name}=True" for name in DECODER_SETTINGS if settings.get(name)]
    if not on:
        return None
    return (f"{what} sets {' and '.join(on)} (RoBERTa as a decoder: causal attention, as in RobertaForCausalLM, "
            "or cross-attention to an encoder), but roberta_fast "
            "computes only RoBERTa's bidirectional encoder, whose outputs would differ; run this model with "
            "transformers itself, or load an encoder checkpoint (is_decoder and add_cross_attention false)")


def attn_implementation_error(value, call: str) -> str | None:
    """The error for a transformers attention implementation other than "eager" and "sdpa" (whose
    function roberta_fast computes with its own kernels), given in `call` (the user's call, as text); else None."""
    if value in (None, "eager", "sdpa"):
        return None
    return (f"{call} is not supported: roberta_fast computes the function of transformers' 'eager' and "
            "'sdpa' attention with its own kernels (backend='fused' on a GPU); leave it out or pass 'eager' or 'sdpa'")


def _decoder_flag(name: str) -> property:
    """A config property that reads False and refuses to be set to True (decoder_error)."""
    def refuse(config, value):
        error = decoder_error({name: value}, "setting the config")
        if error:
            raise ValueError(error)
    return property(lambda config: False, refuse)


def untied_decoder_error(what: str) -> str:
    """The error for an MLM whose decoder is not its word embeddings (`what` says where it came from).

    roberta_fast's RobertaForMaskedLM reads its decoder from the word embeddings, as RoBERTa ties them:
    built from such a config it would lose the trained decoder (loading) or save a config transformers
    reads as untied, with no decoder weights, so that it draws a random one."""
    return (f"{what} an MLM decoder that is not its word embeddings (weights that differ, or "
            "tie_word_embeddings=false), but roberta_fast's RobertaForMaskedLM always ties them, as RoBERTa does. "
            "Load an untied checkpoint "
            "with transformers' RobertaForMaskedLM (or its encoder alone with rf.RobertaModel.from_pretrained); "
            "otherwise leave tie_word_embeddings at True")


@dataclass
class RobertaConfig:
    """RoBERTa hyperparameters; defaults are roberta-base's."""

    _commit_hash = None  # not a field: transformers 5.0's pipeline() reads model.config._commit_hash
    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    position_embedding_type: str = "absolute"
    classifier_dropout: float | None = None
    # What a call returns when it does not say (transformers' PretrainedConfig fields of these names).
    output_hidden_states: bool = False
    output_attentions: bool = False
    return_dict: bool = True
    # Anything else found in an HF config.json, written back as it was read.
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ checks
    def __post_init__(self):
        errors = []

        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                errors.append(f"{name} must be a positive integer, got {value!r}")
                return False
            return True

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            positive_int(name)
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, name)
            if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                errors.append(f"{name} must be a probability in [0, 1), got {p!r}")
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            errors.append(f"classifier_dropout must be None or in [0, 1), got {self.classifier_dropout!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            errors.append(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not (isinstance(self.initializer_range, (int, float)) and self.initializer_range > 0):
            errors.append(f"initializer_range must be > 0, got {self.initializer_range!r}")
        if (isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int)
                and self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads):
            errors.append(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); e.g. use {self.num_attention_heads * max(1, round(self.hidden_size / self.num_attention_heads))}"
            )
        if self.hidden_act not in ("gelu",):
            errors.append(
                f"hidden_act {self.hidden_act!r} is not supported: RoBERTa uses 'gelu' (the erf form), "
                "which is the only activation implemented"
            )
        if self.position_embedding_type != "absolute":
            errors.append(
                f"position_embedding_type {self.position_embedding_type!r} is not supported; "
                "only RoBERTa's learned 'absolute' positions are implemented"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and isinstance(self.vocab_size, int) and not 0 <= value < self.vocab_size:
                errors.append(f"{name} ({value}) must be a token id in [0, vocab_size={self.vocab_size})")
        if self.pad_token_id is None:
            errors.append("pad_token_id must be set: RoBERTa's positions are counted from it")
        elif isinstance(self.max_position_embeddings, int) and self.max_seq_len < 1:
            errors.append(
                f"max_position_embeddings ({self.max_position_embeddings}) leaves no position for tokens: "
                f"RoBERTa positions start at pad_token_id + 1 = {self.pad_token_id + 1}, so it must be at "
                f"least {self.pad_token_id + 2} (for sequences of up to N tokens use N + {self.pad_token_id + 1})"
            )
        decoder = decoder_error(self.extra, "the config")
        if decoder:
            errors.append(decoder)
        if "num_labels" in self.extra:  # a dict's or keyword's num_labels, as transformers' config takes it:
            num_labels = self.extra.pop("num_labels")  # against an id2label of another size it wins (LABEL_i)
            if "id2label" not in self.extra or len(self.extra["id2label"]) != num_labels:
                self.num_labels = num_labels
        if self.problem_type not in (None, *PROBLEM_TYPES):
            errors.append(f"problem_type must be None or one of {PROBLEM_TYPES}, got {self.problem_type!r}")
        elif self.problem_type == "single_label_classification" and self.num_labels == 1:
            errors.append('problem_type="single_label_classification" needs num_labels > 1 (for one output '
                          'use problem_type="regression")')
        if errors:
            raise ValueError("Invalid RobertaConfig:\n  - " + "\n  - ".join(errors))

    # ------------------------------------------------------------- derived facts
    @property
    def max_seq_len(self) -> int:
        """Longest sequence the position table can hold (positions start at pad_token_id + 1)."""
        return self.max_position_embeddings - self.pad_token_id - 1

    is_encoder_decoder = False  # transformers' flags: RoBERTa is an encoder, with no sub-configs
    sub_configs = {}  # (no annotation: a class attribute, not a dataclass field)

    def get_text_config(self, *args, **kwargs) -> "RobertaConfig":
        """transformers' accessor of a composite model's text part: this config itself."""
        return self

    is_decoder = _decoder_flag("is_decoder")  # transformers' decoder flags: False; True is refused
    add_cross_attention = _decoder_flag("add_cross_attention")

    @property
    def model_type(self) -> str:
        """transformers' config attribute (sentence-transformers, PEFT and optimum branch on it): "roberta",
        or what the checkpoint's config.json said ("xlm-roberta", "camembert"), as to_dict writes it."""
        return self.extra.get("model_type", "roberta")

    @property
    def use_return_dict(self) -> bool:
        """transformers' older name of return_dict."""
        return self.return_dict

    # transformers' PretrainedConfig label fields, kept in `extra` (so config.json carries them as
    # transformers writes them): the class names, and which loss the classification head computes.
    @property
    def id2label(self) -> dict[int, str]:
        """Class id -> name; transformers' default is two classes, LABEL_0 and LABEL_1."""
        labels = self.extra.get("id2label")
        if labels is None:
            return {0: "LABEL_0", 1: "LABEL_1"}
        if not all(isinstance(k, int) for k in labels):  # config.json's keys are strings
            labels = self.extra["id2label"] = {int(k): v for k, v in labels.items()}
        return labels

    @id2label.setter
    def id2label(self, value: dict | None):
        if value is None:
            self.extra.pop("id2label", None)
        else:
            self.extra["id2label"] = {int(k): v for k, v in value.items()}

    @property
    def label2id(self) -> dict[str, int]:
        """Class name -> id: the config's, else id2label's inverse."""
        labels = self.extra.get("label2id")
        return {v: k for k, v in self.id2label.items()} if labels is None else labels

    @label2id.setter
    def label2id(self, value: dict | None):
        if value is None:
            self.extra.pop("label2id", None)
        else:
            self.extra["label2id"] = value

    @property
    def num_labels(self) -> int:
        """len(id2label); setting another count names the classes LABEL_0, LABEL_1, ... (as transformers)."""
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, value: int):
        if "id2label" not in self.extra or self.num_labels != value:
            self.id2label = {i: f"LABEL_{i}" for i in range(value)}
            self.label2id = {f"LABEL_{i}": i for i in range(value)}

    @property
    def problem_type(self) -> str | None:
        """The sequence-classification loss (PROBLEM_TYPES); None: inferred from the labels, as transformers."""
        return self.extra.get("problem_type")

    @problem_type.setter
    def problem_type(self, value: str | None):
        if value not in (None, *PROBLEM_TYPES):
            raise ValueError(f"problem_type must be None or one of {PROBLEM_TYPES}, got {value!r}")
        self.extra["problem_type"] = value

    @property
    def architectures(self) -> list[str] | None:
        """transformers' field, kept in `extra`: the model classes config.json names (save_pretrained
        writes the saving class); None for a config that was never saved."""
        return self.extra.get("architectures")

    @architectures.setter
    def architectures(self, value: list[str] | None):
        self.extra["architectures"] = value

    @property
    def tie_word_embeddings(self) -> bool:
        """transformers' flag, kept in `extra`: True when the MLM decoder is the word embeddings (RoBERTa's
        case, and the only one roberta_fast's RobertaForMaskedLM builds)."""
        return self.extra.get("tie_word_embeddings", True)

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, value: bool):
        self.extra["tie_word_embeddings"] = value

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Parameter count of RobertaForMaskedLM (decoder tied to the word embeddings)."""
        h, i, n = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h  # attn, ffn, two LayerNorms
        head = h * h + h + 2 * h + self.vocab_size  # dense, LayerNorm, decoder bias
        emb = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        return n * layer + head + (emb if include_embeddings else 0)

    # ----------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "RobertaConfig":
        """A named size: "tiny" (trains on 2 CPU cores in minutes), "base", "large"."""
        presets = {
            "tiny": dict(vocab_size=8192, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=512, max_position_embeddings=130),
            "base": dict(),
            "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                          intermediate_size=4096),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    # ------------------------------------------------------------ HF interop
    @classmethod
    def from_dict(cls, data: dict) -> "RobertaConfig":
        """Build from an HF config dict; unknown keys are kept in `extra`. From a transformers config's
        to_dict, the keys its config.json leaves out (_name_or_path, ...) are dropped, so saving writes none."""
        data = dict(data)
        model_type = data.get("model_type", "roberta")
        if model_type not in ("roberta", "xlm-roberta", "camembert"):
            raise ValueError(
                f"config.json has model_type {model_type!r}; roberta_fast loads RoBERTa-architecture "
                "models (model_type 'roberta', 'xlm-roberta' or 'camembert')"
            )
        data.pop("_name_or_path", None)  # from a transformers config object: not written back, as there
        for key, default in _UNWRITTEN_DEFAULTS.items():
            if key in data and data[key] == default:
                del data[key]
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: data.pop(k) for k in list(data) if k in names}
        return cls(**known, extra=data)

    def to_dict(self) -> dict:
        """The HF config.json contents (model_type 'roberta')."""
        out = {k: v for k, v in _PASSTHROUGH_DEFAULTS.items()}
        out.update(self.extra)
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        for name in _OUTPUT_FLAGS:  # written only when set, as transformers writes a config.json
            if out[name] == _OUTPUT_FLAGS[name]:
                del out[name]
        out["model_type"] = out.get("model_type", "roberta")
        return {k: v for k, v in sorted(out.items()) if v is not None or k not in _NONE_LEFT_OUT}

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "RobertaConfig":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from err
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, revision: str | None = None) -> "RobertaConfig":
        """Read `config.json` from an HF model directory, the file itself, or a Hub name."""
        from .hub import config_dir

        path = config_dir(path, revision)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {path!r}: expected an HF model directory")
        return cls.from_json_file(file)

    def save_pretrained(self, directory: str | os.PathLike, architectures: list[str] | None = None,
                        dtype: str | None = None):
        """Write `config.json` into `directory` atomically. dtype ("float32", ...): the dtype of the
        weights saved beside it, written as transformers writes it ("dtype"; its older name
        "torch_dtype" is dropped), so that transformers' dtype="auto" loads them as saved."""
        os.makedirs(directory, exist_ok=True)
        data = self.to_dict()
        if architectures is not None:
            data["architectures"] = architectures
        if dtype is not None:
            data.pop("torch_dtype", None)
            data["dtype"] = dtype
        from .files import write_text_atomic

        write_text_atomic(os.path.join(directory, "config.json"), json.dumps(data, indent=2, sort_keys=True) + "\n")


def _taking_transformers_keywords(init):
    """RobertaConfig's dataclass __init__, also taking transformers' config keywords, kept in `extra`
    as from a config.json (TRANSFORMERS_KEYWORDS: RobertaConfig(num_labels=3); is_decoder=True is
    refused); any other unknown keyword stays a TypeError, so a typo is not kept silently."""
    def __init__(self, *args, **kwargs):
        taken = {k: kwargs.pop(k) for k in TRANSFORMERS_KEYWORDS if k in kwargs}
        if taken:
            extra = dict(kwargs.get("extra", {}))
            if "id2label" in taken:  # new class names: label2id is their inverse again, not the one
                extra.pop("label2id", None)  # dataclasses.replace passes in `extra`
            kwargs["extra"] = {**extra, **taken}
        init(self, *args, **kwargs)
    return functools.wraps(init)(__init__)


RobertaConfig.__init__ = _taking_transformers_keywords(RobertaConfig.__init__)
