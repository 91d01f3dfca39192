"""Reader for the CIFAR-10 / CIFAR-100 "python version" batches, without unsafe unpickling.

The official batches (Krizhevsky 2009, https://www.cs.toronto.edu/~kriz/cifar.html) are
Python 2 pickles of a dict with ``data`` ((n, 3072) uint8, rows are R, G, B planes of 32x32)
and ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100). mpifl never unpickles files with the
stock unpickler: :class:`_NumpyOnlyUnpickler` resolves only the few numpy globals needed to
rebuild arrays, so a crafted file cannot call ``os.system`` or anything else.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.core.errors import DataError

try:  # numpy >= 2 names its internals numpy._core; pickles from numpy 1 say numpy.core
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles written by Python 3 store bytes as _codecs.encode(str, "latin1");
    # allow exactly that use, not arbitrary codecs.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise DataError("pickle uses _codecs.encode for something other than latin1 bytes")
    return text.encode("latin1")


_ALLOWED: dict[tuple[str, str], Callable[..., object]] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}
for _mod in ("numpy.core", "numpy._core"):
    _ALLOWED[(f"{_mod}.multiarray", "_reconstruct")] = _multiarray._reconstruct
    _ALLOWED[(f"{_mod}.multiarray", "scalar")] = _multiarray.scalar
    # private, so numpy's stubs omit it
    _ALLOWED[(f"{_mod}.numeric", "_frombuffer")] = \
        _numeric._frombuffer  # type: ignore[attr-defined]


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler whose globals are limited to numpy's array-rebuilding functions."""

    def find_class(self, module: str,
                   name: str) -> Callable[..., object]:  # noqa: D102 - see class docstring
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise DataError(
                f"refusing to load {module}.{name} from a pickle (only numpy arrays are allowed)"
            ) from None


def _get(batch: dict[Any, Any], key: str) -> Any:
    """``batch[key]`` whether the keys are str (latin1 load) or bytes (protocol >= 3)."""
    for k in (key, key.encode()):
        if k in batch:
            return batch[k]
    return None


def read_cifar_batch(path: str | Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR batch file.

    Args:
        path: e.g. ``cifar-10-batches-py/data_batch_1``.
        label_key: ``"labels"`` (CIFAR-10) or ``"fine_labels"`` (CIFAR-100).
    Returns:
        images (n, 3, 32, 32) uint8 and labels (n,) int64.
    Raises:
        DataError: unreadable or damaged file, a pickle that names anything but numpy's
            array globals, or missing / ill-shaped ``data`` and labels.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            # latin1: the official files are Python 2 pickles whose str objects hold raw bytes
            batch = _NumpyOnlyUnpickler(f, encoding="latin1").load()
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise DataError(f"cannot read CIFAR batch {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path} is not a CIFAR batch (a {type(batch).__name__}, not a dict)")
    data, labels = _get(batch, "data"), _get(batch, label_key)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        raise DataError(f"{path}: 'data' is not a (n, 3072) uint8 array")
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        y = None
    if y is None or y.shape != (data.shape[0],):
        raise DataError(f"{path}: '{label_key}' is missing or does not have {data.shape[0]} labels")
    return data.reshape(-1, 3, 32, 32), y


def _load(folder: Path, files: tuple[str, ...], label_key: str
          ) -> tuple[np.ndarray, np.ndarray]:
    parts = [read_cifar_batch(folder / f, label_key) for f in files]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_cifar10_pool(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Pooled train (``data_batch_1..5``) + test (``test_batch``) samples of CIFAR-10.

    Returns images (N, 3, 32, 32) uint8 and labels (N,) int64, N = 60,000. Raises DataError.
    """
    files = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
    return _load(Path(folder), files, "labels")


def load_cifar100_pool(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Pooled ``train`` + ``test`` samples of CIFAR-100 with the 100 fine labels.

    Returns images (N, 3, 32, 32) uint8 and labels (N,) int64, N = 60,000. Raises DataError.
    """
    return _load(Path(folder), ("train", "test"), "fine_labels")
