"""Values <-> HDF5 arrays of a results file: chunking, deflate compression and the chunk cache.

Storage (docs/RESULTS.md, "Storage"): every dataset of at least :data:`COMPRESS_MIN_BYTES` (the
per-client arrays of a large population, /rounds/selected of many clients per round) is chunked
(:func:`chunk_shape`: one evaluation row is whole chunks, a client's column one chunk per
evaluation) and compressed with HDF5's built-in deflate (gzip, level :data:`GZIP_LEVEL`), with
the shuffle filter except for accuracies (fractions k/n: plain deflate is 3x smaller on them).
Smaller datasets stay contiguous, as in every file before. Names, shapes and dtypes are the same
either way: any HDF5 reader (h5py, h5dump, R, MATLAB) reads both. The results file is rewritten
whole at every flush (:mod:`mpifl.store.writer`), so the compressed chunks of evaluation rows
and /clients are kept (:class:`ChunkCache`) and each rewrite compresses only what is new.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import h5py
import numpy as np

#: Datasets of at least this many bytes are chunked and compressed; smaller ones stay
#: contiguous (a chunk index and a filter would cost more than they save).
COMPRESS_MIN_BYTES = 1 << 16
#: Elements per chunk (256 KiB of float64): at K = 1e6, 31 chunks per evaluation row.
CHUNK_ELEMENTS = 1 << 15
#: Deflate level: 1 is within 4% of level 4's size (docs/BENCHMARKS.md), and faster.
GZIP_LEVEL = 1


def chunk_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """HDF5 chunk shape of a 1-D or 2-D dataset: about :data:`CHUNK_ELEMENTS` elements, whole
    rows when a row is shorter (``(E, K)`` -> ``(1, 32768)`` at K >= 32768; ``(K, C)`` ->
    ``(32768 // C, C)``), so one row (an evaluation) or one column (a client) is read without
    the rest."""
    if len(shape) == 1:
        return (max(1, min(shape[0], CHUNK_ELEMENTS)),)
    cols = max(1, min(shape[1], CHUNK_ELEMENTS))
    return (max(1, min(shape[0], CHUNK_ELEMENTS // cols)), cols)


def _shuffled(name: str) -> bool:
    """Shuffle filter for ``name``: yes but for accuracies, whose values are a few fractions
    k/n that plain deflate finds repeated (measured in docs/BENCHMARKS.md)."""
    return not name.endswith("accuracy")


def _encode(block: np.ndarray, chunks: tuple[int, ...], shuffle: bool) -> bytes:
    """One chunk as HDF5's shuffle + deflate filters store it: padded to the full chunk shape
    (edge chunks), bytes transposed by the shuffle filter, then zlib (deflate's format)."""
    if block.shape != chunks:
        full = np.zeros(chunks, dtype=block.dtype)
        full[tuple(slice(0, n) for n in block.shape)] = block
        block = full
    raw: np.ndarray = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    size = block.dtype.itemsize
    if shuffle and size > 1:
        raw = raw.reshape(-1, size).T
    return zlib.compress(np.ascontiguousarray(raw).tobytes(), GZIP_LEVEL)


class ChunkCache:
    """Compressed chunks of arrays that do not change once written (evaluation rows, /clients),
    so that a rewrite of the file compresses only what is new.

    Entries are keyed by name and hold the array they were made from: an entry is used only for
    that very array object (a replaced row is compressed again). Size: the compressed bytes,
    about 0.2 (accuracies) to 0.9 (losses) of the rows' own.
    """

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[np.ndarray, list[bytes]]] = {}

    def get(self, key: Any, source: np.ndarray, make: Callable[[], list[bytes]]) -> list[bytes]:
        hit = self._entries.get(key)
        if hit is not None and hit[0] is source:
            return hit[1]
        blobs = make()
        self._entries[key] = (source, blobs)
        return blobs


class LocalState(NamedTuple):
    """The clients' local coordinates of w (FedBN's BatchNorm rows) as the results file keeps
    them: ``/clients/local_state``.

    Attributes:
        rows: (K, s) float32, client k's values of the s local coordinates.
        entries: one ``(name, first column, end column, offset in w)`` per model entry the
            columns hold (``"bn1.running_mean"``, ...), in column order.
    """

    rows: np.ndarray
    entries: list[tuple[str, int, int, int]]

    @classmethod
    def of(cls, rows: Any, index: np.ndarray, layout: Any) -> "LocalState":
        """From the (K, s) rows, their (s,) ascending positions in w and the model's
        :class:`~mpifl.core.layout.ParamLayout` (``names``, ``offsets``, ``numels``).

        Raises:
            ValueError: positions that are not whole entries of the layout.
        """
        index = np.asarray(index, dtype=np.int64)
        entries = []
        for name, off, n in zip(layout.names, layout.offsets, layout.numels):
            col = int(np.searchsorted(index, off))
            if col < len(index) and index[col] == off:
                if not np.array_equal(index[col:col + n], np.arange(off, off + n)):
                    raise ValueError(f"local coordinates hold part of {name} only")
                entries.append((name, col, col + n, int(off)))
        if sum(b - a for _, a, b, _ in entries) != len(index):
            raise ValueError("local coordinates that are not whole model entries")
        return cls(np.asarray(rows, dtype=np.float32), entries)

    @staticmethod
    def column_names(entries: list[tuple[str, int, int, int]]) -> list[str]:
        """One label per column: ``"bn1.running_mean[0]"``, ``"bn1.running_mean[1]"``, ..."""
        return [f"{name}[{i}]" for name, a, b, _ in entries for i in range(b - a)]


def _chunk_offsets(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(0, n, c) for n, c in zip(shape, chunks)))


def create_dataset(g: h5py.Group, name: str, data: np.ndarray, *, cache: ChunkCache | None = None,
                   rows: list[np.ndarray] | None = None) -> h5py.Dataset:
    """``g[name] = data``, chunked and deflate-compressed when it holds at least
    :data:`COMPRESS_MIN_BYTES` (shape, dtype and values as given; see the module docstring).

    Args:
        data: a 1-D or 2-D array (or ``rows``' stack).
        cache: compressed chunks kept between rewrites, keyed by ``name`` (and row): reused
            while the same array objects are written again.
        rows: when given, ``data`` is ``np.stack(rows)`` and rows are cached one by one (only
            when a chunk is one row: K >= CHUNK_ELEMENTS; not at all otherwise). A cached row
            must not be changed in place (history rows never are).

    Returns:
        The dataset. Chunks are written with ``write_direct_chunk`` from :func:`_encode`:
        exactly what HDF5's deflate (and shuffle) filters would store, read back by any reader.
    """
    data = np.ascontiguousarray(data)
    if (data.nbytes < COMPRESS_MIN_BYTES or data.ndim not in (1, 2)
            or data.dtype.kind not in "biuf"):
        return g.create_dataset(name, data=data)
    chunks, shuffle = chunk_shape(data.shape), _shuffled(name)
    d = g.create_dataset(name, shape=data.shape, dtype=data.dtype, chunks=chunks,
                         compression="gzip", compression_opts=GZIP_LEVEL, shuffle=shuffle)
    by_row = rows is not None and data.ndim == 2 and chunks[0] == 1

    def encode(array: np.ndarray, offsets: Iterable[tuple[int, ...]]) -> list[bytes]:
        return [_encode(array[tuple(slice(o, o + c) for o, c in zip(off, chunks))], chunks,
                        shuffle) for off in offsets]

    if by_row and rows is not None:
        cols = list(range(0, data.shape[1], chunks[1]))
        for i, row in enumerate(rows):
            def make_row(i: int = i) -> list[bytes]:
                return encode(data[i:i + 1], [(0, c) for c in cols])
            blobs = cache.get((name, i), row, make_row) if cache is not None else make_row()
            for c, blob in zip(cols, blobs):
                d.id.write_direct_chunk((i, c), blob)
        return d
    offsets = list(_chunk_offsets(data.shape, chunks))

    def make() -> list[bytes]:
        return encode(data, offsets)

    # a stack of rows is a new array at every write: caching it would only hold memory
    blobs = cache.get(name, data, make) if cache is not None and rows is None else make()
    for off, blob in zip(offsets, blobs):
        d.id.write_direct_chunk(off, blob)
    return d


def padded(rows: list[Any], dtype: str, fill: Any) -> np.ndarray:
    """(R, m) from R rows of (m,) values, None rows (not recorded) filled with ``fill``."""
    width = max((len(r) for r in rows if r is not None), default=0)
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, :len(r)] = r
    return out


def write_local(f: h5py.File, local: LocalState) -> None:
    """``/clients/local_state`` (K, s) float32, chunked and compressed when large, with the
    entries of its columns as attributes."""
    d = create_dataset(f, "clients/local_state", local.rows)
    d.attrs["unit"] = ("each client's local coordinates of w (model.batchnorm), at the end; "
                       "columns column_start[i]:column_stop[i] are entry names[i], "
                       "w[offset[i]:offset[i] + (column_stop[i] - column_start[i])] globally")
    d.attrs["names"] = np.array([n for n, _, _, _ in local.entries], dtype="S")
    for i, key in enumerate(("column_start", "column_stop", "offset"), start=1):
        d.attrs[key] = np.array([e[i] for e in local.entries], dtype=np.int64)


def read_local(f: h5py.File) -> list[tuple[str, int, int, int]]:
    """The entries of ``/clients/local_state``'s columns (empty when the file has none)."""
    if "clients/local_state" not in f:
        return []
    a = f["clients/local_state"].attrs
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in a["names"]]
    return [(n, int(s), int(e), int(o)) for n, s, e, o in
            zip(names, a["column_start"], a["column_stop"], a["offset"])]


def plain(v: Any) -> Any:
    """An HDF5 attribute as a Python value (bytes as text, numpy scalars as Python's)."""
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    return v
