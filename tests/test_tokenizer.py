"""RobertaTokenizer: RoBERTa's id layout, round trips, word starts, and parity with transformers.

The tokenizer is trained on the pydoc topics (roberta_fast.corpus) with a small vocab;
parity is checked against `transformers.AutoTokenizer` / `RobertaTokenizerFast` loaded
from the directory `save` writes (no downloads).
"""
import json

import numpy as np
import pytest

from roberta_fast import RobertaTokenizer
from roberta_fast.tokenizer import _bytes_to_unicode
from roberta_fast.corpus import iter_documents

TRICKY = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "emoji 🤗🎉👩‍👩‍👧 and ünïcödé, 日本語のテキスト, Ελληνικά, עברית",
    "a  b   c\n\n\nd\t\te\r\nf",
    "\n\nstarts with newlines",
    "The <mask> sat on the mat.",
    "x<mask>y",
    "two<mask> <mask>masks",
    "  <mask>  ",
    "<s>literal specials</s> <pad> <unk>",
    "\u00a0nbsp\u2028line sep\u200bzero width",
    "don't won't it's we'll I'm you've they'd",
    "numbers 1234567890 3.14159 -42 1e-5",
    "",
]
PLAIN = [t for t in TRICKY if "<" not in t]  # no special-token text: decode(encode(t)) == t


@pytest.fixture(scope="module")
def tok():
    return RobertaTokenizer.train_from_iterator(iter_documents(max_bytes=150_000), vocab_size=1200)


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    return tok.save(tmp_path_factory.mktemp("tok"))


def test_id_layout(tok):
    assert tok.vocab_size == 1200 == len(tok)
    assert tok.special_ids == {"bos_id": 0, "pad_id": 1, "eos_id": 2, "unk_id": 3, "mask_id": 1199}
    assert [tok.id_to_token(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert tok.id_to_token(1199) == "<mask>"


def test_encode_adds_bos_eos(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids[1:-1] == tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("") == [tok.bos_id, tok.eos_id]


@pytest.mark.parametrize("text", PLAIN)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_id not in ids  # byte-level: every string is covered by the alphabet
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_mask_lstrip(tok):
    a = tok.encode("a")[1:-1]
    assert tok.encode("a <mask>") == [tok.bos_id, *a, tok.mask_id, tok.eos_id]  # the space goes with <mask>
    assert tok.encode("a<mask>") == tok.encode("a <mask>")
    ids = tok.encode("two<mask> <mask>masks")
    assert ids.count(tok.mask_id) == 2


def test_batch_equals_single(tok):
    assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]
    ids, starts = tok.encode_batch(TRICKY, add_special_tokens=False, word_starts=True)
    assert [len(s) for s in starts] == [len(i) for i in ids]


def test_encode_batch_takes_any_iterable_of_texts(tok):
    """A generator or map object was used up by the type check: encode_batch returned [] for it."""
    assert tok.encode_batch(t for t in TRICKY) == tok.encode_batch(list(TRICKY))
    assert tok.encode_batch(map(str.lower, TRICKY)) == [tok.encode(t.lower()) for t in TRICKY]


def test_truncation_or_padding_saved_in_tokenizer_json_is_not_applied(tok, saved, tmp_path):
    """transformers saves its tokenizer's truncation / padding settings into tokenizer.json and applies
    them only when a call asks; rf applied them to every encode (texts cut and padded: the
    pretraining shards too). Loaded, they are cleared, so the ids are transformers' whole-text ids."""
    import shutil

    from tokenizers import Tokenizer

    shutil.copytree(saved, tmp_path / "tok")
    backend = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    backend.enable_truncation(4)
    backend.enable_padding(length=12, pad_id=tok.pad_id)
    backend.save(str(tmp_path / "tok" / "tokenizer.json"))
    loaded = RobertaTokenizer.from_pretrained(tmp_path / "tok")
    text = "the quick brown fox jumps over the lazy dog"
    assert loaded.encode(text) == tok.encode(text) and len(tok.encode(text)) > 4
    assert loaded.encode_batch(["a", text]) == tok.encode_batch(["a", text])


def test_a_tokenizer_that_encodes_otherwise_has_another_hash(tok, saved, tmp_path):
    """The hash covered the vocabulary, merges and added tokens only: the same files with
    add_prefix_space=True (transformers' option) encode otherwise under the same hash, so a preprocess
    rerun kept shards of the other ids and a dataset check passed. RoBERTa's own pipeline keeps the
    hash it always had (datasets made before stay valid)."""
    transformers = pytest.importorskip("transformers")  # (in the test extras)
    roundtrip = transformers.AutoTokenizer.from_pretrained(saved)
    roundtrip.save_pretrained(tmp_path / "same")
    assert RobertaTokenizer.from_pretrained(tmp_path / "same").tokenizer_hash == tok.tokenizer_hash
    transformers.AutoTokenizer.from_pretrained(saved, add_prefix_space=True).save_pretrained(tmp_path / "prefix")
    prefixed = RobertaTokenizer.from_pretrained(tmp_path / "prefix")
    assert prefixed.encode("hello world") != tok.encode("hello world")
    assert prefixed.tokenizer_hash != tok.tokenizer_hash


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab+merges"])
def test_transformers_parity(tok, saved, tmp_path, files):
    transformers = pytest.importorskip("transformers")
    path = saved
    if files == "vocab+merges":  # what ships with roberta-base: no tokenizer.json
        path = tmp_path
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
            (path / name).write_bytes((saved / name).read_bytes())
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    assert "Roberta" in type(hf).__name__ and hf.is_fast
    ours = RobertaTokenizer.from_pretrained(path)
    assert ours.tokenizer_hash == tok.tokenizer_hash
    assert (hf.bos_token_id, hf.pad_token_id, hf.eos_token_id, hf.unk_token_id, hf.mask_token_id) == tuple(
        tok.special_ids.values())
    assert (hf.cls_token, hf.sep_token, hf.mask_token) == ("<s>", "</s>", "<mask>")
    assert len(hf) == tok.vocab_size
    for text in TRICKY:
        assert hf(text)["input_ids"] == tok.encode(text) == ours.encode(text), text
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False)
    assert hf(TRICKY)["input_ids"] == tok.encode_batch(TRICKY)
    for text in PLAIN:
        assert hf.decode(tok.encode(text), skip_special_tokens=True) == text


def test_save_writes_consistent_files(tok, saved):
    vocab = json.loads((saved / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == tok.vocab_size and vocab["<mask>"] == tok.mask_id and vocab["<s>"] == 0
    merges = (saved / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and [tuple(m.split(" ")) for m in merges[1:]] == tok.merges()
    assert json.loads((saved / "tokenizer_config.json").read_text())["tokenizer_class"] == "RobertaTokenizer"
    assert not list(saved.glob("*.tmp"))


def test_train_from_files(tmp_path):
    docs = list(iter_documents(max_bytes=60_000))
    files = []
    for k in range(2):
        f = tmp_path / f"part{k}.txt"
        f.write_text("\n".join(docs[k::2]), encoding="utf-8")
        files.append(f)
    tok = RobertaTokenizer.train(files, vocab_size=600, min_frequency=2)
    assert tok.vocab_size == 600 and tok.mask_id == 599 and tok.special_ids["pad_id"] == 1
    text = docs[0][:200]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_word_starts_group_whitespace_words(tok):
    texts = ["Hello world, it's a test.\nNew  line\there", "one", "  spaced   out  ", "x\n\ny"]
    ids, starts = tok.encode_batch(texts, add_special_tokens=False, word_starts=True)
    for text, row, flags in zip(texts, ids, starts):
        cut = np.flatnonzero(flags).tolist() + [len(row)]
        assert cut[0] == 0
        words = [tok.decode(row[a:b]).strip() for a, b in zip(cut[:-1], cut[1:])]
        assert [w for w in words if w] == text.split(), text
    with_specials, flags = tok.encode_batch(["a b"], word_starts=True)
    assert flags[0][0] and flags[0][-1] and flags[0][1]  # <s>, </s> and the token after <s>


ZH = ["自然语言处理是计算机科学领域与人工智能领域中的一个重要方向", "它研究能实现人与计算机之间用自然语言进行有效通信的各种理论和方法",
      "深度学习模型在大规模语料上进行预训练", "北京是中华人民共和国的首都"]


def test_word_starts_make_each_cjk_character_a_word():
    """CJK text has no spaces: each ideograph starts a word (BERT's BasicTokenizer), so a
    token of whole CJK characters is a word of its own; English words are unchanged."""
    rng = np.random.default_rng(0)  # characters in random order: BPE cannot merge whole sentences
    chars = list("".join(ZH))
    docs = ["".join(rng.choice(chars, 12)) + " and Beijing is big" for _ in range(300)]
    tok = RobertaTokenizer.train_from_iterator(docs, vocab_size=500)
    text = ZH[3] + ", and Beijing is big"
    (row,), (flags,) = tok.encode_batch([text], add_special_tokens=False, word_starts=True)
    cut = np.flatnonzero(flags).tolist() + [len(row)]
    words = [tok.decode(row[a:b]).strip() for a, b in zip(cut[:-1], cut[1:])]
    zh_tokens = [tok.decode([i]) for i in tok.encode(ZH[3], add_special_tokens=False)]
    assert len(zh_tokens) > 3 and words == zh_tokens + [",", "and", "Beijing", "is", "big"]
    begins, breaks_after = tok.word_start_tables()
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    for token, i in tok.backend.get_vocab().items():
        data = bytes(byte_of[c] for c in token)
        if len(data) == 3 and data.decode("utf-8", "replace") in "".join(ZH):
            assert begins[i] and breaks_after[i], token  # one whole character
        if len(data) in (1, 2) and data[0] >= 0xE0:  # the first bytes of a character cut mid-way
            assert not breaks_after[i], token
            assert begins[i] or not 0xE5 <= data[0] <= 0xE9, token  # U+5000-9FFF: CJK whatever follows
        if 1 <= len(data) < 3 and data[0] & 0xC0 == 0x80:
            assert not begins[i], token  # bytes from the middle of a character


def test_bad_arguments(tok, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        RobertaTokenizer.train_from_iterator(["some text"], vocab_size=100)
    with pytest.raises(ValueError, match="missing.txt' does not exist"):
        RobertaTokenizer.train([tmp_path / "missing.txt"], vocab_size=1000)
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="no document to read in .*blank.txt"):
        RobertaTokenizer.train([tmp_path / "blank.txt"], vocab_size=1000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="no document to read in .*d: 1 unsupported files"):
        RobertaTokenizer.train([tmp_path / "d"], vocab_size=1000)
    with pytest.raises(ValueError, match="neither tokenizer.json nor vocab.json"):
        RobertaTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        RobertaTokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="list of str"):
        tok.encode_batch("one string")


def test_train_reads_jsonl_text_and_directories_as_preprocess_does(tmp_path):
    """A .jsonl trains on its text field (not the raw JSON lines), a directory on the files in it,
    exactly as training on the documents preprocess reads from them."""
    docs = list(iter_documents(max_bytes=40_000))
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    with open(tmp_path / "corpus" / "a.jsonl", "w", encoding="utf-8") as f:
        for d in docs[::2]:
            f.write(json.dumps({"text": d, "zqxmeta": "zqx"}) + "\n")  # the field must not be learnt
    txt = [d.replace("\n\n", "\n") for d in docs[1::2]]  # blank lines separate documents
    (tmp_path / "corpus" / "sub" / "b.txt").write_text("\n\n".join(txt) + "\n", encoding="utf-8")
    tok = RobertaTokenizer.train([tmp_path / "corpus"], vocab_size=500)
    assert not [t for t in tok.backend.get_vocab() if "zqx" in t or '\\"' in t]
    expected = RobertaTokenizer.train_from_iterator(docs[::2] + txt, vocab_size=500)
    assert tok.tokenizer_hash == expected.tokenizer_hash



def test_train_names_the_files_it_skips_on_stderr(tmp_path, capsys):
    """A directory's files of no known type (an archive, an image) are skipped silently by the reader
    (preprocess names them in its report): train names them, one line per reason."""
    (tmp_path / "a.txt").write_text("\n\n".join(iter_documents(max_bytes=5_000)), encoding="utf-8")
    (tmp_path / "c4.json.tar").write_bytes(b"not text")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    RobertaTokenizer.train([tmp_path], vocab_size=300)
    err = capsys.readouterr().err
    assert f"skipped 2 unsupported files: {tmp_path / 'c4.json.tar'}, {tmp_path / 'image.png'}" in err
    assert f"skipped 1 empty files: {tmp_path / 'empty.txt'}" in err

def test_a_vocabulary_smaller_than_asked_is_reported():
    with pytest.warns(UserWarning, match=r"the tokenizer has (\d+) ids, fewer than vocab_size=50265") as record:
        tok = RobertaTokenizer.train_from_iterator(["a small corpus, a small vocabulary"] * 3, vocab_size=50265)
    assert f"has {tok.vocab_size} ids" in str(record[0].message) and tok.vocab_size < 300


def test_save_states_the_model_max_length(tok, tmp_path):
    assert json.loads((tok.save(tmp_path / "a") / "tokenizer_config.json").read_text())["model_max_length"] == 512
    config = json.loads((tok.save(tmp_path / "b", model_max_length=128) / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 128
    with pytest.raises(ValueError, match="model_max_length"):
        tok.save(tmp_path / "c", model_max_length=0)


@pytest.mark.parametrize("name, damage", [
    ("tokenizer.json", "empty"), ("tokenizer.json", "truncated"),
    ("vocab.json", "empty"), ("vocab.json", "truncated"), ("merges.txt", "empty"), ("merges.txt", "truncated"),
])
def test_an_empty_or_truncated_file_is_named(saved, tmp_path, name, damage):
    """Not tokenizers' bare `Exception: Error while reading BPE files: EOF while parsing`."""
    for f in saved.iterdir():
        if f.name != "tokenizer.json" or name == "tokenizer.json":  # else vocab.json + merges.txt are read
            (tmp_path / f.name).write_bytes(f.read_bytes())
    data = (saved / name).read_bytes()
    (tmp_path / name).write_bytes(b"" if damage == "empty" else data[: data.rfind(b"\n", 0, len(data) // 2) + 3])
    problem = "is empty" if damage == "empty" else "cannot be read .*: it is truncated or damaged"
    with pytest.raises(ValueError, match=f"{tmp_path / name} {problem}"):
        RobertaTokenizer.from_pretrained(tmp_path)
