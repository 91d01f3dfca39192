"""Download the datasets' official files, verified by their published MD5 sums (image sets) or
by SHA-256 (tabular sets: the values pinned in :data:`mpifl.data.tabular.SHA256`).

Each data set declares its files in its own module (:data:`mpifl.data.images.IMAGES`,
:data:`mpifl.data.tabular.URLS`). They land in ``root`` (default ``~/.cache/mpifl/data``, one of
the data roots searched by :func:`mpifl.data.load_federated`), in the data set's folder:
``fashion-mnist/`` and ``mnist/`` hold the four gzip IDX files; CIFAR tarballs are kept in
``root`` and extracted to ``cifar-10-batches-py/`` and ``cifar-100-python/``; ``adult/``,
``compas/`` and ``german/`` hold the tabular sets' files (the UCI and ProPublica originals;
:mod:`mpifl.data.tabular` reads them). Each download goes to a temporary name and is renamed
only after its checksum matches, so an interrupted or corrupted download never looks like a dataset. A file
already present with the right checksum is not downloaded again.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

from mpifl.core.errors import DataError
# the image sets declare their files and sources in their own module (IMAGES), the tabular
# sets in theirs (URLS, SHA256)
from mpifl.data import images as _images  # noqa: F401 -- registers SOURCES
from mpifl.data.roots import (LAYOUTS, SOURCES, DatasetLayout, Source, default_cache_root,
                              locate_file)
from mpifl.data.tabular import LAYOUTS as TABULAR_LAYOUTS
from mpifl.data.tabular import SHA256, URLS

_TIMEOUT_S = 60

#: The tabular fairness sets: UCI's and ProPublica's files, by SHA-256 (pinned once, in
#: :data:`mpifl.data.tabular.SHA256`).
TABULAR_SOURCES: dict[str, Source] = {
    name: Source(url, tuple(SHA256[name].items()), algorithm="sha256")
    for name, url in URLS.items()}
FETCHABLE = tuple(SOURCES) + tuple(TABULAR_SOURCES)


class _Hash(Protocol):
    """What the downloads use of a :mod:`hashlib` object."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def _hasher(algorithm: str) -> _Hash:
    return hashlib.new(algorithm, usedforsecurity=False)


def file_digest(path: Path, algorithm: str = "md5") -> str:
    """Hex digest of a file (``algorithm`` a :mod:`hashlib` name), read in 1 MiB blocks."""
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(url: str, dest: Path, md5: str, algorithm: str = "md5") -> None:
    """Fetch url to dest via a temporary file; verify its digest (``md5`` holds the expected
    hex digest of ``algorithm``) before the rename."""
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    h = _hasher(algorithm)
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as resp, open(tmp, "wb") as out:
            for block in iter(lambda: resp.read(1 << 20), b""):
                h.update(block)
                out.write(block)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise DataError(
            f"could not download {url} ({reason}); download it by hand and put it at {dest} "
            f"({algorithm} {md5})"
        ) from None
    if h.hexdigest() != md5:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"checksum mismatch for {url}: {algorithm} {h.hexdigest()}, expected {md5}; the "
            f"file was removed (a damaged download or a changed mirror; put the official file at {dest})"
        )
    os.replace(tmp, dest)


def _extract(tarball: Path, root: Path) -> None:
    """Extract a tarball into root, refusing links and paths that leave root."""
    # The "data" filter (PEP 706) rejects absolute paths, "..", links out of the tree and
    # device files; a Python without it (before 3.10.12 / 3.11.4) must not extract blindly.
    if not hasattr(tarfile, "data_filter"):
        raise DataError(f"this Python lacks tarfile's 'data' filter (PEP 706); upgrade it or "
                        f"extract {tarball} by hand into {root}")
    try:
        with tarfile.open(tarball, "r:*") as tar:
            members = tar.getmembers()
            for m in members:  # check every member first: a bad one leaves nothing behind
                tarfile.data_filter(m, str(root))
            tar.extractall(root, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"cannot extract {tarball}: {type(exc).__name__}: {exc}") from None


def _layout(name: str) -> DatasetLayout:
    return LAYOUTS[name] if name in LAYOUTS else TABULAR_LAYOUTS[name]


def _source(name: str) -> Source:
    return SOURCES[name] if name in SOURCES else TABULAR_SOURCES[name]


def _complete(name: str, folder: Path) -> bool:
    layout = _layout(name)
    return all(locate_file(folder, f, layout.gz_ok) for f in layout.files)


def fetch_dataset(name: str, root: str | Path | None = None,
                  base_url: str | None = None) -> Path:
    """Download (and for CIFAR extract) dataset ``name`` into ``root``; skip verified files.

    Args:
        name: one of :data:`FETCHABLE` (fashion_mnist, mnist, cifar10, cifar100, adult,
            compas, german).
        root: data root (default ``~/.cache/mpifl/data``).
        base_url: replaces the official base URL (a mirror, or ``file://`` in tests).
    Returns:
        the dataset folder, e.g. ``root/fashion-mnist``, ``root/cifar-10-batches-py`` or
        ``root/adult``.
    Raises:
        DataError: unknown name, a failed download, a checksum mismatch (the file is removed),
            or a tarball that cannot be extracted safely.
    """
    if name not in SOURCES and name not in TABULAR_SOURCES:
        raise DataError(f"cannot fetch '{name}' (fetchable: {', '.join(FETCHABLE)})")
    src, layout = _source(name), _layout(name)
    root = Path(root).expanduser() if root is not None else default_cache_root()
    folder = root / layout.subdir
    download_dir = root if src.archive else folder
    try:
        download_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {download_dir}: {exc}") from None
    base = (base_url or src.base_url).rstrip("/") + "/"
    for fname, digest in src.files:
        dest = download_dir / fname
        if dest.is_file() and file_digest(dest, src.algorithm) == digest:
            continue  # already there and verified
        _download(base + fname, dest, digest, src.algorithm)
    if src.archive and not _complete(name, folder):
        _extract(download_dir / src.files[0][0], root)
        if not _complete(name, folder):
            raise DataError(f"{src.files[0][0]} did not contain the expected {folder}")
    return folder

