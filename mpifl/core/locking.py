"""The run lock: one writer per results file, and stale temporary files.

A run ``RUN.h5`` is locked by ``RUN.h5.lock`` beside it: the file holds ``host pid`` of its owner
and is held with ``fcntl.flock`` while the run writes. The kernel drops the flock when the owner
dies however it dies (``kill -9`` included), so a lock left behind by a dead process is simply
taken over (stale-lock detection); on file systems without ``flock`` the lock falls back to an
exclusive create, and a lock file naming a pid that no longer exists on this host is stale.

The lock is taken before anything of the run is opened for writing: a second ``mpifl run``,
``--overwrite`` or ``resume`` on a live run refuses in one line and touches nothing.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
from pathlib import Path

from mpifl.core.errors import OutputError

log = logging.getLogger("mpifl.lock")

_TMP = re.compile(r"\.tmp-(\d+)$")


def lock_path(results: Path) -> Path:
    """``RUN.h5`` -> ``RUN.h5.lock``."""
    return results.with_name(results.name + ".lock")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(path: Path) -> tuple[str, int] | None:
    try:
        host, pid = path.read_text().split()[:2]
        return host, int(pid)
    except (OSError, ValueError):
        return None


class RunLock:
    """An exclusive lock on one run (its results file and checkpoint folder).

    Use :meth:`acquire` (raises :class:`OutputError` when another live process holds it) and
    :meth:`release`; also a context manager.
    """

    def __init__(self, results: Path) -> None:
        self.results = Path(results)
        self.path = lock_path(self.results)
        self._fd: int | None = None
        self._exclusive_file = False  # fallback without flock: we created the file

    def acquire(self) -> "RunLock":
        me = f"{socket.gethostname()} {os.getpid()}\n"
        for _ in range(20):  # retries only when the lock file is replaced under us
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OutputError(f"--out {self.results}: cannot write there "
                                  f"({exc.strerror or exc})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputError(self._busy_message()) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    return self._acquire_exclusive(me)
                raise OutputError(f"{self.path}: cannot lock ({exc.strerror or exc})") from None
            try:  # the file we locked must still be the one at the path (not unlinked by a
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino  # releasing owner)
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            old = _owner(self.path)
            if old is not None and (old[0], old[1]) != (socket.gethostname(), os.getpid()):
                log.info("taking over the stale run lock %s of pid %d on %s (no longer running)",
                         self.path, old[1], old[0])
            try:
                os.ftruncate(fd, 0)
                os.write(fd, me.encode())
            except OSError as exc:  # a full disk (or EIO) before anything of the run is written
                self._discard(fd)
                raise OutputError(f"cannot write run lock {self.path}: "
                                  f"{exc.strerror or exc}") from None
            self._fd = fd
            return self
        raise OutputError(f"{self.path}: cannot lock (the lock file keeps changing)")

    def _acquire_exclusive(self, me: str) -> "RunLock":
        """Without flock: create the file exclusively; a file of a dead pid here is stale."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                old = _owner(self.path)
                if old and old[0] == socket.gethostname() and not pid_alive(old[1]):
                    log.info("removing the stale run lock %s of pid %d", self.path, old[1])
                    self.path.unlink(missing_ok=True)
                    continue
                raise OutputError(self._busy_message()) from None
            try:
                os.write(fd, me.encode())
            except OSError as exc:
                self._discard(fd)
                raise OutputError(f"cannot write run lock {self.path}: "
                                  f"{exc.strerror or exc}") from None
            self._fd, self._exclusive_file = fd, True
            return self
        raise OutputError(self._busy_message())

    def _discard(self, fd: int) -> None:
        """Remove the lock file this process holds (or created) but could not write, and close
        it: nothing of the run is left behind."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(fd)

    def _busy_message(self) -> str:
        old = _owner(self.path)
        who = f"pid {old[1]} on {old[0]}" if old else "another process"
        return (f"{self.results} is in use by a live run ({who}; lock {self.path}); "
                "wait for it to end or stop it first")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiter re-checks the inode
        except OSError:
            pass
        if not self._exclusive_file:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def owner_alive(results: Path) -> bool:
    """Whether a live process holds the run lock of ``results`` (read-only: a shared
    ``flock`` attempt is refused while the owner holds its exclusive one). Without flock, a
    lock file naming a live pid on this host counts as held."""
    path = lock_path(Path(results))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # no lock file: the owner released it, or never ran
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        old = _owner(path)
        return bool(old and (old[0] != socket.gethostname() or pid_alive(old[1])))
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def clean_stale_temporaries(folder: Path, prefix: str = "") -> list[Path]:
    """Remove ``<prefix>*.tmp-PID`` files in ``folder`` whose PID is not running on this host
    (left by a writer killed mid-write). Called under the run lock, so no live writer of this
    run can own them unless its pid is still alive."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = _TMP.search(p.name)
        if m and p.name.startswith(prefix) and int(m.group(1)) != os.getpid() \
                and not pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    if removed:
        log.info("removed %d stale temporary file(s) in %s", len(removed), folder)
    return removed
