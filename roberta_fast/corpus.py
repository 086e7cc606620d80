"""The embedded default corpus: English from the Python installation itself, built offline.

    path = roberta_fast.corpus.default_dataset()        # a dataset directory (see preprocess.py)
    ds = roberta_fast.data.PretrainingDataset(path)       # its tokenizer is in path / "tokenizer"

So that `python -m roberta_fast.train` trains on real text on a fresh machine with no
network, the corpus is made from the documentation every CPython carries: the
`pydoc_data` help topics (one document per topic) and the docstrings of the standard
library's source files (one document per module: its docstring, then its classes' and
functions' docstrings), read with `ast` so that no module is imported. Test packages,
idlelib and site-packages are left out. About 2 MB of English on CPython 3.11.

It is a demonstration corpus, far too small to pretrain a useful model: point the
trainer at real text by preprocessing it (`python -m roberta_fast.preprocess`).

`default_dataset(cache_dir=None, vocab_size=8192)` builds, once, under `cache_dir`
(default $ROBERTA_FAST_CACHE, else ~/.cache/roberta_fast):
    corpus-py3.X-v1.jsonl                  the documents, {"text": ...} per line
    default-py3.X-v1-vocab8192/            the dataset directory it returns, holding
        tokenizer/                         a byte-level BPE trained on the corpus
        manifest.json, train/, valid/      the token shards (2% of documents held out)
Each part is built under a temporary name and renamed into place, so an interrupted or
concurrent build never leaves a half-made cache; a later call returns at once. The
tokenizer may come out a little smaller than `vocab_size` when the corpus runs out of
merges: models must take `manifest["vocab_size"]`. Building takes ~15 s on 2 cores.
"""
from __future__ import annotations

import ast
import json
import multiprocessing
import os
import shutil
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator

from roberta_fast.files import atomic_path, temp_dir_for

CORPUS_VERSION = 1
MAX_BYTES = 8_000_000  # cap on the corpus text (the stdlib gives about 2 MB)
VALID_FRACTION = 0.02
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
_TAG = f"py{sys.version_info.major}.{sys.version_info.minor}-v{CORPUS_VERSION}"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default corpus lives: cache_dir, else $ROBERTA_FAST_CACHE, else ~/.cache/roberta_fast."""
    if cache_dir is None:
        cache_dir = os.environ.get("ROBERTA_FAST_CACHE") or Path.home() / ".cache" / "roberta_fast"
    return Path(cache_dir)


def _module_docs(path: Path) -> str:
    """The docstrings of a source file, module first, without importing it ('' if none or unparsable)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc.split()) >= 3:
                docs.append(doc.strip())
    return "\n\n".join(docs)


def iter_documents(max_bytes: int = MAX_BYTES) -> Iterator[str]:
    """The corpus documents in a fixed order, up to about max_bytes of UTF-8."""
    total = 0

    def take(text: str) -> bool:
        nonlocal total
        total += len(text.encode("utf-8"))
        return total <= max_bytes

    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it; the docstrings remain
        topics = {}
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            if not take(text):
                return
            yield text
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        paths += [Path(root) / name for name in sorted(names) if name.endswith(".py")]
    for text in _parse_all(paths):
        if text:
            if not take(text):
                return
            yield text


def _parse_all(paths: list[Path]) -> Iterator[str]:
    """_module_docs of each path, in order; parsing is the slow part, so it is spread over the cores."""
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    done = 0
    if workers > 1:
        pool = ProcessPoolExecutor(min(workers, 16), mp_context=multiprocessing.get_context("spawn"))
        try:
            for text in pool.map(_module_docs, paths, chunksize=8):
                yield text
                done += 1
        except BrokenProcessPool:  # e.g. a calling script without a __main__ guard: go serial
            pass
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    for path in paths[done:]:
        yield _module_docs(path)


def build_corpus(path: str | os.PathLike, max_bytes: int = MAX_BYTES) -> Path:
    """Write the corpus documents to `path` as JSONL ({"text": ...} per line), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for doc in iter_documents(max_bytes):
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return path


def default_dataset(cache_dir: str | os.PathLike | None = None, vocab_size: int = 8192,
                    max_bytes: int = MAX_BYTES, progress: bool = False) -> Path:
    """The dataset directory of the embedded corpus, built and cached on first use (see module doc)."""
    from roberta_fast.preprocess import preprocess
    from roberta_fast.tokenizer import RobertaTokenizer

    root = cache_root(cache_dir)
    size_tag = "" if max_bytes == MAX_BYTES else f"-{max_bytes}B"
    final = root / f"default-{_TAG}{size_tag}-vocab{vocab_size}"
    if (final / "manifest.json").is_file():
        return final
    corpus = root / f"corpus-{_TAG}{size_tag}.jsonl"
    if not corpus.is_file():
        build_corpus(corpus, max_bytes)
    root.mkdir(parents=True, exist_ok=True)
    work = temp_dir_for(final)
    try:
        docs = (json.loads(line)["text"] for line in corpus.open(encoding="utf-8"))
        tokenizer = RobertaTokenizer.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2)
        preprocess([corpus], tokenizer, work, valid_fraction=VALID_FRACTION, progress=progress,
                   log=lambda msg: None)
        try:
            os.rename(work, final)
        except OSError:  # another process finished first: keep its copy
            if not (final / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(default_dataset(progress=True))
