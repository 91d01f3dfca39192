"""Reader for the IDX format of MNIST and Fashion-MNIST (no torchvision needed).

IDX (LeCun et al., http://yann.lecun.com/exdb/mnist/): two zero bytes, a type byte
(0x08 ubyte, 0x09 byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), a byte with
the number of dimensions, then one big-endian uint32 per dimension, then the data in C order,
big-endian. Files may be gzip-compressed (detected by the gzip magic bytes, not the name).
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.core.errors import DataError
from mpifl.data.bounds import check_memory
from mpifl.data.roots import locate_file

_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> tuple[bytes, bytes]:
    """The file's header and data, gunzipped if it is gzip data, the size its header declares
    compared before the data are read: with the file's size (plain files), with the memory
    bound (gzip data, whose size is known only once decompressed).

    Raises:
        DataError: unreadable, not IDX, declared size larger than memory or than the file.
    """
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == _GZIP_MAGIC
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _DTYPES or head[3] == 0:
                raise DataError(f"{path} is not an IDX file (bad magic number "
                                f"{head.hex() or 'none'})")
            head += f.read(4 * head[3])
            if len(head) < 4 + 4 * head[3]:
                raise DataError(f"IDX file {path} is truncated inside its header")
            dims = tuple(int(d) for d in np.frombuffer(head, ">u4", offset=4))
            # Python's integers: numpy's int64 product of four 65,536s wraps to 0
            expected = len(head) + math.prod(dims) * _DTYPES[head[2]].itemsize
            size = None if gz else path.stat().st_size
            if size is None:
                check_memory(expected, f"IDX file {path}: header {dims}")
            elif size != expected:  # before anything is read: a damaged header reads nothing
                _wrong_size(path, size, dims, expected)
            body = f.read(expected - len(head) + 1)  # one byte more: trailing data
    except (OSError, EOFError, zlib.error) as exc:
        # gzip raises EOFError for a truncated stream and BadGzipFile (an OSError) for junk
        raise DataError(f"cannot read IDX file {path}: {exc}") from None
    if len(head) + len(body) != expected:
        _wrong_size(path, len(head) + len(body), dims, expected, gz)
    return head, body


def _wrong_size(path: Path, size: int, dims: tuple[int, ...], expected: int,
                gz: bool = False) -> None:
    """DataError: the file (gunzipped) has ``size`` bytes, its header needs ``expected``; of
    gzip data one byte past ``expected`` at most was read."""
    if size < expected:
        what = f"truncated: {size} bytes"
    else:
        what = f"longer than its header says: {f'more than {expected}' if gz else size} bytes"
    raise DataError(f"IDX file {path} is {what}, header {dims} needs {expected}")


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (raw or gzip) into a native-byte-order array of the shape it declares.

    Returns:
        array with the file's dims, dtype uint8/int8/int16/int32/float32/float64 (native order).
    Raises:
        DataError: unreadable file, bad magic number, unknown type code, a size that does not
            match the header (truncated or trailing data), or a gzip file whose header
            declares more than memory holds (:func:`mpifl.data.bounds.memory_bound`).
    """
    path = Path(path)
    head, body = _read_bytes(path)
    dtype = _DTYPES[head[2]]
    dims = tuple(int(d) for d in np.frombuffer(head, ">u4", offset=4))
    arr = np.frombuffer(body, dtype).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))


def _read_split(folder: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    paths = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        name = f"{prefix}-{kind}"
        p = locate_file(folder, name, gz_ok=True)
        if p is None:
            raise DataError(f"missing {name}[.gz] in {folder}")
        paths.append(p)
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataError(f"{paths[0]}: expected uint8 images (n, rows, cols), got "
                        f"{images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.shape != (images.shape[0],):
        raise DataError(f"{paths[1]}: expected {images.shape[0]} uint8 labels, got "
                        f"{labels.dtype} {labels.shape}")
    return images, labels


def load_idx_pool(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The pooled train + test samples of an (F)MNIST folder, train first.

    Returns:
        images (N, rows, cols) uint8 and labels (N,) int64; N = 70,000 for the real datasets.
    Raises:
        DataError: a file is missing or damaged, or train and test disagree on image size.
    """
    folder = Path(folder)
    x_tr, y_tr = _read_split(folder, "train")
    x_te, y_te = _read_split(folder, "t10k")
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise DataError(f"{folder}: train images {x_tr.shape[1:]} and test images "
                        f"{x_te.shape[1:]} differ in size")
    return np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te]).astype(np.int64)
