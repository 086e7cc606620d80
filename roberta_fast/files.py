"""Atomic writes that end with the permissions a plain write would give.

    with atomic_path(path) as tmp:        # any writer fills tmp (open, torch.save, save_file, savefig)
        ...                               # then tmp is renamed onto path; on an error it is removed
    write_text_atomic(path, text)
    with temp_dirs_guarded(directory):    # first removes the ones killed writers left beside it
        tmp = temp_dir_for(directory)     # a directory to fill, then os.replace it onto `directory`

Every file the package writes goes through a temporary name and a rename, so no reader
ever sees half a file. `tempfile.mkstemp` makes the temporary file private (0600) and
`mkdtemp` its directory 0700, and a rename keeps those modes: exports were readable by
their owner only, where a plain write gives 0644 / 0755 under the usual umask 022. So the
file a rename publishes gets the mode a plain write would: an existing file's own mode,
else 0666 less the umask (directories 0777 less the umask). Under umask 077 that is still
owner-only, as the user asked.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def umask() -> int:
    """The process's umask: read from /proc on Linux, else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # (briefly process-wide: only where /proc cannot tell)
    os.umask(mask)
    return mask


def file_mode(path: str | os.PathLike) -> int:
    """The mode a plain `open(path, "w")` leaves: the existing file's, else 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode a plain `mkdir` gives: 0777 less the umask."""
    return 0o777 & ~umask()


def temp_path_for(path: str | os.PathLike) -> Path:
    """A new empty file beside `path` (`.NAME.XXXXXXXX.tmp`) to write before `publish`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def publish(tmp: str | os.PathLike, path: str | os.PathLike, durable: bool = False) -> None:
    """Give `tmp` the mode a plain write of `path` would have and rename it onto `path`.

    durable: fsync the file before the rename and the directory after it, so the new
    content survives a power cut (checkpoints)."""
    os.chmod(tmp, file_mode(path))
    if durable:
        _fsync(tmp)
    os.replace(tmp, path)
    if durable:
        _fsync(Path(path).parent)


@contextmanager
def atomic_path(path: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write; published onto `path` when the
    block ends, removed if it raises."""
    tmp = temp_path_for(path)
    try:
        yield tmp
        publish(tmp, path, durable)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, durable: bool = False) -> None:
    """Write `text` (UTF-8) to `path` atomically, with a plain write's permissions."""
    with atomic_path(path, durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


def temp_dir_for(directory: str | os.PathLike) -> Path:
    """A new directory beside `directory` (`.NAME.XXXXXXXX`) with a plain mkdir's mode, to fill
    and then rename onto `directory` (mkdtemp alone would leave it 0700)."""
    directory = Path(directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    os.chmod(tmp, dir_mode())
    return tmp


@contextmanager
def temp_dirs_guarded(directory: str | os.PathLike) -> Iterator[None]:
    """For a block that writes a temp_dir_for(directory) and renames it onto `directory`: first
    removes the ones writers killed before their rename left beside it (exactly `.NAME.XXXXXXXX`,
    temp_dir_for's names for it; nothing else), then holds a shared flock on the parent directory
    until the block ends. The removal needs the exclusive flock, so it never takes a live writer's
    directory (another process exporting there) for a stale one; where there is no flock (not
    POSIX, a filesystem without locks) nothing is removed."""
    directory = Path(directory)
    try:
        import fcntl

        fd = os.open(directory.parent, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        if _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):  # no writer at work beside it: theirs are stale
            stale = re.compile(re.escape(f".{directory.name}.") + "[a-z0-9_]{8}")  # mkdtemp's 8 characters
            for path in directory.parent.iterdir():
                if stale.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
        _flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _flock(fd: int, operation: int) -> bool:
    """flock(fd, operation); False if another process holds the lock or the filesystem has none."""
    import fcntl

    try:
        fcntl.flock(fd, operation)
        return True
    except OSError:
        return False


def _fsync(path: str | os.PathLike) -> None:
    """fsync a file or a directory (directories: skipped where the platform cannot open them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if os.path.isdir(path):
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


def absolute_if_local(value: str | None) -> str | None:
    """`value` as an absolute path if it names a local file or directory, else as it is (a Hub
    name, None): what a checkpoint records, so a tool run from another directory finds it."""
    return str(Path(value).resolve()) if value and os.path.exists(value) else value


def inside(root: str | os.PathLike, name, what: str, fix: str) -> Path:
    """`root / name` for a file name read from a file in `root` (a manifest, state.json), refused
    unless it is a relative path that stays inside `root`: a received directory must not make a tool
    read files elsewhere. Checked on the name, not the resolved path, so links the directory's owner
    made (train/ on another disk) still work. ValueError naming `what` (the entry), the name and `fix`."""
    if not isinstance(name, str) or os.path.normpath(name or ".") == ".":
        raise ValueError(f"{what} is {name!r}, not a file name: {fix}")
    if os.path.isabs(name):
        raise ValueError(f"{what} is the absolute path {name!r}, not a file inside {str(root)!r}: {fix}")
    parts = Path(os.path.normpath(name)).parts
    if parts and parts[0] == "..":
        raise ValueError(f"{what} {name!r} points outside {str(root)!r}: {fix}")
    return Path(root) / name
