"""roberta_fast.corpus: the embedded corpus is English, read without imports, built once and cached.

The caching tests build a small slice of the corpus (max_bytes) to stay fast; one test
builds the full default dataset (~10 s on 2 cores).
"""
import json
import os
import stat
import time

from roberta_fast import corpus
from roberta_fast.data import PretrainingDataset, check_dataset
from roberta_fast.tokenizer import RobertaTokenizer


def test_documents_are_english_and_deterministic():
    docs = list(corpus.iter_documents(max_bytes=300_000))
    assert docs == list(corpus.iter_documents(max_bytes=300_000))
    assert len(docs) > 20 and sum(len(d.encode()) for d in docs) <= 300_000
    words = " ".join(docs).lower().split()
    assert words.count("the") > 0.02 * len(words)  # prose, not code
    assert all(d.strip() == d and d for d in docs)


def test_docstrings_are_read_without_importing(tmp_path):
    marker = tmp_path / "imported"
    src = tmp_path / "sidefx.py"
    src.write_text(
        f'"""Module docstring with several words."""\nopen({str(marker)!r}, "w").write("x")\n'
        'class A:\n    """Class docstring: also words."""\n    def f(self):\n        """Method doc is kept too."""\n'
        'def g():\n    "no"\n'
    )
    text = corpus._module_docs(src)
    assert not marker.exists()
    assert text == "Module docstring with several words.\n\nClass docstring: also words.\n\nMethod doc is kept too."
    (tmp_path / "broken.py").write_text("def (:\n")
    assert corpus._module_docs(tmp_path / "broken.py") == ""


def test_default_dataset_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ROBERTA_FAST_CACHE", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    old_umask = os.umask(0o022)
    try:
        path = corpus.default_dataset(vocab_size=700, max_bytes=200_000)
    finally:
        os.umask(old_umask)
    # built in a temporary directory (mkdtemp: 0700), yet as readable as a plain mkdir would make it
    assert {stat.S_IMODE(p.stat().st_mode) for p in [path, *path.rglob("*")] if p.is_dir()} == {0o755}
    assert {stat.S_IMODE(p.stat().st_mode) for p in path.parent.rglob("*") if p.is_file()} == {0o644}
    assert path.parent == tmp_path / "cache" and (path / "manifest.json").is_file()
    stamp = (path / "manifest.json").stat().st_mtime_ns
    t1 = time.perf_counter()
    assert corpus.default_dataset(vocab_size=700, max_bytes=200_000) == path
    assert (path / "manifest.json").stat().st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no leftovers
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["vocab_size"] == 700 and manifest["splits"]["train"]["tokens"] > 30_000
    tok = RobertaTokenizer.from_pretrained(path / "tokenizer")
    check_dataset(path, vocab_size=700, tokenizer=tok)
    ds = PretrainingDataset(path, seq_len=128)
    assert len(ds) > 200 and ds[0][0] == tok.bos_id
    assert "the" in tok.decode(ds[3].tolist()).lower().split()
    assert t1 - t0 < 60


def test_cache_dir_argument_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("ROBERTA_FAST_CACHE", str(tmp_path / "env"))
    assert corpus.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert corpus.cache_root() == tmp_path / "env"
    monkeypatch.delenv("ROBERTA_FAST_CACHE")
    assert corpus.cache_root().name == "roberta_fast"


def test_full_default_dataset(tmp_path):
    """What `python -m roberta_fast.train` trains on by default: well under a minute to build."""
    t0 = time.perf_counter()
    path = corpus.default_dataset(cache_dir=tmp_path)
    assert time.perf_counter() - t0 < 60
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["vocab_size"] == 8192 and manifest["counts"]["bytes"] > 1_000_000
    assert manifest["splits"]["train"]["tokens"] > 300_000 and manifest["splits"]["valid"]["documents"] > 0
