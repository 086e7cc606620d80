"""roberta_fast.documents: every format gives the documents of the plain .jsonl, in preprocess and
tokenizer training; formats told by their bytes; damaged files named, their rerun resumed.

The text is the embedded corpus (English prose from the Python documentation), written in
tmp_path as plain JSONL and as each other format at test time."""
import builtins
import bz2
import codecs
import gzip
import json
import lzma
import re

import numpy as np
import pytest

from roberta_fast import RobertaTokenizer
from roberta_fast import documents
from roberta_fast import preprocess as pp
from roberta_fast.corpus import iter_documents

pa = pytest.importorskip("pyarrow", reason="the Parquet / Arrow formats need pyarrow (the [data] extra)")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard", reason="the zstd format needs zstandard (the [data] extra)")

DOCS = list(iter_documents(max_bytes=60_000))


@pytest.fixture(scope="module")
def tok():
    return RobertaTokenizer.train_from_iterator(iter_documents(max_bytes=150_000), vocab_size=1000)


def jsonl_bytes(docs) -> bytes:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def txt_bytes(docs) -> bytes:
    """The documents blank-line separated (a blank line inside one would split it)."""
    return "\n\n".join(re.sub(r"\n\s*\n", "\n", d) for d in docs).encode()


def zstd_frames(data: bytes, frames: int) -> bytes:
    """Several zstd frames back to back, cut at arbitrary bytes (as pzstd writes them)."""
    step = len(data) // frames + 1
    return b"".join(zstandard.ZstdCompressor(write_checksum=True).compress(data[a:a + step])
                    for a in range(0, len(data), step))


def write_table(path, docs, kind, rows_per_group=3):
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=rows_per_group)
    else:
        with pa.OSFile(str(path), "wb") as sink:
            new = pa.ipc.new_file if kind == "arrow-file" else pa.ipc.new_stream
            with new(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=rows_per_group):
                    writer.write_batch(batch)


FORMATS = {
    "jsonl.gz": lambda p, d: p.write_bytes(gzip.compress(jsonl_bytes(d))),
    "jsonl.bz2": lambda p, d: p.write_bytes(bz2.compress(jsonl_bytes(d))),
    "jsonl.xz": lambda p, d: p.write_bytes(lzma.compress(jsonl_bytes(d))),
    "jsonl.zst": lambda p, d: p.write_bytes(zstd_frames(jsonl_bytes(d), 8)),
    "txt.zst": lambda p, d: p.write_bytes(zstd_frames(txt_bytes(d), 8)),
    "txt.gz": lambda p, d: p.write_bytes(gzip.compress(txt_bytes(d))),
    "parquet": lambda p, d: write_table(p, d, "parquet"),
    "arrow": lambda p, d: write_table(p, d, "arrow-stream"),
    "arrow-file.arrow": lambda p, d: write_table(p, d, "arrow-file"),
}


def shard_docs(out):
    """Every document of both splits as a list of ids, in shard order."""
    m = json.loads((out / "manifest.json").read_text())
    docs = []
    for split in ("train", "valid"):
        for shard in m["splits"][split]["shards"]:
            ids = np.fromfile(out / shard["bin"], dtype=m["dtype"])
            idx = np.load(out / shard["idx"])
            docs += [ids[a:b].tolist() for a, b in zip(idx[:-1], idx[1:])]
    return docs


def run(inputs, tok, out, **kw):
    log = []
    kw.setdefault("valid_fraction", 0.05)
    m = pp.preprocess(inputs, tok, out, progress=False, log=log.append, **kw)
    return m, "\n".join(log)


@pytest.fixture(scope="module")
def plain(tok, tmp_path_factory):
    """The plain .jsonl of DOCS (and of the .txt reading of them), preprocessed: what every format must give."""
    d = tmp_path_factory.mktemp("plain")
    (d / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    m, _ = run([d / "docs.jsonl"], tok, d / "out")
    return m, shard_docs(d / "out")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_gives_the_plain_jsonl_documents(fmt, tok, plain, tmp_path):
    path = tmp_path / f"docs.{fmt}"
    FORMATS[fmt](path, DOCS)
    # small shards: several chunks from the row groups / record batches of one table
    m, _ = run([path], tok, tmp_path / "out", shard_mb=0.004, workers=2)
    want_manifest, want = plain
    if fmt.startswith("txt"):  # the same text as a plain .txt file
        (tmp_path / "docs.txt").write_bytes(txt_bytes(DOCS))
        want_manifest, _ = run([tmp_path / "docs.txt"], tok, tmp_path / "plain")
        want = shard_docs(tmp_path / "plain")
    assert m["counts"]["documents"] == len(DOCS) == want_manifest["counts"]["documents"]
    assert sorted(shard_docs(tmp_path / "out")) == sorted(want)
    assert m["splits"]["valid"]["documents"] == want_manifest["splits"]["valid"]["documents"]
    if fmt in ("parquet", "arrow", "jsonl.zst", "txt.zst"):  # row groups, record batches, runs of zstd frames
        assert len(m["splits"]["train"]["shards"]) > 2  # the units really ran as separate chunks


def test_tokenizer_training_reads_every_format_alike(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    want = RobertaTokenizer.train([tmp_path / "docs.jsonl"], vocab_size=600).tokenizer_hash
    for fmt in ("jsonl.zst", "parquet", "arrow"):
        FORMATS[fmt](tmp_path / f"d.{fmt}", DOCS)
        assert RobertaTokenizer.train([tmp_path / f"d.{fmt}"], vocab_size=600).tokenizer_hash == want, fmt


def test_datasets_directories_and_objects(tok, plain, tmp_path):
    """A save_to_disk directory, a Dataset backed by its arrow files, an in-memory (and a shuffled)
    Dataset: the same documents, in preprocess and in tokenizer training."""
    datasets = pytest.importorskip("datasets", reason="reading datasets objects needs datasets (the [data] extra)")
    ds = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "saved"), max_shard_size="20KB")  # several .arrow files
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1
    on_disk = datasets.load_from_disk(str(tmp_path / "saved"))
    _, want = plain
    for name, source in [("dir", tmp_path / "saved"), ("on_disk", on_disk), ("memory", ds)]:
        m, _ = run(source, tok, tmp_path / f"out-{name}")
        assert m["counts"]["documents"] == len(DOCS) and shard_docs(tmp_path / f"out-{name}") == want, name
    shuffled = ds.shuffle(seed=0)
    m, _ = run(shuffled, tok, tmp_path / "out-shuffled")
    assert sorted(shard_docs(tmp_path / "out-shuffled")) == sorted(want)
    again, log = run(shuffled, tok, tmp_path / "out-shuffled")  # the copy it wrote is found again
    assert "chunks already done" in log and again["splits"] == m["splits"]
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    want_tok = RobertaTokenizer.train([tmp_path / "docs.jsonl"], vocab_size=600).tokenizer_hash
    assert RobertaTokenizer.train(ds, vocab_size=600).tokenizer_hash == want_tok
    assert RobertaTokenizer.train(tmp_path / "saved", vocab_size=600).tokenizer_hash == want_tok


def test_files_are_read_by_their_bytes_or_refused_by_name(tok, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "really_gzip.jsonl.zst").write_bytes(gzip.compress(jsonl_bytes(DOCS[:3])))
    (d / "plain.txt.gz").write_text("plain text under a .gz name\n")
    (d / "noext").write_bytes(gzip.compress(jsonl_bytes(DOCS[3:5])))  # skipped in a directory: no known type
    (d / "fake.parquet").write_bytes(b"\x00\x01 not parquet at all")
    (d / "archive.tar.gz").write_bytes(gzip.compress(b"x" * 100))
    (d / "bzh.txt").write_text("BZh9 is how this text begins, as bzip2's files do\n")  # no block magic: text
    m, log = run([d / "noext", d], tok, tmp_path / "out", valid_fraction=0.0)
    assert m["counts"]["documents"] == 3 + 1 + 2 + 1
    assert "really_gzip.jsonl.zst is gzip-compressed, not zstd: read as gzip" in log
    assert "plain.txt.gz is plain text, not gzip: read as text" in log
    assert m["refused"]["mislabelled_files"] == [str(d / "fake.parquet")] and "named parquet" in log
    assert m["refused"]["unsupported_files"] == [str(d / "archive.tar.gz")]
    binary = tmp_path / "binary.txt.gz"
    binary.write_bytes(gzip.compress(b"text\x00\x01\x02"))
    with pytest.raises(ValueError, match="1 binary files"):
        run([binary], tok, tmp_path / "out2")


def test_parquet_column_errors_name_the_choice(tok, tmp_path):
    write_table(tmp_path / "t.parquet", DOCS[:4], "parquet")
    with pytest.raises(ValueError, match=r"has no column 'body' \(its columns: \['id', 'text'\]\); pass --text-field"):
        run([tmp_path / "t.parquet"], tok, tmp_path / "out", text_field="body")
    with pytest.raises(ValueError, match="column 'id' holds int64, not text"):
        run([tmp_path / "t.parquet"], tok, tmp_path / "out2", text_field="id")


def damage(path, fmt):
    data = path.read_bytes()
    if fmt == "parquet":
        path.write_bytes(data[:-20])  # the footer (its metadata) cut off
    elif fmt == "jsonl.zst":
        bad = bytearray(data)
        bad[len(data) * 2 // 3] ^= 0xFF  # a corrupt byte inside the last frame
        path.write_bytes(bytes(bad))
    else:
        path.write_bytes(data[: len(data) * 2 // 3])  # truncated mid-stream


@pytest.mark.parametrize("fmt", ["jsonl.gz", "jsonl.zst", "txt.gz", "parquet"])
def test_a_damaged_file_is_named_and_the_rerun_resumes(fmt, tok, tmp_path, capsys):
    """The error names the file and how far it got; the other files' shards are kept; the rerun with
    --skip-damaged resumes them, says once that it leaves the file out (not to pass --skip-damaged)
    and names the file in the manifest."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:20]))
    FORMATS[fmt](d / f"b.{fmt}", DOCS * 3)
    (d / "c.jsonl").write_bytes(jsonl_bytes(DOCS[:10]))
    damage(d / f"b.{fmt}", fmt)
    out = tmp_path / "out"
    kw = dict(shard_mb=0.005, workers=1)
    with pytest.raises(documents.DamagedInputError) as err:
        run([d], tok, out, **kw)
    message = str(err.value)
    assert message.startswith(f"{d / f'b.{fmt}'} is damaged or truncated") and "--skip-damaged" in message
    done = len(list((out / "chunks").glob("*.json")))
    if fmt == "parquet":  # a table without its footer (its metadata) is refused when planning, before any row
        assert "reading its metadata" in message
    else:
        assert "after " in message and " documents (at b." in message and done >= 1
    assert not (out / "manifest.json").exists()
    assert not list(out.rglob("*.tmp"))  # the damaged chunk's half-written shards are gone
    capsys.readouterr()
    m, log = run([d], tok, out, skip_damaged=True, **kw)
    said = log + capsys.readouterr().err
    assert f"resuming: {done} of" in log or not done
    left_out = [line for line in said.splitlines() if f"left out (--skip-damaged): {d / f'b.{fmt}'}" in line]
    assert left_out and len(set(left_out)) == len(left_out), said  # each damage once (zstd: per run of frames)
    assert "pass --skip-damaged" not in said
    assert m["refused"]["damaged_files"] == [str(d / f"b.{fmt}")] and m["counts"]["damaged_files"] == 1
    want, _ = run([d / "a.jsonl", d / "c.jsonl"], tok, tmp_path / "clean", **kw)
    clean = len(DOCS[:20]) + len(DOCS[:10])
    assert want["counts"]["documents"] == clean
    if fmt == "jsonl.zst":  # several frames: only the runs of frames that cannot be read are left out
        assert clean < m["counts"]["documents"] < clean + 3 * len(DOCS)
    else:
        assert m["counts"]["documents"] == clean


def test_a_missing_library_names_the_extra(tok, tmp_path, monkeypatch):
    write_table(tmp_path / "t.parquet", DOCS[:4], "parquet")
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kw):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ValueError, match=r"needs pyarrow: pip install 'roberta_fast\[data\]'"):
        run([tmp_path / "t.parquet"], tok, tmp_path / "out")


@pytest.mark.parametrize("fmt", ["jsonl.zst", "parquet", "arrow"])
def test_an_interrupted_run_resumes_to_the_same_shards(fmt, tok, tmp_path):
    """Frames, row groups and record batches are chunks like byte ranges: a run killed before its last
    chunk and its manifest continues from the finished ones and gives the same shards."""
    FORMATS[fmt](tmp_path / f"docs.{fmt}", DOCS)
    out = tmp_path / "out"
    run([tmp_path / f"docs.{fmt}"], tok, out, shard_mb=0.004)
    before = shard_docs(out)
    markers = sorted((out / "chunks").glob("*.json"))
    assert len(markers) >= 3
    markers[-1].unlink()  # the last chunk never finished, the manifest was never written
    (out / "manifest.json").unlink()
    untouched = {p: p.stat().st_mtime_ns for p in (out / "train").glob("00000.*")}
    _, log = run([tmp_path / f"docs.{fmt}"], tok, out, shard_mb=0.004)
    assert f"{len(markers) - 1} of {len(markers)} chunks already done" in log
    assert shard_docs(out) == before and untouched == {p: p.stat().st_mtime_ns for p in untouched}


def test_invalid_utf8_in_a_table_is_replaced_and_counted(tok, tmp_path):
    """pyarrow refuses to turn invalid UTF-8 into str; it is replaced and counted as in text files."""
    data, offsets = b"caf\xe9 ok" + b"good text", np.array([0, 7, 16], dtype=np.int32)
    column = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)])
    pq.write_table(pa.table({"text": column}), tmp_path / "bad.parquet")
    m, _ = run([tmp_path / "bad.parquet"], tok, tmp_path / "out", valid_fraction=0.0)
    assert m["counts"]["invalid_utf8_replaced"] == 1 and m["counts"]["documents"] == 2
    assert [tok.decode(d) for d in shard_docs(tmp_path / "out")] == ["caf\ufffd ok</s>", "good text</s>"]


def skippable(payload: bytes) -> bytes:
    """A zstd skippable frame (metadata zstd readers pass over): magic, little-endian size, payload."""
    return (0x184D2A50).to_bytes(4, "little") + len(payload).to_bytes(4, "little") + payload


def read_in_units(path, room):
    """Every document of a file read unit by unit, as preprocess splits it with units of about `room` bytes."""
    (source,), _ = documents.find_sources([path], log=lambda msg: None)
    units = list(pp._units(source, room, room, False, "text"))
    docs = [p for start, end, _ in units for p, _, _ in documents.SegmentReader(source, start, end)]
    return docs, len(units)


def test_zstd_runs_read_each_document_once_whatever_the_split(tmp_path):
    """A document longer than a whole run of frames: the runs starting inside it read nothing (they
    read the next document again, which the run it starts in reads too)."""
    long = "\n".join(f"line {i} of the long document" for i in range(300))
    docs = ["first doc", long, "third doc", "fourth doc"]
    data = "\n\n".join(docs).encode() + b"\n"
    c = zstandard.ZstdCompressor()
    (tmp_path / "d.txt.zst").write_bytes(b"".join(c.compress(data[a:a + 500]) for a in range(0, len(data), 500)))
    got, units = read_in_units(tmp_path / "d.txt.zst", 1)
    assert units > 5 and got == docs


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_zstd_skippable_frames_lose_nothing(kind, tmp_path):
    """Skippable frames (pzstd writes one before every frame) at the start, between frames and at
    the end: the file is zstd, and each split reads every document once."""
    data = (txt_bytes(DOCS) + b"\n") if kind == "txt" else jsonl_bytes(DOCS)
    c = zstandard.ZstdCompressor()
    frames = [skippable(b"size") + c.compress(data[a:a + 3000]) for a in range(0, len(data), 3000)]
    frames[5] += skippable(b"metadata in the middle")
    (tmp_path / f"d.{kind}.zst").write_bytes(b"".join(frames) + skippable(b"seek table"))
    (tmp_path / f"d.{kind}").write_bytes(data)
    want, _ = read_in_units(tmp_path / f"d.{kind}", 1 << 30)
    for room in (1 << 30, 1, 5000):
        got, _ = read_in_units(tmp_path / f"d.{kind}.zst", room)
        assert got == want and len(got) == len(DOCS), room


@pytest.mark.parametrize("name", ["d.jsonl", "d.txt", "d.jsonl.gz", "d.txt.zst"])
def test_a_utf8_byte_order_mark_is_not_text(name, tmp_path):
    """A file starting with a BOM (as Windows tools write): the first JSONL record is not bad JSON,
    and the first text document holds no U+FEFF."""
    data = codecs.BOM_UTF8 + (b'{"text": "first"}\n{"text": "second"}\n' if ".jsonl" in name else b"first\n\nsecond\n")
    compress = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}.get((tmp_path / name).suffix)
    (tmp_path / name).write_bytes(compress(data) if compress else data)
    (source,), _ = documents.find_sources([tmp_path / name], log=lambda msg: None)
    stats = documents.new_stats()
    assert [p for p, _, _ in documents.SegmentReader(source, 0, source.size, stats=stats)] == ["first", "second"]
    assert stats["bad_json_lines"] == 0


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_dictionary_encoded_text_column_is_text(kind, tmp_path):
    """A pandas Categorical / pyarrow dictionary<string> column is read as its strings, not refused."""
    texts = ["a doc", "another doc", "a doc", None, "café"]
    table = pa.table({"text": pa.array(texts).dictionary_encode()})
    path = tmp_path / f"t.{kind}"
    if kind == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    assert list(documents.read_documents([path], log=lambda msg: None)) == ["a doc", "another doc", "a doc", "café"]


@pytest.mark.parametrize("codec", [gzip, lzma])  # (bzip2 decodes whole 900 kB blocks)
def test_a_truncated_small_file_counts_the_documents_read(codec, tmp_path):
    """The error says how far the reading got, even when the whole file fits one read-ahead buffer."""
    data = codec.compress(b"".join(b"document %d with a few words\n\n" % i for i in range(2000)))
    path = tmp_path / f"t.txt.{ {gzip: 'gz', bz2: 'bz2', lzma: 'xz'}[codec] }"
    path.write_bytes(data[: len(data) * 2 // 3])
    (source,), _ = documents.find_sources([path], log=lambda msg: None)
    with pytest.raises(documents.DamagedInputError, match=r"after [1-9]\d* documents"):
        list(documents.SegmentReader(source, 0, source.size))


def test_a_json_file_of_lines_is_jsonl_and_a_json_document_is_refused(tmp_path):
    """C4's uncompressed shards (c4-train.00000-of-01024.json) are JSON lines: their text field is
    read, in a directory too, not the raw lines; a .json holding one array or one object spread over
    lines is refused by name; a file named on its own with no known extension is read by its bytes,
    and the log says so."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "c4-train.00000-of-01024.json").write_bytes(jsonl_bytes(DOCS[:3]))
    (d / "array.json").write_text(json.dumps([{"text": d} for d in DOCS[3:5]]))
    (d / "pretty.json").write_text(json.dumps({"text": DOCS[5]}, indent=2))
    (tmp_path / "noext").write_bytes(jsonl_bytes(DOCS[6:8]))
    log = []
    assert list(documents.read_documents([d / "c4-train.00000-of-01024.json"], log=log.append)) == DOCS[:3]
    sources, refused = documents.find_sources([d, tmp_path / "noext"], log.append)
    assert [(s.path, s.kind) for s in sources] == [(str(d / "c4-train.00000-of-01024.json"), "jsonl"),
                                                    (str(tmp_path / "noext"), "jsonl")]
    assert refused["not_jsonl_files"] == [str(d / "array.json"), str(d / "pretty.json")]
    said = "\n".join(log)
    assert f"refusing {d / 'array.json'}: it holds one JSON array" in said and "jq -c '.[]' array.json" in said
    assert f"refusing {d / 'pretty.json'}: its first line is not JSON" in said
    assert f"{tmp_path / 'noext'} holds JSONL (its first bytes say so)" in said
    assert list(documents.read_documents([tmp_path / "noext"], log=log.append)) == DOCS[6:8]


def test_nul_bytes_past_the_sniffed_head_are_dropped_and_counted(tok, tmp_path):
    """NUL bytes after the first 8 KiB (a log zero-filled after a crash) never reach the shards: each
    line (or JSONL record) holding one is dropped, counted as nul_lines and located, the rest read."""
    text = txt_bytes(DOCS)
    assert len(text) > documents.SNIFF_BYTES  # the NULs lie past the head that marks binary files
    d = tmp_path / "in"
    d.mkdir()
    (d / "crashed.txt").write_bytes(text + b"\n" + b"\x00" * 65536 + b"\n")
    lines = b"a line\n" * 2000  # a document running on past the NUL line
    (d / "mid.txt").write_bytes(lines + b"\x00\x00 half written\nlast line\n\nnext document\n")
    (d / "records.jsonl").write_bytes(jsonl_bytes(DOCS[:2]) + b"\x00" * 100 + b"\n" + jsonl_bytes(DOCS[2:3]))
    m, log = run([d], tok, tmp_path / "out", valid_fraction=0.0)
    assert m["counts"]["nul_lines"] == 3 and "nul_lines: 3" in log
    assert m["examples"]["nul_lines"] == [f"crashed.txt@byte{len(text) + 1}", f"mid.txt@byte{len(lines)}",
                                          f"records.jsonl@byte{len(jsonl_bytes(DOCS[:2]))}"]
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "crashed.txt").write_bytes(text)
    (tmp_path / "clean" / "mid.txt").write_bytes(lines + b"last line\n\nnext document\n")
    (tmp_path / "clean" / "records.jsonl").write_bytes(jsonl_bytes(DOCS[:3]))
    want, _ = run([tmp_path / "clean"], tok, tmp_path / "want", valid_fraction=0.0)
    assert shard_docs(tmp_path / "out") == shard_docs(tmp_path / "want")
    assert m["counts"]["documents"] == want["counts"]["documents"] == len(DOCS) + 2 + 3


def test_a_crlf_cut_by_a_read_block_is_one_line_end(tmp_path, monkeypatch):
    """"\\r\\n" reads as "\\n" also where a block of READ_BLOCK bytes ends between the two; a lone "\\r"
    (old Mac line ends) is no line break, kept as text, at the end of the file too."""
    monkeypatch.setattr(documents, "READ_BLOCK", 8)
    (tmp_path / "a.txt").write_bytes(b"abcdefg\r\nnext\r\n\r\nold\rmac\r\n\r\n1234567\r")
    assert list(documents.read_documents([tmp_path / "a.txt"])) == ["abcdefg\nnext", "old\rmac", "1234567\r"]


def test_linked_folders_are_read_once_and_hidden_names_are_said(tmp_path):
    """A linked folder (corpus/wiki -> another disk) is read like its own, a loop of links ends, a
    folder reached twice is read once; files and folders named ".*" are skipped, and the log says so."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "w.txt").write_text("wiki doc\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("top doc\n")
    (corpus / ".notes.txt").write_text("hidden\n")
    (corpus / "wiki").symlink_to(tmp_path / "elsewhere")
    (corpus / "wiki2").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "loop").symlink_to(corpus)
    log = []
    sources, _ = documents.find_sources([corpus], log.append)
    assert [s.path for s in sources] == [str(corpus / "a.txt"), str(corpus / "wiki" / "w.txt")]
    assert f"skipping 1 hidden files and folders (names starting with '.') in {corpus}: {corpus / '.notes.txt'}" in log


def three_files(d):
    """a.jsonl, b.jsonl.gz and c.jsonl in `d`; returns `d` and b's bytes (to put back once damaged)."""
    d.mkdir()
    (d / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:20]))
    FORMATS["jsonl.gz"](d / "b.jsonl.gz", DOCS * 2)
    (d / "c.jsonl").write_bytes(jsonl_bytes(DOCS[:10]))
    return d, (d / "b.jsonl.gz").read_bytes()


def test_a_replaced_damaged_file_resumes_the_run(tok, tmp_path):
    """The damaged-file error's advice followed: with the file replaced, the same command keeps the
    chunks finished before it and redoes those that read it, or read what changed: the shards are a
    fresh run's. So does a rerun after a finished file changed; other files are still refused."""
    d, intact = three_files(tmp_path / "in")
    damage(d / "b.jsonl.gz", "jsonl.gz")
    out, kw = tmp_path / "out", dict(shard_mb=0.005, workers=1)
    with pytest.raises(documents.DamagedInputError, match="replace it"):
        run([d], tok, out, **kw)
    done = len(list((out / "chunks").glob("*.json")))
    assert done >= 1
    (d / "b.jsonl.gz").write_bytes(intact)
    m, log = run([d], tok, out, **kw)
    assert f"resuming: {done} of" in log and f"1 input files changed since the last run ({d / 'b.jsonl.gz'})" in log
    want, _ = run([d], tok, tmp_path / "fresh", **kw)
    assert shard_docs(out) == shard_docs(tmp_path / "fresh") and m["counts"] == want["counts"]

    (d / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:12]))  # fewer chunks: every one after shifts
    m, log = run([d], tok, out, **kw)
    want, _ = run([d], tok, tmp_path / "fresh2", **kw)
    assert shard_docs(out) == shard_docs(tmp_path / "fresh2") and m["counts"] == want["counts"]
    for sub in ("train", "valid", "chunks"):  # none left of the chunks past the new last one
        assert sorted(p.name for p in (out / sub).iterdir()) == sorted(p.name for p in (tmp_path / "fresh2" / sub).iterdir())
    (d / "d.jsonl").write_bytes(jsonl_bytes(DOCS[:3]))
    with pytest.raises(ValueError, match="made from other inputs or options"):
        run([d], tok, out, **kw)


def test_tokenizer_training_text_says_what_it_replaced_or_dropped(tmp_path):
    """What RobertaTokenizer.train reads counts, as preprocess does, the invalid UTF-8 and lone
    surrogates it replaced and the NUL lines and bad JSONL lines it left out, and logs them at the end."""
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok\n\n" + b"x" * documents.SNIFF_BYTES + b"\n\nbad \x00 line\nok\n")
    record = b'{"text": "lone \\ud800 here"}\n'
    (tmp_path / "b.jsonl").write_bytes(record + b"{not json\n")
    log = []
    texts = list(documents.read_documents([tmp_path], log=log.append))
    assert texts[0] == "caf\ufffd ok" and texts[-1] == "lone \ufffd here" and "ok" in texts
    assert log[-1] == ("read 4 documents, with text replaced or left out: invalid_utf8_replaced 1, "
                       f"lone_surrogates_replaced 1, nul_lines 1 (a.txt@byte{documents.SNIFF_BYTES + 11}), "
                       f"bad_json_lines 1 (b.jsonl@byte{len(record)})"), log


@pytest.mark.parametrize("how", ["escaping", "absolute"])
def test_a_save_to_disk_state_naming_a_file_outside_it_is_refused(tmp_path, how):
    """A received datasets folder must not make preprocess read (and tokenise) a file elsewhere."""
    from roberta_fast.documents import find_sources

    (tmp_path / "private.txt").write_text("secret notes\n")
    received = tmp_path / "received"
    received.mkdir()
    name = "../private.txt" if how == "escaping" else str(tmp_path / "private.txt")
    (received / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
    (received / "dataset_info.json").write_text("{}")
    with pytest.raises(ValueError, match=r"state.json': the _data_files entry .*not made by `datasets`"):
        find_sources([received], log=lambda m: None)


def test_a_file_left_out_as_damaged_from_its_start_and_then_replaced_resumes_the_run(tok, tmp_path):
    """--skip-damaged leaves out a file that cannot be read from its first bytes (it never enters the
    plan's files); replaced, the same command resumes (redoing the chunks from where it falls in the
    order) to a fresh run's shards, instead of refusing the output as "made from other inputs"."""
    d, intact = three_files(tmp_path / "in")
    (d / "b.jsonl.gz").write_bytes(intact[:10] + b"\xff" * 64 + intact[74:])  # the deflate stream's start
    out, kw = tmp_path / "out", dict(shard_mb=0.005, workers=1)
    m, _ = run([d], tok, out, skip_damaged=True, **kw)
    assert m["refused"]["damaged_files"] == [str(d / "b.jsonl.gz")]
    (d / "b.jsonl.gz").write_bytes(intact)
    m, log = run([d], tok, out, **kw)
    assert f"1 input files changed since the last run ({d / 'b.jsonl.gz'})" in log and "resuming: " in log
    want, _ = run([d], tok, tmp_path / "fresh", **kw)
    assert shard_docs(out) == shard_docs(tmp_path / "fresh") and m["counts"] == want["counts"]
    assert not m["refused"]["damaged_files"]

    with pytest.raises(ValueError, match="made from other inputs or options"):  # another order: other chunks
        run([d / "c.jsonl", d / "b.jsonl.gz", d / "a.jsonl"], tok, out, **kw)
