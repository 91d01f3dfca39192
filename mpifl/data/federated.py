"""Federated datasets: the sample pool, its partition over K clients, and each client's
train/test split, stored as CSR index arrays (no per-client Python objects, so K = 10,000
clients cost a few arrays).

Every data set and partition, mpifl's own (:mod:`mpifl.data.builtin`) and plugins alike, comes
from the registries of :mod:`mpifl.data.registry` and is loaded by the same steps:
:func:`load_federated`.

Reproducibility: the partition draws from ``default_rng([seed, PARTITION_TAG])`` and client k
splits its samples with ``default_rng([seed, k, SPLIT_TAG])``; nothing depends on the number of
ranks, so every rank that calls :func:`load_federated` with the same arguments gets the same
result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import ValidationError

from mpifl.core.blame import blame
from mpifl.core.errors import DataError
from mpifl.core.registry import Registry
from mpifl.core.rng import PARTITION_TAG, SPLIT_TAG
from mpifl.data.builtin import DATASETS, PARTITIONS
from mpifl.data.compat import (check_combination, check_pool, describe_params, lookup,
                               resolve_params)
from mpifl.data.registry import (DATASET_LOADERS, PARTITIONERS, DataPool, Partitioned,
                                 call_partition, params_class)
from mpifl.data.tabular import standardise_numeric

__all__ = ["DATASETS", "PARTITIONS", "FederatedData", "load_federated", "split_clients"]


@dataclass
class FederatedData:
    """A sample pool and, per client, the indices of its local train and test samples.

    Attributes:
        name: the data set's name (``data.dataset``).
        x: (N, *input_shape) float32, every sample of the pool, normalised; or (N, T) int64
            token ids in 0..vocab_size-1 (:class:`mpifl.data.registry.DataPool`).
        y: (N,) int64 labels in 0..num_classes-1, (N, T) int64 sequence targets, or (N,) /
            (N, T) float32 regression targets (a plugin data set; ``[model] loss = "mse"``).
        num_classes: number of classes C (for regression targets: their number T, the model's
            output width).
        input_shape: (1, 28, 28) for (Fashion-)MNIST, (3, 32, 32) for CIFAR, (60,) synthetic,
            (F,) for the tabular sets (see :mod:`mpifl.data.tabular`).
        train_ptr: (K+1,) int64 CSR offsets into ``train_idx``.
        train_idx: (sum n_k,) int64 indices into x / y; client k's train samples are
            ``train_idx[train_ptr[k]:train_ptr[k+1]]``.
        test_ptr, test_idx: the same for the local test splits.
        sensitive: (N,) int64 sensitive-group id per sample (tabular sets: 0 = female,
            1 = male), for group fairness metrics and constraints; None for data without one.
        vocab_size: V for token inputs (the model's embedding rows), None for float features.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    train_ptr: np.ndarray
    train_idx: np.ndarray
    test_ptr: np.ndarray
    test_idx: np.ndarray
    sensitive: np.ndarray | None = None
    vocab_size: int | None = None
    #: every sample is held (a :class:`mpifl.data.lazy.LazyPopulation` draws them on demand)
    lazy: ClassVar[bool] = False

    def __post_init__(self) -> None:
        # Cheap structural checks: a wrong CSR would silently train on the wrong samples.
        if len(self.x) != len(self.y) or tuple(self.x.shape[1:]) != tuple(self.input_shape):
            raise ValueError(f"x {self.x.shape} / y {self.y.shape} / input_shape "
                             f"{self.input_shape} disagree")
        for ptr, idx in ((self.train_ptr, self.train_idx), (self.test_ptr, self.test_idx)):
            if len(ptr) != len(self.train_ptr) or ptr[0] != 0 or ptr[-1] != len(idx):
                raise ValueError("CSR offsets do not match their index arrays")
        if self.sensitive is not None and (self.sensitive.shape != self.y.shape
                                           or self.sensitive.dtype != np.int64):
            raise ValueError(f"sensitive must be ({len(self.y)},) int64, got "
                             f"{self.sensitive.shape} {self.sensitive.dtype}")

    @property
    def num_clients(self) -> int:
        """K, the number of clients."""
        return len(self.train_ptr) - 1

    @property
    def label_dtype(self) -> np.dtype:
        """The labels' dtype: integer classes, or float regression targets."""
        return self.y.dtype

    @property
    def target_shape(self) -> tuple[int, ...]:
        """One sample's target shape: () for a label, (T,) for sequence or vector targets."""
        return tuple(self.y.shape[1:])

    @property
    def num_train(self) -> np.ndarray:
        """(K,) int64 local train sizes n_k."""
        return np.diff(self.train_ptr)

    @property
    def num_test(self) -> np.ndarray:
        """(K,) int64 local test sizes."""
        return np.diff(self.test_ptr)

    def label_counts(self) -> np.ndarray:
        """(K, C) int64: each client's training samples per label; (K, 0) for regression
        targets (float y) and sequence targets ((N, T) y)."""
        if self.y.dtype.kind not in "iu" or self.y.ndim != 1:  # regression / sequence targets
            return np.zeros((self.num_clients, 0), dtype=np.int64)
        rows = np.repeat(np.arange(self.num_clients), self.num_train)
        counts = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        np.add.at(counts, (rows, self.y[self.train_idx]), 1)
        return counts

    def train_indices(self, k: int) -> np.ndarray:
        """Client k's train sample indices into x / y (a view, int64)."""
        return self.train_idx[self.train_ptr[k]:self.train_ptr[k + 1]]

    def test_indices(self, k: int) -> np.ndarray:
        """Client k's test sample indices into x / y (a view, int64)."""
        return self.test_idx[self.test_ptr[k]:self.test_ptr[k + 1]]


# --------------------------------------------------------------------------- client splits

def _split_counts(n: int, fractions: Sequence[float]) -> tuple[int, int]:
    """(train, test) counts of a client with n samples; train+test < n leaves validation."""
    if len(fractions) == 1:
        n_train = round(fractions[0] * n)
        n_test = n - n_train
    else:
        n_train, n_test = round(fractions[0] * n), round(fractions[1] * n)
    if n >= 2:  # at least one sample each, so every client can be trained and evaluated
        n_train = min(max(n_train, 1), n - 1)
        n_test = min(max(n_test, 1), n - n_train)
    return n_train, n_test


def split_clients(parts: Sequence[np.ndarray], seed: int, fractions: Sequence[float],
                  orders: Callable[[np.ndarray], np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle each client's samples with ``default_rng([seed, k, SPLIT_TAG])`` and cut them.

    Args:
        parts: K index arrays (a partition).
        fractions: ``(train_fraction,)`` (the rest is test) or ``(train, test)`` fractions
            (the rest is set aside as validation and not returned).
        orders: a data set's own keyed split order instead (the pool's ``split_orders``,
            :class:`mpifl.data.registry.DataPool`): ``orders(sizes)`` of the (K,) part sizes
            gives each part's permutation of range(n_k), one after another.
    Returns:
        train_ptr (K+1,), train_idx, test_ptr (K+1,), test_idx, all int64.
    """
    if orders is not None:
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        flat, starts = orders(sizes), np.concatenate([[0], np.cumsum(sizes)])
    train, test = [], []
    for k, idx in enumerate(parts):
        idx = (np.random.default_rng([seed, k, SPLIT_TAG]).permutation(idx) if orders is None
               else np.asarray(idx)[flat[starts[k]:starts[k + 1]]])
        n_train, n_test = _split_counts(len(idx), fractions)
        train.append(idx[:n_train])
        test.append(idx[n_train:n_train + n_test])

    def csr(pieces: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ptr = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=ptr[1:])
        flat = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
        return ptr, flat

    return (*csr(train), *csr(test))



# --------------------------------------------------------------------------- entry point

def load_federated(
    dataset: str,
    *,
    partition: str,
    num_clients: int,
    seed: int,
    train_fraction: float = 0.8,
    data_root: str | None = None,
    dataset_params: Mapping[str, Any] | None = None,
    partition_params: Mapping[str, Any] | None = None,
) -> FederatedData:
    """Load a data set, partition its pool over K clients, split each client's samples into
    local train/test. Every name goes through the registries (:mod:`mpifl.data.registry`).

    Args:
        dataset: a registered data set (:data:`DATASETS` are mpifl's own; the image sets are
            searched for as described in :mod:`mpifl.data.roots`) or ``"pkg.module:loader"``.
        partition: a registered partition (:data:`PARTITIONS`, see
            :mod:`mpifl.data.partition`) or ``"pkg.module:function"``.
        num_clients: K; for ``one_class_per_client`` it must equal ``len(classes)``.
        seed: non-negative; keys the partition and the per-client splits.
        train_fraction: share of each client's samples used for training, in (0, 1); the rest
            is its test split. A partition may set its own split (``one_class_per_client``:
            80/10/10 train/test/validation, validation unused, ALGORITHMS.md §8).
        dataset_params: the data set loader's keywords (``[data.params]``), validated by its
            ``Params`` when it has one (e.g. synthetic ``alpha``, ``beta``; tabular
            ``sensitive_feature``).
        partition_params: the partition's keywords (``[data.partition_params]``), likewise
            (e.g. dirichlet ``alpha``, pathological ``classes_per_client``, one_class_per_client
            ``classes``, group_skew ``heterogeneity`` / ``group_proportions``).

    Returns:
        The :class:`FederatedData` (normalisation: :mod:`mpifl.data.builtin`).

    Raises:
        DataError: unknown names, bad parameters (one line naming the key), a partition that
            does not go with the data set, e.g. more clients than samples or a client left
            with fewer than 2 samples, a missing or damaged dataset.
    """
    _check_args(dataset, partition, num_clients, seed, train_fraction)
    dp = _params(DATASET_LOADERS, dataset, dataset_params, "data.params")
    pp = _params(PARTITIONERS, partition, partition_params, "data.partition_params")
    check_combination(dataset, partition, pp, num_clients)
    out = _load(dataset, seed, data_root, num_clients, dp)
    if isinstance(out, FederatedData):
        if out.num_clients != num_clients:
            raise DataError(f"data set '{dataset}' has {out.num_clients} clients, "
                            f"data.num_clients is {num_clients}")
        return out
    if not isinstance(out, DataPool):
        raise DataError(f"data set '{dataset}': the loader must return a DataPool or a "
                        f"FederatedData, got {type(out).__name__}")
    pool = out.check(dataset)
    check_pool(dataset, partition, pool)
    split = call_partition(partition, pool, num_clients,
                           np.random.default_rng([seed, PARTITION_TAG]), pp)
    return _federate(dataset, partition, pool if split.pool is None else split.pool, split, seed,
                     train_fraction)


def _check_args(dataset: str, partition: str, num_clients: int, seed: int,
                train_fraction: float) -> None:
    _registered(DATASET_LOADERS, dataset, "dataset")
    _registered(PARTITIONERS, partition, "partition")
    if int(num_clients) != num_clients or num_clients < 1:
        raise DataError(f"num_clients must be a positive integer, got {num_clients}")
    if int(seed) != seed or seed < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed}")
    if not 0 < train_fraction < 1:
        raise DataError(f"train_fraction must be in (0, 1), got {train_fraction}")


def _registered(registry: Registry[Callable[..., Any]], name: str, kind: str) -> None:
    """DataError naming the known ones unless ``name`` is registered (or an importable path)."""
    if lookup(registry, name) is None:
        raise DataError(f"unknown {kind} '{name}' (known: {', '.join(registry.available())})")


def _params(registry: Registry[Callable[..., Any]], name: str, params: Mapping[str, Any] | None,
            table: str) -> dict[str, Any]:
    try:
        return resolve_params(registry, name, params)
    except ValidationError as exc:
        raise DataError(describe_params(exc, table)) from None


def _load(dataset: str, seed: int, data_root: str | None, num_clients: int,
          params: dict[str, Any]) -> Any:
    """The loader's pool or finished split; K is passed to a loader that names it."""
    loader = DATASET_LOADERS.get(dataset)
    extra = {"num_clients": num_clients} if _names(loader, "num_clients") else {}
    with blame([("data set", dataset, loader)], "load"):
        try:
            return loader(seed=seed, data_root=data_root, **extra, **params)
        except TypeError as exc:  # most often a [data.params] key a loader without Params lacks
            if params_class(loader) is not None:
                raise
            raise DataError(f"data set '{dataset}': {exc}") from None


def _names(fn: Any, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _federate(dataset: str, partition: str, pool: DataPool, split: Partitioned, seed: int,
              train_fraction: float) -> FederatedData:
    """Cut each client's part into train/test, then standardise the pool's marked columns with
    the training pool's statistics."""
    _check_sizes(split.parts, partition)
    fractions = split.fractions or (train_fraction,)
    train_ptr, train_idx, test_ptr, test_idx = split_clients(split.parts, seed, fractions,
                                                             pool.split_orders)
    x = pool.x
    if pool.standardise is not None:
        x = standardise_numeric(x, pool.standardise, train_idx)
    return FederatedData(dataset, x, pool.y, pool.num_classes, tuple(x.shape[1:]), train_ptr,
                         train_idx, test_ptr, test_idx, sensitive=pool.sensitive,
                         vocab_size=pool.vocab_size)


def _check_sizes(parts: Sequence[np.ndarray], partition: str) -> None:
    sizes = np.array([len(p) for p in parts])
    small = np.flatnonzero(sizes < 2)
    if len(small):
        k = int(small[0])
        raise DataError(
            f"partition '{partition}' leaves {len(small)} client(s) with fewer than 2 samples "
            f"(client {k} has {sizes[k]}), so they cannot have both a train and a test sample; "
            f"use fewer clients or other partition parameters"
        )
