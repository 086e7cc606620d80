"""RoBERTa's byte-level BPE tokenizer, a thin wrapper over HF `tokenizers` (the Rust core).

    tok = RobertaTokenizer.train(["corpus/", "b.jsonl"], vocab_size=50265, min_frequency=2)
    tok = RobertaTokenizer.from_pretrained(dir)  # tokenizer.json, or vocab.json + merges.txt
    tok.save(dir, model_max_length=512)  # tokenizer.json, vocab.json, merges.txt + HF config files
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
its text begins with ASCII whitespace (space, tab, line break; other Unicode spaces,
such as NBSP, do not count), when it is a special token, or when the token
before it ends with such whitespace or is special. As in BERT's BasicTokenizer, each CJK
ideograph is a word (text without spaces is otherwise one word): a token also begins a
word when a CJK character starts at its first byte, or when the token before it ends
with a complete one (a byte-level token that starts or ends mid-character does not).
`word_start_tables()` gives the two per-id lookup tables, so the data pipeline computes
the flags from ids alone.

`train` reads its inputs as `preprocess` does (documents.py: text, JSONL, compressed,
Parquet, Arrow, `datasets`) and warns when the text runs out of merges before `vocab_size`. A damaged or
empty tokenizer file is a ValueError naming it, wherever a tokenizer is loaded.

`tokenizer_hash` identifies the vocabulary, merges and special tokens independently
of the `tokenizers` version that serialised them, and the pipeline settings that change
ids where they are not RoBERTa's (add_prefix_space=True, a normalizer); datasets record it
in their manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .documents import read_documents
from .files import write_text_atomic

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
_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}

# CJK ideographs, each a word of its own: the ranges of BERT's BasicTokenizer._is_chinese_char.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(data: bytes) -> bool:
    """True if `data` is exactly one complete UTF-8 character, a CJK ideograph."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return len(text) == 1 and any(lo <= ord(text) <= hi for lo, hi in _CJK_RANGES)


def _cjk_edges(token: str) -> tuple[bool, bool]:
    """(a CJK character starts at the first byte, a complete one ends at the last) of a byte-level
    BPE token, whose bytes may start or end mid-character (then not). A character cut after its
    first bytes (a rare one in a small vocabulary: [lead][rest]) counts when the lowest and the
    highest characters with those first bytes are CJK (a lone 0xE4 also starts U+4DC0-4DFF, the
    Yijing hexagrams, which BERT's ranges leave out: taken as a word start all the same)."""
    data = bytes(_BYTE_OF_CHAR.get(c, 0) for c in token)
    n = {0xE0: 3, 0xF0: 4}.get(data[0] & 0xF0, 0) if data else 0  # CJK is 3 or 4 UTF-8 bytes
    head = data[:n]
    pad = n - len(head)  # the missing continuation bytes: the lowest and highest completions
    first = n > 0 and _is_cjk(head + b"\x80" * pad) and _is_cjk(head + b"\xbf" * pad)
    last = len(data) - 1
    while last > 0 and len(data) - last < 4 and data[last] & 0xC0 == 0x80:
        last -= 1  # back over continuation bytes to the last character's lead byte
    return first, _is_cjk(data[last:])


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


_REFETCH = "save the tokenizer again (RobertaTokenizer.save) or download its files again"


def _read(file: Path, load):
    """load(str(file)), or a ValueError naming the file when it is empty, truncated or damaged
    (`tokenizers` raises a bare Exception such as "EOF while parsing a list at line 808")."""
    if file.stat().st_size == 0:
        raise ValueError(f"{file} is empty: it was not fully written or copied; {_REFETCH}")
    try:
        return load(str(file))
    except Exception as err:  # noqa: BLE001 -- tokenizers' errors are plain Exceptions
        raise ValueError(f"{file} cannot be read ({err}): it is truncated or damaged; {_REFETCH}") from None


def _read_bpe(vocab_file: Path, merges_file: Path) -> models.BPE:
    """A BPE model from vocab.json + merges.txt; an empty, truncated or damaged file is a
    ValueError naming it. (A merges.txt cut exactly at a line end still reads as a shorter list
    of merges: nothing in the file tells them apart.)"""
    def vocab_json(file):
        with open(file, encoding="utf-8") as f:
            return json.load(f)

    vocab = _read(vocab_file, vocab_json)
    if not isinstance(vocab, dict):
        raise ValueError(f"{vocab_file} holds a JSON {type(vocab).__name__}, not RoBERTa's token -> id map")
    missing = [t for t in _ROLES.values() if t not in vocab]
    if missing:
        raise ValueError(f"{vocab_file} lacks the special tokens {missing}; RoBERTa's vocab.json "
                         "holds <s>, <pad>, </s>, <unk> and <mask>")
    return _read(merges_file, lambda m: models.BPE.from_file(
        str(vocab_file), m, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))


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
        # a tokenizer.json may carry truncation or padding (transformers saves its tokenizer's last
        # settings): ids here are whole texts, as transformers' tokenizer gives them unless asked per call
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.backend = tokenizer

    # ------------------------------------------------------------------ construction
    @classmethod
    def train(
        cls, files, vocab_size: int = 50265, min_frequency: int = 2,
        show_progress: bool = False, text_field: str = "text",
    ) -> "RobertaTokenizer":
        """Train byte-level BPE on files and directories, or a `datasets.Dataset`, read as
        `preprocess` reads them (documents.py: text, JSONL by its `text_field`, either compressed,
        Parquet and Arrow by the `text_field` column; files it skips are named on stderr).
        `vocab_size` counts every id, `<mask>` included."""
        tok, trainer = cls._untrained(vocab_size, min_frequency, show_progress)
        tok.train_from_iterator(read_documents(files, text_field=text_field), trainer)
        return cls._finish(tok, vocab_size, min_frequency)

    @classmethod
    def train_from_iterator(
        cls, texts: Iterable[str], vocab_size: int = 50265, min_frequency: int = 2,
        show_progress: bool = False,
    ) -> "RobertaTokenizer":
        """Train byte-level BPE on an iterable of strings (documents or batches of lines)."""
        tok, trainer = cls._untrained(vocab_size, min_frequency, show_progress)
        tok.train_from_iterator(texts, trainer)
        return cls._finish(tok, vocab_size, min_frequency)

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
    def _finish(cls, tok: Tokenizer, vocab_size: int, min_frequency: int) -> "RobertaTokenizer":
        _add_specials(tok)
        reached = tok.get_vocab_size(with_added_tokens=True)
        if reached < vocab_size:  # a small corpus runs out of pairs to merge
            warnings.warn(f"the tokenizer has {reached} ids, fewer than vocab_size={vocab_size}: the text has no "
                          f"more pairs to merge that occur min_frequency={min_frequency} times or more; give it "
                          f"more text, or build the model with vocab_size={reached}", stacklevel=3)
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
            tok = _read(path / "tokenizer.json", Tokenizer.from_file)
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            tok = Tokenizer(_read_bpe(path / "vocab.json", path / "merges.txt"))
            _add_specials(tok)
            _pipeline(tok)
        else:
            raise ValueError(
                f"{str(path)!r} holds neither tokenizer.json nor vocab.json + merges.txt; "
                "pass a directory written by RobertaTokenizer.save or a roberta-base download"
            )
        return cls(tok)

    # ------------------------------------------------------------------ saving
    def save(self, path: str | os.PathLike, model_max_length: int = 512) -> Path:
        """Write tokenizer.json, vocab.json, merges.txt and the HF config files into `path`.

        model_max_length: the most tokens the model takes (transformers truncates to it):
        a model directory's is its config's `max_seq_len` (max_position_embeddings -
        pad_token_id - 1); 512, roberta-base's, for a tokenizer saved alone."""
        if not isinstance(model_max_length, int) or model_max_length < 3:
            raise ValueError(f"model_max_length must be an int >= 3 (<s>, a token, </s>), got {model_max_length!r}")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path / "tokenizer.json", self.backend.to_str(pretty=True))
        full = self.backend.get_vocab(with_added_tokens=True)
        vocab = dict(sorted(full.items(), key=lambda kv: kv[1]))
        write_text_atomic(path / "vocab.json", json.dumps(vocab, ensure_ascii=False) + "\n")
        merges = self.merges()
        write_text_atomic(path / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
                    "pad_token": "<pad>", "cls_token": "<s>"}
        mask = {"content": MASK_TOKEN, "lstrip": True, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}
        write_text_atomic(path / "special_tokens_map.json", json.dumps({**specials, "mask_token": mask}, indent=2))
        config = {
            "tokenizer_class": "RobertaTokenizer",  # transformers picks its fast variant
            **specials,
            "mask_token": MASK_TOKEN,
            "add_prefix_space": False,
            "trim_offsets": True,
            "errors": "replace",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
        }
        write_text_atomic(path / "tokenizer_config.json", json.dumps(config, indent=2))
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
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a list of str (use encode for a single text)")
        texts = list(texts)  # (before the check: a generator would be used up by it)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch expects a list of str (use encode for a single text)")
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
                    cjk_first, cjk_last = _cjk_edges(token)
                    begins[i] = token[0] in _BYTE_LEVEL_WHITESPACE or cjk_first
                    breaks_after[i] = token[-1] in _BYTE_LEVEL_WHITESPACE or cjk_last
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

    def _pipeline_settings(self) -> dict:
        """The settings outside the vocabulary that change ids: the normalizer, and the pre-tokenizer's
        and post-processor's kinds, prefix spaces and regex (not offsets, not decoding)."""
        pipeline = json.loads(self.backend.to_str())
        pre, post = pipeline.get("pre_tokenizer") or {}, pipeline.get("post_processor") or {}
        return {"normalizer": pipeline.get("normalizer"),
                "pre_tokenizer": [pre.get("type"), pre.get("add_prefix_space"), pre.get("use_regex")],
                "post_processor": [post.get("type"), post.get("add_prefix_space"), post.get("sep"), post.get("cls")]}

    @property
    def tokenizer_hash(self) -> str:
        """sha256 of the vocabulary, merges and added tokens (stable across `tokenizers` versions), and of
        the pipeline settings that change ids where they are not RoBERTa's (add_prefix_space=True, a
        normalizer): two tokenizers that encode differently never share a hash, and RoBERTa's keep theirs."""
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
            pipeline = self._pipeline_settings()
            if pipeline != {"normalizer": None, "pre_tokenizer": ["ByteLevel", False, True],
                            "post_processor": ["RobertaProcessing", False, ["</s>", self.eos_id], ["<s>", self.bos_id]]}:
                payload["pipeline"] = pipeline
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
