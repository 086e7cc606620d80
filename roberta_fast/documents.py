"""One reader of documents for every source: plain, compressed, Parquet, Arrow / `datasets`.

    sources, refused = find_sources(["corpus/", "c4-00000.json.gz", "wiki.parquet"], log)
    for piece, first, last in SegmentReader(sources[0], 0, sources[0].size, options, stats): ...
    texts = read_documents(inputs, text_field="text")   # what tokenizer training reads

Both `preprocess` (in chunks, in parallel) and `RobertaTokenizer.train` read through here.

Formats, told apart by their first bytes (magic), then by their extension:
- text (.txt .text .md .rst): documents separated by blank lines (or one per file); `\r\n`
  reads as `\n`, but a lone `\r` (old Mac line ends) is no line break: it stays in the text;
- JSONL (.jsonl .ndjson .json, as C4 ships): one JSON object per line, the text under `text_field`
  (a .json holding one JSON array, or one object spread over lines, is refused by name);
- either compressed: gzip (1f 8b), bzip2 ("BZh"), xz (fd "7zXZ" 00) with the standard library,
  zstd (28 b5 2f fd, frames read across; skippable frames, as pzstd writes, passed over) with
  `zstandard`: `.jsonl.gz`, `.txt.zst`, ...; a UTF-8 byte order mark at the start is dropped;
- Parquet ("PAR1") with `pyarrow`: the `text_field` column (plain or dictionary-encoded
  strings), one document per row;
- Arrow IPC, file ("ARROW1") or stream format (as `datasets` writes its `.arrow` files,
  memory-mapped), one document per row; a `datasets` `save_to_disk` directory is its
  .arrow files in order; a `datasets.Dataset` object is read from its cache files.
A file whose bytes contradict its extension is read by its bytes (and said so), or refused
by name when neither tells what it is; a file named on its own with no known extension is read
as its bytes tell (JSONL if it starts with "{", else text; said so too). A missing optional library is one line naming the
extra that installs it (`pip install roberta_fast[data]`).

Parallel units: byte ranges cut at document starts (plain files), runs of whole frames (a
zstd file of several frames: each run reads the documents that start in it, the byte before
it taken from the previous frame, the last one read on into the next frame; a run lying inside
one long document reads nothing), whole files
(other compressed files: a stream cannot be entered mid-way; a single large one is read by
one worker, streaming, in bounded memory), row groups (Parquet: memory holds one row group's
text column at a time) and record batches (Arrow, memory-mapped).

NUL bytes: in the first SNIFF_BYTES they mark a binary file, refused by name; past them (a log
zero-filled after a crash) each line (JSONL: record) holding one is dropped and counted as
`nul_lines` (a line longer than READ_BLOCK from the block holding the NUL on).

Locations: a counted problem names `file@byteN` (text and JSONL, offsets into the
decompressed text) or `file@rowN` (tables). A damaged file (truncated gzip, corrupt zstd
frame, unreadable Parquet) raises `DamagedInputError` naming the file, the format and how far
it got (documents, and the byte or row reached).
"""
from __future__ import annotations

import codecs
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

TEXT_EXTS = {".txt", ".text", ".md", ".rst"}
JSONL_EXTS = {".jsonl", ".ndjson"}
CODEC_EXTS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
TABLE_EXTS = {".parquet": "parquet", ".arrow": "arrow"}
MAGIC = [(b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
         (b"PAR1", "parquet"), (b"ARROW1", "arrow"), (b"\xff\xff\xff\xff", "arrow")]  # the last: IPC stream
_BZ2 = re.compile(rb"BZh[1-9](\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)")  # a block or the end
EXTRA = "pip install 'roberta_fast[data]' (pyarrow, zstandard, datasets)"
READ_BLOCK = 1 << 20  # bytes read per readline call: bounds memory on enormous lines
PIECE_CHARS = 1 << 20  # long documents are tokenized in pieces of about this many chars
SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary (as git does)
BLANK = " \t\r\n\x0b\x0c"  # a line of only these separates documents
TABLE_BATCH = 1024  # rows converted to Python at a time
MAX_EXAMPLES = 20  # file names / locations kept per count in the report


class DamagedInputError(ValueError):
    """A file that cannot be read to its end: truncated, corrupt, or not what it claims to be."""

    def __init__(self, message: str, path: str | None = None, what: str | None = None):
        super().__init__(message)
        self.path = path  # (not kept through pickling: read it in the process that raised it)
        self.what = what or message  # the damage alone, without the advice (what --skip-damaged logs)


def _need(module: str):
    """Import an optional dependency, or a one-line error naming the extra that installs it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"reading this format needs {module.split('.')[0]}: {EXTRA}") from None


# --------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Source:
    """One input file: kind "text" | "jsonl" | "parquet" | "arrow", codec None | "gzip" | "bz2" | "xz" | "zstd"."""

    path: str
    kind: str
    codec: str | None = None

    @property
    def size(self) -> int:
        return os.path.getsize(self.path)

    @property
    def splittable(self) -> bool:
        """Plain text and JSONL can be cut at any document start (compressed files cannot)."""
        return self.kind in ("text", "jsonl") and self.codec is None


def _is_skippable(word: bytes) -> bool:
    """A zstd skippable frame's magic (0x184D2A50..5F little-endian): metadata, e.g. pzstd's frame sizes."""
    return len(word) == 4 and int.from_bytes(word, "little") & 0xFFFFFFF0 == 0x184D2A50


def magic(head: bytes) -> str | None:
    """The format a file's first bytes announce (bzip2's "BZh" with its level and block magic,
    so that text beginning "BZh" stays text), or None. Leading zstd skippable frames (every
    pzstd output starts with one) are passed over to the frame after them."""
    if _BZ2.match(head):
        return "bz2"
    pos = 0
    while _is_skippable(head[pos:pos + 4]):
        pos += 8 + int.from_bytes(head[pos + 4:pos + 8], "little")
        if pos + 4 > len(head):
            return "zstd" if pos > 0 and len(head) == SNIFF_BYTES else None  # metadata longer than the head read
        if not _is_skippable(head[pos:pos + 4]):
            return "zstd" if head[pos:].startswith(b"\x28\xb5\x2f\xfd") else None
    return next((name for prefix, name in MAGIC if head.startswith(prefix)), None)


def _claimed(name: str) -> tuple[str | None, str | None]:
    """(kind, codec) that a file name claims: 'x.jsonl.gz' -> ('jsonl', 'gzip')."""
    suffixes = [s.lower() for s in Path(name).suffixes]
    codec = CODEC_EXTS.get(suffixes[-1]) if suffixes else None
    inner = suffixes[-2] if codec and len(suffixes) > 1 else (suffixes[-1] if suffixes and not codec else "")
    kind = "jsonl" if inner in JSONL_EXTS or inner == ".json" else \
        "text" if inner in TEXT_EXTS else TABLE_EXTS.get(inner)
    return kind, codec


def _sniff_kind(head: bytes) -> str:
    return "jsonl" if head.lstrip().startswith(b"{") else "text"


def _not_jsonl(head: bytes, name: str) -> str | None:
    """Why file `name`, starting with `head`, is not JSON lines (one JSON array, one object spread
    over lines, text), with the fix; None when its first line is JSON or longer than the head."""
    head = head.removeprefix(codecs.BOM_UTF8).lstrip(BLANK.encode())
    stem = name.split(".")[0] or name
    if head.startswith(b"["):
        return (f"it holds one JSON array, not JSON lines (one object per line): convert it "
                f"(jq -c '.[]' {name} > {stem}.jsonl)")
    line, newline, _ = head.partition(b"\n")
    try:
        if newline:
            json.loads(line.decode("utf-8", errors="replace"))
    except ValueError:
        return (f"its first line is not JSON, so it is not JSON lines (one object per line): convert one object "
                f"spread over lines (jq -c . {name} > {stem}.jsonl), or name a text file .txt")
    return None


def identify(p: Path, head: bytes, explicit: bool, log: Callable) -> tuple[Source | None, str | None]:
    """(the Source, None), or (None, why refused: a `refused` key) for a file starting with `head`."""
    kind, codec = _claimed(p.name)
    found = magic(head)
    if found in ("parquet", "arrow"):
        if kind != found:
            log(f"{p} holds {found} data (its first bytes say so): read as {found}")
        return Source(str(p), found), None
    if found is not None:  # compressed
        if codec and codec != found:
            log(f"{p} is {found}-compressed, not {codec}: read as {found}")
        if kind not in ("text", "jsonl"):
            if not explicit:  # e.g. a .tar.gz in a directory
                return None, "unsupported_files"
            kind = _sniff_kind(decompressed_head(Source(str(p), "text", found)))
            log(f"{p} holds {found}-compressed {'JSONL' if kind == 'jsonl' else 'text'} (its first bytes say so): "
                "read as such")
        return Source(str(p), kind, found), None
    if b"\x00" in head:
        if codec or kind in ("parquet", "arrow"):
            log(f"refusing {p}: named {codec or kind} but its bytes are not ({head[:8].hex(' ')}...)")
            return None, "mislabelled_files"
        log(f"refusing binary file {p}: it holds NUL bytes (convert UTF-16 text to UTF-8)")
        return None, "binary_files"
    if codec or kind in ("parquet", "arrow"):  # plain text under a compressed or columnar name
        claimed = codec or kind
        kind = kind if kind in ("text", "jsonl") else _sniff_kind(head)
        log(f"{p} is plain text, not {claimed}: read as {'JSONL' if kind == 'jsonl' else 'text'}")
        return Source(str(p), kind), None
    if kind is None:
        if not explicit:
            return None, "unsupported_files"
        kind = _sniff_kind(head)  # a file named on its own, of no known extension: its bytes tell
        log(f"{p} holds {'JSONL' if kind == 'jsonl' else 'text'} (its first bytes say so): read as such")
    return Source(str(p), kind), None


def decompressed_head(source: Source) -> bytes:
    """The first SNIFF_BYTES of a compressed file's text (a DamagedInputError if they cannot be read)."""
    with _guard(source, lambda: "at its start"):
        stream, raw = open_binary(source)
        with raw, stream:
            return stream.raw.read(SNIFF_BYTES)  # (not the buffer's: it would read a whole block)


def _dataset_dir_files(p: Path) -> list[Path] | None:
    """The .arrow files of a `datasets` save_to_disk directory, in order (None if it is not one).
    ValueError if state.json names a file outside the directory (it was not made by save_to_disk)."""
    from .files import inside

    state = p / "state.json"
    if not state.is_file() or not (p / "dataset_info.json").is_file():
        return None
    files = json.loads(state.read_text()).get("_data_files") or []
    fix = "the directory is damaged or was not made by `datasets` save_to_disk; ask for a fresh copy"
    return [inside(p, f.get("filename") if isinstance(f, dict) else f, f"{str(state)!r}: the _data_files entry",
                   fix) for f in files]


def find_sources(inputs, log: Callable[[str], None], cache_dir: Path | None = None,
                 skip_damaged: bool = False) -> tuple[list[Source], dict]:
    """The input files as Sources, and the files refused or skipped by reason. Directories are
    searched recursively, following linked folders but reading each folder once, and leaving out
    (logged) names starting with "." (a save_to_disk directory gives its .arrow files); a `datasets.Dataset`
    gives its cache files (an in-memory or reindexed one is first written to `cache_dir`).
    A compressed file whose start cannot be decompressed is a DamagedInputError, or with
    skip_damaged refused as a damaged file."""
    sources, seen = [], set()
    refused = {"binary_files": [], "empty_files": [], "unreadable_files": [], "unsupported_files": [],
               "mislabelled_files": [], "not_jsonl_files": [], "damaged_files": []}

    def add(p: Path, explicit: bool):
        key = os.path.realpath(p)
        if key in seen:
            return
        seen.add(key)
        if not explicit and _claimed(p.name) == (None, None):
            refused["unsupported_files"].append(str(p))
            return
        try:
            size = p.stat().st_size
            with open(p, "rb") as f:
                head = f.read(SNIFF_BYTES)
        except OSError as err:  # permissions, a dangling link, ...
            refused["unreadable_files"].append(str(p))
            log(f"skipping unreadable file {p}: {err.strerror or err}")
            return
        if size == 0:
            refused["empty_files"].append(str(p))
            log(f"skipping empty file {p}")
            return
        try:
            source, why = identify(p, head, explicit, log)
            if source is not None and source.codec:
                head = decompressed_head(source)
                if b"\x00" in head:
                    source, why = None, "binary_files"
                    log(f"refusing binary file {p}: its decompressed bytes hold NUL bytes")
            if source is not None and source.kind == "jsonl" and not JSONL_EXTS & {x.lower() for x in p.suffixes}:
                problem = _not_jsonl(head, p.name)  # JSONL by a .json name or by its bytes: it may be one JSON document
                if problem:
                    source, why = None, "not_jsonl_files"
                    log(f"refusing {p}: {problem}")
        except DamagedInputError as err:
            if not skip_damaged:
                raise
            source, why = None, "damaged_files"
            log(f"skipping damaged file: {err}")
        if source is None:
            refused[why].append(str(p))
        else:
            sources.append(source)

    if isinstance(inputs, (str, os.PathLike)) or _is_dataset(inputs):
        inputs = [inputs]
    if not inputs:
        raise ValueError("preprocess needs at least one input file or directory")
    for item in inputs:
        if _is_dataset(item):
            for path in dataset_files(item, cache_dir):
                add(path, explicit=True)
            continue
        p = Path(item)
        if p.is_dir():
            hidden, walked = [], set()
            for root, dirs, names in os.walk(p, followlinks=True):  # linked folders too (corpus/wiki -> /mnt/...)
                root = Path(root)
                if os.path.realpath(root) in walked:  # a link to a folder read already (or a loop)
                    dirs[:] = []
                    continue
                walked.add(os.path.realpath(root))
                if (root / "plan.json").is_file():  # a dataset directory: never read as input
                    log(f"skipping {root}: it is a preprocess output")
                    dirs[:] = []
                    continue
                arrow = _dataset_dir_files(root)
                if arrow is not None:
                    for path in arrow:
                        add(path, explicit=True)
                    dirs[:] = []
                    continue
                hidden += [str(root / n) for n in dirs + names if n.startswith(".")]
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for n in sorted(names):
                    if not n.startswith("."):
                        add(root / n, explicit=False)
            if hidden:
                log(f"skipping {len(hidden)} hidden files and folders (names starting with '.') in {p}: "
                    + ", ".join(hidden[:5]) + (", ..." if len(hidden) > 5 else ""))
        elif p.is_file():
            add(p, explicit=True)
        else:
            raise ValueError(f"input {str(p)!r} does not exist (pass files or directories of text, JSONL, "
                             "their .gz/.bz2/.xz/.zst, Parquet or Arrow)")
    return sources, refused


# --------------------------------------------------------------------------- datasets.Dataset
def _is_dataset(obj) -> bool:
    return type(obj).__name__ == "Dataset" and type(obj).__module__.startswith("datasets")


def dataset_files(ds, cache_dir: Path | None) -> list[Path]:
    """Arrow files holding a datasets.Dataset's rows in order: its own cache files when it has
    them and no index mapping (after shuffle/select), else a copy written once to cache_dir in
    batches (named by the dataset's fingerprint, so a rerun finds it)."""
    if ds.cache_files and getattr(ds, "_indices", None) is None:
        return [Path(f["filename"]) for f in ds.cache_files]
    if cache_dir is None:
        raise ValueError("this datasets.Dataset lives in memory (or is reindexed): pass it to preprocess, "
                         "which writes it to its output directory first, or save_to_disk it")
    pa = _need("pyarrow")
    from .files import atomic_path

    path = Path(cache_dir) / f"dataset-{ds._fingerprint}.arrow"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_stream(sink, ds.data.schema) as writer:
                for batch in ds.with_format("arrow").iter(batch_size=TABLE_BATCH):
                    writer.write_table(batch)
    return [path]


def _dataset_texts(ds, field: str) -> Iterator[str]:
    """The `field` column of a datasets.Dataset, batch by batch (for tokenizer training)."""
    if field not in ds.column_names:
        raise ValueError(f"the dataset has no column {field!r} (its columns: {ds.column_names}); pass text_field")
    for batch in ds.select_columns([field]).with_format("arrow").iter(batch_size=TABLE_BATCH):
        yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str) and t.strip())


# --------------------------------------------------------------------------- opening
def open_binary(source: Source, offset: int = 0):
    """(stream of the decompressed bytes, the raw file) of a text or JSONL source (a zstd file:
    from the frame starting at `offset`)."""
    raw = open(source.path, "rb")
    raw.seek(offset)
    try:
        if source.codec is None:
            return raw, raw
        if source.codec == "gzip":
            import gzip
            return io.BufferedReader(_Read1(gzip.GzipFile(fileobj=raw, mode="rb")), READ_BLOCK), raw
        if source.codec == "bz2":
            import bz2
            return io.BufferedReader(_Read1(bz2.BZ2File(raw)), READ_BLOCK), raw
        if source.codec == "xz":
            import lzma
            return io.BufferedReader(_Read1(lzma.LZMAFile(raw)), READ_BLOCK), raw
        return io.BufferedReader(_ZstdFrames(raw), READ_BLOCK), raw
    except BaseException:
        raw.close()
        raise


class _Read1(io.RawIOBase):
    """A decompressing file read with read1: what it decompressed before a truncation is read
    (and counted) before the error, not lost in a buffer filled whole."""

    def __init__(self, f):
        self.f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read1(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self):
        self.f.close()
        super().close()


def zstd_frame_offsets(path: str, skippable: bool = False) -> list[int]:
    """Where each frame of a zstd file starts, read from the frame and block headers (RFC 8878;
    nothing decompressed); [0] when the framing is not clear. Skippable frames are listed only
    with `skippable`: units start at regular frames, but `zstandard` counts every frame."""
    key = (path, os.path.getsize(path), os.stat(path).st_mtime_ns)
    if key not in _FRAMES:
        _FRAMES.clear()
        _FRAMES[key] = _scan_zstd_frames(path, key[1])
    frames = _FRAMES[key]
    return [o for o, skip in frames if skippable or not skip] or [0]


_FRAMES: dict = {}


def _scan_zstd_frames(path: str, size: int) -> list[tuple[int, bool]]:
    """(offset, is skippable) of every frame; [(0, False)] when the framing is not clear."""
    offsets, pos = [], 0
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            head = f.read(8)
            if len(head) < 8:
                return [(0, False)]
            if _is_skippable(head[:4]):  # its size follows
                offsets.append((pos, True))
                pos += 8 + int.from_bytes(head[4:8], "little")
                continue
            if int.from_bytes(head[:4], "little") != 0xFD2FB528:
                return [(0, False)]
            offsets.append((pos, False))
            fhd = head[4]  # frame header descriptor
            single_segment = (fhd >> 5) & 1
            pos += 5 + (not single_segment) + (0, 1, 2, 4)[fhd & 3] + ((1 if single_segment else 0), 2, 4, 8)[fhd >> 6]
            while True:  # blocks: a 3-byte header (last, type, size); an RLE block holds 1 byte
                f.seek(pos)
                block = f.read(3)
                if len(block) < 3:
                    return [(0, False)]
                header = int.from_bytes(block, "little")
                kind = (header >> 1) & 3
                if kind == 3:
                    return [(0, False)]
                pos += 3 + (1 if kind == 1 else header >> 3)
                if header & 1:
                    break
            pos += 4 * ((fhd >> 2) & 1)  # the content checksum
    return offsets or [(0, False)]


def _zstd_last_byte(path: str, offset: int) -> bytes:
    """The last decompressed byte of the last regular frame before `offset` (skippable frames
    between hold no text; streamed: nothing else kept)."""
    frames = [o for o in zstd_frame_offsets(path) if o < offset]
    frame = _need("zstandard").ZstdDecompressor().decompressobj()
    last = b""
    with open(path, "rb") as f:
        f.seek(frames[-1])
        left = offset - frames[-1]
        while left > 0 and not frame.eof:
            out = frame.decompress(f.read(min(left, 1 << 16)))
            left -= 1 << 16
            last = out[-1:] or last
    return last


class _FrameStart:
    """Compares as the decompressed offset at which frame `n` (skippable ones counted) of a
    _ZstdFrames stream begins; infinite when the file ends first. Each comparison decompresses
    ahead as far as it needs to be exact (a frame may start right where the bytes read end)."""

    def __init__(self, frames, n: int):
        self.frames, self.n = frames, n

    def __le__(self, pos):
        return self.frames.start_of(self.n, pos) <= pos

    def __gt__(self, pos):
        return not self <= pos


def _boundary_after(f, at_line_start: bool, kind: str) -> tuple[int, int]:
    """Read `f` on to where the next document starts (JSONL: the next line start; text: past the
    next whole blank line); return (bytes read, where its separator starts: the blank line, or
    for JSONL the line itself). `at_line_start`: the byte before was a newline."""
    if kind == "jsonl" and at_line_start:
        return 0, 0
    pos = 0
    while True:
        raw = f.readline(READ_BLOCK)
        if not raw:
            return pos, pos
        whole = at_line_start and raw.endswith(b"\n")
        at_line_start = raw.endswith(b"\n")
        pos += len(raw)
        if kind == "jsonl" and at_line_start:
            return pos, pos
        if kind == "text" and whole and _is_blank(raw):
            return pos, pos - len(raw)


def next_boundary(f, x: int, size: int, kind: str, doc_per_file: bool) -> int:
    """Smallest offset >= x where a document of a plain file starts (after a blank line; a line for JSONL)."""
    if x <= 0:
        return 0
    if kind == "text" and doc_per_file:
        return size
    f.seek(x - 1)
    at_line_start = f.read(1) == b"\n"
    return min(x + _boundary_after(f, at_line_start, kind)[0], size)


class _ZstdFrames(io.RawIOBase):
    """The frames of a zstd file one after another, decompressed by `zstandard`'s decompressobj;
    a file ending inside a frame is an EOFError (zstandard's stream_reader ends there silently)."""

    def __init__(self, raw):
        self.zstd, self.raw = _need("zstandard"), raw
        self.frame = self.zstd.ZstdDecompressor().decompressobj()
        self.fed = False  # bytes given to the current frame
        self.out, self.at = b"", 0
        self.starts, self.produced = [0], 0  # decompressed offsets where the frames begin; bytes out so far

    def readable(self) -> bool:
        return True

    def _more(self) -> bool:
        """Decompress the next compressed chunk onto `out` (False at the end of the file)."""
        chunk = self.raw.read(1 << 14)  # bounds the output of one call: 16 KiB times the ratio
        if not chunk:
            if self.fed and not self.frame.eof:
                raise EOFError("the file ends inside a zstd frame")
            return False
        parts = [self.out[self.at:]]
        while chunk:
            if self.frame.eof:  # the next frame (a skippable one too: zstandard gives it no bytes)
                self.frame, self.fed = self.zstd.ZstdDecompressor().decompressobj(), False
                self.starts.append(self.produced)
            self.fed = True
            parts.append(self.frame.decompress(chunk))
            self.produced += len(parts[-1])
            chunk = self.frame.unused_data if self.frame.eof else b""
        self.out, self.at = b"".join(parts), 0
        return True

    def start_of(self, n: int, pos: int) -> float:
        """Where frame n begins if that is at or before decompressed offset `pos`, else inf."""
        while len(self.starts) <= n and self.produced <= pos and self._more():
            pass
        return self.starts[n] if len(self.starts) > n else float("inf")

    def readinto(self, b) -> int:
        while self.at == len(self.out):
            if not self._more():
                return 0
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n


def _damage_errors() -> tuple:
    errors = [EOFError, OSError]  # truncated streams; gzip.BadGzipFile and bz2's "Invalid data stream"
    for module, name in (("lzma", "LZMAError"), ("zlib", "error"), ("zstandard", "ZstdError"),
                         ("pyarrow", "ArrowException")):
        mod = sys.modules.get(module)
        if mod is not None:
            errors.append(getattr(mod, name))
    return tuple(errors)


class _guard:
    """Turn a decompressor's or pyarrow's error into a DamagedInputError naming the file and `where()`."""

    def __init__(self, source: Source, where: Callable[[], str]):
        self.source, self.where = source, where

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or isinstance(err, DamagedInputError) or not isinstance(err, _damage_errors()):
            return False
        if isinstance(err, OSError) and err.errno is not None:
            return False  # a real I/O error (permissions, disk): not the file's content
        what = self.source.codec or self.source.kind
        damage = f"{self.source.path} is damaged or truncated ({what}: {err}) {self.where()}"
        raise DamagedInputError(f"{damage}; replace it, or pass --skip-damaged to leave it out (finished shards "
                                "are kept and the rerun resumes)", self.source.path, damage) from None


# --------------------------------------------------------------------------- decoding
_INVALID = [0]  # invalid UTF-8 sequences replaced in this process so far


def _count_and_replace(err: UnicodeDecodeError):
    """Codec error handler: U+FFFD for each invalid sequence, counted."""
    _INVALID[0] += 1
    return "\ufffd", err.end


codecs.register_error("roberta_fast.count_replace", _count_and_replace)


def _is_blank(raw: bytes) -> bool:
    return not raw.strip(BLANK.encode())


def note(stats: dict, key: str, example: str, count: int = 1) -> None:
    """Count a problem in `stats` and keep its first MAX_EXAMPLES locations."""
    stats[key] += count
    examples = stats["examples"].setdefault(key, [])
    if len(examples) < MAX_EXAMPLES:
        examples.append(example)


def _cut(text: str) -> int:
    """Index at which to cut a long text: a single space between two non-spaces, late as possible."""
    lo = len(text) // 2
    i = text.rfind(" ", lo, len(text) - 1)
    while i > lo:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    return -1


def split_long(text: str, stats: dict) -> Iterator[str]:
    """Yield `text` in pieces of about PIECE_CHARS whose tokenizations concatenate to its own."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        window = text[start: start + PIECE_CHARS + 1]
        i = _cut(window)
        if i < 0:
            i = PIECE_CHARS
            stats["hard_splits"] += 1
        yield window[:i]
        start += i
    yield text[start:]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _document(text, stats: dict, where: Callable[[], str]):
    """The pieces (piece, first, last) of one record's text, or none (counted) when it holds no text."""
    if not isinstance(text, str):
        note(stats, "records_without_text", where())
        return ()
    if not text.strip():
        note(stats, "empty_documents", where())
        return ()
    if not text.isascii() and _SURROGATE.search(text):  # "\ud800" escapes: not encodable text
        text, n = _SURROGATE.subn("\ufffd", text)
        stats["lone_surrogates_replaced"] += n
    if len(text) <= PIECE_CHARS:
        return ((text, True, True),)
    pieces = list(split_long(text, stats))
    return [(piece, k == 0, k == len(pieces) - 1) for k, piece in enumerate(pieces)]


# --------------------------------------------------------------------------- reading
class SegmentReader:
    """The pieces (text, first, last) of the documents of one segment of a source: bytes
    [start, end) of a plain file (cut at document starts), a whole compressed file (0, size),
    or row groups / record batches [start, end) of a table. `pos()` is the input consumed
    (bytes; for tables the weights of the units done), `where()` the current location."""

    def __init__(self, source: Source, start: int, end: int, text_field: str = "text",
                 doc_per_file: bool = False, stats: dict | None = None, weights: Sequence[int] = ()):
        self.source, self.start, self.end = source, start, end
        self.text_field, self.doc_per_file = text_field, doc_per_file
        self.stats = stats if stats is not None else new_stats()
        self.name = os.path.basename(source.path)
        self.weights = weights
        self.documents = 0
        self._where, self._pos = (lambda: f"{self.name}@byte{start}"), (lambda: start)

    def pos(self) -> int:
        return self._pos()

    def where(self) -> str:
        return self._where()

    def __iter__(self):
        how_far = lambda: f"after {self.documents} documents (at {self.where()})"  # noqa: E731
        with _guard(self.source, how_far):
            if self.source.kind in ("parquet", "arrow"):
                pieces = self._table_pieces()
            else:
                pieces = self._stream_pieces()
            for piece in pieces:
                self.documents += piece[2]
                yield piece

    # ---- text and JSONL, plain or compressed
    def _stream_pieces(self):
        frames = self.source.codec == "zstd" and (self.start > 0 or self.end < self.source.size)
        stream, raw = open_binary(self.source, self.start if frames else 0)
        with raw, stream:
            if self.start and not frames:
                stream.seek(self.start)
            pos = self.start if self.source.codec is None else 0
            offset = [pos]  # the (decompressed) offset of the current line
            self._where = lambda: f"{self.name}@byte{offset[0]}"
            self._pos = (lambda: stream.tell()) if self.source.codec is None else (lambda: raw.tell())
            end, exact = (self.end if self.source.codec is None else float("inf")), True
            if frames:  # the documents starting in frames [start, end): from the first document start on
                unit = stream.raw  # to where a document starts after the frame at `end` begins
                prefix = f"{self.name}@frame{self.start}+byte"
                self._where = lambda: f"{prefix}{offset[0]}"
                n = len([o for o in zstd_frame_offsets(self.source.path, skippable=True) if self.start <= o < self.end])
                end, exact = _FrameStart(unit, n), False
                if self.start:
                    pos, separator = _boundary_after(
                        stream, _zstd_last_byte(self.source.path, self.start) == b"\n", self.source.kind)
                    if end <= separator:  # a document longer than these frames: it is the previous run's,
                        return            # and the next one starts in a later run
            if self.source.kind == "jsonl":
                yield from self._jsonl(stream, pos, end, offset)
            else:
                yield from self._text(stream, pos, end, offset, exact)

    def _jsonl(self, f, pos, end, offset):
        stats, field = self.stats, self.text_field
        where = self._where
        while pos < end:
            offset[0] = pos
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            if offset[0] == 0 and self.start == 0:  # a UTF-8 byte order mark marks the encoding: not text
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if b"\x00" in raw:  # a zero-filled region (a log after a crash): not JSON, not text
                note(stats, "nul_lines", where())
                continue
            if _is_blank(raw):
                stats["blank_jsonl_lines"] += 1
                continue
            try:
                record = json.loads(raw.decode("utf-8", errors="roberta_fast.count_replace"))
            except ValueError:
                note(stats, "bad_json_lines", where())
                continue
            yield from _document(record.get(field) if isinstance(record, dict) else None, stats, where)

    def _text(self, f, pos, end, offset, exact=True):
        """Documents separated by blank lines (or the whole file with doc_per_file); `\\r\\n` read as `\\n`.
        Reads to `end` (exact: a document start), else on to the first blank line starting at or past it."""
        stats, doc_per_file = self.stats, self.doc_per_file
        dec = codecs.getincrementaldecoder("utf-8")(errors="roberta_fast.count_replace")
        parts: list[str] = []  # the current document's text not yet yielded
        size = 0  # chars in parts
        in_doc = first = False
        newline = ""  # "\n" owed before the next line of the document
        at_line_start = True
        dropping = False  # the rest of a line holding a NUL byte is dropped too
        carry = b""  # a "\r" ending a block, held back: the next block may start with its "\n"
        while not exact or pos < end:
            offset[0] = pos
            block = f.readline(READ_BLOCK)
            if not block and not carry:
                break
            pos += len(block)
            raw, carry = carry + block, b""
            if block.endswith(b"\r") and (not exact or pos < end):  # (at the end: read as it is)
                raw, carry = raw[:-1], b"\r"
                if not raw:
                    continue
            if offset[0] == 0 and self.start == 0:  # a UTF-8 byte order mark marks the encoding: not text
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if dropping or b"\x00" in raw:  # a zero-filled region (a log after a crash): not text
                if not dropping:
                    note(stats, "nul_lines", self._where())
                    dec.reset()  # (a character cut at the block before belongs to the line dropped)
                at_line_start = raw.endswith(b"\n")
                dropping = not at_line_start
                if at_line_start and in_doc:
                    newline = "\n"  # the line ended: the next one starts a line of its own
                continue
            whole_line = at_line_start and raw.endswith(b"\n")
            at_line_start = raw.endswith(b"\n")
            text = dec.decode(raw)
            if whole_line and not doc_per_file and _is_blank(raw):
                if in_doc:
                    yield "".join(parts), first, True
                    parts, size, in_doc, newline = [], 0, False, ""
                if not exact and offset[0] >= end:  # the boundary the next segment starts at
                    break
                continue
            if not in_doc:
                in_doc, first = True, True
            if text.endswith("\n"):
                text = text[:-2] if text.endswith("\r\n") else text[:-1]
                parts.append(newline + text)
                newline = "\n"
            else:
                parts.append(newline + text)
                newline = ""
            size += len(parts[-1])
            if size > PIECE_CHARS:
                *head, tail = split_long("".join(parts), stats)
                for piece in head:
                    yield piece, first, False
                    first = False
                parts, size = [tail], len(tail)
        tail = dec.decode(b"", final=True)
        if tail:
            parts.append(newline + tail)
        if in_doc:
            yield "".join(parts), first, True

    # ---- Parquet and Arrow
    def _table_pieces(self):
        row = [0]
        self._where = lambda: f"{self.name}@row{row[0]}"
        done = [0]
        self._pos = lambda: done[0]
        for unit, first_row, batches in table_batches(self.source, self.start, self.end, self.text_field):
            row[0] = first_row
            for batch in batches:
                for text in _strings(batch):
                    yield from _document(text, self.stats, self._where)
                    row[0] += 1
            done[0] += self.weights[unit - self.start] if self.weights else 0


def _strings(column) -> list:
    """A string column's values; invalid UTF-8 (which pyarrow refuses to convert) replaced and counted."""
    if hasattr(column, "dictionary_decode"):  # dictionary-encoded: the strings themselves
        column = column.dictionary_decode()
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pa = _need("pyarrow")
        raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        return [None if b is None else b.decode("utf-8", errors="roberta_fast.count_replace") for b in raw.to_pylist()]


def new_stats() -> dict:
    """The counts a reading keeps (and the preprocess manifest reports)."""
    keys = ["bytes", "documents", "tokens", "pieces", "hard_splits", "invalid_utf8_replaced",
            "lone_surrogates_replaced", "empty_documents", "blank_files", "bad_json_lines", "records_without_text",
            "blank_jsonl_lines", "nul_lines", "valid_added"]
    return {**{k: 0 for k in keys}, "examples": {}}


# --------------------------------------------------------------------------- tables
def _text_column(schema, field: str, path: str) -> None:
    pa = _need("pyarrow")
    if field not in schema.names:
        raise ValueError(f"{path} has no column {field!r} (its columns: {schema.names}); pass --text-field")
    kind = schema.field(field).type
    if pa.types.is_dictionary(kind):  # dictionary-encoded (a pandas Categorical): its values are the text
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda t: False)(kind)):
        raise ValueError(f"{path}: column {field!r} holds {kind}, not text; pass --text-field naming a text column")


def _arrow_reader(path: str):
    """An Arrow IPC reader over a memory map: ('file', reader) for the file format, else ('stream', reader)."""
    pa = _need("pyarrow")
    source = pa.memory_map(path)
    if source.read(6) == b"ARROW1":
        source.seek(0)
        return source, pa.ipc.open_file(source)
    source.seek(0)
    return source, pa.ipc.open_stream(source)


def table_units(source: Source, field: str) -> list[int]:
    """The weight (text bytes) of each parallel unit of a table: row groups (Parquet) or record batches (Arrow)."""
    with _guard(source, lambda: "reading its metadata"):
        if source.kind == "parquet":
            pq = _need("pyarrow.parquet")
            meta = pq.ParquetFile(source.path)
            _text_column(meta.schema_arrow, field, source.path)
            column = meta.schema_arrow.names.index(field)
            md = meta.metadata
            return [md.row_group(i).column(column).total_uncompressed_size for i in range(md.num_row_groups)]
        mm, reader = _arrow_reader(source.path)
        with mm:
            _text_column(reader.schema, field, source.path)
            if hasattr(reader, "num_record_batches"):
                return [reader.get_batch(i).column(field).nbytes for i in range(reader.num_record_batches)]
            return [batch.column(field).nbytes for batch in reader]  # zero-copy: touches the metadata only


def table_batches(source: Source, start: int, end: int, field: str):
    """(unit, its first row, its `field` column in batches) for units [start, end) of a table."""
    if source.kind == "parquet":
        pq = _need("pyarrow.parquet")
        pf = pq.ParquetFile(source.path)
        _text_column(pf.schema_arrow, field, source.path)
        row = sum(pf.metadata.row_group(i).num_rows for i in range(start))
        for unit in range(start, end):
            yield unit, row, (b.column(0) for b in pf.iter_batches(TABLE_BATCH, row_groups=[unit], columns=[field]))
            row += pf.metadata.row_group(unit).num_rows
        return
    mm, reader = _arrow_reader(source.path)
    with mm:
        _text_column(reader.schema, field, source.path)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if hasattr(reader, "num_record_batches") else iter(reader)
        row = 0
        for unit, batch in enumerate(batches):
            if unit >= end:
                break
            if unit >= start:
                column = batch.column(field)
                yield unit, row, (column.slice(a, TABLE_BATCH) for a in range(0, len(column), TABLE_BATCH))
            row += batch.num_rows


# --------------------------------------------------------------------------- whole inputs
def units_of(source: Source, field: str) -> tuple[int, list[int]]:
    """(end, weights): a source read whole is SegmentReader(source, 0, end, weights=weights)."""
    if source.kind in ("parquet", "arrow"):
        weights = table_units(source, field)
        return len(weights), weights
    return source.size, []


def nothing_to_read(inputs, refused: dict, counts: dict | None = None) -> str:
    """The error for inputs that yield no document, naming them and what was skipped."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) or _is_dataset(inputs) else inputs
    names = ["a datasets.Dataset" if _is_dataset(i) else str(i) for i in items]
    why = [f"{len(v)} {k.replace('_', ' ')} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})"
           for k, v in refused.items() if v]
    why += [f"{v} {k.replace('_', ' ')}" for k, v in (counts or {}).items()
            if v and k in ("empty_documents", "blank_files", "bad_json_lines", "records_without_text", "nul_lines")]
    return (f"no document to read in {', '.join(names)}" + (f": {'; '.join(why)}" if why else "")
            + f"; pass text files ({', '.join(sorted(TEXT_EXTS))}, documents separated by blank lines), JSONL "
              "(the text under --text-field), either compressed (.gz .bz2 .xz .zst), Parquet or Arrow files "
              "(the --text-field column), datasets save_to_disk directories, or directories holding them")


def read_documents(inputs, text_field: str = "text", log: Callable[[str], None] | None = None,
                   skip_damaged: bool = False) -> Iterator[str]:
    """The text of `inputs` as preprocess reads it (every format above; a datasets.Dataset too),
    document by document (pieces of about PIECE_CHARS for longer ones): what
    `RobertaTokenizer.train` learns from. Inputs are checked now: the files skipped are logged,
    one line per reason; a ValueError names inputs that hold no file to read, or (when the
    iterator ends) no document. At the end it logs the text it replaced or left out (invalid
    UTF-8, lone surrogates, lines with NUL bytes, undecodable JSONL lines), as preprocess counts them."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) or _is_dataset(inputs) else list(inputs)
    datasets = [i for i in items if _is_dataset(i)]
    files = [i for i in items if not _is_dataset(i)]
    sources, refused = find_sources(files, log) if files or not datasets else ([], {})
    if not sources and not datasets:
        raise ValueError(nothing_to_read(inputs, refused))
    for why, names in refused.items():  # (preprocess names them in its report and manifest instead)
        if names:
            more = f", ... ({len(names)} in all)" if len(names) > MAX_EXAMPLES else ""
            log(f"skipped {len(names)} {why.replace('_', ' ')}: {', '.join(names[:MAX_EXAMPLES])}{more}")

    def documents() -> Iterator[str]:
        stats, n, invalid = new_stats(), 0, _INVALID[0]
        for ds in datasets:
            for text in _dataset_texts(ds, text_field):
                n += 1
                yield text
        for source in sources:
            try:
                end, weights = units_of(source, text_field)
                for piece, _, _ in SegmentReader(source, 0, end, text_field, False, stats, weights):
                    if piece.strip():
                        n += 1
                        yield piece
            except DamagedInputError as err:
                if not skip_damaged:
                    raise
                log(f"skipping damaged file: {err}")
        stats["invalid_utf8_replaced"] += _INVALID[0] - invalid
        said = [f"{k} {stats[k]}" + (f" ({', '.join(stats['examples'][k][:3])})" if stats["examples"].get(k) else "")
                for k in ("invalid_utf8_replaced", "lone_surrogates_replaced", "nul_lines", "bad_json_lines",
                          "records_without_text") if stats[k]]
        if said:  # (preprocess counts them in its report and manifest)
            log(f"read {n} documents, with text replaced or left out: {', '.join(said)}")
        if not n:
            raise ValueError(nothing_to_read(inputs, refused, stats))

    return documents()


# --------------------------------------------------------------------------- task tables
def is_table(path) -> bool:
    """A Parquet or Arrow file (by its bytes), or a datasets save_to_disk directory."""
    path = Path(path)
    if path.is_dir():
        return _dataset_dir_files(path) is not None
    with open(path, "rb") as f:
        return magic(f.read(8)) in ("parquet", "arrow")


def _label_names(features: dict) -> dict:
    """column -> ClassLabel names, from a datasets features description (a Sequence's / List's inner one too)."""
    names = {}
    for column, feature in (features or {}).items():
        while isinstance(feature, dict) and "names" not in feature and isinstance(feature.get("feature"), dict):
            feature = feature["feature"]
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and feature.get("names"):
            names[column] = feature["names"]
    return names


def _named(value, names: list):
    """A ClassLabel id (or a list of them) as its name."""
    if isinstance(value, list):
        return [_named(v, names) for v in value]
    return names[value] if isinstance(value, int) and 0 <= value < len(names) else value


def table_label_names(path) -> dict[str, list[str]]:
    """column -> its ClassLabel names in id order, of a Parquet / Arrow file or save_to_disk directory:
    the dataset's own label order (MNLI's 0 entailment, 1 neutral, 2 contradiction), which run_glue keeps."""
    path = Path(path)
    file = (_dataset_dir_files(path) if path.is_dir() else [path])[0]
    with open(file, "rb") as f:
        parquet = magic(f.read(8)) == "parquet"
    if parquet:
        schema = _need("pyarrow.parquet").read_schema(str(file))
    else:
        mm, reader = _arrow_reader(str(file))
        schema = reader.schema
        mm.close()
    meta = json.loads((schema.metadata or {}).get(b"huggingface", b"{}"))
    return _label_names(meta.get("info", {}).get("features"))


def table_rows(path) -> Iterator[tuple[str, dict]]:
    """(location "file@rowN", row as a dict) of a Parquet / Arrow file or a save_to_disk directory,
    in batches; ClassLabel ids (datasets' labels) become their names."""
    path = Path(path)
    files = _dataset_dir_files(path) if path.is_dir() else [path]
    for file in files:
        with open(file, "rb") as f:
            source = Source(str(file), "parquet" if magic(f.read(8)) == "parquet" else "arrow")
        row = [0]
        with _guard(source, lambda: f"at row {row[0]}"):
            if source.kind == "parquet":
                pf = _need("pyarrow.parquet").ParquetFile(str(file))
                schema, batches = pf.schema_arrow, pf.iter_batches(TABLE_BATCH)
                mm = None
            else:
                mm, reader = _arrow_reader(str(file))
                schema = reader.schema
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
                    if hasattr(reader, "num_record_batches") else iter(reader)
            meta = json.loads((schema.metadata or {}).get(b"huggingface", b"{}"))
            names = _label_names(meta.get("info", {}).get("features"))
            try:
                for batch in batches:
                    for record in batch.to_pylist():
                        yield f"{file}@row{row[0]}", {k: _named(v, names[k]) if k in names else v
                                                       for k, v in record.items()}
                        row[0] += 1
            finally:
                if mm is not None:
                    mm.close()
