"""Data sets and partitions by name: the built-in label partitions and the users' own.

A **data set plugin** is a loader ``(*, seed, data_root, **params) -> DataPool | FederatedData``
registered with ``@DATASET_LOADERS.register("name")``: either the pool of examples that a
registered partition then splits over the clients (and each client's samples into local
train/test, as for the built-in sets), or a finished federated split.

A **partition plugin** is ``(labels, num_clients, rng, **context) -> list of K index arrays``
registered with ``@PARTITIONERS.register("name")``. It receives, of ``num_classes``,
``sensitive``, ``classes_per_client`` and ``dirichlet_alpha``, those its signature names (all of
them if it takes ``**kwargs``), plus the config's ``[data.partition_params]``; ``rng`` is keyed by
``(seed, PARTITION_TAG)`` so the split depends only on the seed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpifl.core.errors import DataError
from mpifl.core.registry import Registry
from mpifl.data import partition as P

__all__ = ["DATASET_LOADERS", "PARTITIONERS", "DataPool", "call_partition"]


@dataclass
class DataPool:
    """The examples of a data set before it is split over clients.

    Attributes:
        x: (N, *input_shape) float32 features, already normalised as the model expects.
        y: (N,) int64 labels in ``0 .. num_classes - 1``; or, for a regression task (``[model]
            loss = "mse"``), (N,) or (N, T) float32 targets, split by a partition that does not
            read labels (``iid`` or the user's own).
        num_classes: C >= 2 classes; for float targets, their number T >= 1 (the model's output
            width).
        sensitive: optional (N,) int64 sensitive-group ids (for demographic parity and the other
            group-fairness metrics, mFairFL, the ``group_skew`` partition); None without one.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    sensitive: np.ndarray | None = None

    def check(self, name: str) -> DataPool:
        """This pool with its dtypes checked (float32 x, int64 y / sensitive, labels in range).

        Raises:
            DataError: one line naming the data set and what is wrong.
        """
        x, y = np.asarray(self.x), np.asarray(self.y)
        if x.dtype != np.float32 or x.ndim < 2:
            raise DataError(f"data set '{name}': x must be (N, ...) float32, got {x.shape} {x.dtype}")
        if y.dtype.kind == "f":  # regression targets
            width = 1 if y.ndim == 1 else (y.shape[1] if y.ndim == 2 else 0)
            if y.dtype != np.float32 or len(y) != len(x) or width != int(self.num_classes):
                raise DataError(f"data set '{name}': float targets must be ({len(x)},) or "
                                f"({len(x)}, num_classes) float32, got {y.shape} {y.dtype} with "
                                f"num_classes={self.num_classes}")
            if not np.isfinite(y).all():
                raise DataError(f"data set '{name}': the targets have NaN or infinite values")
            return DataPool(x, y, int(self.num_classes), self._sensitive(name, y))
        if y.shape != (len(x),) or y.dtype.kind not in "iu":
            raise DataError(f"data set '{name}': y must be ({len(x)},) integers, got {y.shape} "
                            f"{y.dtype}")
        if int(self.num_classes) < 2 or (len(y) and (y.min() < 0 or y.max() >= self.num_classes)):
            raise DataError(f"data set '{name}': labels must lie in 0..num_classes-1 with "
                            f"num_classes >= 2 (num_classes={self.num_classes})")
        return DataPool(x, y.astype(np.int64), int(self.num_classes), self._sensitive(name, y))

    def _sensitive(self, name: str, y: np.ndarray) -> np.ndarray | None:
        s = self.sensitive
        if s is not None:
            s = np.asarray(s)
            if s.shape != y.shape[:1] or s.dtype.kind not in "iu" or (len(s) and s.min() < 0):
                raise DataError(f"data set '{name}': sensitive must be ({len(y)},) non-negative "
                                f"integers, got {s.shape} {s.dtype}")
            s = s.astype(np.int64)
        return s


def _check_callable(name: str, fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"{name!r} must be a function, got {fn!r}")


#: Data set loaders by name (plugins; the built-in sets are read by :mod:`mpifl.data.federated`).
DATASET_LOADERS: Registry[Callable[..., Any]] = Registry("data set", _check_callable)
#: Label partitions by name: the built-in ones below and plugins.
PARTITIONERS: Registry[Callable[..., list[np.ndarray]]] = Registry("partition", _check_callable)

PARTITIONERS.add("iid", P.iid)
PARTITIONERS.add("shards", P.shards)


@PARTITIONERS.register("pathological")
def _pathological(labels, num_clients, rng, *, num_classes, classes_per_client=2):
    return P.pathological(labels, num_clients, rng, classes_per_client, num_classes)


@PARTITIONERS.register("dirichlet")
def _dirichlet(labels, num_clients, rng, *, num_classes, dirichlet_alpha=0.5):
    return P.dirichlet(labels, num_clients, rng, dirichlet_alpha, num_classes)


def call_partition(name: str, labels: np.ndarray, num_clients: int, rng: np.random.Generator,
                   context: dict[str, Any], params: dict[str, Any] | None = None
                   ) -> list[np.ndarray]:
    """Run partition ``name`` with the context keys its signature names plus ``params``.

    Raises:
        DataError: unknown partition, parameters it does not take, or a result that is not
            K integer index arrays into ``labels``.
    """
    try:
        fn = PARTITIONERS.get(name)
    except LookupError as exc:
        raise DataError(f"data.partition: {exc}") from None
    sig = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
    kwargs = {k: v for k, v in context.items() if takes_all or k in sig}
    try:
        parts = fn(labels, num_clients, rng, **kwargs, **(params or {}))
    except TypeError as exc:
        raise DataError(f"partition '{name}': {exc}") from None
    if len(parts) != num_clients:
        raise DataError(f"partition '{name}' returned {len(parts)} clients, expected {num_clients}")
    out = [np.asarray(p) for p in parts]
    for p in out:
        if p.ndim != 1 or p.dtype.kind not in "iu" or (p.size and (p.min() < 0
                                                                     or p.max() >= len(labels))):
            raise DataError(f"partition '{name}' must return 1-D integer index arrays into the "
                            f"{len(labels)} samples")
    return [p.astype(np.int64) for p in out]
