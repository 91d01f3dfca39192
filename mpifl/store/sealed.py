"""Sealed HDF5 files: a SHA-256 of the whole file in its user block, checked before HDF5 reads it.

mpifl's results files and checkpoints are created with a 512-byte HDF5 user block (HDF5 skips
it; its superblock starts at byte 512). After the file is written and closed, the user block
gets ``MPIFL-SHA256 <hex digest of bytes 512..end> <length>``. A reader verifies that digest on
the bytes it is about to hand to HDF5 (same open file, no second lookup of the path), so a
flipped byte or a truncation anywhere -- data, attributes or HDF5's own metadata -- is reported
in one line, and damaged metadata never reaches the HDF5 library (which may crash on it).

Files written before sealing (no user block) are still read; for them only HDF5's own checks
and mpifl's value checks apply.

Writes go to a temporary ``.NAME.tmp-PID`` beside the target, are fsynced and renamed over it:
a failure at any point (a full disk, a kill) leaves the previous file intact.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import BinaryIO, Callable

import h5py

from mpifl.core.errors import OutputError

USERBLOCK = 512
MAGIC = b"MPIFL-SHA256 "
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SEAL = re.compile(rb"^MPIFL-SHA256 ([0-9a-f]{64}) (\d+)\n\x00*$")


def temporary_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _hash_from(f: BinaryIO, offset: int) -> tuple[str, int]:
    h = hashlib.sha256()
    f.seek(offset)
    n = 0
    while chunk := f.read(1 << 22):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def seal(path: Path) -> None:
    """Write the digest of an HDF5 file created with ``userblock_size=USERBLOCK`` into it."""
    with open(path, "r+b") as f:
        digest, n = _hash_from(f, USERBLOCK)
        header = MAGIC + f"{digest} {n}\n".encode()
        f.seek(0)
        f.write(header.ljust(USERBLOCK, b"\x00"))
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, fill: Callable[[h5py.File], None], what: str) -> None:
    """Create ``path`` as a sealed HDF5 file filled by ``fill(f)``, atomically.

    Raises:
        OutputError: the file cannot be written (e.g. a full disk); ``path`` is untouched.
    """
    tmp = temporary_for(path)
    try:
        with h5py.File(tmp, "w", userblock_size=USERBLOCK) as f:
            fill(f)
        seal(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError)):  # h5py reports ENOSPC in several ways
            raise OutputError(f"cannot write {what} {path}: {reason(exc)}") from None
        raise


def reason(exc: BaseException) -> str:
    """An OS or HDF5 error in a few words: the errno's text when there is one."""
    text = " ".join(str(exc).split())
    if m := re.search(r"errno = (\d+)", text):  # HDF5's "file write failed: ... errno = 28"
        return os.strerror(int(m.group(1)))
    if isinstance(exc, OSError) and exc.strerror:
        return " ".join(exc.strerror.split())
    return text[:300] or type(exc).__name__


def open_verified(path: Path, what: str) -> tuple[BinaryIO, bool]:
    """Open ``path`` for reading and verify its seal.

    Returns:
        The open binary file (positioned at 0; hand it to ``h5py.File``) and whether it was
        sealed (False: an older file without a digest).

    Raises:
        OutputError: missing, not HDF5, truncated or damaged (digest mismatch).
    """
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise OutputError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    try:
        head = f.read(USERBLOCK + len(HDF5_SIGNATURE))
        if head.startswith(HDF5_SIGNATURE):
            f.seek(0)
            return f, False
        if head[USERBLOCK:] != HDF5_SIGNATURE and not head.startswith(MAGIC):
            raise OutputError(f"{path}: cannot read as HDF5 (not an HDF5 file, so not an "
                              f"mpifl {what})")
        m = _SEAL.match(head[:USERBLOCK])
        if m is None:
            raise OutputError(f"{path}: damaged {what} (its checksum header is unreadable)")
        digest, n = _hash_from(f, USERBLOCK)
        if n != int(m.group(2)):
            raise OutputError(f"{path}: unreadable {what}: cannot read as HDF5 (truncated: {n} "
                              f"of {int(m.group(2))} bytes after the header)")
        if digest != m.group(1).decode():
            raise OutputError(f"{path}: damaged {what} (checksum mismatch)")
        f.seek(0)
        return f, True
    except BaseException:
        f.close()
        raise


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
