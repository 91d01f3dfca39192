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

HDF5 never sees a failed write. It writes through :class:`_Shielded` (h5py's ``fileobj``
driver), which does the I/O itself: the first ``OSError`` (ENOSPC, EIO, EDQUOT, ... any errno)
is kept, later writes go to memory, and HDF5 finishes and closes the file as if all went well.
Only then is the error raised, as one :class:`OutputError` naming the file, and the temporary is
removed. (Letting HDF5 see the error instead leaves its file open with metadata it cannot
flush: every later release of an h5py object prints "Can't decrement id ref count", and the
library can crash at exit.)
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar, cast

import h5py

from mpifl.core.errors import OutputError

USERBLOCK = 512
MAGIC = b"MPIFL-SHA256 "
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SEAL = re.compile(rb"^MPIFL-SHA256 ([0-9a-f]{64}) (\d+)\n\x00*$")
_R = TypeVar("_R")


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
        f.seek(0)
        f.write(_header(digest, n))
        f.flush()
        os.fsync(f.fileno())


def _header(digest: str, n: int) -> bytes:
    return (MAGIC + f"{digest} {n}\n".encode()).ljust(USERBLOCK, b"\x00")


class _Shielded:
    """The file object a new HDF5 file is written through (h5py's ``fileobj`` driver), so that
    no I/O error ever reaches HDF5.

    It writes with ``os.pwrite`` to ``path`` (created empty). The first exception (an
    ``OSError`` of any errno, or a signal handler's ``KeyboardInterrupt`` raised inside a call)
    is kept in :attr:`error` and the file counts as failed: from then on nothing goes to the
    disk, small writes (HDF5's metadata) are kept in memory so that HDF5 reads back what it
    wrote, large ones (raw data) are dropped. HDF5 therefore ends and closes the file normally;
    the caller then raises :attr:`error` and removes the file.
    """

    _KEEP_BELOW = 1 << 20  # after a failure, writes this large are raw data: dropped

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.pos = 0
        self.size = 0  # the end of the file as HDF5 sees it
        self.error: BaseException | None = None
        self._memory: list[tuple[int, bytes]] = []  # writes after the failure, in order

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def _guarded(self, call: Callable[..., _R], *args: Any) -> _R:
        """``call(*args)``, retried after an exception (kept in :attr:`error`): each call is
        idempotent, and once failed it no longer touches the disk."""
        for _ in range(100):
            try:
                return call(*args)
            except BaseException as exc:  # noqa: BLE001 -- nothing may reach HDF5
                self._fail(exc)
        # pragma: no cover -- a call that fails every time is a bug
        raise cast(BaseException, self.error)  # pragma: no cover

    # -- the methods h5py's fileobj driver calls ----------------------------------------------

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._guarded(self._seek, offset, whence)

    def _seek(self, offset: int, whence: int) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self._guarded(lambda: self.pos)

    def write(self, buf: Any) -> int:
        return self._guarded(self._write, memoryview(buf).cast("B"), self.pos)

    def _write(self, view: memoryview, pos: int) -> int:
        n = len(view)
        if self.error is None:
            try:
                done = 0
                while done < n:
                    k = os.pwrite(self.fd, view[done:], pos + done)
                    if k <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += k
            except OSError as exc:
                self._fail(exc)
        if self.error is not None and n < self._KEEP_BELOW:
            self._memory.append((pos, bytes(view)))
        self.pos = pos + n
        self.size = max(self.size, self.pos)
        return n

    def readinto(self, buf: Any) -> int:
        return self._guarded(self._readinto, memoryview(buf).cast("B"), self.pos)

    def _readinto(self, view: memoryview, pos: int) -> int:
        n = max(0, min(len(view), self.size - pos))
        got = 0
        try:
            while got < n:  # straight into HDF5's buffer: no copy of a large dataset
                k = os.preadv(self.fd, [view[got:n]], pos + got)
                if k <= 0:
                    break
                got += k
        except OSError as exc:
            self._fail(exc)
        if got < n:
            view[got:n] = bytes(n - got)
        for at, data in self._memory:  # what HDF5 wrote after the failure
            lo, hi = max(at, pos), min(at + len(data), pos + n)
            if lo < hi:
                view[lo - pos:hi - pos] = data[lo - at:hi - at]
        self.pos = pos + n
        return n

    def read(self, size: int = -1) -> bytes:
        return self._guarded(self._read, size)

    def _read(self, size: int | None) -> bytes:
        size = self.size - self.pos if size is None or size < 0 else size
        buf = bytearray(size)
        return bytes(buf[:self._readinto(memoryview(buf), self.pos)])

    def truncate(self, size: int | None = None) -> int:
        return self._guarded(self._truncate, self.pos if size is None else size)

    def _truncate(self, size: int) -> int:
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self._fail(exc)
        self.size = size
        self._memory = [(at, d[:max(0, size - at)]) for at, d in self._memory if at < size]
        return size

    def flush(self) -> None:
        pass  # every write is already in the kernel; :meth:`seal_and_sync` fsyncs

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    # -- after HDF5 has closed the file --------------------------------------------------------

    def seal_and_sync(self) -> None:
        """Write the digest header and fsync (raises the kept error, or this step's)."""
        if self.error is not None:
            raise self.error
        h = hashlib.sha256()
        pos, n = USERBLOCK, 0
        while chunk := os.pread(self.fd, 1 << 22, pos):
            h.update(chunk)
            pos += len(chunk)
            n += len(chunk)
        header = _header(h.hexdigest(), n)
        if os.pwrite(self.fd, header, 0) != len(header):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(self.fd)  # a delayed ENOSPC or EIO of the writes shows up here

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # an error here (NFS: a delayed EIO) is raised; fsync came first


def write_atomic(path: Path, fill: Callable[[h5py.File], None], what: str) -> None:
    """Create ``path`` as a sealed HDF5 file filled by ``fill(f)``, atomically.

    Any I/O error (a full disk, EIO, ...) ends in one :class:`OutputError` ``cannot write
    <what> <path>: <reason>``; HDF5 itself never sees it (:class:`_Shielded`), the temporary
    file is removed and ``path`` is untouched. An exception of ``fill`` (or a
    ``KeyboardInterrupt``) is raised as it is, after the same clean-up.

    Raises:
        OutputError: the file cannot be written; ``path`` is untouched.
    """
    tmp = temporary_for(path)
    sink: _Shielded | None = None
    try:
        sink = _Shielded(tmp)
        f = h5py.File(sink, "w", userblock_size=USERBLOCK)
        try:
            fill(f)
        finally:
            f.close()  # exactly once, with no I/O error pending: HDF5 closes cleanly
            del f
        sink.seal_and_sync()
        sink.close()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        if sink is not None:
            if sink.error is not None and not isinstance(exc, OSError):
                exc = sink.error  # the first error, not a consequence of it
            try:
                sink.close()
            except OSError:
                pass
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError)):  # RuntimeError: HDF5's own failures
            raise OutputError(f"cannot write {what} {path}: {reason(exc)}") from None
        raise exc from None


def reason(exc: BaseException) -> str:
    """An OS or HDF5 error in a few words: the errno's text when there is one."""
    text = " ".join(str(exc).split())
    if m := re.search(r"errno = (\d+)", text):  # HDF5's "file write failed: ... errno = 28"
        return os.strerror(int(m.group(1)))
    if isinstance(exc, OSError) and exc.strerror:
        return " ".join(exc.strerror.split())
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
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
