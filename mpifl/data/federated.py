"""Federated datasets: the sample pool, its partition over K clients, and each client's
train/test split, stored as CSR index arrays (no per-client Python objects, so K = 10,000
clients cost a few arrays).

Reproducibility: the partition draws from ``default_rng([seed, PARTITION_TAG])`` and client k
splits its samples with ``default_rng([seed, k, SPLIT_TAG])``; nothing depends on the number of
ranks, so every rank that calls :func:`load_federated` with the same arguments gets the same
result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpifl.data import partition as P
from mpifl.data.cifar import load_cifar10_pool, load_cifar100_pool
from mpifl.data.idx import load_idx_pool
from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS, DataPool, call_partition
from mpifl.data.roots import find_dataset_dir
from mpifl.data.synthetic import NUM_CLASSES as SYNTHETIC_CLASSES
from mpifl.data.synthetic import NUM_FEATURES as SYNTHETIC_FEATURES
from mpifl.data.synthetic import generate_synthetic
from mpifl.data.tabular import TABULAR, load_tabular, standardise_numeric
from mpifl.core.blame import blame
from mpifl.core.errors import DataError
from mpifl.core.rng import PARTITION_TAG, SPLIT_TAG

#: The built-in data sets (plugins add theirs to :data:`mpifl.data.registry.DATASET_LOADERS`).
DATASETS = ("fashion_mnist", "mnist", "cifar10", "cifar100", "synthetic", *TABULAR)
#: The built-in partitions; the label partitions among them are also in
#: :data:`mpifl.data.registry.PARTITIONERS`, beside plugins.
PARTITIONS = ("iid", "shards", "pathological", "dirichlet", "one_class_per_client", "natural",
              "group_skew")
#: Built-in partitions that are not label partitions of a pool.
SPECIAL_PARTITIONS = ("one_class_per_client", "natural", "group_skew")

ONE_CLASS_DEFAULT = (0, 2, 6)  # Fashion-MNIST T-shirt, pullover, shirt (FedFV Table 3)
ONE_CLASS_FRACTIONS = (0.8, 0.1)  # train, test; the remaining 10 % is validation (unused)

_NUM_CLASSES = {"fashion_mnist": 10, "mnist": 10, "cifar10": 10, "cifar100": 100}


@dataclass
class FederatedData:
    """A sample pool and, per client, the indices of its local train and test samples.

    Attributes:
        name: dataset name (one of :data:`DATASETS`).
        x: (N, *input_shape) float32, every sample of the pool, normalised.
        y: (N,) int64 labels in 0..num_classes-1, or (N,) / (N, T) float32 regression targets
            (a plugin data set; ``[model] loss = "mse"``).
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
    def num_train(self) -> np.ndarray:
        """(K,) int64 local train sizes n_k."""
        return np.diff(self.train_ptr)

    @property
    def num_test(self) -> np.ndarray:
        """(K,) int64 local test sizes."""
        return np.diff(self.test_ptr)

    def label_counts(self) -> np.ndarray:
        """(K, C) int64: each client's training samples per label; (K, 0) for regression
        targets (float y)."""
        if self.y.dtype.kind not in "iu":
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


# --------------------------------------------------------------------------- loading pools

def _load_raw(dataset: str, data_root: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Raw images (N, channels, H, W) uint8 and labels (N,) int64 of the pooled train+test."""
    folder = find_dataset_dir(dataset, data_root)
    if dataset in ("fashion_mnist", "mnist"):
        x, y = load_idx_pool(folder)
        x = x[:, None]  # add the channel axis: (N, 1, 28, 28)
    elif dataset == "cifar10":
        x, y = load_cifar10_pool(folder)
    else:
        x, y = load_cifar100_pool(folder)
    c = _NUM_CLASSES[dataset]
    if len(y) and (y.min() < 0 or y.max() >= c):
        raise DataError(f"{folder}: labels outside 0..{c - 1} (found {y.min()}..{y.max()})")
    return x, y


def _scale(x: np.ndarray) -> np.ndarray:
    """uint8 pixels to float32 in [0, 1]."""
    return np.multiply(x, np.float32(1 / 255), dtype=np.float32)


def _standardise_channels(x: np.ndarray) -> np.ndarray:
    """In place: per channel, subtract the pool's mean and divide by its std (CIFAR)."""
    for c in range(x.shape[1]):
        mean = x[:, c].mean(dtype=np.float64)
        std = x[:, c].std(dtype=np.float64)
        x[:, c] -= np.float32(mean)
        x[:, c] /= np.float32(std if std > 0 else 1.0)
    return x


def _standardise_pixels(raw: np.ndarray) -> np.ndarray:
    """Per pixel ``(x - mean) / (std + 0.001)`` over the samples given, on raw 0..255 values.

    As in the q-FFL / AFL preprocessing that FedFV's one-class experiment reuses (ALGORITHMS.md §8).
    """
    xf = raw.astype(np.float32)
    mean = xf.mean(axis=0, dtype=np.float64)
    std = xf.std(axis=0, dtype=np.float64)
    xf -= mean.astype(np.float32)
    xf /= (std + 0.001).astype(np.float32)
    return xf


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


def split_clients(parts: Sequence[np.ndarray], seed: int, fractions: Sequence[float]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle each client's samples with ``default_rng([seed, k, SPLIT_TAG])`` and cut them.

    Args:
        parts: K index arrays (a partition).
        fractions: ``(train_fraction,)`` (the rest is test) or ``(train, test)`` fractions
            (the rest is set aside as validation and not returned).
    Returns:
        train_ptr (K+1,), train_idx, test_ptr (K+1,), test_idx, all int64.
    """
    train, test = [], []
    for k, idx in enumerate(parts):
        idx = np.random.default_rng([seed, k, SPLIT_TAG]).permutation(idx)
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

def _check_args(dataset: str, partition: str, num_clients: int, seed: int,
                train_fraction: float) -> None:
    if dataset not in DATASETS:
        _registered(DATASET_LOADERS, dataset, "dataset", known_datasets)
    if partition not in SPECIAL_PARTITIONS:
        _registered(PARTITIONERS, partition, "partition", known_partitions)
    if (dataset == "synthetic") != (partition == "natural"):
        raise DataError(f"partition 'natural' goes with dataset 'synthetic' and only with it "
                        f"(got dataset '{dataset}', partition '{partition}')")
    if partition == "group_skew" and dataset not in TABULAR:
        raise DataError(f"partition 'group_skew' needs a dataset with a sensitive attribute "
                        f"({', '.join(TABULAR)}), got '{dataset}'")
    if partition == "one_class_per_client" and dataset in TABULAR:
        raise DataError(f"partition 'one_class_per_client' is for the image datasets, got "
                        f"'{dataset}'")
    if int(num_clients) != num_clients or num_clients < 1:
        raise DataError(f"num_clients must be a positive integer, got {num_clients}")
    if int(seed) != seed or seed < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed}")
    if not 0 < train_fraction < 1:
        raise DataError(f"train_fraction must be in (0, 1), got {train_fraction}")


def _registered(registry, name: str, kind: str, known) -> None:
    """DataError naming the known ones unless ``name`` is registered (or an importable path)."""
    try:
        registry.get(name)
    except LookupError:
        raise DataError(f"unknown {kind} '{name}' (known: {', '.join(known())})") from None


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


def _one_class(dataset: str, raw: np.ndarray, y: np.ndarray, num_clients: int,
               classes: Sequence[int] | None):
    """Pool, labels, parts for one_class_per_client: the chosen classes only, relabelled."""
    classes = list(ONE_CLASS_DEFAULT if classes is None else classes)
    c_total = _NUM_CLASSES[dataset]
    bad = [c for c in classes if not 0 <= int(c) < c_total]
    if bad:
        raise DataError(f"one_class_per_client: classes {bad} are not in 0..{c_total - 1}")
    parts = P.one_class_per_client(y, num_clients, classes)
    keep = np.concatenate(parts)
    x = _standardise_pixels(raw[keep])
    y_new = np.repeat(np.arange(len(parts), dtype=np.int64), [len(p) for p in parts])
    return x, y_new, P.natural([len(p) for p in parts]), len(classes)


def load_federated(
    dataset: str,
    *,
    partition: str,
    num_clients: int,
    seed: int,
    train_fraction: float = 0.8,
    data_root: str | None = None,
    classes_per_client: int = 2,
    dirichlet_alpha: float = 0.5,
    classes: list[int] | None = None,
    synthetic_alpha: float = 1.0,
    synthetic_beta: float = 1.0,
    heterogeneity: str = "high",
    group_proportions: Sequence[Sequence[float]] | None = None,
    sensitive_feature: bool = True,
    dataset_params: dict | None = None,
    partition_params: dict | None = None,
) -> FederatedData:
    """Load a dataset, partition its pooled train+test samples over K clients, split each
    client's samples into local train/test.

    Args:
        dataset: one of :data:`DATASETS`; the image sets are searched for as described in
            :mod:`mpifl.data.roots`.
        partition: one of :data:`PARTITIONS` (see :mod:`mpifl.data.partition`). ``natural``
            goes with ``synthetic`` and only with it.
        num_clients: K; for ``one_class_per_client`` it must equal ``len(classes)``.
        seed: non-negative; keys the partition and the per-client splits.
        train_fraction: share of each client's samples used for training, in (0, 1); the rest
            is its test split. Ignored by ``one_class_per_client``, which always splits
            80/10/10 train/test/validation (validation unused, ALGORITHMS.md §8).
        classes_per_client: k of ``pathological``.
        dirichlet_alpha: alpha of ``dirichlet``.
        classes: the classes of ``one_class_per_client`` (default [0, 2, 6]); ignored by the
            other partitions.
        synthetic_alpha, synthetic_beta: the alpha, beta of Synthetic(alpha, beta).
        heterogeneity: ``group_skew`` preset, ``"high"`` or ``"low"`` (the mFairFL paper's
            splits over 5 clients, :data:`mpifl.data.partition.GROUP_SKEW_PRESETS`).
        group_proportions: ``group_skew`` shares, one row of K per sensitive group; replaces
            the preset when given.
        sensitive_feature: tabular sets only: keep the sensitive attribute's one-hot columns
            among the model inputs (it is always in ``FederatedData.sensitive``).
        dataset_params: keyword arguments of a plugin data set's loader.
        partition_params: keyword arguments of a plugin partition.

    Normalisation: (Fashion-)MNIST pixels / 255; CIFAR / 255 then per-channel standardisation
    with the pool's mean and std; ``one_class_per_client`` per-pixel ``(x - mean) / (std +
    0.001)`` over the chosen classes' samples (raw 0..255 values), labels remapped to
    0..len(classes)-1; synthetic features as drawn; tabular numerical columns standardised with
    the mean and std of the training pool (the union of the clients' train splits), one-hot
    columns as 0/1.

    Raises:
        DataError: unknown names, bad parameters (e.g. more clients than samples, a client left
            with fewer than 2 samples), a missing or damaged dataset.
    """
    _check_args(dataset, partition, num_clients, seed, train_fraction)
    label_split = dict(classes_per_client=classes_per_client, dirichlet_alpha=dirichlet_alpha,
                       params=partition_params)
    if dataset not in DATASETS:
        return _load_plugin(dataset, partition, num_clients, seed, train_fraction, data_root,
                            dataset_params or {}, label_split)
    if dataset in TABULAR:
        return _load_tabular(dataset, partition, num_clients, seed, train_fraction, data_root,
                             classes_per_client, dirichlet_alpha,
                             _group_proportions(heterogeneity, group_proportions),
                             sensitive_feature, partition_params)
    fractions: tuple[float, ...] = (train_fraction,)
    if dataset == "synthetic":
        x, y, sizes = generate_synthetic(num_clients, seed, synthetic_alpha, synthetic_beta)
        parts, num_classes = P.natural(sizes), SYNTHETIC_CLASSES
        input_shape: tuple[int, ...] = (SYNTHETIC_FEATURES,)
    else:
        raw, y = _load_raw(dataset, data_root)
        input_shape = tuple(raw.shape[1:])
        if partition == "one_class_per_client":
            x, y, parts, num_classes = _one_class(dataset, raw, y, num_clients, classes)
            fractions = ONE_CLASS_FRACTIONS
        else:
            num_classes = _NUM_CLASSES[dataset]
            x = _scale(raw)
            del raw
            if dataset.startswith("cifar"):
                _standardise_channels(x)
            parts = _partition(partition, y, num_clients, seed, num_classes, **label_split)
    _check_sizes(parts, partition)
    train_ptr, train_idx, test_ptr, test_idx = split_clients(parts, seed, fractions)
    return FederatedData(dataset, x, y, num_classes, input_shape,
                         train_ptr, train_idx, test_ptr, test_idx)


def _group_proportions(heterogeneity: str, explicit) -> Sequence[Sequence[float]]:
    if explicit is not None:
        return explicit
    if heterogeneity not in P.GROUP_SKEW_PRESETS:
        raise DataError(f"heterogeneity must be one of {', '.join(P.GROUP_SKEW_PRESETS)}, "
                        f"got {heterogeneity!r}")
    return P.GROUP_SKEW_PRESETS[heterogeneity]


def _load_tabular(dataset: str, partition: str, num_clients: int, seed: int,
                  train_fraction: float, data_root: str | None, classes_per_client: int,
                  dirichlet_alpha: float, proportions: Sequence[Sequence[float]],
                  sensitive_feature: bool, partition_params: dict | None) -> FederatedData:
    """A tabular set: read, partition (labels, or sensitive groups for group_skew), split,
    then standardise the numerical columns with the training pool's statistics."""
    pool = load_tabular(dataset, data_root, sensitive_feature=sensitive_feature)
    if partition == "group_skew":
        rng = np.random.default_rng([seed, PARTITION_TAG])
        parts = P.group_skew(pool.sensitive, num_clients, rng, proportions)
    else:
        parts = _partition(partition, pool.y, num_clients, seed, 2,
                           classes_per_client=classes_per_client, dirichlet_alpha=dirichlet_alpha,
                           params=partition_params, sensitive=pool.sensitive)
    _check_sizes(parts, partition)
    train_ptr, train_idx, test_ptr, test_idx = split_clients(parts, seed, (train_fraction,))
    x = standardise_numeric(pool.x, pool.numeric, train_idx)
    return FederatedData(dataset, x, pool.y, 2, (x.shape[1],), train_ptr, train_idx,
                         test_ptr, test_idx, sensitive=pool.sensitive)


def _partition(name: str, y: np.ndarray, num_clients: int, seed: int, num_classes: int, *,
               classes_per_client: int, dirichlet_alpha: float, params: dict | None = None,
               sensitive: np.ndarray | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, PARTITION_TAG])
    context = dict(num_classes=num_classes, sensitive=sensitive,
                   classes_per_client=classes_per_client, dirichlet_alpha=dirichlet_alpha)
    return call_partition(name, y, num_clients, rng, context, params)


def known_datasets() -> list[str]:
    """Built-in and registered plugin data set names."""
    return [*DATASETS, *(n for n in DATASET_LOADERS.available() if n not in DATASETS)]


def known_partitions() -> list[str]:
    """Built-in and registered plugin partition names."""
    return [*PARTITIONS, *(n for n in PARTITIONERS.available() if n not in PARTITIONS)]


def _load_plugin(dataset: str, partition: str, num_clients: int, seed: int,
                 train_fraction: float, data_root: str | None, params: dict,
                 label_split: dict) -> FederatedData:
    """A plugin data set: its loader's finished split, or its pool split by a label partition."""
    loader = DATASET_LOADERS.get(dataset)
    with blame([("data set", dataset, loader)], "load"):
        try:
            out = loader(seed=seed, data_root=data_root, **params)
        except TypeError as exc:  # most often a [data.params] key the loader lacks
            raise DataError(f"data set '{dataset}': {exc}") from None
    if isinstance(out, FederatedData):
        if out.num_clients != num_clients:
            raise DataError(f"data set '{dataset}' has {out.num_clients} clients, "
                            f"data.num_clients is {num_clients}")
        return out
    if not isinstance(out, DataPool):
        raise DataError(f"data set '{dataset}': the loader must return a DataPool or a "
                        f"FederatedData, got {type(out).__name__}")
    pool = out.check(dataset)
    if partition in SPECIAL_PARTITIONS:
        raise DataError(f"partition '{partition}' is for the built-in data sets; split a plugin "
                        f"data set with a label partition (iid, shards, pathological, dirichlet) "
                        f"or a plugin partition (which may take `sensitive`)")
    if pool.y.dtype.kind == "f" and partition in PARTITIONS and partition != "iid":
        raise DataError(f"partition '{partition}' splits by class label; data set '{dataset}' "
                        f"has regression targets: use 'iid' or a plugin partition")
    parts = _partition(partition, pool.y, num_clients, seed, pool.num_classes,
                       sensitive=pool.sensitive, **label_split)
    _check_sizes(parts, partition)
    train_ptr, train_idx, test_ptr, test_idx = split_clients(parts, seed, (train_fraction,))
    return FederatedData(dataset, pool.x, pool.y, pool.num_classes, tuple(pool.x.shape[1:]),
                         train_ptr, train_idx, test_ptr, test_idx, sensitive=pool.sensitive)
