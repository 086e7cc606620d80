"""Checkpoints that survive a kill at any moment, and the stop signal that triggers one.

    ckpt = CheckpointManager(out_dir / "checkpoints", keep=2)
    ckpt.save(step, state)            # state: any torch.save-able dict
    path = ckpt.latest()              # newest complete checkpoint, or None
    state = load_checkpoint(path)

A checkpoint is one file `step_00001234.pt`, written to a temporary file in the same
directory, flushed and fsync'd, renamed over its final name (atomic on POSIX), and the
directory fsync'd so the rename itself is durable. A kill during the write leaves only
a `.tmp` file, which `latest()` ignores and the next save removes. After a save the
oldest checkpoints beyond `keep` are deleted.

Checkpoints are read with `torch.load(weights_only=True)`: tensors, plain containers,
numbers and strings only, so a checkpoint from someone else (a shared scratch disk, a
download) cannot run code when it is loaded. What this package saves is made of exactly
those (`rng_state` keeps NumPy's generator as a tensor). A file that needs more, such as a
checkpoint from an older roberta_fast or a crafted one, is refused with an error naming
the objects it asks for; `trust=True` (`--trust-checkpoint` in the CLIs) reads it with
the full unpickler, for files the user wrote themselves.

`StopSignal` turns the first SIGTERM / SIGINT into a flag the training loop checks once
per step (it then saves and exits); a second SIGINT interrupts at once.
"""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import torch

_NAME = re.compile(r"^step_(\d{8,})\.pt$")


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """torch.save to `path` via temp file + fsync + rename + directory fsync."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, map_location="cpu", trust: bool = False) -> dict:
    """Load a checkpoint file (or a directory's latest) without running code from it.

    ValueError naming the file if it is not a readable checkpoint, or if it needs Python
    objects beyond tensors and plain containers (`trust=True` loads those: only for files
    you wrote yourself).
    """
    path = Path(path)
    if path.is_dir():
        found = CheckpointManager(path).latest()
        if found is None:
            raise ValueError(f"no checkpoint (step_*.pt) in {str(path)!r}")
        path = found
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    if not trust:
        unsafe = _unsafe_globals(path)
        if unsafe:
            raise ValueError(
                f"refusing to load checkpoint {str(path)!r}: it holds Python objects beyond tensors and "
                f"plain containers ({', '.join(unsafe[:6])}{', ...' if len(unsafe) > 6 else ''}), and "
                "unpickling them can run arbitrary code. Checkpoints written by older roberta_fast versions "
                "hold NumPy's RNG state this way; if you wrote this file yourself, pass "
                "--trust-checkpoint (trust=True) to load it anyway. Never do so for a file from someone else.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=not trust)
    except Exception as err:  # truncated or foreign file
        raise ValueError(f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{str(path)!r} is not a roberta_fast training checkpoint")
    return state


def _unsafe_globals(path: Path) -> list[str]:
    """The Python globals a checkpoint's pickle asks for beyond weights_only's allow-list
    (read from the pickle's opcodes, nothing executed); [] for a file that is not a
    torch zip checkpoint (torch.load then reports it)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        return []


class CheckpointManager:
    """Numbered checkpoints in one directory: atomic save, keep the last `keep`, find the latest."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep

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

    def save(self, step: int, state: dict) -> Path:
        """Write `state` as the checkpoint of `step`, then prune to the newest `keep`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".step_*.tmp"):  # left by a killed writer
            stale.unlink(missing_ok=True)
        path = self.path_for(step)
        atomic_torch_save(state, path)
        for _, old in self.checkpoints()[:-self.keep]:
            old.unlink(missing_ok=True)
        return path


class StopSignal:
    """While installed, SIGTERM and the first SIGINT set `requested` instead of killing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = name
        print(f"\n{name} received: saving a checkpoint after this step, then exiting "
              "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

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
