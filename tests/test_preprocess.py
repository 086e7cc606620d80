"""roberta_fast.preprocess: shards equal direct encoding, resuming, parallel workers, bad input.

Documents are checked against `transformers`' tokenizer (split_special_tokens=True, since
preprocessing treats "<mask>" in text as text) loaded from the saved tokenizer; every bad
input is written into tmp_path.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from roberta_fast import RobertaTokenizer
from roberta_fast import documents
from roberta_fast import preprocess as pp
from roberta_fast.corpus import iter_documents

DOCS = [
    "First document.\nIt has two lines.",
    "  Leading spaces, emoji 🤗 and ünïcödé 日本語.",
    "A literal <mask> and </s> inside text stay text.",
    "Tabs\tand  double  spaces\nand a line\nand another",
    "short",
    "Numbers 3.14159 and 1e-5, quotes: \"don't\" 'it's'.",
]


@pytest.fixture(scope="module")
def tok():
    return RobertaTokenizer.train_from_iterator(iter_documents(max_bytes=150_000), vocab_size=1000)


@pytest.fixture(scope="module")
def hf(tok, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok.save(tmp_path_factory.mktemp("tok"))))


def direct(hf, text):
    """What a document's slot in a shard must hold: its encoding without <s> (ending in </s>)."""
    return hf(text, split_special_tokens=True)["input_ids"][1:]


def shard_docs(out, split):
    """Every document of a split as a list of ids, in shard order."""
    m = json.loads((out / "manifest.json").read_text())
    docs = []
    for shard in m["splits"][split]["shards"]:
        ids = np.fromfile(out / shard["bin"], dtype=m["dtype"])
        idx = np.load(out / shard["idx"])
        assert idx[0] == 0 and idx[-1] == len(ids) == shard["tokens"] and len(idx) == shard["documents"] + 1
        docs += [ids[a:b].tolist() for a, b in zip(idx[:-1], idx[1:])]
    return docs


def run(inputs, tok, out, **kw):
    log = []
    kw.setdefault("progress", False)
    m = pp.preprocess(inputs, tok, out, log=log.append, **kw)
    return m, "\n".join(log)


def write_corpus(tmp_path, docs):
    """Half of the documents blank-line separated in a .txt, half in a .jsonl."""
    (tmp_path / "in").mkdir()
    txt = [re.sub(r"\n\s*\n", "\n", d) for d in docs[::2]]  # a blank line would split the document
    jsonl = docs[1::2]
    (tmp_path / "in" / "a.txt").write_text("\n\n".join(txt) + "\n", encoding="utf-8")
    with open(tmp_path / "in" / "b.jsonl", "w", encoding="utf-8") as f:
        for d in jsonl:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    return txt + jsonl  # the order preprocessing reads them in


def test_shards_equal_direct_encoding(tok, hf, tmp_path):
    docs = write_corpus(tmp_path, DOCS)
    m, log = run([tmp_path / "in"], tok, tmp_path / "out", valid_fraction=0.4)
    expected = [direct(hf, d) for d in docs]
    train, valid = shard_docs(tmp_path / "out", "train"), shard_docs(tmp_path / "out", "valid")
    in_valid = [zlib.crc32(d.encode()) < 0.4 * 2**32 for d in docs]
    assert train == [e for e, v in zip(expected, in_valid) if not v]
    assert valid == [e for e, v in zip(expected, in_valid) if v]
    assert 0 < len(valid) < len(docs)  # the split above really holds documents out
    assert m["counts"]["documents"] == len(docs)
    assert m["counts"]["tokens"] == sum(map(len, expected)) == m["splits"]["train"]["tokens"] + m["splits"]["valid"]["tokens"]
    assert m["vocab_size"] == tok.vocab_size and m["tokenizer_hash"] == tok.tokenizer_hash
    assert m["dtype"] == "uint16" and m["eos_id"] == tok.eos_id and m["mask_id"] == tok.mask_id
    assert {s["path"].rsplit("/", 1)[-1] for s in m["sources"]} == {"a.txt", "b.jsonl"}
    assert RobertaTokenizer.from_pretrained(tmp_path / "out" / "tokenizer").tokenizer_hash == tok.tokenizer_hash
    assert "documents: 6" in log


def test_the_manifest_is_written_before_the_summary(tok, tmp_path):
    """A reader that stops at the summary (`... | head -3`) ends the process with a broken pipe there:
    the dataset must be complete by then, its manifest included."""
    (tmp_path / "in.txt").write_text("one short document here\n\nand a second one there\n")

    def log(line):
        if line.startswith("dataset:"):
            assert (tmp_path / "out" / "manifest.json").exists(), "summary printed before the manifest"
            raise BrokenPipeError

    with pytest.raises(BrokenPipeError):
        pp.preprocess([tmp_path / "in.txt"], tok, tmp_path / "out", log=log, progress=False, valid_fraction=0.5)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]["documents"] >= 1


def test_chunks_and_workers_do_not_change_the_data(tok, tmp_path):
    docs = list(iter_documents(max_bytes=60_000))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "docs.txt").write_text("\n\n".join(d.replace("\n\n", "\n") for d in docs))
    inputs = [tmp_path / "docs.jsonl", tmp_path / "docs.txt"]
    m1, _ = run(inputs, tok, tmp_path / "one", shard_mb=10.0, workers=1)
    m4, _ = run(inputs, tok, tmp_path / "many", shard_mb=0.01, workers=2)
    assert len(m4["splits"]["train"]["shards"]) > 4
    assert shard_docs(tmp_path / "many", "train") == shard_docs(tmp_path / "one", "train")
    assert shard_docs(tmp_path / "many", "valid") == shard_docs(tmp_path / "one", "valid")
    assert m1["counts"] == m4["counts"]


def test_resume_skips_finished_chunks(tok, tmp_path):
    # 60 kB: several 5 kB chunks whatever the Python version (its documentation is the corpus;
    # 20 kB of Python 3.12's made only 2 chunks)
    docs = write_corpus(tmp_path, [d for d in iter_documents(max_bytes=60_000)])
    out = tmp_path / "out"
    run([tmp_path / "in"], tok, out, shard_mb=0.005)
    before = shard_docs(out, "train")
    chunks = sorted((out / "chunks").glob("*.json"))
    assert len(chunks) >= 3
    # an interrupted run: the last chunk never finished, the manifest was never written
    chunks[-1].unlink()
    (out / "manifest.json").unlink()
    untouched = out / "train" / "00000.bin"
    stamp = untouched.stat().st_mtime_ns
    _, log = run([tmp_path / "in"], tok, out, shard_mb=0.005)
    assert f"{len(chunks) - 1} of {len(chunks)} chunks already done" in log
    assert untouched.stat().st_mtime_ns == stamp
    assert shard_docs(out, "train") == before and len(before) + len(shard_docs(out, "valid")) == len(docs)


def test_output_inside_the_input_is_not_read(tok, tmp_path):
    write_corpus(tmp_path, DOCS)
    run([tmp_path / "in"], tok, tmp_path / "in" / "out")  # its tokenizer/merges.txt is a .txt file
    m, log = run([tmp_path / "in"], tok, tmp_path / "in" / "out")
    assert "it is a preprocess output" in log and m["counts"]["documents"] == len(DOCS)
    assert m["counts"]["unsupported_files"] == 0


def test_refuses_other_inputs_in_the_same_out(tok, tmp_path):
    write_corpus(tmp_path, DOCS)
    out = tmp_path / "out"
    run([tmp_path / "in" / "a.txt"], tok, out)
    with pytest.raises(ValueError, match="other inputs or options.*--overwrite"):
        run([tmp_path / "in"], tok, out)
    m, _ = run([tmp_path / "in"], tok, out, overwrite=True)
    assert m["counts"]["documents"] == len(DOCS)


def test_bad_input_is_counted_never_lost(tok, hf, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "bad_utf8.txt").write_bytes(b"caf\xe9 ok\xff\xfe end\n\n\n  \t\nsecond \xc3 doc\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.txt").write_bytes(b"\n   \n\t\n")
    (d / "records.jsonl").write_text(
        json.dumps({"text": "good record"}) + "\n" + "{not json\n" + json.dumps({"title": "no text"}) + "\n"
        + json.dumps({"text": "   "}) + "\n" + json.dumps(["a list"]) + "\n\n" + '{"text": "lone \\ud800 half"}\n'
        + json.dumps({"text": "last"}))
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")  # skipped: not a text type
    (d / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"looks like text\x00\x01\x02 but is not")
    m, log = run([d, binary], tok, tmp_path / "out", valid_fraction=0.0)
    c = m["counts"]
    assert c["invalid_utf8_replaced"] == 4  # \xe9, \xff, \xfe and a truncated \xc3
    assert (c["empty_files"], c["blank_files"], c["binary_files"], c["unsupported_files"]) == (1, 1, 1, 1)
    assert c["unreadable_files"] == 1 and "skipping unreadable file" in log
    assert (c["bad_json_lines"], c["records_without_text"], c["empty_documents"], c["blank_jsonl_lines"]) == (1, 2, 1, 1)
    assert c["documents"] == 5 and c["lone_surrogates_replaced"] == 1
    assert shard_docs(tmp_path / "out", "train") == [direct(hf, t) for t in [
        "caf\ufffd ok\ufffd\ufffd end", "second \ufffd doc", "good record", "lone \ufffd half", "last"]]
    assert str(binary) in m["refused"]["binary_files"] and "refusing binary file" in log and str(binary) in log
    for key, value in c.items():
        assert f"{key}: {value}" in log  # the report prints every count
    assert "records.jsonl@byte" in log


def test_enormous_line(tok, hf, tmp_path, monkeypatch):
    """Lines longer than the read block and documents longer than a piece, at small limits."""
    monkeypatch.setattr(documents, "READ_BLOCK", 1000)
    monkeypatch.setattr(documents, "PIECE_CHARS", 3000)
    words = " ".join(f"word{i % 97} ünï{i % 13}" for i in range(2000))  # one ~30 kB line
    (tmp_path / "long.txt").write_text(words + "\n\nnext doc", encoding="utf-8")
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": words}) + "\n")
    m, _ = run([tmp_path / "long.txt", tmp_path / "long.jsonl"], tok, tmp_path / "out", valid_fraction=0.0)
    assert m["counts"]["pieces"] > 15 and m["counts"]["hard_splits"] == 0
    assert shard_docs(tmp_path / "out", "train") == [direct(hf, words), direct(hf, "next doc"), direct(hf, words)]
    nospace = "x" * 10_000
    (tmp_path / "nospace.txt").write_text(nospace)
    m, _ = run([tmp_path / "nospace.txt"], tok, tmp_path / "out2", valid_fraction=0.0)
    (doc,) = shard_docs(tmp_path / "out2", "train")
    assert m["counts"]["hard_splits"] >= 3 and tok.decode(doc[:-1]) == nospace  # cut, but nothing lost


def test_real_size_single_line(tok, hf, tmp_path):
    """A 1.2 MB line with no newline at the real limits: read in blocks, tokenized in pieces."""
    line = " ".join(["the", "value", "of", "a", "function", "is"][i % 6] for i in range(250_000))
    assert len(line) > documents.READ_BLOCK and len(line) > documents.PIECE_CHARS
    (tmp_path / "big.txt").write_text(line)
    m, _ = run([tmp_path / "big.txt"], tok, tmp_path / "out", valid_fraction=0.0)
    assert m["counts"]["pieces"] >= 2 and m["counts"]["hard_splits"] == 0
    assert shard_docs(tmp_path / "out", "train") == [tok.encode(line)[1:]]


def test_doc_per_file(tok, hf, tmp_path):
    (tmp_path / "d").mkdir()
    texts = ["para one\n\npara two\n", "single\r\nline\n\n\n", "no newline"]
    for k, t in enumerate(texts):
        (tmp_path / "d" / f"{k}.txt").write_text(t, newline="")
    run([tmp_path / "d"], tok, tmp_path / "out", doc_per_file=True, valid_fraction=0.0)
    expect = ["para one\n\npara two", "single\nline\n\n", "no newline"]
    assert shard_docs(tmp_path / "out", "train") == [direct(hf, t) for t in expect]


def test_large_vocab_uses_uint32(tmp_path):
    """A vocab.json + merges.txt tokenizer with 70,002 ids, one merge reaching id 70,000."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + ByteLevel.alphabet())}
    vocab.update({f"filler{i}": i for i in range(len(vocab), 70_000)})
    vocab.update({"ab": 70_000, "<mask>": 70_001})
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "tok" / "merges.txt").write_text("#version: 0.2\na b\n")
    big = RobertaTokenizer.from_pretrained(tmp_path / "tok")
    assert big.vocab_size == 70_002 and big.mask_id == 70_001
    (tmp_path / "a.txt").write_text("ab cab")
    m, _ = run([tmp_path / "a.txt"], big, tmp_path / "out", valid_fraction=0.0)
    assert m["dtype"] == "uint32"
    (doc,) = shard_docs(tmp_path / "out", "train")
    assert doc == big.encode("ab cab")[1:] and doc.count(70_000) == 2


def test_cli(tok, tmp_path):
    write_corpus(tmp_path, DOCS)
    tok.save(tmp_path / "tok")
    cmd = [sys.executable, "-m", "roberta_fast.preprocess", "--tokenizer", str(tmp_path / "tok"),
           "--out", str(tmp_path / "out"), "--quiet", str(tmp_path / "in")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]["documents"] == len(DOCS)
    assert "empty_documents: 0" in res.stderr
    bad = subprocess.run(cmd[:-1] + [str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


def test_a_tokenizer_name_neither_local_nor_on_the_hub(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "a.txt").write_text("some text\n")
    assert pp.main(["--tokenizer", "acme/missing", "--out", str(tmp_path / "o"), str(tmp_path / "a.txt")]) == 2
    assert "'acme/missing' is neither a local directory nor a Hugging Face Hub repository" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bad_arguments(tok, tmp_path):
    with pytest.raises(ValueError, match="at least one input"):
        pp.preprocess([], tok, tmp_path / "o")
    with pytest.raises(ValueError, match="valid_fraction"):
        pp.preprocess([tmp_path], tok, tmp_path / "o", valid_fraction=1.5)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "junk.txt").write_text("not mine")
    with pytest.raises(ValueError, match="not a preprocess output"):
        pp.preprocess([tmp_path / "x"], tok, tmp_path / "x")


def test_invalid_utf8_names_the_files(tok, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "latin1.txt").write_bytes("café olé\n\nnaïve\n\n".encode("latin-1") * 20)
    (tmp_path / "in" / "clean.txt").write_text("plain text\n")
    m, log = run([tmp_path / "in"], tok, tmp_path / "out", valid_fraction=0.0, shard_mb=0.0001)  # 100-byte chunks
    assert m["counts"]["invalid_utf8_replaced"] == 60 and len(list((tmp_path / "out" / "chunks").iterdir())) > 3
    assert m["examples"]["invalid_utf8_replaced"] == [str(tmp_path / "in" / "latin1.txt")]
    assert f"invalid_utf8_replaced: {tmp_path / 'in' / 'latin1.txt'}" in log


def test_inputs_without_a_document_are_an_error(tok, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "in" / "empty.jsonl").write_text(json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"no document to read in .*in: .*1 blank files.*1 records without text"):
        run([tmp_path / "in"], tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-made is left to refuse a corrected rerun
    (tmp_path / "mine").mkdir()  # an empty directory made by the user stays, empty
    with pytest.raises(ValueError, match="no document to read"):
        run([tmp_path / "in"], tok, tmp_path / "mine")
    assert not list((tmp_path / "mine").iterdir())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("a,b\n")
    tok.save(tmp_path / "tok")
    assert pp.main(["--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "o"), "--quiet",
                    str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert f"error: no document to read in {tmp_path / 'other'}: 1 unsupported files ({tmp_path / 'other' / 'data.csv'})" in err


def test_a_small_corpus_still_gets_a_validation_split(tok, tmp_path):
    """At the default --valid-fraction 0.005, 60 documents expect 0.3 held out: the split is topped
    up with the next-lowest hashes to one batch of tokens, the same whatever the chunking."""
    from roberta_fast.data import PretrainingDataset

    docs = list(iter_documents(max_bytes=60_000))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    hashes = sorted(zlib.crc32(d.encode()) for d in docs)
    assert hashes[0] >= 0.005 * 2**32  # the hash rule alone holds out nothing
    m, log = run([tmp_path / "docs.jsonl"], tok, tmp_path / "one", shard_mb=10.0, workers=1)
    valid = m["splits"]["valid"]
    assert 1 <= valid["documents"] <= len(docs) // 10 and m["counts"]["valid_added"] == valid["documents"]
    assert valid["tokens"] >= pp.MIN_VALID_TOKENS or valid["documents"] == len(docs) // 10
    assert "the valid split had 0 documents (0 tokens) at --valid-fraction 0.005" in log
    assert len(PretrainingDataset(tmp_path / "one", "valid", seq_len=128)) > 0  # what training needs
    assert set(tok.decode(d) for d in shard_docs(tmp_path / "one", "valid")) == {
        d + "</s>" for d in docs if zlib.crc32(d.encode()) in hashes[:valid["documents"]]}
    m4, _ = run([tmp_path / "docs.jsonl"], tok, tmp_path / "many", shard_mb=0.005, workers=2)
    assert len(m4["splits"]["train"]["shards"]) > 4
    assert shard_docs(tmp_path / "many", "valid") == shard_docs(tmp_path / "one", "valid")
    assert shard_docs(tmp_path / "many", "train") == shard_docs(tmp_path / "one", "train")
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "many").rglob("*.bin")}
    again, _ = run([tmp_path / "docs.jsonl"], tok, tmp_path / "many", shard_mb=0.005, workers=2)
    assert again["splits"] == m4["splits"] and stamps == {p: p.stat().st_mtime_ns for p in stamps}


def test_a_damaged_tokenizer_is_named_not_a_traceback(tok, tmp_path, capsys):
    tok.save(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "truncation": null, "add')
    (tmp_path / "a.txt").write_text("some text\n")
    assert pp.main(["--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "o"), str(tmp_path / "a.txt")]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'tok' / 'tokenizer.json'} cannot be read (EOF while parsing" in err
    assert "truncated or damaged" in err and err.count("\n") == 1


def test_a_run_killed_before_its_plan_is_written_reruns(tok, tmp_path, monkeypatch):
    """Killed while creating the output tree (its empty folders, or a half-written plan.json): the
    rerun takes the directory as its own rather than refusing it as 'not a preprocess output'."""
    write_corpus(tmp_path, DOCS)
    out = tmp_path / "out"
    for sub in ("train", "valid", "chunks", "tokenizer"):  # an older version made these before plan.json
        (out / sub).mkdir(parents=True)
    (out / ".plan.json.abc123.tmp").write_text("{")
    m, _ = run([tmp_path / "in"], tok, out)
    assert m["counts"]["documents"] == len(DOCS) and not list(out.glob(".*.tmp"))

    mkdir = pp.Path.mkdir

    def killed(self, *args, **kw):
        if self.name == "train":  # plan.json is written first: killed at the folders
            raise KeyboardInterrupt
        return mkdir(self, *args, **kw)
    monkeypatch.setattr(pp.Path, "mkdir", killed)
    with pytest.raises(KeyboardInterrupt):
        run([tmp_path / "in"], tok, tmp_path / "out2")
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == [pp.LOCK_NAME, "plan.json"]
    m, _ = run([tmp_path / "in"], tok, tmp_path / "out2")
    assert m["counts"]["documents"] == len(DOCS)


def test_stale_temporary_chunk_markers_are_removed(tok, tmp_path):
    write_corpus(tmp_path, DOCS)
    run([tmp_path / "in"], tok, tmp_path / "out")
    (tmp_path / "out" / "chunks" / ".00000.json.abc123.tmp").write_text("{")
    run([tmp_path / "in"], tok, tmp_path / "out")
    assert not list((tmp_path / "out").rglob("*.tmp"))


def start_long_run(tok, tmp_path):
    """A CLI run of 2 workers over 60 small chunks, once its first chunk is done: (process, its out)."""
    (tmp_path / "in").mkdir()
    words = [f"w{i}x{i * 7 % 13}" for i in range(500)]
    text = "\n\n".join(" ".join(words[(d + k) % 500] for k in range(60)) for d in range(24000))  # ~0.2 MB a chunk
    (tmp_path / "in" / "a.txt").write_text(text + "\n")
    tok.save(tmp_path / "tok")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "roberta_fast.preprocess", "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
           "--quiet", "--workers", "2", "--shard-mb", str(len(text) / 60e6), str(tmp_path / "in")]
    # SIGINT at its default in the run, as in a terminal: a shell's background job (`.ci/run &`) ignores it,
    # and an ignored SIGINT is inherited
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not list((out / "chunks").glob("*.json")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1]
    return p, out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_the_workers_at_once(tok, tmp_path, sig):
    """Ctrl-C (SIGINT to the process group) or SIGTERM (to preprocess alone): no chunk more, one line, 130 / 143."""
    p, out = start_long_run(tok, tmp_path)
    t0 = time.time()
    if sig == "SIGINT":
        os.killpg(p.pid, signal.SIGINT)
    else:
        os.kill(p.pid, signal.SIGTERM)
    try:
        err = p.communicate(timeout=20)[1]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        err = p.communicate()[1]
    done = len(list((out / "chunks").glob("*.json")))
    assert time.time() - t0 < 5 and done < 30, (time.time() - t0, done)
    assert p.returncode == 128 + getattr(signal, sig), err
    assert err.strip() == f"interrupted: {done} of 60 chunks done; rerun the same command to resume", err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_die_with_a_killed_parent(tok, tmp_path):
    """SIGKILL of preprocess alone (the OOM killer): its workers do not tokenize on."""
    p, out = start_long_run(tok, tmp_path)

    def ppid(stat: Path) -> int:
        try:
            return int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            return 0

    children = [int(s.parent.name) for s in Path("/proc").glob("[0-9]*/stat") if ppid(s) == p.pid]
    assert children
    os.kill(p.pid, signal.SIGKILL)
    p.wait()

    def running(c: int) -> bool:  # (a zombie waiting to be reaped counts as dead)
        try:
            return Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 5
    while any(map(running, children)) and time.time() < deadline:
        time.sleep(0.05)
    alive = [c for c in children if running(c)]
    for c in alive:
        os.kill(c, signal.SIGKILL)
    assert not alive


def test_a_second_run_on_one_out_is_refused(tok, tmp_path):
    """A run holding --out's lock (another terminal, a scheduler retry) keeps a second one out, which
    would delete its temporary files as stale; once it ends, the same out is used again."""
    fcntl = pytest.importorskip("fcntl")
    write_corpus(tmp_path, DOCS)
    out = tmp_path / "out"
    run([tmp_path / "in"], tok, out)
    with open(out / pp.LOCK_NAME, "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.truncate(0)
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        with pytest.raises(ValueError, match=r"another preprocess \(pid 4242 on elsewhere\) is writing to"):
            run([tmp_path / "in"], tok, out)
    m, log = run([tmp_path / "in"], tok, out)
    assert "resuming" in log and m["counts"]["documents"] == len(DOCS)


def test_a_refused_run_leaves_no_out_it_made(tok, tmp_path):
    """An --out made for a run that then fails before writing anything (here: a damaged table) is
    removed again, lock file and all."""
    pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the [data] extra)")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"x" * 100)
    with pytest.raises(documents.DamagedInputError):
        run([tmp_path / "bad.parquet"], tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _texts(out, tok):
    """Every document of both splits, decoded with the dataset's own tokenizer."""
    own = RobertaTokenizer.from_pretrained(out / "tokenizer")
    return sorted(own.decode(ids, skip_special_tokens=True) for split in ("train", "valid")
                  for ids in shard_docs(out, split))


def test_overwrite_through_linked_output_folders_replaces_the_data(tok, tmp_path):
    """train/ valid/ chunks/ linked to another disk: --overwrite with other inputs (or another
    tokenizer) leaves the links, empties their targets of the old run's files only, and the
    dataset holds the new text; a linked tokenizer/ (someone's own folder) is never written through."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "a.txt").write_text("\n\n".join(f"lower case document {i} here" for i in range(30)) + "\n")
    (tmp_path / "b" / "b.txt").write_text("\n\n".join(f"UPPER CASE DOCUMENT {i}" for i in range(12)) + "\n")
    out, disk = tmp_path / "out", tmp_path / "disk"
    out.mkdir()
    for sub in ("train", "valid", "chunks"):
        (disk / sub).mkdir(parents=True)
        (out / sub).symlink_to(disk / sub)
    run([tmp_path / "a"], tok, out, shard_mb=0.0005, valid_fraction=0.2)
    (disk / "train" / "notes.txt").write_text("not the run's")
    _, log = run([tmp_path / "b"], tok, out, shard_mb=0.0005, valid_fraction=0.2, overwrite=True)
    assert "resuming" not in log and all((out / sub).is_symlink() for sub in ("train", "valid", "chunks"))
    assert _texts(out, tok) == sorted(f"UPPER CASE DOCUMENT {i}" for i in range(12))
    run([tmp_path / "b"], tok, tmp_path / "fresh", shard_mb=0.0005, valid_fraction=0.2)
    for sub in ("train", "valid", "chunks"):  # no stale shards or markers of the longer first run
        assert sorted(p.name for p in (disk / sub).iterdir() if p.name != "notes.txt") == \
            sorted(p.name for p in (tmp_path / "fresh" / sub).iterdir())
    assert (disk / "train" / "notes.txt").read_text() == "not the run's"

    other = RobertaTokenizer.train_from_iterator(iter_documents(max_bytes=60_000), vocab_size=700)
    mine = other.save(tmp_path / "my_tokenizer")
    kept = {p.name: p.read_bytes() for p in mine.iterdir()}
    os.rename(out / "tokenizer", tmp_path / "old_tokenizer")
    (out / "tokenizer").symlink_to(mine)
    run([tmp_path / "b"], tok, out, shard_mb=0.0005, valid_fraction=0.2, overwrite=True)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == kept and not (out / "tokenizer").is_symlink()
    assert _texts(out, tok) == sorted(f"UPPER CASE DOCUMENT {i}" for i in range(12))


def test_a_chunk_made_with_another_tokenizer_is_never_resumed(tok, tmp_path, monkeypatch):
    """The second guard: should the old run's files outlive an --overwrite, each chunk's marker
    records what it was made with, and a chunk of another tokenizer or options is redone."""
    write_corpus(tmp_path, DOCS * 3)
    out = tmp_path / "out"
    run([tmp_path / "in"], tok, out, shard_mb=0.0005)
    other = RobertaTokenizer.train_from_iterator(iter_documents(max_bytes=60_000), vocab_size=700)
    monkeypatch.setattr(pp, "_remove_run_output", lambda out: (out / "plan.json").unlink())  # removes nothing else
    m, log = run([tmp_path / "in"], other, out, shard_mb=0.0005, overwrite=True)
    assert "resuming" not in log and "was made from other inputs or options: redoing it" in log
    assert _texts(out, other) == sorted(DOCS * 3)


def test_linked_outputs_without_a_document_leave_nothing_to_refuse_the_rerun(tok, tmp_path):
    """--out a link to another disk (or its subfolders linked by the user beforehand): inputs with no
    document are the usual error, the links stay, and a corrected rerun is not refused."""
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "b.txt").write_text("\n \n")
    write_corpus(tmp_path, DOCS)
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "disk")
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre_train").mkdir()
    (tmp_path / "pre" / "train").symlink_to(tmp_path / "pre_train")
    for out in (tmp_path / "out", tmp_path / "pre"):
        with pytest.raises(ValueError, match="no document to read"):
            run([tmp_path / "blank"], tok, out)
        assert out.is_symlink() or (out / "train").is_symlink()
        m, _ = run([tmp_path / "in"], tok, out)
        assert m["counts"]["documents"] == len(DOCS)


def test_a_dangling_link_as_out_or_in_it_is_named(tok, tmp_path):
    write_corpus(tmp_path, DOCS)
    (tmp_path / "out").symlink_to(tmp_path / "unmounted")
    with pytest.raises(ValueError, match="is a link to .*unmounted', which does not exist: create that folder"):
        run([tmp_path / "in"], tok, tmp_path / "out")
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "train").symlink_to(tmp_path / "unmounted")
    with pytest.raises(ValueError, match="o2/train' is a link to .*unmounted', which does not exist: create"):
        run([tmp_path / "in"], tok, tmp_path / "o2")
