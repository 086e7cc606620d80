"""Training samples and batches from a preprocessed dataset directory (roberta_fast.preprocess).

    ds = PretrainingDataset(path, split="train", seq_len=512, mode="full")  # or "doc"
    ds[i]                   # (seq_len,) int64 ids; rows shorter than seq_len end in <pad>
    ds.sample(i)            # numpy dict: input_ids, attention_mask[, word_starts, position_ids, cu_seqlens]
    ds.batch(indices)       # those samples as (B, S) tensors, their ids asked of the disk at once
    ds.manifest             # vocab_size, tokenizer_hash, bos/pad/eos/unk/mask_id, counts, ...
    ds.tokenizer_path       # the tokenizer directory the ids belong to
    dataset_tokenizer(path) # its RobertaTokenizer, checked against the manifest's tokenizer_hash
    check_dataset(path, vocab_size=cfg.vocab_size, tokenizer=tok)  # ValueError on mismatch
    loader = BatchLoader(ds, batch_size=16, seed=0, rank=r, world_size=w)
    for batch in loader: ...  # {"input_ids", "attention_mask"[, "word_starts"]}: (B, S) tensors
    loader.forever()          # the same across epochs, without end
    loader.state_dict() / loader.load_state_dict(sd)  # {epoch, step, samples_seen, ...}: O(1) resume

Integrity: opening a split checks the manifest against itself and the files (a stat per
file, the index's header and last offset): the dtype holds the vocabulary's ids, each
shard's token count times the dtype's size is its recorded and its actual size, its
index ends at its token count, and its largest id (recorded by preprocess) fits the
vocabulary, so a lying manifest is refused rather than read as garbage ids (a manifest
of an older preprocess has no largest id: verify_checksums says so; rerunning preprocess
adds it). `verify_checksums(path)` checks the SHA-256 the manifest records for each
file, one sequential read of the dataset (the trainer does it at start unless
--no-data-checksums: for storage that already guarantees integrity, where reading
petabytes at each start costs more than it protects). A damaged file is named with the
fix: rerun the preprocess command that made the dataset, which checks its finished
shards and redoes the damaged ones.

Access cost: a "full" sample is a slice of the memory-mapped shards (a binary search over
the handful of shard offsets). The shards are read at random, so they are mapped with
MADV_RANDOM (a missed page costs one page, not the disk's read-ahead window), and a batch
first asks the OS for all its samples' pages at once (MADV_WILLNEED), so a batch read from
a cold disk waits about one disk latency, not one per sample (benchmarks/bench_loader.py).
A "doc" sample adds two binary searches (its shard, its document) over the document index,
which the dataset loads once (8 bytes per document: its offset in its shard and its first run,
each a uint32 unless a shard holds 2^32 ids or more); pack=True also plans the packing once at
construction (a pass over the documents, ~1 s per 10M of them; 8 bytes per packed row).

Sample layouts (the RoBERTa paper's input formats; S = seq_len):
- mode="full" (FULL-SENTENCES, the default): the split's token stream (every document's
  ids followed by `</s>`, documents back to back, so a `</s>` separates documents) is cut
  into consecutive runs of S-1 tokens, each row `<s>` + run. Rows cross document
  boundaries; only the last row of the split can be short (padded).
- mode="doc" (DOC-SENTENCES): rows never cross a document boundary. A document is cut
  into runs of S-2 tokens and each run becomes `<s>` + run + `</s>`. With pack=False each
  run is a row, padded; with pack=True runs are packed in order into rows of S (next
  fit), and `sample(i)` adds `position_ids` that restart at every run (RoBERTa's
  convention: pad_id + 1 + offset, pad_id on padding) and `cu_seqlens`, the run
  boundaries inside the row, so attention can be kept inside each document. Batches of
  packed rows carry `position_ids` (B, S), `cu_seqlens` over the flattened B*S tokens
  (each run one segment, each row's padding tail another) and `max_seqlen`.

Word starts (`word_starts=True`): the rule of RobertaTokenizer.word_starts, applied to
each row (the first token after `<s>` counts as a word start even mid-word in "full" mode).

Order: BatchLoader visits a permutation of the samples drawn from (seed, epoch) by a
keyed Feistel network with cycle walking, so the i-th sample of an epoch is computed
in O(1) time and memory, no permutation array is stored, and resuming skips straight to
the next batch. Micro-step t of an epoch is permuted positions [t*B*W, (t+1)*B*W)
(B = batch_size per rank, W = world_size); rank r takes positions t*B*W + r*B + k,
k < B, so ranks are disjoint and together complete, and a sample's position does not
depend on how its optimizer step's G = B*W*A samples (A = accum_steps micro-steps) are
split over ranks and micro-steps. An epoch is a whole number of optimizer steps, so the
same G visits the same samples in the same steps whatever the split, and a run resumes
at another world size. drop_last=True drops the epoch's final partial optimizer step;
drop_last=False completes it by wrapping round to the epoch's first samples (as torch's
DistributedSampler does), so every rank takes the same number of steps. Batches are
built in a background thread `prefetch` batches ahead, in pinned memory when CUDA is
available.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import mmap
import queue
import threading
from pathlib import Path

import numpy as np
import torch

FORMAT, VERSION = "roberta_fast.tokens", 1
# what training reads of a manifest: one missing is a damaged manifest, not a KeyError
MANIFEST_KEYS = ("vocab_size", "tokenizer_hash", "bos_id", "pad_id", "eos_id", "unk_id", "mask_id", "dtype", "splits")
PACK_CHUNK = 1 << 20  # documents planned per step of pack=True planning (PretrainingDataset._pack_runs)
REPAIR = ("rerun the `python -m roberta_fast.preprocess` command that made it (same inputs and --out): it "
          "checks the finished shards and redoes the damaged ones")


# --------------------------------------------------------------------------- manifest
def load_manifest(path: str | Path) -> dict:
    """The manifest.json of a dataset directory; ValueError naming the fix if it is not one."""
    path = Path(path)
    file = path / "manifest.json"
    if not file.is_file():
        raise ValueError(
            f"{str(path)!r} is not a preprocessed dataset (no manifest.json); make one with "
            "`python -m roberta_fast.preprocess --tokenizer TOKDIR --out DIR INPUT...` "
            "(an interrupted run resumes when rerun)"
        )
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:  # truncated or overwritten (UnicodeDecodeError included)
        raise _damaged(file, f"is not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise _damaged(file, f"holds a {type(manifest).__name__}, not a manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{str(file)!r} is format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"this roberta_fast reads {FORMAT!r} version {VERSION}: rerun roberta_fast.preprocess"
        )
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise _damaged(file, f"lacks {', '.join(missing)}")
    return manifest


def dataset_tokenizer(path: str | Path, manifest: dict | None = None):
    """The RobertaTokenizer a dataset's ids belong to (its tokenizer/ folder), checked against the
    manifest's tokenizer_hash, so that a model trained on the ids is never exported with another
    tokenizer. ValueError naming the folder and the fix if it is missing, unreadable or another one."""
    from .tokenizer import RobertaTokenizer

    path = Path(path)
    manifest = manifest if manifest is not None else load_manifest(path)
    directory = _member(path, manifest.get("tokenizer_path", "tokenizer"), "tokenizer_path")
    if not directory.is_dir():  # checked first: a relative path would otherwise be tried as a Hub name
        raise _damaged(directory, "is missing (the tokenizer the dataset's ids belong to)")
    try:
        tokenizer = RobertaTokenizer.from_pretrained(directory)
    except ValueError as err:
        raise _damaged(directory, f"cannot be loaded ({err})") from None
    if tokenizer.tokenizer_hash != manifest["tokenizer_hash"]:
        raise _damaged(directory, f"holds tokenizer {tokenizer.tokenizer_hash[:12]}, not the tokenizer "
                                  f"{manifest['tokenizer_hash'][:12]} the dataset was made with")
    return tokenizer


def check_dataset(dataset, *, vocab_size: int | None = None, tokenizer=None) -> dict:
    """Refuse (ValueError) a dataset whose ids do not belong to `tokenizer` or a model of `vocab_size`.

    `dataset` is a directory, a manifest dict or a PretrainingDataset; returns the manifest.
    """
    if isinstance(dataset, PretrainingDataset):
        manifest = dataset.manifest
    elif isinstance(dataset, dict):
        manifest = dataset
    else:
        manifest = load_manifest(dataset)
    if vocab_size is not None and int(vocab_size) != manifest["vocab_size"]:
        raise ValueError(
            f"the dataset was tokenized with a vocabulary of {manifest['vocab_size']} ids but the model has "
            f"vocab_size={vocab_size}; set the model's vocab_size to {manifest['vocab_size']} or preprocess "
            "the text again with the model's tokenizer"
        )
    if tokenizer is not None:
        if not hasattr(tokenizer, "tokenizer_hash"):
            from roberta_fast.tokenizer import RobertaTokenizer

            tokenizer = RobertaTokenizer.from_pretrained(tokenizer)
        if tokenizer.tokenizer_hash != manifest["tokenizer_hash"]:
            raise ValueError(
                f"the dataset was tokenized with tokenizer {manifest['tokenizer_hash'][:12]} but the given "
                f"tokenizer is {tokenizer.tokenizer_hash[:12]}; use the dataset's own tokenizer "
                "(<dataset>/tokenizer) or preprocess the text again with this one"
            )
    return manifest


# --------------------------------------------------------------------------- integrity
def _damaged(file: Path, what: str) -> ValueError:
    return ValueError(f"{str(file)!r} {what}: the dataset is damaged; {REPAIR}")


def _member(root: Path, name, entry: str) -> Path:
    """`root / name` for a file the manifest names; ValueError if it lies outside the dataset directory."""
    from .files import inside

    return inside(root, name, f"{str(root / 'manifest.json')!r}: {entry}",
                  f"the dataset is damaged or was not made by roberta_fast.preprocess; {REPAIR}")


def _check_size(file: Path, expected: int) -> None:
    if not file.is_file():
        raise _damaged(file, "is missing")
    if file.stat().st_size != expected:
        raise _damaged(file, f"should hold {expected} bytes but holds {file.stat().st_size}")


def _check_index(file: Path, shard: dict) -> None:
    """The document index of a shard: its recorded size, a readable header of n_docs + 1
    offsets, and a last offset that is the shard's token count."""
    if "idx_bytes" in shard:
        _check_size(file, shard["idx_bytes"])
    try:
        offsets = np.load(file, mmap_mode="r")  # (n_docs + 1,): reads the header and, below, one value
    except (OSError, ValueError) as err:
        raise _damaged(file, f"cannot be read ({err})") from None
    if offsets.shape != (shard["documents"] + 1,):
        raise _damaged(file, f"holds {offsets.shape} offsets instead of ({shard['documents'] + 1},)")
    if int(offsets[-1]) != shard["tokens"]:
        raise _damaged(file, f"ends its documents at token {int(offsets[-1])}, but the manifest says the shard "
                             f"holds {shard['tokens']} tokens")


def _token_dtype(manifest: dict, root: Path) -> np.dtype:
    """The manifest's id dtype; ValueError unless it is an unsigned integer type wide enough
    for every id of the manifest's vocabulary (a lying dtype reads garbage ids)."""
    vocab = manifest["vocab_size"]
    try:
        dtype = np.dtype(manifest["dtype"])
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "u" or np.iinfo(dtype).max < vocab - 1:
        raise _damaged(root / "manifest.json", f"says the ids are {manifest['dtype']!r}, which cannot hold the "
                                               f"ids of its {vocab}-id vocabulary (preprocess writes uint16, or "
                                               "uint32 past 65536 ids)")
    return dtype


def _check_shard(root: Path, shard: dict, dtype: np.dtype, vocab_size: int) -> None:
    """A shard against its manifest entry: the byte size the manifest records, the token count
    times the dtype's size and the file's size agree; its index ends at the token count; its
    largest id (recorded by preprocess) fits the vocabulary."""
    file = _member(root, shard["bin"], "the shard bin file")
    size = shard["tokens"] * dtype.itemsize
    if shard.get("bin_bytes", size) != size:
        raise _damaged(root / "manifest.json", f"records {shard['bin_bytes']} bytes for {shard['bin']}, but "
                                               f"{shard['tokens']} tokens of {dtype} are {size} bytes")
    _check_size(file, size)
    _check_index(_member(root, shard["idx"], "the shard idx file"), shard)
    if shard.get("max_id", -1) >= vocab_size:
        raise _damaged(root / "manifest.json", f"says {shard['bin']} holds ids up to {shard['max_id']}, past its "
                                               f"{vocab_size}-id vocabulary")


def verify_checksums(path: str | Path, log=print) -> None:
    """Check every shard and index of a dataset against the SHA-256 its manifest records;
    ValueError naming every damaged file and the fix. One sequential read of the dataset."""
    from .integrity import sha256_file

    path = Path(path)
    manifest = load_manifest(path)
    bad, unrecorded, no_max = [], 0, 0
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            no_max += "max_id" not in shard
            for kind in ("bin", "idx"):
                expected = shard.get(f"{kind}_sha256")
                file = _member(path, shard[kind], f"the shard {kind} file")
                if expected is None:
                    unrecorded += 1
                elif not file.is_file():
                    bad.append(f"{shard[kind]} (missing)")
                elif sha256_file(file) != expected:
                    bad.append(f"{shard[kind]} (checksum mismatch)")
    if bad:
        raise ValueError(f"the dataset {str(path)!r} is damaged: {', '.join(bad)}; {REPAIR}")
    if unrecorded:
        log(f"note: the manifest of {path} records no checksums for {unrecorded} files (made by an older "
            "roberta_fast.preprocess): only their sizes were checked; rerun preprocess to add them")
    if no_max:
        log(f"note: the manifest of {path} records no largest id for {no_max} shards (made by an older "
            "roberta_fast.preprocess): their ids are not checked against the vocabulary; rerun preprocess to add it")


# --------------------------------------------------------------------------- token stream
def _map_file(file: Path) -> mmap.mmap:
    """A shard file memory-mapped read-only and advised as read at random (MADV_RANDOM): a
    missed page then costs one page, not the device's read-ahead window (up to megabytes: with
    8 MB a cold shuffled batch of 64 x 512 ids took 20x longer)."""
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the file object
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


class TokenStream:
    """The shards of one split as one virtual array of ids (memory-mapped), with its document index."""

    def __init__(self, root: Path, manifest: dict, split: str):
        if split not in manifest["splits"]:
            raise ValueError(f"split must be one of {sorted(manifest['splits'])}, got {split!r}")
        self.root, self._dtype, self._info = root, _token_dtype(manifest, root), manifest["splits"][split]["shards"]
        for shard in self._info:
            _check_shard(root, shard, self._dtype, manifest["vocab_size"])
        self._map_shards()
        sizes = [shard["tokens"] for shard in self._info]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (n_shards + 1,)

    def _map_shards(self) -> None:
        self._maps = [_map_file(self.root / shard["bin"]) if shard["tokens"] else b""  # (an empty file cannot
                      for shard in self._info]                                          # be mapped)
        self.shards = [np.frombuffer(m, dtype=self._dtype, count=shard["tokens"])
                       for m, shard in zip(self._maps, self._info)]

    def __getstate__(self) -> dict:
        """Pickled (e.g. for a spawned DataLoader worker) without its memory maps, which the copy
        makes again: a map cannot be pickled, and an array of its ids would be copied whole."""
        return {**self.__dict__, "_maps": None, "shards": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map_shards()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _pieces(self, start: int, stop: int):
        """(shard, lo, hi) for each shard's part of the stream's ids [start, stop), in order (hi > lo:
        an empty shard inside the range has no part)."""
        start, stop = max(0, start), min(stop, len(self))
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - int(self.starts[s])
            hi = min(stop, int(self.starts[s + 1])) - int(self.starts[s])
            if hi > lo:
                yield s, lo, hi
            pos += hi - lo
            s += 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop) of the stream as int64, across shard boundaries."""
        out = np.empty(max(0, min(stop, len(self)) - max(0, start)), dtype=np.int64)
        at = 0
        for s, lo, hi in self._pieces(start, stop):
            out[at: at + hi - lo] = self.shards[s][lo:hi]
            at += hi - lo
        return out

    def will_need(self, ranges) -> None:
        """Ask the OS to read the ids of these [start, stop) ranges now, all at once (madvise
        WILLNEED), before they are copied. A cold page of a memory map is otherwise read when
        touched, one disk wait after another: a shuffled batch touches B places of the corpus."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        for start, stop in ranges:
            for s, lo, hi in self._pieces(start, stop):
                item = self.shards[s].itemsize
                first = lo * item // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages
                self._maps[s].madvise(mmap.MADV_WILLNEED, first, hi * item - first)

    @property
    def fingerprint(self) -> str | None:
        """SHA-256 over the SHA-256s the manifest records for the split's files: the content's identity
        wherever the dataset lies (a copy has the same); None if the manifest records none."""
        digests = [shard.get(f"{kind}_sha256") for shard in self._info for kind in ("bin", "idx")]
        return None if None in digests else hashlib.sha256(" ".join(digests).encode()).hexdigest()

    def doc_offsets(self, s: int) -> np.ndarray:
        """(n_docs + 1,) int64 offsets of shard s's documents in the shard (each ends with its `</s>`)."""
        return np.load(self.root / self._info[s]["idx"])


# --------------------------------------------------------------------------- dataset
def _narrow(counts: np.ndarray) -> np.ndarray:
    """Non-negative counts as uint32 where they fit (a shard's offsets and runs almost always do),
    int64 otherwise: the document index is kept per rank, so its width is memory times ranks."""
    return counts.astype(np.uint32 if not len(counts) or int(counts.max()) < 1 << 32 else np.int64)


class PretrainingDataset:
    """Fixed-length MLM samples from a dataset directory; see the module docstring for the layouts."""

    def __init__(self, path: str | Path, split: str = "train", seq_len: int = 512, mode: str = "full",
                 pack: bool = False, word_starts: bool = False):
        if mode not in ("full", "doc"):
            raise ValueError(f"mode must be 'full' (FULL-SENTENCES) or 'doc' (DOC-SENTENCES), got {mode!r}")
        if pack and mode != "doc":
            raise ValueError("pack=True packs whole documents and needs mode='doc'")
        if not isinstance(seq_len, int) or seq_len < 3:
            raise ValueError(f"seq_len must be an int >= 3 (<s>, a token, </s>), got {seq_len!r}")
        self.path = Path(path).absolute()  # (a pickled copy may be opened from another directory)
        self.manifest = load_manifest(self.path)
        self.tokenizer_path = _member(self.path, self.manifest.get("tokenizer_path", "tokenizer"), "tokenizer_path")
        self.split, self.seq_len, self.mode, self.pack = split, seq_len, mode, pack
        self.stream = TokenStream(self.path, self.manifest, split)
        m = self.manifest
        self.bos_id, self.pad_id, self.eos_id = m["bos_id"], m["pad_id"], m["eos_id"]
        self.mask_id, self.vocab_size = m["mask_id"], m["vocab_size"]
        self._tables = None
        self.word_starts = word_starts
        if mode == "full":
            self._n = math.ceil(len(self.stream) / (seq_len - 1))
        else:
            body = seq_len - 2
            shards = range(len(self.stream.shards))
            # per shard, (n_docs + 1,) each: its documents' offsets in it and their first runs
            self._doc_offsets = [_narrow(self.stream.doc_offsets(s)) for s in shards]
            self._doc_runs = [_narrow(np.concatenate([[0], np.cumsum(-(-self._doc_lengths(s) // body))]))
                              for s in shards]  # (ceil: a document's runs)
            self._shard_runs = [0, *itertools.accumulate(int(first_runs[-1]) for first_runs in self._doc_runs)]
            self._n = self._shard_runs[-1]  # (the shards' first runs: n_shards + 1 Python ints)
            if pack:
                self._rows = self._pack_runs(map(self._doc_lengths, shards), self._n, body)
                self._n = len(self._rows) - 1

    def __len__(self) -> int:
        return self._n

    # ---- runs (DOC-SENTENCES)
    def _doc_lengths(self, s: int) -> np.ndarray:
        """(n_docs,) int64 lengths of shard s's documents, without their `</s>`."""
        return np.diff(self._doc_offsets[s].astype(np.int64)) - 1

    def _run_span(self, k: int) -> tuple[int, int]:
        """The stream ids [lo, hi) of run k: up to S-2 ids of one document (not its `</s>`)."""
        s = bisect.bisect_right(self._shard_runs, k) - 1  # its shard (empty ones skipped)
        k -= self._shard_runs[s]
        first_runs, offsets = self._doc_runs[s], self._doc_offsets[s]
        # its document in the shard (a key of the array's dtype: another would convert the whole array)
        d = int(first_runs.searchsorted(first_runs.dtype.type(k), "right")) - 1
        body = self.seq_len - 2
        lo = int(self.stream.starts[s]) + int(offsets[d]) + (k - int(first_runs[d])) * body
        end = int(self.stream.starts[s]) + int(offsets[d + 1]) - 1  # the document's </s>
        return lo, min(end, lo + body)

    def _run(self, k: int) -> np.ndarray:
        """Run k: `<s>` + its ids + `</s>`."""
        return np.concatenate([[self.bos_id], self.stream.read(*self._run_span(k)), [self.eos_id]])

    def _pack_runs(self, lengths, n_runs: int, body: int) -> np.ndarray:
        """(n_rows + 1,) first run of each packed row: runs in order, next fit into rows of S.
        `lengths`: arrays of the documents' lengths without their `</s>`, in stream order (one
        per shard); n_runs: their runs of `body` ids in all.

        Documents are planned PACK_CHUNK at a time: next fit is sequential (a Python loop), and
        only one chunk's run lengths exist as Python ints, so planning needs the result, a shard's
        lengths and O(chunk), not ~60 bytes per document."""
        if n_runs == 0:
            return np.zeros(1, dtype=np.int64)
        rows = np.empty(n_runs + 1, dtype=np.int64)  # at most one row per run
        rows[0], n_rows, fill, k = 0, 1, 0, 0
        for lengths_c in (part[a:a + PACK_CHUNK] for part in lengths for a in range(0, len(part), PACK_CHUNK)):
            runs_c = -(-lengths_c // body)
            # run lengths incl. <s> and </s>: full runs of body, then each document's remainder
            run_len = np.full(int(runs_c.sum()), body + 2, dtype=np.int64)
            some = runs_c > 0
            run_len[np.cumsum(runs_c)[some] - 1] = lengths_c[some] - (runs_c[some] - 1) * body + 2
            for n in run_len.tolist():
                if fill + n > self.seq_len:
                    rows[n_rows] = k
                    n_rows += 1
                    fill = 0
                fill += n
                k += 1
        rows[n_rows] = n_runs
        rows.resize(n_rows + 1, refcheck=False)  # shrinks in place
        return rows

    # ---- samples
    def _check_index(self, i: int) -> int:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"dataset index must be an int, got {type(i).__name__}")
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} out of range for a dataset of {self._n} samples")
        return int(i)

    def _parts(self, i: int) -> list[np.ndarray]:
        """The int64 id runs that make up sample i (one, or several when packed)."""
        if self.mode == "full":
            step = self.seq_len - 1
            return [np.concatenate([[self.bos_id], self.stream.read(i * step, (i + 1) * step)]).astype(np.int64)]
        if not self.pack:
            return [self._run(i)]
        return [self._run(k) for k in range(self._rows[i], self._rows[i + 1])]

    def _span(self, i: int) -> tuple[int, int]:
        """The stream ids [lo, hi) that sample i reads (a packed row's runs lie one after another)."""
        if self.mode == "full":
            return i * (self.seq_len - 1), (i + 1) * (self.seq_len - 1)
        first, last = (i, i) if not self.pack else (int(self._rows[i]), int(self._rows[i + 1]) - 1)
        return self._run_span(first)[0], self._run_span(last)[1]

    def batch(self, indices) -> dict:
        """Samples `indices` collated into (B, S) tensors (see collate). Their ids are asked of
        the disk all at once first, so a cold batch waits for the disk about once, not B times."""
        indices = [self._check_index(i) for i in indices]
        self.stream.will_need([self._span(i) for i in indices])
        return collate([self.sample(i) for i in indices], self.seq_len)

    def row(self, i: int) -> np.ndarray:
        """Ids of sample i as a numpy int64 array of up to seq_len (unpadded)."""
        parts = self._parts(self._check_index(i))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, i: int) -> torch.Tensor:
        """(seq_len,) int64 ids of sample i, padded with pad_id."""
        return torch.from_numpy(self.sample(i)["input_ids"])

    def sample(self, i: int) -> dict:
        """Sample i as numpy arrays: input_ids, attention_mask (seq_len,), and word_starts /
        position_ids / cu_seqlens where they apply."""
        parts = self._parts(self._check_index(i))
        ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        n, S = len(ids), self.seq_len
        out_ids = np.full(S, self.pad_id, dtype=np.int64)
        out_ids[:n] = ids
        mask = np.zeros(S, dtype=np.int64)
        mask[:n] = 1
        out = {"input_ids": out_ids, "attention_mask": mask}
        if self.word_starts:
            from roberta_fast.tokenizer import word_starts_from_tables

            starts = np.zeros(S, dtype=bool)
            starts[:n] = word_starts_from_tables(ids, *self._word_tables())
            out["word_starts"] = starts
        if self.pack:
            cu = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)
            pos = np.full(S, self.pad_id, dtype=np.int64)
            for a, b in zip(cu[:-1], cu[1:]):
                pos[a:b] = self.pad_id + 1 + np.arange(b - a)  # restart per document run
            out["position_ids"], out["cu_seqlens"] = pos, cu
        return out

    def _word_tables(self):
        if self._tables is None:
            from roberta_fast.tokenizer import RobertaTokenizer

            self._tables = RobertaTokenizer.from_pretrained(self.tokenizer_path).word_start_tables()
        return self._tables

    def __repr__(self) -> str:
        return (f"PretrainingDataset({str(self.path)!r}, split={self.split!r}, seq_len={self.seq_len}, "
                f"mode={self.mode!r}, pack={self.pack}, samples={self._n})")


# --------------------------------------------------------------------------- shuffling
_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_M64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions, n: int, seed: int, epoch: int, rounds: int = 4) -> np.ndarray:
    """Images of `positions` (ints in [0, n)) under a pseudo-random permutation of [0, n) keyed by (seed, epoch)."""
    pos = np.asarray(positions, dtype=np.uint64)
    if n <= 0:
        raise ValueError("cannot permute an empty range")
    if pos.size and int(pos.max()) >= n:
        raise ValueError(f"positions must lie in [0, {n})")
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # 2^(2*half) >= n and < 4n
    mask = np.uint64((1 << half) - 1)
    base = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xD1B54A32D192ED03 + 1) & _M64
    keys = _splitmix64(np.arange(rounds, dtype=np.uint64) + np.uint64(base))
    with np.errstate(over="ignore"):
        out = pos.copy()
        todo = np.ones(out.shape, dtype=bool)
        while todo.any():  # cycle walking: re-apply until the image falls inside [0, n)
            x = out[todo]
            left, right = x >> np.uint64(half), x & mask
            for key in keys:
                left, right = right, left ^ (_splitmix64(right ^ key) & mask)
            out[todo] = (left << np.uint64(half)) | right
            todo = out >= np.uint64(n)
    return out.astype(np.int64)


# --------------------------------------------------------------------------- loader
def collate(samples: list[dict], seq_len: int) -> dict:
    """Samples (dataset.sample(i)) -> a batch of (B, S) tensors.

    Packed samples' cu_seqlens become offsets into the flattened B*S tokens (each row's
    padding tail a segment of its own), with max_seqlen beside them.
    """
    out = {}
    for key in samples[0]:
        if key == "cu_seqlens":
            cu = [0]
            for b, s in enumerate(samples):
                cu += (b * seq_len + s["cu_seqlens"][1:]).tolist()
                if cu[-1] != (b + 1) * seq_len:
                    cu.append((b + 1) * seq_len)
            out[key] = torch.tensor(cu, dtype=torch.int32)
            out["max_seqlen"] = int(np.diff(cu).max())
        else:
            out[key] = torch.from_numpy(np.stack([s[key] for s in samples]))
    return out


class BatchLoader:
    """Deterministic, resumable, rank-sharded batches of a PretrainingDataset (see the module docstring)."""

    def __init__(self, dataset: PretrainingDataset, batch_size: int, *, seed: int, rank: int = 0,
                 world_size: int = 1, accum_steps: int = 1, drop_last: bool = True, shuffle: bool = True,
                 pin_memory: bool | None = None, prefetch: int = 2):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"accum_steps must be a positive int, got {accum_steps!r}")
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if len(dataset) == 0:
            raise ValueError(f"{dataset!r} has no samples; give it more text or pick another split")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, int(seed)
        self.rank, self.world_size, self.drop_last, self.shuffle = rank, world_size, drop_last, shuffle
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.prefetch = prefetch
        self.global_batch = batch_size * world_size  # samples of one micro-step over all ranks
        n, step_samples = len(dataset), self.global_batch * accum_steps  # (an optimizer step's)
        optimizer_steps = n // step_samples if drop_last else -(-n // step_samples)
        self.steps_per_epoch = optimizer_steps * accum_steps  # micro-steps
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{n} samples make no full global batch of {step_samples} (batch_size x world_size x "
                "accumulation steps); use a smaller batch, more data, or drop_last=False"
            )
        self.epoch, self.step = 0, 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """Dataset indices of this rank's batch `step` of `epoch`: (batch_size,) int64."""
        n = len(self.dataset)
        k = np.arange(self.batch_size, dtype=np.int64)
        pos = step * self.global_batch + self.rank * self.batch_size + k  # (B,) positions in the epoch
        pos %= n  # only drop_last=False reaches past the end: wrap to the epoch's first samples
        return permute(pos, n, self.seed, epoch) if self.shuffle else pos

    def batch(self, epoch: int, step: int) -> dict:
        """This rank's batch `step` of `epoch` as (B, S) tensors (pinned if pin_memory)."""
        out = self.dataset.batch(self.indices(epoch, step))
        if self.pin_memory:
            out = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out

    def __iter__(self):
        """Yield the rest of the current epoch; afterwards the loader stands at the next epoch."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        epoch, first = self.epoch, self.step
        for step, batch in self._produce(epoch, first):
            self.step = step + 1  # counted before the yield: state_dict() names the next batch
            yield batch
        if self.epoch == epoch and self.step >= self.steps_per_epoch:
            self.epoch, self.step = epoch + 1, 0

    def forever(self):
        """Yield batches across epochs without end."""
        while True:
            yield from self

    def _produce(self, epoch: int, first: int):
        steps = range(first, self.steps_per_epoch)
        if self.prefetch == 0:
            for step in steps:
                yield step, self.batch(epoch, step)
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            try:
                for step in steps:
                    item = (step, self.batch(epoch, step))
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
                q.put(None)
            except BaseException as err:  # handed to the consumer, raised there
                q.put(err)

        thread = threading.Thread(target=work, name="BatchLoader-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    q.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

    def state_dict(self) -> dict:
        """Where the loader stands: the next batch is batch `step` of `epoch`."""
        return {"epoch": self.epoch, "step": self.step, "samples_seen": self.step * self.global_batch,
                "seed": self.seed, "global_batch": self.global_batch, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": len(self.dataset),
                "data_sha256": self.dataset.stream.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the batch after the saved one; the order must be the same (seed, data, global batch)."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "drop_last", "dataset_len"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume: the saved loader had {key}={state[key]!r}, this one has {mine[key]!r}; "
                    "resume with the same data, seed and options"
                )
        saved = state.get("data_sha256")  # None: a checkpoint of before it was recorded, or a manifest without
        if saved is not None and mine["data_sha256"] is not None and saved != mine["data_sha256"]:
            raise ValueError(
                f"cannot resume: the dataset's content is not the one the run trained on (fingerprint "
                f"{mine['data_sha256'][:12]}, the checkpoint's {saved[:12]}: re-made from other text, or with other "
                "preprocess options, --shard-mb included, as the fingerprint covers each shard file), so the saved "
                "position may point at other samples. Resume with the run's dataset (or re-make it with the options "
                "in its manifest.json); to train on this one, start "
                "a new run (new --out) with --init-from an export of the checkpoint (python -m roberta_fast.export)"
            )
        if state["samples_seen"] % self.global_batch:
            raise ValueError(
                f"cannot resume: {state['samples_seen']} samples were seen, not a whole number of global "
                f"batches of {self.global_batch}; keep batch_size x world_size at {state['global_batch']}"
            )
        self.epoch, self.step = int(state["epoch"]), state["samples_seen"] // self.global_batch
