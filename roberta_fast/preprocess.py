"""Raw text -> a dataset directory of memory-mapped token shards.

    python -m roberta_fast.preprocess --tokenizer TOKDIR --out DATADIR INPUT...
    roberta_fast.preprocess.preprocess(inputs, tokenizer, out)    # the same from Python
    roberta_fast.preprocess.preprocess(dataset, tokenizer, out)   # a datasets.Dataset

Inputs are read by documents.py, the one reader of every format: `.txt` files (documents
separated by blank lines, or one document per file with --doc-per-file; `\r\n` line ends
read as `\n`, a lone `\r` kept as text), `.jsonl` files (one JSON object per line, the text under --text-field),
either compressed (.gz .bz2 .xz .zst, told by their bytes), Parquet and Arrow files (the
--text-field column), `datasets` save_to_disk directories, a `datasets.Dataset` (from
Python), and directories of them, searched recursively (linked folders too, each folder once;
names starting with "." skipped, and logged). A Dataset held in memory or
reindexed (shuffle, select) is first written to DATADIR/inputs/. The dataset directory holds:

    manifest.json           written last: tokenizer hash, vocab size, special ids, dtype,
                            per-split shard list, token/document counts and largest id, each shard's
                            and index's size and SHA-256 (checked by training), every
                            input count, the source files and their sizes
    tokenizer/              the tokenizer the ids belong to (RobertaTokenizer.save)
    train/NNNNN.bin         token ids, uint16 when the vocabulary fits, else uint32:
    valid/NNNNN.bin           each document's ids followed by `</s>` (= its direct
                              encoding without the leading `<s>`), documents back to back
    train/NNNNN.idx.npy     int64 offsets of the documents in the .bin (n_docs + 1)
    chunks/NNNNN.json       marks input chunk NNNNN done, with its counts (for resuming)
    plan.json               the inputs and options the shards were made from

Text is text: a literal "<mask>" or "</s>" inside a document is tokenized as characters
(tokenizers' `encode_special_tokens`), so special ids only ever come from the pipeline.
A document goes to the validation split when the CRC32 of its (first MiB of) text falls
below --valid-fraction, so the split does not depend on chunking, ordering or workers,
and duplicate documents land in the same split. A split that comes out smaller than one
batch of the tiny preset (MIN_VALID_TOKENS = 16 x 128 tokens; 168 documents at the
default 0.005 expect fewer than one) takes the documents with the next-lowest CRCs until it has that
many tokens, up to 10% of the documents (at most 64), still independent of chunking; the
report says so. Inputs that yield no document at all are an error naming them.

Streaming, bounded memory: files are read line by line in blocks of at most 1 MiB and
long documents are tokenized in pieces of about 1 MiB cut at a single space between
two words, where byte-level BPE gives the same ids as on the whole text (a piece with
no such space is cut hard; those cuts are counted). JSONL records are parsed whole.
Input is planned into chunks of about --shard-mb MB of input (compressed bytes for
compressed files, text bytes for tables) cut at document boundaries, from units that can be
read apart: byte ranges of plain files, runs of whole zstd frames (a .zst of several
frames), whole files for other compressed files (a stream cannot be entered mid-way: one
large .gz is read by one process, whose tokenizer then uses every core), Parquet row groups
and Arrow record batches. Chunks run in parallel worker processes, each writing its shards
via temporary files and renames, then its chunks/ marker. A rerun with the same inputs and options skips the
finished chunks whose shards still match the sizes and checksums in their markers (one
read of them) and redoes the others, so a rerun also repairs a damaged dataset. Input files
changed since (a damaged one replaced) are taken too: the chunks that read them, or whose input
moved with them, are redone (each marker keeps the segments it read); other input files or
options are refused unless --overwrite, and a second run on a DATADIR
that one is writing is refused (a flock on DATADIR/.preprocess.lock). DATADIR, or its train/
valid/ chunks/, may be links (the shards on another disk): --overwrite keeps the links and
removes only the run's files behind them; a linked tokenizer/ is replaced by a folder, never
written through. Ctrl-C or SIGTERM stops the
run and its workers at once, says how many chunks are done and exits 130 / 143 (as train
does); on Linux the workers are also killed when the run is (SIGKILL, the OOM killer).

Bad input never crashes the run or vanishes silently: invalid UTF-8 is replaced by
U+FFFD and counted, naming the files (as are lone surrogates escaped in JSON), empty files
and empty documents are skipped and counted, files with NUL bytes in their first 8 KiB (binary)
are refused by name, lines (JSONL records) holding a NUL byte further on (a log zero-filled after
a crash) are dropped and counted (nul_lines), undecodable JSONL lines are counted with their byte
offsets; the final report prints every count
and the manifest keeps them. A damaged file (a truncated .gz, a corrupt zstd
frame, an unreadable Parquet file) stops the run with an error naming it and how far it got
(documents, byte or row); the chunks already finished are kept, so the rerun resumes. With
--skip-damaged it is left out instead (for a zstd file of several frames: the runs of frames
that cannot be read), counted and named in the manifest's `refused`, as binary files are.
"""
from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from roberta_fast import documents
from roberta_fast.documents import MAX_EXAMPLES
from roberta_fast.integrity import HashingWriter, sha256_file
from roberta_fast.files import publish, temp_path_for, write_text_atomic
from roberta_fast.tokenizer import RobertaTokenizer

FORMAT = "roberta_fast.tokens"
VERSION = 1
BATCH_CHARS = 1 << 20  # chars per encode_batch call
LOCK_NAME = ".preprocess.lock"  # flock-ed by the run writing the directory: one run per --out
MIN_VALID_TOKENS = 16 * 128  # a valid split smaller than one batch of the tiny preset is topped up
MAX_TOP_UP = 64  # documents a top-up may add (also at most 10% of them); each chunk keeps this many candidates


# --------------------------------------------------------------------------- writing
class _ShardWriter:
    """Appends documents' ids to a temporary .bin; `close()` renames it and writes the .idx.npy."""

    def __init__(self, bin_path: Path, dtype: np.dtype):
        self.bin_path, self.dtype = bin_path, dtype
        self.tmp = temp_path_for(bin_path)
        self.f = HashingWriter(open(self.tmp, "wb"))  # the checksum, computed as the bytes go out
        self.offsets = [0]
        self.n = 0
        self.max_id = -1  # recorded in the manifest: loading checks it against the vocabulary

    def write(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self.f.write(arr.tobytes())
        self.n += arr.size
        if arr.size:
            self.max_id = max(self.max_id, int(arr.max()))

    def end_document(self) -> None:
        self.offsets.append(self.n)

    def discard(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def close(self) -> dict:
        self.f.close()
        idx_path = self.bin_path.with_name(self.bin_path.stem + ".idx.npy")
        idx_tmp = temp_path_for(idx_path)
        with open(idx_tmp, "wb") as f:
            idx = HashingWriter(f)
            np.save(idx, np.asarray(self.offsets, dtype=np.int64))
        publish(self.tmp, self.bin_path)
        publish(idx_tmp, idx_path)
        return {"tokens": self.n, "documents": len(self.offsets) - 1, "max_id": self.max_id, "bin_bytes": self.f.size,
                "bin_sha256": self.f.sha256, "idx_bytes": idx.size, "idx_sha256": idx.sha256}


def _crc(text: str) -> int:
    """The document's hash that decides its split (of its first piece: at most PIECE_CHARS chars)."""
    return zlib.crc32(text[:documents.PIECE_CHARS].encode("utf-8"))


class _Lowest:
    """The `k` lowest CRCs added, each with its [documents, tokens] (duplicates summed); bounded memory."""

    def __init__(self, k: int):
        self.k, self.counts, self.heap = k, {}, []  # heap: the kept CRCs, negated (the largest on top)

    def add(self, crc: int, tokens: int) -> None:
        if crc in self.counts:
            self.counts[crc][0] += 1
            self.counts[crc][1] += tokens
            return
        if len(self.heap) == self.k:
            if crc > -self.heap[0]:
                return
            del self.counts[-heapq.heappop(self.heap)]
        heapq.heappush(self.heap, -crc)
        self.counts[crc] = [1, tokens]

    def lowest(self) -> list[list[int]]:
        """[[crc, documents, tokens], ...] by increasing CRC."""
        return [[crc, *self.counts[crc]] for crc in sorted(self.counts)]


# worker globals (set once per process by _init_worker)
_TOKENIZER = None
_PROGRESS = None


def _init_worker(tokenizer_file: str, progress, single_threaded: bool) -> None:
    global _TOKENIZER, _PROGRESS
    if single_threaded:  # one process per core: keep the Rust core from spawning its own threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
    _TOKENIZER = RobertaTokenizer.from_pretrained(Path(tokenizer_file).parent)
    _TOKENIZER.backend.encode_special_tokens = True  # text is text: no special ids from the data
    _PROGRESS = progress


def _run_chunk(task: dict) -> dict:
    """Tokenize one chunk of input into its train/valid shards; return its counts. A damaged file
    is a DamagedInputError (the chunk's temporary shards removed), or with skip_damaged the chunk
    is redone without it and the file named in its counts."""
    damaged = list(task.get("damaged", []))  # a rerun (the valid top-up) knows them from the first run
    while True:
        segments = [s for s in task["segments"] if s[0] not in damaged]
        try:
            return _tokenize_chunk(task, segments, damaged)
        except documents.DamagedInputError as err:
            if not task["options"].get("skip_damaged"):
                raise
            damaged.append(err.path)
            print(f"preprocess: left out (--skip-damaged): {err.what}", file=sys.stderr)


def _tokenize_chunk(task: dict, segments: list, damaged: list) -> dict:
    out, index, opts = Path(task["out"]), task["index"], task["options"]
    dtype = np.dtype(task["dtype"])
    stats = documents.new_stats()
    documents._INVALID[0] = 0
    writers = {s: _ShardWriter(out / s / f"{index:05d}.bin", dtype) for s in ("train", "valid")}
    eos = _TOKENIZER.eos_id
    batch: list[tuple[str, bool, bool]] = []
    threshold = opts["valid_fraction"] * 2**32
    forced = set(task.get("forced_valid", ()))  # CRCs a top-up of the valid split moved there
    candidates = _Lowest(MAX_TOP_UP)  # the lowest CRCs of the documents not valid by their hash
    state = {"split": "train", "crc": 0, "doc_tokens": 0, "chars": 0}

    def flush():
        ids = _TOKENIZER.encode_batch([p for p, _, _ in batch], add_special_tokens=False)
        n = 0
        for (piece, first, last), piece_ids in zip(batch, ids):
            if first:
                crc = state["crc"] = _crc(piece)
                state["split"] = "valid" if crc < threshold or crc in forced else "train"
                state["doc_tokens"] = 0
            w = writers[state["split"]]
            w.write(piece_ids)
            n += len(piece_ids)
            state["doc_tokens"] += len(piece_ids) + last
            if last:
                w.write([eos])
                w.end_document()
                stats["documents"] += 1
                n += 1
                if state["crc"] >= threshold:
                    candidates.add(state["crc"], state["doc_tokens"])
                    stats["valid_added"] += state["crc"] in forced
        stats["pieces"] += len(batch)
        stats["tokens"] += n
        batch.clear()
        state["chars"] = 0
        return n

    reported = 0  # input bytes reported to the progress bar
    try:
        for path, kind, codec, start, end, weights in segments:
            source = documents.Source(path, kind, codec)
            invalid = documents._INVALID[0]
            reader = documents.SegmentReader(source, start, end, opts["text_field"], opts["doc_per_file"],
                                             stats, weights)
            docs_before = stats["documents"] + stats["empty_documents"]
            base = reader.pos()
            for piece in reader:
                if piece[1] and piece[2] and not piece[0].strip():
                    documents.note(stats, "empty_documents", reader.where())
                    continue
                batch.append(piece)
                state["chars"] += len(piece[0])
                if state["chars"] >= BATCH_CHARS:
                    n = flush()
                    _report(reader.pos() - base - reported, n)
                    reported = reader.pos() - base
            n = flush() if batch else 0
            size = _segment_bytes(start, end, weights)
            _report(size - reported, n)
            reported = 0
            if kind == "text" and start == 0 and end == source.size and \
                    stats["documents"] + stats["empty_documents"] == docs_before:
                documents.note(stats, "blank_files", path)  # only blank lines: nothing to keep
            if documents._INVALID[0] > invalid:
                documents.note(stats, "invalid_utf8_replaced", path, documents._INVALID[0] - invalid)
            stats["bytes"] += size
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    stats["shards"] = {s: w.close() for s, w in writers.items()}
    stats["candidates"], stats["forced_valid"] = candidates.lowest(), sorted(forced)
    stats["damaged_files"] = damaged
    stats["segments"] = _canonical(task["segments"])  # what it read: compared once input files changed
    stats["made_with"] = task["made_with"]  # tokenizer, dtype, options: a marker of another run is never taken
    write_text_atomic(out / "chunks" / f"{index:05d}.json", json.dumps(stats))
    return stats


def _segment_bytes(start: int, end: int, weights) -> int:
    """Input bytes of a segment: its byte range, a compressed file's size, or its table units' text bytes."""
    return sum(weights) if weights else end - start


def _report(nbytes: int, ntokens: int) -> None:
    if _PROGRESS is not None:
        _PROGRESS(nbytes, ntokens)


# --------------------------------------------------------------------------- planning
def _units(source: documents.Source, room: int, shard_bytes: int, doc_per_file: bool, text_field: str):
    """The parallel units of a source as (start, end, weights): byte ranges cut at document starts
    (plain files: the first of about `room` bytes, the others shard_bytes), runs of whole frames
    (zstd; its documents are those starting in them, see documents.SegmentReader), the whole
    file (other compressed files), or each row group / record batch (tables, weights: text bytes)."""
    if source.kind in ("parquet", "arrow"):
        for i, w in enumerate(documents.table_units(source, text_field)):
            yield i, i + 1, [w]
        return
    size = source.size
    if source.codec == "zstd" and not (doc_per_file and source.kind == "text"):
        frames = documents.zstd_frame_offsets(source.path) + [size]  # several frames: units of whole frames
        start = 0
        for offset in frames[1:]:
            if offset - start >= room or offset == size:
                yield start, offset, []
                start, room = offset, shard_bytes
        return
    if not source.splittable:
        yield 0, size, []
        return
    with open(source.path, "rb") as f:
        start = 0
        while start < size:
            end = documents.next_boundary(f, start + room, size, source.kind, doc_per_file) \
                if start + room < size else size
            end = size if end <= start else end
            yield start, end, []
            start, room = end, shard_bytes


def _plan(sources: list[documents.Source], shard_bytes: int, doc_per_file: bool, text_field: str,
          skip_damaged: bool, refused: dict, log: Callable) -> list[list]:
    """Chunks of about shard_bytes of input: lists of segments (path, kind, codec, start, end,
    weights); a chunk ends once it holds shard_bytes, a segment never crosses a document. A table
    whose metadata cannot be read is a DamagedInputError, or skipped into refused["damaged_files"]."""
    chunks, current, filled = [], [], 0
    for source in sources:
        try:
            units = list(_units(source, shard_bytes - filled, shard_bytes, doc_per_file, text_field))
        except documents.DamagedInputError as err:
            if not skip_damaged:
                raise
            log(f"left out (--skip-damaged): {err.what}")
            refused["damaged_files"].append(source.path)
            continue
        for start, end, weights in units:
            if current and current[-1][0] == source.path and weights and current[-1][4] == start:
                last = current.pop()  # consecutive table units of one file: one segment
                start, weights = last[3], last[5] + weights
            current.append((source.path, source.kind, source.codec, start, end, weights))
            filled += weights[-1] if weights else end - start
            if filled >= shard_bytes:
                chunks.append(current)
                current, filled = [], 0
    if current:
        chunks.append(current)
    return chunks


# --------------------------------------------------------------------------- driver
class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, from main) stopped the run: the message says how far it got. The
    finished chunks are kept; the rerun resumes."""


def preprocess(
    inputs: Sequence[str | os.PathLike],
    tokenizer: RobertaTokenizer | str | os.PathLike,
    out: str | os.PathLike,
    *,
    valid_fraction: float = 0.005,
    text_field: str = "text",
    doc_per_file: bool = False,
    shard_mb: float = 32,
    workers: int | None = None,
    overwrite: bool = False,
    skip_damaged: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Tokenize `inputs` (files, directories, a datasets.Dataset) into the dataset directory `out`;
    return its manifest (see module doc)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction!r}")
    if shard_mb <= 0:
        raise ValueError(f"shard_mb must be positive, got {shard_mb!r}")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if not isinstance(tokenizer, RobertaTokenizer):
        tokenizer = RobertaTokenizer.from_pretrained(tokenizer)
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {str(out)!r} is a link to {os.readlink(out)!r}, which does not exist: create that "
                         "folder, or pass another --out")
    fresh = not out.exists() or not any(_run_output(p) for p in out.iterdir())  # emptied again if no document
    files, refused = documents.find_sources(inputs, log, out / "inputs", skip_damaged)
    if not files:
        raise ValueError(documents.nothing_to_read(inputs, refused))
    options = {"valid_fraction": valid_fraction, "text_field": text_field, "doc_per_file": doc_per_file,
               "shard_mb": shard_mb, "split_special_tokens": True}
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    sources = [{"path": os.path.abspath(f.path), "kind": f.kind, **({"codec": f.codec} if f.codec else {}),
                "bytes": f.size, "mtime_ns": os.stat(f.path).st_mtime_ns} for f in files]
    plan = {"format": FORMAT, "version": VERSION, "tokenizer_hash": tokenizer.tokenizer_hash,
            "dtype": dtype, "options": options, "sources": sources}
    if refused["damaged_files"]:  # left out by --skip-damaged: a rerun with them replaced is this run's
        plan["left_out"] = sorted(os.path.abspath(p) for p in refused["damaged_files"])
    with _locked(out):  # one run per --out: a second's cleanup would delete this one's temporary files
        chunks = _plan(files, int(shard_mb * 1e6), doc_per_file, text_field, skip_damaged, refused, log)
        _prepare_out(out, plan, overwrite, chunks, log)
        tokenizer.save(out / "tokenizer")
        made_with = _made_with(plan)
        todo = [i for i in range(len(chunks)) if not _chunk_done(out, i, chunks[i], made_with, log)]
        if len(todo) < len(chunks):
            log(f"resuming: {len(chunks) - len(todo)} of {len(chunks)} chunks already done in {out}")
        run_options = {**options, "skip_damaged": skip_damaged}  # (skipping is no part of what the shards are)
        common = {"out": str(out), "dtype": dtype, "options": run_options, "made_with": made_with}
        tasks = [{**common, "index": i, "segments": chunks[i]} for i in todo]
        t0 = time.time()

        def run(tasks: list[dict]) -> None:
            _execute(tasks, str(out / "tokenizer" / "tokenizer.json"), workers, progress,
                     sum(_segment_bytes(*segment[3:]) for t in tasks for segment in t["segments"]))

        try:
            run(tasks)
            run(_top_up_valid(out, chunks, valid_fraction, log, common))
        except KeyboardInterrupt:
            done = sum((out / "chunks" / f"{i:05d}.json").exists() for i in range(len(chunks)))
            raise Interrupted(f"interrupted: {done} of {len(chunks)} chunks done; rerun the same command to resume") \
                from None
        manifest = _manifest(out, tokenizer, plan, len(chunks), refused)
        splits = manifest["splits"]
        if not splits["train"]["documents"] + splits["valid"]["documents"]:
            _print_report(manifest, time.time() - t0, log)
            if fresh:  # leave nothing that would refuse a corrected rerun ("made from other inputs")
                _remove_run_output(out)  # (links kept; an --out this run made goes with its lock)
                shutil.rmtree(out / "inputs", ignore_errors=True)
                (out / LOCK_NAME).unlink(missing_ok=True)  # (we are done with it)
            raise ValueError(documents.nothing_to_read(inputs, refused, manifest["counts"]))
        # the manifest before the report: a reader that stops at the summary (`| head`) ends this process
        # there, and must not leave a dataset without its manifest
        write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=1))
        _print_report(manifest, time.time() - t0, log)
        if not splits["valid"]["documents"]:
            log(f"warning: the valid split is empty ({splits['train']['documents']} documents, --valid-fraction "
                f"{valid_fraction}): python -m roberta_fast.train needs one; give more text or a larger --valid-fraction")
        return manifest


def _top_up_valid(out: Path, chunks: list, fraction: float, log: Callable, common: dict) -> list[dict]:
    """The chunk tasks to (re)do so that a valid split smaller than MIN_VALID_TOKENS gets more
    documents: those with the lowest CRCs, the next the hash rule would take, so that the choice,
    like the split itself, depends on neither chunking nor workers. It adds at most MAX_TOP_UP
    documents, and stops at 10% of all documents; a rerun redoes nothing."""
    markers = [json.loads((out / "chunks" / f"{i:05d}.json").read_text()) for i in range(len(chunks))]
    pool: dict[int, list[int]] = {}  # CRC -> [documents, tokens] of the train documents' lowest CRCs
    valid_docs = valid_tokens = documents = 0
    for m in markers:
        forced = set(m.get("forced_valid", []))
        documents += m["documents"]
        valid_docs += m["shards"]["valid"]["documents"]
        valid_tokens += m["shards"]["valid"]["tokens"]
        for crc, docs, tokens in m.get("candidates", []):
            pool.setdefault(crc, [0, 0])
            pool[crc][0] += docs
            pool[crc][1] += tokens
            if crc in forced:  # count the split as the hash rule alone made it
                valid_docs, valid_tokens = valid_docs - docs, valid_tokens - tokens
    hashed = (valid_docs, valid_tokens)
    room = min(MAX_TOP_UP, max(1, documents // 10)) - valid_docs if fraction > 0 and documents > 1 else 0
    chosen = set()
    for crc in sorted(pool):
        docs, tokens = pool[crc]
        if valid_tokens >= MIN_VALID_TOKENS or docs > room:
            break
        chosen.add(crc)
        room, valid_docs, valid_tokens = room - docs, valid_docs + docs, valid_tokens + tokens
    if chosen:
        log(f"the valid split had {hashed[0]} documents ({hashed[1]} tokens) at --valid-fraction {fraction}, "
            f"less than one batch ({MIN_VALID_TOKENS} tokens): moved {valid_docs - hashed[0]} documents "
            f"({valid_tokens - hashed[1]} tokens) with the next-lowest hashes into it")
    tasks = []
    for i, m in enumerate(markers):
        need = sorted(chosen & {crc for crc, _, _ in m.get("candidates", [])})
        if need != m.get("forced_valid", []):
            tasks.append({**common, "index": i, "segments": chunks[i], "forced_valid": need,
                          "damaged": m.get("damaged_files", [])})
    return tasks


def _chunk_done(out: Path, index: int, segments: list, made_with: dict, log: Callable) -> bool:
    """Whether chunk `index` is finished: its marker exists, records this run's `segments` and
    `made_with` (markers of older preprocess versions record neither) and its shards match the
    sizes and checksums recorded there (a damaged one is logged and its marker removed, to redo it)."""
    marker = out / "chunks" / f"{index:05d}.json"
    if not marker.exists():
        return False
    done = json.loads(marker.read_text())
    segments = _canonical(segments)
    if done.get("made_with", made_with) != made_with or done.get("segments", segments) != segments:
        log(f"chunk {index} was made from other inputs or options: redoing it")
        marker.unlink()
        return False
    for split, info in done["shards"].items():
        for kind, name in (("bin", f"{split}/{index:05d}.bin"), ("idx", f"{split}/{index:05d}.idx.npy")):
            file, size, digest = out / name, info.get(f"{kind}_bytes"), info.get(f"{kind}_sha256")
            if digest is None:  # a marker of an older preprocess: nothing to compare with
                continue
            if not file.is_file() or file.stat().st_size != size or sha256_file(file) != digest:
                log(f"{file} is damaged or missing: redoing chunk {index}")
                marker.unlink()
                return False
    return True


def _shard_files(out: Path, split: str, index: int, info: dict, dtype: str) -> dict:
    """A manifest's shard entry: file names, counts, largest id, sizes and checksums (computed
    here when the chunk's marker came from an older preprocess that did not record them)."""
    entry = {"bin": f"{split}/{index:05d}.bin", "idx": f"{split}/{index:05d}.idx.npy", **info}
    for kind in ("bin", "idx"):
        if f"{kind}_sha256" not in entry:
            entry[f"{kind}_bytes"] = (out / entry[kind]).stat().st_size
            entry[f"{kind}_sha256"] = sha256_file(out / entry[kind])
    if "max_id" not in entry:
        entry["max_id"] = int(np.memmap(out / entry["bin"], dtype=dtype, mode="r").max())  # (shards hold tokens)
    return entry


@contextlib.contextmanager
def _locked(out: Path):
    """Hold an exclusive flock on `out`/.preprocess.lock (made with `out`), or raise ValueError
    naming the run that holds it. (A filesystem without locks runs unlocked.) An `out` it made is
    removed again if the run leaves nothing else in it (refused, or failed before writing)."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK_NAME, "a+") as f, contextlib.ExitStack() as cleanup:
        try:
            import fcntl
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ValueError(f"another preprocess ({f.read().strip() or 'pid unknown'}) is writing to {str(out)!r}: "
                             "wait for it to end (or stop it), or pass another --out") from None
        except (ImportError, OSError):  # not POSIX, or no locks on this filesystem
            pass
        else:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
            if made:  # (only while locked: never the lock file of a run that made `out` at the same moment)
                cleanup.callback(_remove_if_only_lock, out)
        yield  # closing the file releases the lock


def _remove_if_only_lock(out: Path) -> None:
    with contextlib.suppress(OSError):
        if [p.name for p in out.iterdir()] in ([LOCK_NAME], []):
            (out / LOCK_NAME).unlink(missing_ok=True)
            out.rmdir()


def _made_with(plan: dict) -> dict:
    """A plan but its input files: format, version, tokenizer, dtype and options."""
    return {k: v for k, v in plan.items() if k not in ("sources", "left_out")}


def _changed_files(old: dict, plan: dict) -> list[str] | None:
    """The input files whose size or mtime differ between the plan `old` and `plan` of the same
    files and options (a damaged file replaced), or that one of them read and the other left out
    as damaged (--skip-damaged); None when `old` is another run's."""
    was, now = {s["path"]: s for s in old["sources"]}, {s["path"]: s for s in plan["sources"]}
    both = was.keys() & now.keys()  # read by both, in the same order (the order makes the chunks)
    if (_made_with(old) != _made_with(plan) or {*was, *old.get("left_out", [])} != {*now, *plan.get("left_out", [])}
            or [p for p in was if p in both] != [p for p in now if p in both]):
        return None
    return [path for path in {**was, **now} if was.get(path) != now.get(path)]


def _canonical(segments: list) -> list:
    """Segments as a marker keeps them (JSON, absolute paths): what a chunk read."""
    return json.loads(json.dumps([[os.path.abspath(path), *rest] for path, *rest in segments]))


def _forget_changed(out: Path, chunks: list, changed: list[str], log: Callable) -> None:
    """Remove the markers (to redo them) of the chunks that read a changed input file, or other
    segments than they will now (their input moved), and those past the last chunk with their shards."""
    log(f"{len(changed)} input files changed since the last run ({', '.join(changed[:5])}"
        f"{', ...' if len(changed) > 5 else ''}): redoing the chunks that read them")
    for marker in (out / "chunks").glob("*.json"):
        i = int(marker.stem)
        if i < len(chunks):
            segments = json.loads(marker.read_text()).get("segments")
            if segments == _canonical(chunks[i]) and not any(path in changed for path, *_ in segments):
                continue
        else:
            for name in ("train/{}.bin", "train/{}.idx.npy", "valid/{}.bin", "valid/{}.idx.npy"):
                (out / name.format(marker.stem)).unlink(missing_ok=True)
        marker.unlink()


OUTPUT_FOLDERS = ("train", "valid", "chunks", "tokenizer")
_RUN_FILE = re.compile(r"^(\d{5}\.(bin|idx\.npy|json)|\..*\.tmp)$")  # shards, markers, their temporaries


def _run_output(p: Path) -> bool:
    """Whether `p`, an entry of an output directory, holds what a run wrote: not inputs/ (a
    datasets.Dataset written out), nor an empty output folder (left by a run killed before
    plan.json, or made, or linked elsewhere, by the user beforehand)."""
    if p.name in OUTPUT_FOLDERS:
        return p.is_dir() and any(p.iterdir())
    return p.name not in ("inputs", LOCK_NAME)


def _remove_run_output(out: Path) -> None:
    """Remove what runs wrote in `out` (--overwrite, or a run that found nothing to keep). A
    train/ valid/ chunks/ that is a link (the shards on another disk) is kept and emptied of the
    run's files only; a linked tokenizer/ is unlinked, never written through. Errors are raised:
    an output that could not be removed must not be resumed as if it had been."""
    for sub in OUTPUT_FOLDERS:
        folder = out / sub
        if folder.is_symlink():
            if sub == "tokenizer" or not folder.exists():
                folder.unlink()
            else:
                for f in folder.iterdir():
                    if _RUN_FILE.match(f.name) and not f.is_dir():
                        f.unlink()
        elif folder.exists():
            shutil.rmtree(folder)
    for name in ("manifest.json", "plan.json"):
        (out / name).unlink(missing_ok=True)


def _prepare_out(out: Path, plan: dict, overwrite: bool, chunks: list, log: Callable) -> None:
    """Create the output tree, or check that an existing one is the same run (resume) or that of
    input files changed since (a damaged file replaced: the chunks they touch are forgotten), or
    refuse another run's output. plan.json is written after that, before the folders: a run killed
    in between leaves a directory its rerun knows as its own."""
    plan_file = out / "plan.json"
    for stale in out.glob(".plan.json.*.tmp"):  # a plan.json write killed half-way
        stale.unlink()

    for sub in OUTPUT_FOLDERS:
        if (out / sub).is_symlink() and not (out / sub).exists():
            raise ValueError(f"{str(out / sub)!r} is a link to {os.readlink(out / sub)!r}, which does not exist: "
                             "create that folder (the link is kept, to hold the shards elsewhere), or remove the link")
    changed = None
    if out.exists() and any(_run_output(p) for p in out.iterdir()):
        old = json.loads(plan_file.read_text()) if plan_file.exists() else None
        changed = _changed_files(old, plan) if old and not overwrite else None
        if old != plan and changed is None:
            if not overwrite:
                why = "was made from other inputs or options" if old else "is not a preprocess output"
                raise ValueError(
                    f"output directory {str(out)!r} is not empty and {why}; pass a new --out, or "
                    "--overwrite (overwrite=True) to replace it"
                )
            _remove_run_output(out)
    out.mkdir(parents=True, exist_ok=True)
    if changed:
        (out / "manifest.json").unlink(missing_ok=True)  # (written again at the end)
        _forget_changed(out, chunks, changed, log)
    write_text_atomic(plan_file, json.dumps(plan, indent=1))
    if (out / "tokenizer").is_symlink():  # written by every run: into a folder of its own, never a link's
        (out / "tokenizer").unlink()
    for sub in OUTPUT_FOLDERS:
        (out / sub).mkdir(exist_ok=True)
    for sub in ("train", "valid", "chunks"):  # leftovers of an interrupted run
        for stale in (out / sub).glob(".*.tmp"):
            stale.unlink()


def _execute(tasks: list[dict], tokenizer_file: str, workers: int, progress: bool, total: int) -> None:
    """Run the chunk tasks, in this process or a pool of spawned workers, with a progress bar."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress or not tasks,
               desc="preprocess", dynamic_ncols=True)
    t0, tokens = time.time(), [0]

    def update(nbytes: int, ntokens: int) -> None:
        tokens[0] += ntokens
        bar.update(nbytes)
        bar.set_postfix_str(f"{tokens[0] / max(time.time() - t0, 1e-9) / 1e6:.2f}M tok/s", refresh=False)

    try:
        if workers > 1 and len(tasks) > 1:
            tasks = _execute_pool(tasks, tokenizer_file, workers, update)
        if tasks:  # one worker, one task, or a pool that could not start
            _init_worker(tokenizer_file, update, single_threaded=False)
            for task in tasks:
                _run_chunk(task)
    finally:
        bar.close()


def _execute_pool(tasks: list[dict], tokenizer_file: str, workers: int, update: Callable) -> list[dict]:
    """Run tasks in spawned worker processes; return those left undone if the pool broke. On Ctrl-C
    (or SIGTERM, see main) the pending tasks are cancelled and the workers stopped at once: their
    chunks' temporary files are removed by the rerun, which redoes those chunks."""
    ctx = mp.get_context("spawn")  # no fork of a process that may hold Rust thread pools
    counters = ctx.Array("q", 2)  # bytes, tokens done: shared with the workers for the progress bar
    seen = [0, 0]
    with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx, initializer=_init_pool,
                             initargs=(tokenizer_file, counters, os.getpid())) as pool:
        with _ctrl_c_ignored():  # the workers (spawned by submit) start with it ignored, see _init_pool
            futures = {pool.submit(_run_chunk, task): task for task in tasks}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
                now = list(counters[:])
                update(now[0] - seen[0], now[1] - seen[1])
                seen = now
        except BrokenProcessPool:  # e.g. a calling script without a __main__ guard
            print("preprocess: worker processes could not run; continuing in this process", file=sys.stderr)
            return [futures[f] for f in futures if not (f.done() and f.exception() is None)]
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop now, not after the chunks running
            for process in (pool._processes or {}).values():  # (no public way to stop a running task)
                process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return []


@contextlib.contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored while the pool spawns its workers, so that they inherit it ignored from their first
    instruction: a worker still starting when Ctrl-C reaches the process group would die of it (before
    _init_pool), break the pool and stall the parent's stop. (Main thread only: signals are its.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _init_pool(tokenizer_file: str, counters, parent: int) -> None:
    """A worker: Ctrl-C is the parent's to handle (it stops the workers), and on Linux the worker
    is killed when the parent dies (SIGKILL, the OOM killer), rather than tokenizing on alone
    and holding the parent's stderr (a `| tee`) open."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(1)

    def progress(nbytes: int, ntokens: int) -> None:
        with counters.get_lock():
            counters[0] += nbytes
            counters[1] += ntokens

    _init_worker(tokenizer_file, progress, single_threaded=True)


def _manifest(out: Path, tokenizer: RobertaTokenizer, plan: dict, n_chunks: int, refused: dict) -> dict:
    """Aggregate the chunk markers into the dataset manifest."""
    counts = {k: 0 for k in documents.new_stats() if k != "examples"}
    refused = {k: list(v) for k, v in refused.items()}
    examples: dict[str, list] = {}
    splits = {s: {"tokens": 0, "documents": 0, "shards": []} for s in ("train", "valid")}
    for i in range(n_chunks):
        stats = json.loads((out / "chunks" / f"{i:05d}.json").read_text())
        for k in counts:
            counts[k] += stats.get(k, 0)  # (a marker of an older preprocess lacks the newer counts)
        for k, v in stats["examples"].items():  # (a file read in two chunks is named once)
            kept = examples.setdefault(k, [])
            kept += [e for e in v if e not in kept][: MAX_EXAMPLES - len(kept)]
        refused["damaged_files"] += [p for p in stats.get("damaged_files", []) if p not in refused["damaged_files"]]
        for s, info in stats["shards"].items():
            splits[s]["tokens"] += info["tokens"]
            splits[s]["documents"] += info["documents"]
            if info["documents"]:
                splits[s]["shards"].append(_shard_files(out, s, i, info, plan["dtype"]))
    for k, names in refused.items():
        counts[k] = len(names)
    return {
        "format": FORMAT,
        "version": VERSION,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_hash": tokenizer.tokenizer_hash,
        "tokenizer_path": "tokenizer",
        **tokenizer.special_ids,
        "dtype": plan["dtype"],
        "splits": splits,
        "counts": counts,
        "refused": refused,
        "examples": examples,
        "options": plan["options"],
        "sources": [{"path": s["path"], "bytes": s["bytes"]} for s in plan["sources"]],
    }


def _print_report(manifest: dict, seconds: float, log: Callable) -> None:
    c, sp = manifest["counts"], manifest["splits"]
    lines = [
        f"dataset: {sp['train']['documents']} train documents ({sp['train']['tokens']} tokens), "
        f"{sp['valid']['documents']} valid documents ({sp['valid']['tokens']} tokens), "
        f"{manifest['dtype']}, vocab {manifest['vocab_size']}",
        f"{len(manifest['sources'])} files, {c['bytes'] / 1e6:.2f} MB read in all; this run took {seconds:.1f} s",
    ]
    lines += [f"  {k}: {v}" for k, v in c.items()]
    for k, names in {**manifest["refused"], **manifest["examples"]}.items():
        if names:
            lines.append(f"  {k}: " + ", ".join(names[:MAX_EXAMPLES]))
    log("\n".join(lines))


def build_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m roberta_fast.preprocess`."""
    p = argparse.ArgumentParser(prog="python -m roberta_fast.preprocess", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text / JSONL files (or their .gz .bz2 .xz .zst), Parquet or Arrow "
                                             "files, datasets save_to_disk directories, or directories of them")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer directory (RobertaTokenizer.save, or roberta-base's files) or a Hub name")
    p.add_argument("--out", required=True, help="dataset directory to write (or resume)")
    p.add_argument("--valid-fraction", type=float, default=0.005, help="share of documents held out (default 0.005)")
    p.add_argument("--text-field", default="text",
                   help="JSONL field / Parquet or Arrow column holding the text (default: text)")
    p.add_argument("--doc-per-file", action="store_true",
                   help="each .txt file is one document (default: blank lines separate documents)")
    p.add_argument("--shard-mb", type=float, default=32, help="input MB per shard (default 32)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--skip-damaged", action="store_true",
                   help="leave out a damaged file (truncated, corrupt), naming it in the manifest (default: stop "
                        "with an error naming it; finished shards are kept either way)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output made from other inputs or options (default: refuse)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: show one)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stopped_by = [signal.SIGINT]

    def on_sigterm(signum, frame):  # a scheduler's SIGTERM stops the run as Ctrl-C does
        stopped_by[0] = signum
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        preprocess(args.inputs, args.tokenizer, args.out, valid_fraction=args.valid_fraction,
                   text_field=args.text_field, doc_per_file=args.doc_per_file, shard_mb=args.shard_mb,
                   workers=args.workers, overwrite=args.overwrite, skip_damaged=args.skip_damaged,
                   progress=not args.quiet)
    except (ValueError, FileNotFoundError) as err:  # FileNotFoundError: a tokenizer name the Hub lacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # 130 for SIGINT, 143 for SIGTERM, as train exits
        print(err if isinstance(err, Interrupted) else "interrupted; rerun the same command to resume",
              file=sys.stderr)
        return 128 + stopped_by[0]
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
