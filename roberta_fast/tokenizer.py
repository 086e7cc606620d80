"""RoBERTa's byte-level BPE tokenizer, a thin wrapper over HF `tokenizers` (the Rust core).

    tok = RobertaTokenizer.train(["a.txt", "b.txt"], vocab_size=50265, min_frequency=2)
    tok = RobertaTokenizer.from_pretrained(dir)  # tokenizer.json, or vocab.json + merges.txt
    tok.save(dir)  # tokenizer.json, vocab.json, merges.txt + HF config files
    ids = tok.encode("Hello world")              # [0, ..., 2]: <s> ... </s>
    ids, starts = tok.encode_batch(texts, word_starts=True)

Layout of the vocabulary, as roberta-base: `<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3, the
byte alphabet and merges, then `<mask>` as the last id (matched with lstrip, so
"a <mask>" is "a" + `<mask>`). The pipeline is roberta-base's: ByteLevel pre-tokenizer
without a prefix space, BPE without dropout, RobertaProcessing adding `<s> ... </s>`,
ByteLevel decoder. A saved directory loads in `transformers.AutoTokenizer` as a
`RobertaTokenizerFast` giving the same ids (tests/test_tokenizer.py checks it).

Word starts (for whole-word masking) follow fairseq's GPT-2 BPE rule, extended so
that no word runs across a line break or a special token: a token begins a word when
its text begins with whitespace, when it is a special token, or when the token
before it ends with whitespace or is special. `word_start_tables()` gives the two
per-id lookup tables, so the data pipeline computes the flags from ids alone.

`tokenizer_hash` identifies the vocabulary, merges and special tokens independently
of the `tokenizers` version that serialised them; datasets record it in their manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3 in a trained vocabulary
MASK_TOKEN = "<mask>"  # the last id
_ROLES = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": MASK_TOKEN}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# Byte-level images of the whitespace bytes: a token beginning with one begins a word.
_BYTE_LEVEL_WHITESPACE = frozenset(_bytes_to_unicode()[b] for b in b" \t\n\r\x0b\x0c")


def _write_atomic(path: Path, text: str) -> None:
    """Write text to path via a temporary file and a rename, so no reader sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:  # (mkstemp would make it private: mode 0600)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pipeline(tok: Tokenizer) -> Tokenizer:
    """Give a BPE tokenizer roberta-base's pre-tokenizer, decoder and post-processor."""
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", eos), ("<s>", bos), trim_offsets=True, add_prefix_space=False
    )
    return tok


def _add_specials(tok: Tokenizer) -> None:
    """Register the special tokens (and `<mask>` with lstrip) as added tokens."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_special_tokens([AddedToken(MASK_TOKEN, lstrip=True, special=True, normalized=False)])


class RobertaTokenizer:
    """Byte-level BPE with RoBERTa's special tokens; wraps a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        missing = [t for t in _ROLES.values() if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(
                f"the tokenizer lacks RoBERTa's special tokens {missing}; train one with "
                "RobertaTokenizer.train(...) or load roberta-base's vocab.json + merges.txt"
            )
        self.backend = tokenizer

    # ------------------------------------------------------------------ construction
    @classmethod
    def train(
        cls, files: Sequence[str | os.PathLike], vocab_size: int = 50265, min_frequency: int = 2,
        show_progress: bool = False,
    ) -> "RobertaTokenizer":
        """Train byte-level BPE on text files; `vocab_size` counts every id, `<mask>` included."""
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        files = [str(f) for f in files]
        if not files:
            raise ValueError("RobertaTokenizer.train needs at least one text file")
        for f in files:
            if not os.path.isfile(f):
                raise ValueError(f"RobertaTokenizer.train: {f!r} is not a file")
        tok, trainer = cls._untrained(vocab_size, min_frequency, show_progress)
        tok.train(files, trainer)
        return cls._finish(tok)

    @classmethod
    def train_from_iterator(
        cls, texts: Iterable[str], vocab_size: int = 50265, min_frequency: int = 2,
        show_progress: bool = False,
    ) -> "RobertaTokenizer":
        """Train byte-level BPE on an iterable of strings (documents or batches of lines)."""
        tok, trainer = cls._untrained(vocab_size, min_frequency, show_progress)
        tok.train_from_iterator(texts, trainer)
        return cls._finish(tok)

    @staticmethod
    def _untrained(vocab_size: int, min_frequency: int, show_progress: bool):
        n_fixed = len(SPECIAL_TOKENS) + 1 + 256  # specials, <mask>, the byte alphabet
        if not isinstance(vocab_size, int) or vocab_size <= n_fixed:
            raise ValueError(
                f"vocab_size must be an int above {n_fixed} (4 special tokens, <mask> and the 256 "
                f"byte symbols), got {vocab_size!r}"
            )
        if not isinstance(min_frequency, int) or min_frequency < 1:
            raise ValueError(f"min_frequency must be a positive int, got {min_frequency!r}")
        tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - 1,  # <mask> is appended after training, as the last id
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        return tok, trainer

    @classmethod
    def _finish(cls, tok: Tokenizer) -> "RobertaTokenizer":
        _add_specials(tok)
        return cls(_pipeline(tok))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, revision: str | None = None) -> "RobertaTokenizer":
        """Load a directory holding `tokenizer.json`, or `vocab.json` + `merges.txt`, or a Hub
        name ("FacebookAI/roberta-base"; `revision`: a branch, tag or commit)."""
        from .hub import tokenizer_dir

        path = Path(tokenizer_dir(path, revision))
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        if not path.is_dir():
            raise ValueError(f"RobertaTokenizer.from_pretrained: {str(path)!r} is not a directory")
        if (path / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            bpe = models.BPE.from_file(
                str(path / "vocab.json"), str(path / "merges.txt"),
                continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
            )
            tok = Tokenizer(bpe)
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            missing = [t for t in _ROLES.values() if t not in vocab]
            if missing:
                raise ValueError(
                    f"{path / 'vocab.json'} lacks the special tokens {missing}; RoBERTa's vocab.json "
                    "holds <s>, <pad>, </s>, <unk> and <mask>"
                )
            _add_specials(tok)
            _pipeline(tok)
        else:
            raise ValueError(
                f"{str(path)!r} holds neither tokenizer.json nor vocab.json + merges.txt; "
                "pass a directory written by RobertaTokenizer.save or a roberta-base download"
            )
        return cls(tok)

    # ------------------------------------------------------------------ saving
    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json, vocab.json, merges.txt and the HF config files into `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        _write_atomic(path / "tokenizer.json", self.backend.to_str(pretty=True))
        full = self.backend.get_vocab(with_added_tokens=True)
        vocab = dict(sorted(full.items(), key=lambda kv: kv[1]))
        _write_atomic(path / "vocab.json", json.dumps(vocab, ensure_ascii=False) + "\n")
        merges = self.merges()
        _write_atomic(path / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
                    "pad_token": "<pad>", "cls_token": "<s>"}
        mask = {"content": MASK_TOKEN, "lstrip": True, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}
        _write_atomic(path / "special_tokens_map.json", json.dumps({**specials, "mask_token": mask}, indent=2))
        config = {
            "tokenizer_class": "RobertaTokenizer",  # transformers picks its fast variant
            **specials,
            "mask_token": MASK_TOKEN,
            "add_prefix_space": False,
            "trim_offsets": True,
            "errors": "replace",
            "model_max_length": 512,
            "clean_up_tokenization_spaces": False,
        }
        _write_atomic(path / "tokenizer_config.json", json.dumps(config, indent=2))
        return path

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of one text, `<s> ... </s>` around it unless add_special_tokens=False."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True, word_starts: bool = False,
    ):
        """Ids of many texts, encoded in parallel by the Rust core.

        Returns a list of id lists, or (ids, word_starts) with one bool array per text
        when word_starts=True (see the module docstring for the rule).
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch expects a list of str (use encode for a single text)")
        texts = list(texts)
        fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        ids = [e.ids for e in fast(texts, add_special_tokens=add_special_tokens)]
        if not word_starts:
            return ids
        return ids, [self.word_starts(np.asarray(x, dtype=np.int64)) for x in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ids (byte-level decoding; invalid UTF-8 becomes U+FFFD)."""
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def word_start_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(begins, breaks_after): per-id bools; a token starts a word if begins[id] or breaks_after[prev]."""
        if getattr(self, "_tables", None) is None:
            n = self.vocab_size
            begins = np.zeros(n, dtype=bool)
            breaks_after = np.zeros(n, dtype=bool)
            special = {self.backend.token_to_id(t) for t in _ROLES.values()}
            for token, i in self.backend.get_vocab(with_added_tokens=True).items():
                if i in special:
                    begins[i] = breaks_after[i] = True
                elif token:
                    begins[i] = token[0] in _BYTE_LEVEL_WHITESPACE
                    breaks_after[i] = token[-1] in _BYTE_LEVEL_WHITESPACE
            self._tables = (begins, breaks_after)
        return self._tables

    def word_starts(self, ids: np.ndarray) -> np.ndarray:
        """Bool array, True where a token of `ids` (1-D) begins a word."""
        return word_starts_from_tables(ids, *self.word_start_tables())

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (50265 for roberta-base)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    @property
    def special_ids(self) -> dict[str, int]:
        """{"bos_id", "pad_id", "eos_id", "unk_id", "mask_id"} -> id."""
        return {f"{role}_id": self.backend.token_to_id(tok) for role, tok in _ROLES.items()}

    bos_id = property(lambda self: self.backend.token_to_id("<s>"))
    pad_id = property(lambda self: self.backend.token_to_id("<pad>"))
    eos_id = property(lambda self: self.backend.token_to_id("</s>"))
    unk_id = property(lambda self: self.backend.token_to_id("<unk>"))
    mask_id = property(lambda self: self.backend.token_to_id(MASK_TOKEN))

    def merges(self) -> list[tuple[str, str]]:
        """The BPE merges in rank order, whatever `tokenizers` version serialised them."""
        model = json.loads(self.backend.to_str())["model"]
        return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]

    @property
    def tokenizer_hash(self) -> str:
        """sha256 of the vocabulary, merges and added tokens (stable across `tokenizers` versions)."""
        if getattr(self, "_hash", None) is None:
            added = sorted(
                (i, t.content, t.lstrip, t.rstrip, t.special)
                for i, t in self.backend.get_added_tokens_decoder().items()
            )
            payload = {
                "vocab": sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]),
                "merges": [list(m) for m in self.merges()],
                "added": added,
            }
            blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            self._hash = hashlib.sha256(blob).hexdigest()
        return self._hash

    def __repr__(self) -> str:
        return f"RobertaTokenizer(vocab_size={self.vocab_size}, hash={self.tokenizer_hash[:12]})"


def word_starts_from_tables(ids: np.ndarray, begins: np.ndarray, breaks_after: np.ndarray) -> np.ndarray:
    """Word-start flags of a 1-D id array from `RobertaTokenizer.word_start_tables()`."""
    ids = np.asarray(ids)
    out = begins[ids]
    if ids.size:
        out[0] = True  # the first token of a sequence always begins a word
        out[1:] |= breaks_after[ids[:-1]]
    return out
