"""Checksums and disk space: the helpers behind verified checkpoints and dataset shards.

    writer = HashingWriter(f)            # wraps a binary file: .sha256 / .size of what went through it
    torch.save(obj, writer)              # (or np.save) hashed while written: no second read
    sha256_file(path)                    # hex SHA-256 of a file, read in 16 MiB blocks
    sha256_prefix(path, n)               # a hashlib object over the file's first n bytes, to extend
    is_no_space(err)                     # whether an exception is a full disk (or quota), any library's
    human_bytes(1.4e9)                   # "1.4 GB"

SHA-256 because `sha256sum -c` checks the same digests from a shell (a checkpoint's sidecar
file is in its format); it hashes at about 1-2 GB/s per core with the SHA extensions of
current x86 and ARM CPUs, so verifying costs about one sequential read of the file.
"""
from __future__ import annotations

import errno
import hashlib
import math
import os

BLOCK = 16 << 20
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file at `path`."""
    return sha256_prefix(path).hexdigest()


def sha256_prefix(path: str | os.PathLike, n: int | None = None):
    """A hashlib SHA-256 object fed the first `n` bytes of `path` (all of it by default)."""
    sha = hashlib.sha256()
    left = math.inf if n is None else n
    with open(path, "rb") as f:
        while left > 0 and (block := f.read(int(min(BLOCK, left)))):
            sha.update(block)
            left -= len(block)
    return sha


def is_no_space(err: BaseException) -> bool:
    """A full disk or quota: an OSError's errno, or the "os error 28" (122) of Rust I/O
    errors that libraries such as safetensors raise as their own exception types."""
    if isinstance(err, OSError):
        return err.errno in NO_SPACE
    return any(f"os error {code})" in str(err) or f"code: {code}," in str(err) for code in NO_SPACE)


class HashingWriter:
    """A write-only binary file that hashes (SHA-256) and counts the bytes written through it.

    Keeps the OSError a write raised in `error`: torch.save reports a failed write only as
    "unexpected pos ...", and the caller needs to know it was ENOSPC.

    hold=k keeps the last k bytes written out of the running hash (`held`, `hash_before_held()`),
    for a caller that rewrites the end of the file and must hash what comes before it.
    """

    def __init__(self, f, hold: int = 0):
        self.f, self.size, self.error, self.hold = f, 0, None, hold
        self._sha = hashlib.sha256()
        self.held = b""

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if not self.hold:
            self._sha.update(view)
            return n
        if view.nbytes >= self.hold:  # the held bytes and all but the last `hold` of these go to the hash
            self._sha.update(self.held)
            self._sha.update(view[:view.nbytes - self.hold])
            self.held = bytes(view[view.nbytes - self.hold:])
        else:
            joined = self.held + bytes(view)
            self._sha.update(joined[:-self.hold])
            self.held = joined[-self.hold:]
        return n

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()

    def hash_before_held(self):
        """A copy of the hashlib object over every byte written but the `held` ones."""
        return self._sha.copy()

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of every byte written."""
        sha = self._sha.copy()
        sha.update(self.held)
        return sha.hexdigest()


def human_bytes(n: float) -> str:
    """A byte count in words a person reads at a glance: 512 bytes, 23.4 kB, 1.4 GB."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
