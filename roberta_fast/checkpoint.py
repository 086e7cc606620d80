"""Checkpoints that survive a kill at any moment, and the stop signal that triggers one.

    ckpt = CheckpointManager(out_dir / "checkpoints", keep=2)
    ckpt.save(step, state)            # state: any torch.save-able dict
    path = ckpt.latest()              # newest complete checkpoint, or None
    state = load_checkpoint(path)

A checkpoint is one file `step_00001234.pt`, written to a temporary file in the same
directory, flushed and fsync'd, renamed over its final name (atomic on POSIX), and the
directory fsync'd so the rename itself is durable. A kill during the write leaves only
a `.tmp` file, which `latest()` ignores and the next save removes.

Integrity: the proof travels inside the file. torch.save writes a zip archive; its SHA-256
is computed while the bytes go out (no second read) and sealed into the archive's zip
comment, `roberta_fast sha256 <digest of the archive as torch wrote it, comment empty>`,
which torch.load and every zip reader ignore. The SHA-256 of the whole sealed file is also
written beside it in `step_00001234.pt.sha256` (`sha256sum -c` format), before the
checkpoint's rename. Loading checks both, whichever exist, in one sequential read (then
torch.load reads from the page cache), so a checkpoint copied without its sidecar is still
verified. It raises DamagedCheckpoint for a mismatch, a truncated archive (its end record
gone), a 0-byte file or a garbled sidecar; UnverifiedCheckpoint for a zip with neither proof
(another program's file, or an older roberta_fast's without its sidecar), loaded with a note
only under `trust=True`; and a plain ValueError for a raw (non-zip) pickle: "not a
roberta_fast checkpoint". `load_latest()` (the trainer's auto-resume) skips damaged and
unverifiable checkpoints with one line each and takes the newest that verifies; a raw
pickle, or a file refused for its unsafe globals (below), is NOT damage: someone put it
there, and it stays a hard error that auto-resume never skips past.

Disk space: before writing, `save` checks the free space for one checkpoint (the size
of its tensors plus a margin sized to them, or the previous checkpoint's size if
larger). With room, it writes the new file, checks its size, then deletes the oldest
beyond `keep` (so `keep` checkpoints need room for keep + 1 only while saving). Short of
room, it deletes the oldest first, never the newest good one; if that is not enough, or
the disk fills during the write, it raises DiskSpaceError naming the sizes and the
directory, and the last good checkpoint is untouched.

Checkpoints are read with `torch.load(weights_only=True)`: tensors, plain containers,
numbers and strings only, so a checkpoint from someone else (a shared scratch disk, a
download) cannot run code when it is loaded. What this package saves is made of exactly
those (`rng_state` keeps NumPy's generator as a tensor). A file that needs more, such as a
checkpoint from an older roberta_fast or a crafted one, is refused with an error naming
the objects it asks for; `trust=True` (`--trust-checkpoint` in the CLIs) reads it with
the full unpickler, for files the user wrote themselves. A loaded checkpoint's fields must have
the types roberta_fast writes (`check_fields`), and `restoring` turns a field a resume cannot
use into one ValueError naming it: an edited file fails with its field named, not a traceback.

`RunLock` makes one writer per run directory (train and finetune): an advisory lock
(flock) on `<out>/run.lock`, held while the run lives and released by the kernel when the
process ends, kill -9 included, so a stale lock never blocks a restart. The file holds the
holder's pid and host.

`StopSignal` turns the first SIGTERM / SIGINT into a flag the training loop checks once
per step (it then saves and exits); a second SIGINT interrupts at once.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import sys
from pathlib import Path

import torch

from .files import atomic_path, write_text_atomic
from .integrity import HashingWriter, human_bytes, is_no_space, sha256_prefix

_NAME = re.compile(r"^step_(\d{8,})\.pt$")
CHECKSUM_SUFFIX = ".sha256"
_END, _END_SIZE = b"PK\x05\x06", 22  # a zip archive's end record, then its comment (length: its last 2 bytes)
PROOF_TAG = b"roberta_fast sha256 "  # the comment that seals a checkpoint: this, then 64 hex digits
_PROOF_SIZE = len(PROOF_TAG) + 64


class DamagedCheckpoint(ValueError):
    """A checkpoint whose bytes fail their checksum or cannot be read: corruption, not a refusal."""


class UnverifiedCheckpoint(ValueError):
    """A checkpoint that carries no checksum at all (none sealed inside, no sidecar): never trained on unasked."""


class DiskSpaceError(RuntimeError):
    """A checkpoint could not be saved for want of disk space; the last good one is untouched."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def checksum_path(path: str | os.PathLike) -> Path:
    """The sidecar holding a checkpoint's SHA-256: `step_N.pt.sha256`."""
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def atomic_torch_save(obj, path: str | os.PathLike) -> int:
    """torch.save to `path` via temp file + fsync + rename + directory fsync, sealed with the
    SHA-256 of the archive in its zip comment and with its `.sha256` sidecar written
    (atomically) before the rename; returns the bytes written. Both files end with a plain
    write's permissions (roberta_fast.files).

    A failed write raises the OSError itself (ENOSPC included), not torch's "unexpected pos"."""
    path = Path(path)
    writer = None
    try:
        with atomic_path(path, durable=True) as tmp:
            with open(tmp, "wb") as f:
                writer = HashingWriter(f, hold=_END_SIZE)  # the end record, rewritten below
                torch.save(obj, writer)
                end = writer.held
                if end[:4] != _END or end[20:] != b"\0\0":
                    raise RuntimeError(f"torch.save ended {path.name} without a plain zip end record; "
                                       "this roberta_fast cannot seal it")
                seal = _seal(writer.hash_before_held(), end)
                f.seek(writer.size - 2)  # the comment's length and the comment, over the end record's last 2 bytes
                f.write(seal)
            full = writer.hash_before_held()
            full.update(end[:20] + seal)
            write_text_atomic(checksum_path(path), f"{full.hexdigest()}  {path.name}\n", durable=True)
    except BaseException:
        if writer is not None and writer.error is not None:
            raise writer.error from None
        raise
    return writer.size - 2 + len(seal)


def _seal(sha, end: bytes) -> bytes:
    """The new last bytes of an archive whose bytes but the `end` record are hashed in `sha`:
    the comment length and the comment `roberta_fast sha256 <digest of the archive as torch wrote it>`."""
    sha = sha.copy()
    sha.update(end)
    comment = PROOF_TAG + sha.hexdigest().encode()
    return struct.pack("<H", len(comment)) + comment


def _check_format(path: Path) -> None:
    """Refuse what is not a zip archive: an empty file or other bytes (DamagedCheckpoint), a raw
    pickle (ValueError: a file someone put there, never skipped)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} is empty (0 bytes): a save or a copy was cut short")
    if head[:1] == b"\x80":  # pickle's PROTO opcode: torch.save(..., _use_new_zipfile_serialization=False)
        raise ValueError(
            f"{str(path)!r} is not a roberta_fast checkpoint: it is a raw pickle, and roberta_fast writes zip "
            "archives sealed with their checksum. Move it out of the way (or pass another --out / --resume)")
    if head != b"PK\x03\x04":
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: it does not start as a zip archive")


def _read_sidecar(sidecar: Path) -> str:
    """The hex digest in a `.sha256` file; DamagedCheckpoint naming the file if it holds none."""
    words = sidecar.read_bytes().split()[:1]
    digest = words[0].decode("ascii", "replace").lower() if words else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise DamagedCheckpoint(
            f"the checksum file {str(sidecar)!r} is damaged (it holds no SHA-256 digest); delete it if "
            "the checkpoint is sealed (written by this roberta_fast): its own checksum is then checked")
    return digest


def verify_checkpoint(path: str | os.PathLike) -> str:
    """Check `path` against the digest sealed inside it and its `.sha256` sidecar, whichever
    it has, in one read; returns what verified it ("sealed", "sidecar" or both joined by "+").

    DamagedCheckpoint if a check fails or the archive's end is gone (truncated);
    UnverifiedCheckpoint if it has neither (another program's file, or one of an older
    roberta_fast copied without its sidecar)."""
    path = Path(path)
    _check_format(path)
    size = path.stat().st_size
    sidecar = checksum_path(path)
    expected = _read_sidecar(sidecar) if sidecar.is_file() else None
    with open(path, "rb") as f:
        f.seek(max(0, size - _END_SIZE - _PROOF_SIZE))
        tail = f.read()
    proof = struct.pack("<H", _PROOF_SIZE) + PROOF_TAG
    if tail[:4] == _END and tail[20:22 + len(PROOF_TAG)] == proof and len(tail) == _END_SIZE + _PROOF_SIZE:
        sealed, body = tail[-64:].decode("ascii", "replace"), size - 2 - _PROOF_SIZE
    elif tail[-_END_SIZE:-_END_SIZE + 4] == _END and tail[-2:] == b"\0\0":  # a zip without a comment
        sealed, body = None, size
    else:
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: its end is missing or overwritten "
                                "(truncated?), so it is not a complete zip archive")
    if sealed is None and expected is None:
        raise UnverifiedCheckpoint(
            f"checkpoint {str(path)!r} cannot be verified: it carries no checksum inside (roberta_fast seals "
            f"every checkpoint it writes) and has no checksum file {sidecar.name} beside it; it was written by "
            "another program or an older roberta_fast. If you know it is intact, write its checksum file "
            f"(sha256sum {path.name} > {sidecar.name}) or pass --trust-checkpoint")
    prefix = sha256_prefix(path, body)
    how = []
    if sealed is not None:
        actual = prefix.copy()
        actual.update(b"\0\0")  # the archive as torch wrote it: no comment
        if actual.hexdigest() != sealed:
            raise DamagedCheckpoint(
                f"checkpoint {str(path)!r} is damaged: its content does not match the checksum sealed inside it "
                f"(SHA-256 {actual.hexdigest()[:16]}... instead of {sealed[:16]}...)")
        how.append("sealed")
    if expected is not None:
        actual = prefix.copy()
        actual.update(tail[len(tail) - (size - body):] if size > body else b"")
        if actual.hexdigest() != expected:
            raise DamagedCheckpoint(
                f"checkpoint {str(path)!r} is damaged: its content does not match its checksum in {sidecar.name} "
                f"(SHA-256 {actual.hexdigest()[:16]}... instead of {expected[:16]}...)"
                + ("; the checksum sealed inside it matches, so the checksum file may belong to another copy: "
                   "delete it to load this file" if how else ""))
        how.append("sidecar")
    return "+".join(how)


def load_checkpoint(path: str | os.PathLike, map_location="cpu", trust: bool = False, log=_stderr) -> dict:
    """Load a checkpoint file (or a directory's latest), verified, without running code from it.

    DamagedCheckpoint (a ValueError) naming the file if it fails a checksum or cannot be read;
    UnverifiedCheckpoint if it carries no checksum at all (loaded with a note under `trust`);
    ValueError if it needs Python objects beyond tensors and plain containers (`trust=True`
    loads those: only for files you wrote yourself) or is not a roberta_fast checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        found = CheckpointManager(path).latest()
        if found is None:
            raise ValueError(f"no checkpoint (step_*.pt) in {str(path)!r}")
        path = found
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    try:
        verify_checkpoint(path)
    except UnverifiedCheckpoint:
        if not trust:
            _refuse_unsafe(path)  # a planted file is a hard error, never a skip
            raise
        log(f"note: --trust-checkpoint: loading {path} unverified (no checksum inside it, no {checksum_path(path).name})")
    if not trust:
        _refuse_unsafe(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=not trust)
    except Exception as err:  # verified but unreadable: a foreign archive
        first = str(err).strip().splitlines()[:1]
        raise DamagedCheckpoint(
            f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}{': ' + first[0] if first else ''})"
        ) from err
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{str(path)!r} is not a roberta_fast training checkpoint")
    check_fields(state, path)
    return state


# The type of each field a train or finetune checkpoint may hold (absent ones are not checked here:
# the reader of each says what it needs). A file from someone else passes weights_only loading with
# any plain containers in these places; this check turns a wrong one into one ValueError instead
# of a KeyError / TypeError deep in the export or the resume.
_FIELD_TYPES = {
    "step": int, "tokens_seen": int, "world_size": int, "epochs_evaluated": int,
    "model": dict, "optimizer": dict, "schedule": dict, "scaler": dict, "loader": dict, "window": dict,
    "config": dict, "model_config": dict, "rng": (dict, list), "tokenizer_hash": str,
    "resumed_from": (list, type(None)), "labels": (list, type(None)), "task": str, "export_pending": bool,
    "best": (dict, type(None)), "best_metric": str,
}


def check_fields(state: dict, path) -> None:
    """ValueError naming the field if a checkpoint's top-level field, or one of its model weights,
    is not of the type roberta_fast writes (an edited or foreign file)."""
    def wrong(what: str, value) -> ValueError:
        return ValueError(f"checkpoint {str(path)!r} is not a roberta_fast checkpoint: its {what} is "
                          f"{type(value).__name__} {str(value)[:60]!r}; it was edited or written by another "
                          "program (export or resume the run's own checkpoint)")

    for field, types in _FIELD_TYPES.items():
        value = state.get(field)
        if field in state and (not isinstance(value, types) or (types is int and isinstance(value, bool))):
            raise wrong(f"'{field}'", value)
    for name, weight in state.get("model", {}).items():
        if not isinstance(name, str) or not isinstance(weight, torch.Tensor):
            raise wrong(f"model weight {name!r}", weight)


@contextlib.contextmanager
def restoring(path):
    """Around a resume's load_state_dict: a field missing from or malformed in the checkpoint at
    `path` (found only while restoring it: an edited file, another version's or program's) becomes
    one ValueError naming it, instead of a KeyError deep in the optimizer or the loader."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(f"checkpoint {str(path)!r} cannot be resumed: restoring it met {type(err).__name__} "
                         f"{str(err)[:200]}; it was edited, or written by another program or roberta_fast version: "
                         "resume from another checkpoint, or use a new --out") from err
    except RuntimeError as err:
        if not str(err).startswith("Error(s) in loading state_dict"):
            raise
        raise ValueError(f"checkpoint {str(path)!r} cannot be resumed: its weights do not fit this run's model "
                         f"({str(err).splitlines()[1].strip()[:200]}); it was edited, or written by another "
                         "roberta_fast version: resume from another checkpoint, or use a new --out") from err


def _refuse_unsafe(path: Path) -> None:
    """ValueError if the checkpoint's pickle asks for globals weights_only refuses (see module doc)."""
    unsafe = _unsafe_globals(path)
    if unsafe:
        raise ValueError(
            f"refusing to load checkpoint {str(path)!r}: it holds Python objects beyond tensors and "
            f"plain containers ({', '.join(unsafe[:6])}{', ...' if len(unsafe) > 6 else ''}), and "
            "unpickling them can run arbitrary code. Checkpoints written by older roberta_fast versions "
            "hold NumPy's RNG state this way; if you wrote this file yourself, pass "
            "--trust-checkpoint (trust=True) to load it anyway. Never do so for a file from someone else.")


def _unsafe_globals(path: Path) -> list[str]:
    """The Python globals a checkpoint's pickle asks for beyond weights_only's allow-list
    (read from the pickle's opcodes, nothing executed); [] for a file that is not a
    torch zip checkpoint (torch.load then reports it)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        return []


def estimate_size(state) -> int:
    """Bytes torch.save will about write for `state`: its tensors' storages plus a margin sized
    to them, 512 bytes per tensor (its pickle entry, zip records and alignment: about 250 measured)
    and 64 KiB for the rest (the config, Python's RNG state, the seal)."""
    storages, stack = {}, [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            storages[(s.data_ptr(), s.device)] = s.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sum(storages.values()) + 512 * len(storages) + (64 << 10)


class CheckpointManager:
    """Numbered, checksummed checkpoints in one directory: atomic save with a disk-space check,
    keep the last `keep`, find the latest (or the newest that verifies)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2, log=_stderr):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1][1] if ckpts else None

    def load_latest(self, map_location="cpu", trust: bool = False) -> tuple[Path, dict, list[tuple[Path, str]]] | None:
        """(path, state, skipped) of the newest checkpoint that verifies and reads, skipping
        damaged and unverifiable ones with one line each (`skipped`: (path, "damaged" or
        "unverified")); None if there is none at all.

        A checkpoint refused for unsafe globals, or that is not a roberta_fast checkpoint at
        all (a raw pickle), raises: that is not damage. If no checkpoint is usable,
        DamagedCheckpoint says so."""
        skipped = []
        for _, path in reversed(self.checkpoints()):
            try:
                return path, load_checkpoint(path, map_location, trust, self.log), skipped
            except (DamagedCheckpoint, UnverifiedCheckpoint) as err:
                kind = "damaged" if isinstance(err, DamagedCheckpoint) else "unverified"
                self.log(f"skipping the {kind} checkpoint {path.name}: {err}")
                skipped.append((path, kind))
            except ValueError:
                if path.exists():
                    raise
                skipped.append((path, "damaged"))  # removed meanwhile (another rank set it aside)
        if skipped:
            raise DamagedCheckpoint(
                f"no checkpoint in {str(self.directory)!r} can be resumed from "
                f"({', '.join(f'{p.name}: {kind}' for p, kind in skipped)}); move them away (or use a new "
                "--out) to start the run over")
        return None

    def set_aside(self, path: Path, kind: str = "damaged") -> Path:
        """Rename a skipped checkpoint (and its checksum) to `*.damaged` (or `*.<kind>`), out of the run's way."""
        aside = path.with_name(f"{path.name}.{kind}")
        if path.exists():
            os.replace(path, aside)
        sidecar = checksum_path(path)
        if sidecar.exists():
            os.replace(sidecar, sidecar.with_name(f"{sidecar.name}.{kind}"))
        return aside

    def _delete(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)

    def save(self, step: int, state: dict) -> Path:
        """Write `state` as the checkpoint of `step`, then prune to the newest `keep`.

        DiskSpaceError, with the previous checkpoints kept, if the disk has no room for it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".step_*.tmp"):  # left by a killed writer
            stale.unlink(missing_ok=True)
        for sidecar in self.directory.glob(f"step_*.pt{CHECKSUM_SUFFIX}"):  # killed before its rename
            if not sidecar.with_name(sidecar.name[:-len(CHECKSUM_SUFFIX)]).exists():
                sidecar.unlink(missing_ok=True)
        path = self.path_for(step)
        others = [p for s, p in self.checkpoints() if s != step]
        need = max([estimate_size(state)] + [p.stat().st_size for p in others[-1:]])
        self._make_room(path, need, others)
        try:
            size = atomic_torch_save(state, path)
        except OSError as err:
            if not is_no_space(err):
                raise
            raise DiskSpaceError(
                f"the disk ran out of space while saving checkpoint {path.name} in {str(self.directory)!r} "
                f"(about {human_bytes(need)} needed; {human_bytes(shutil.disk_usage(self.directory).free)} "
                f"free now). {self._kept(others)}") from None
        if path.stat().st_size != size:
            raise DiskSpaceError(f"checkpoint {path} holds {path.stat().st_size} bytes after saving {size}; "
                                 f"the disk may be failing. {self._kept(others)}")
        for _, old in self.checkpoints()[:-self.keep]:
            self._delete(old)
        return path

    def _make_room(self, path: Path, need: int, others: list[Path]) -> None:
        """Ensure `need` bytes are free for `path`, deleting the oldest of `others` (never the
        newest) when short; DiskSpaceError if that cannot make room."""
        free = shutil.disk_usage(self.directory).free
        doomed = others[:-1]
        while free < need and doomed:
            old = doomed.pop(0)
            extra = len(others) - self.keep + 1  # how many the prune after this save deletes anyway
            self._delete(old)
            self.log(f"note: deleted checkpoint {old.name} before saving {path.name}, to make room "
                     f"({human_bytes(free)} free, about {human_bytes(need)} needed)"
                     + ("" if extra > 0 else f"; fewer than --keep-checkpoints {self.keep} will remain"))
            others = others[1:]
            free = shutil.disk_usage(self.directory).free
        if free < need:
            raise DiskSpaceError(
                f"not enough disk space to save checkpoint {path.name}: it needs about {human_bytes(need)} "
                f"in {str(self.directory)!r} and that disk has {human_bytes(free)} free. {self._kept(others)}")

    def _kept(self, others: list[Path]) -> str:
        if not others:
            return "No checkpoint was saved yet: free some space or move --out to a larger disk."
        return (f"The last good checkpoint, {others[-1].name}, is untouched: free some space (or move --out "
                "to a larger disk) and rerun the same command to resume from it.")


class RunLock:
    """One writer per run directory: an exclusive flock on `<directory>/run.lock` (see module doc)."""

    NAME = "run.lock"

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / self.NAME
        self._file = None

    def acquire(self, log=_stderr) -> "RunLock":
        """Take the lock, or raise ValueError naming the process that holds it."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            log(f"note: no file locks on this platform: nothing stops a second run on {self.path.parent}")
            return self
        try:
            f = open(self.path, "a+")
        except IsADirectoryError:
            raise ValueError(f"{str(self.path)!r} is a directory, where roberta_fast keeps its one-writer lock file: "
                             "remove it (rmdir) or pass another --out") from None
        for attempt in range(2):
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "pid unknown"
                if attempt == 0 and holder.startswith(f"pid {os.getpid()} "):
                    import gc  # an unreferenced Trainer of this process, not yet collected
                    gc.collect()
                    continue
                f.close()
                raise ValueError(
                    f"another run ({holder}) is writing to {str(self.path.parent)!r}: two runs on one --out "
                    "would overwrite each other's checkpoints and metrics. Wait for it to end (or stop it), "
                    "or pass another --out") from None
            except OSError as err:  # a filesystem without locks
                f.close()
                log(f"note: cannot lock {self.path} ({err.strerror}): nothing stops a second run on this --out")
                return self
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        except OSError as err:
            if not is_no_space(err):
                raise
            with contextlib.suppress(OSError):  # ours (locked): a lock file no run holds is removed
                self.path.unlink()
            with contextlib.suppress(OSError):  # the unwritten line stays in the buffer: close may fail again
                f.close()
            raise ValueError(f"no space left on the disk of {str(self.path.parent)!r} (writing its {self.NAME}): "
                             "free some space, or pass another --out") from None
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file releases the lock
            self._file = None


class StopSignal:
    """While installed, SIGTERM and the first SIGINT set `requested` instead of killing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    WHAT_NEXT = "saving a checkpoint after this step, then exiting (Ctrl-C again to abort without saving)"

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = name
        if os.environ.get("RANK", "0") == "0":  # once per job under torchrun, which signals every rank
            print(f"\n{name} received: {self.WHAT_NEXT}", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignal":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
