"""mpifl's own data sets and partitions, registered exactly as plugins are
(:func:`mpifl.data.registry.register_dataset` / :func:`register_partition`), each with its
``Params`` (the ``[data.params]`` / ``[data.partition_params]`` table) and the tags that say what
goes with what (:mod:`mpifl.data.compat`).

A ``Params`` class's ``legacy`` maps the old flat ``[data]`` keys it replaces (e.g.
``dirichlet_alpha``) to its fields: the config still reads them (job files, sweeps that vary
``data.dirichlet_alpha``, configs stored in results and checkpoints).

Normalisation: the image sets as :mod:`mpifl.data.images` says; ``one_class_per_client``
per-pixel ``(x - mean) / (std + 0.001)`` over the chosen classes' samples (raw 0..255 values),
labels remapped to 0..len(classes)-1; synthetic features as drawn; tabular numerical columns standardised with the mean and std of the training
pool (the union of the clients' train splits), one-hot columns as 0/1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from mpifl.core.errors import DataError
from mpifl.core.params import Params
from mpifl.data import partition as P
from mpifl.data.compat import IncompatibleData
# the image sets register themselves, every fact about each in its entry of IMAGES
from mpifl.data.images import IMAGES
from mpifl.data.registry import (CLIENTS, LABELS, RAW, SENSITIVE, ClientSource, DataPool,
                                 DataShape, NoParams, Partitioned, register_dataset,
                                 register_partition)
from mpifl.data.synthetic import NUM_CLASSES as SYNTHETIC_CLASSES
from mpifl.data.synthetic import NUM_FEATURES as SYNTHETIC_FEATURES
from mpifl.data.synthetic import (client_sizes, counter_orders, counter_sizes, counter_window,
                                  expected_samples_per_client, fill_client, fill_counter,
                                  generate_counter, generate_synthetic)
from mpifl.data.tabular import ROW_COUNTS, TABULAR, feature_width, load_tabular

__all__ = ["DATASETS", "ONE_CLASS_DEFAULT", "ONE_CLASS_FRACTIONS", "PARTITIONS"]

INT32_MAX = 2**31 - 1
ONE_CLASS_DEFAULT = (0, 2, 6)  # Fashion-MNIST T-shirt, pullover, shirt (FedFV Table 3)
ONE_CLASS_FRACTIONS = (0.8, 0.1)  # train, test; the remaining 10 % is validation (unused)


# --------------------------------------------------------------------------- synthetic, tabular

class SyntheticParams(Params):
    """Synthetic(alpha, beta) of FedProx (:mod:`mpifl.data.synthetic`)."""

    legacy: ClassVar[dict[str, str]] = {"synthetic_alpha": "alpha", "synthetic_beta": "beta"}
    alpha: float = Field(1.0, ge=0.0)
    """Model heterogeneity (Li et al., FedProx, MLSys 2020, section 5.1): client k's model mean
    u_k ~ N(0, alpha), its weights W_k and biases b_k ~ N(u_k, 1); alpha is a standard
    deviation, as in the paper's reference code. 0: every client's model has mean 0."""
    beta: float = Field(1.0, ge=0.0)
    """Data heterogeneity: client k's feature centre v_k ~ N(B_k, 1) with B_k ~ N(0, beta)
    (a standard deviation, as alpha), its samples x ~ N(v_k, diag(j^-1.2)). 0: every client's
    centres are drawn around 0."""
    generator: Literal["pcg64", "counter"] = "pcg64"
    """The random numbers behind the same law: "pcg64" (numpy's generator per client, one
    client at a time on the CPU) or "counter" (a counter-based hash keyed by client, stream and
    index: a lazy run draws a round's clients at once with torch on the worker's device, and
    the K sizes at start-up in one vectorised pass). The two give different data, counter with
    its own train/test split; counter's eager and lazy data are the same bits on a CPU, and a
    window drawn on a GPU equals them within float rounding (mpifl/data/synthetic.py)."""


def _counter_orders(sizes: np.ndarray, *, seed: int) -> np.ndarray:
    """The counter generator's split orders of clients 0..K-1 (sizes (K,)), on the CPU."""
    return counter_orders(np.arange(len(sizes), dtype=np.int64), sizes, seed=seed).numpy()


def synthetic_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                      alpha: float, beta: float, generator: str = "pcg64") -> ClientSource:
    """Synthetic's K clients drawn one at a time (:func:`mpifl.data.lazy.load_population`):
    the (K,) sizes now (O(K)), each client's samples when asked; the counter generator also
    draws a whole window at once on a device (``fill_many``) with its own split order."""
    if generator == "counter":
        sizes = counter_sizes(num_clients, seed)

        def fill_many(ids: np.ndarray, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
            return counter_window(ids, sizes[ids], seed=seed, alpha=alpha, beta=beta,
                                  device=device)

        def split_orders(ids: np.ndarray, device: torch.device) -> torch.Tensor:
            return counter_orders(ids, sizes[ids], seed=seed, device=device)

        return ClientSource(sizes, SYNTHETIC_CLASSES, (SYNTHETIC_FEATURES,),
                            partial(fill_counter, seed=seed, alpha=alpha, beta=beta),
                            fill_many=fill_many, split_orders=split_orders)
    return ClientSource(client_sizes(num_clients, seed), SYNTHETIC_CLASSES,
                        (SYNTHETIC_FEATURES,),
                        partial(fill_client, seed=seed, alpha=alpha, beta=beta))


@register_dataset("synthetic", params=SyntheticParams, provides=(LABELS, CLIENTS),
                  lazy=synthetic_clients,
                  shape=DataShape((SYNTHETIC_FEATURES,), SYNTHETIC_CLASSES,
                                  samples_per_client=expected_samples_per_client(),
                                  key="data.num_clients"))
def synthetic(*, seed: int, data_root: str | None = None, num_clients: int, alpha: float,
              beta: float, generator: str = "pcg64") -> DataPool:
    """K clients' samples, x (N, 60) float32, grouped by client (``client_sizes``)."""
    if generator == "counter":
        x, y, sizes = generate_counter(num_clients, seed, alpha, beta)
        return DataPool(x, y, SYNTHETIC_CLASSES, client_sizes=sizes,
                        split_orders=partial(_counter_orders, seed=seed))
    x, y, sizes = generate_synthetic(num_clients, seed, alpha, beta)
    return DataPool(x, y, SYNTHETIC_CLASSES, client_sizes=sizes)


class TabularParams(Params):
    """Adult, COMPAS, German credit (:mod:`mpifl.data.tabular`)."""

    legacy: ClassVar[dict[str, str]] = {"sensitive_feature": "sensitive_feature"}
    sensitive_feature: bool = True
    """Keep the sensitive attribute's one-hot columns (sex; German's A9 personal status and
    sex) among the model's input features, as the usual fair-FL preprocessing does; false drops
    them (widths 103, 16, 58 instead of 105, 18, 63). Either way it stays each sample's group
    (0 female, 1 male) for group_skew and the group metrics."""


def _tabular_loader(name: str) -> Callable[..., DataPool]:
    def load(*, seed: int, data_root: str | None = None, sensitive_feature: bool) -> DataPool:
        """Every kept row: x (N, F) float32, numerical columns standardised after the split."""
        pool = load_tabular(name, data_root, sensitive_feature=sensitive_feature)
        return DataPool(pool.x, pool.y, 2, sensitive=pool.sensitive, standardise=pool.numeric)

    load.__qualname__ = load.__name__ = f"load_{name}"
    return load


for _name in TABULAR:
    # every column (the sensitive one included); the pool and its standardised copy
    register_dataset(_name, params=TabularParams, provides=(LABELS, SENSITIVE),
                     shape=DataShape((feature_width(_name),), 2, samples=ROW_COUNTS[_name],
                                     copies=2.0))(_tabular_loader(_name))


# --------------------------------------------------------------------------- partitions

@register_partition("iid", params=NoParams)
def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """:func:`mpifl.data.partition.iid`."""
    return P.iid(labels, num_clients, rng)


@register_partition("shards", params=NoParams, needs=(LABELS,))
def shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """:func:`mpifl.data.partition.shards`."""
    return P.shards(labels, num_clients, rng)


class PathologicalParams(Params):
    legacy: ClassVar[dict[str, str]] = {"classes_per_client": "classes_per_client"}
    classes_per_client: int = Field(2, ge=1, le=INT32_MAX)
    """k, the most classes a client holds (FedLF's "Pat-k", Pan et al., AAAI 2024): each
    class's shuffled samples are shared equally by the next floor(K k / C) clients with a free
    class slot, so the last clients may get fewer than k classes. Must be in 1..C with K k >= C.
    McMahan et al. 2017's split (2 label-sorted shards a client) is partition "shards"."""


@register_partition("pathological", params=PathologicalParams, needs=(LABELS,))
def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
                 num_classes: int, classes_per_client: int) -> list[np.ndarray]:
    """:func:`mpifl.data.partition.pathological`."""
    return P.pathological(labels, num_clients, rng, classes_per_client, num_classes)


class DirichletParams(Params):
    legacy: ClassVar[dict[str, str]] = {"dirichlet_alpha": "alpha"}
    alpha: float = Field(0.5, gt=0.0)
    """Concentration of the label skew (Hsu et al. 2019, in the form of Li et al.'s
    NIID-Bench, ICDE 2022): each class's samples are split over the K clients in shares
    p ~ Dir(alpha 1_K), a client already holding N/K samples getting no more. Smaller = more
    heterogeneous (a class on few clients); large = close to iid. The whole draw is repeated
    until every client holds at least C samples."""


@register_partition("dirichlet", params=DirichletParams, needs=(LABELS,))
def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
              num_classes: int, alpha: float) -> list[np.ndarray]:
    """:func:`mpifl.data.partition.dirichlet`."""
    return P.dirichlet(labels, num_clients, rng, alpha, num_classes)


class OneClassParams(Params):
    legacy: ClassVar[dict[str, str]] = {"classes": "classes"}
    classes: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        default_factory=lambda: list(ONE_CLASS_DEFAULT), min_length=1)
    """Client k holds every sample of class classes[k] (class ids 0..C-1 of the data set, no
    repeats), relabelled k and split 80/10/10 train/test/unused; needs data.num_clients =
    len(classes). Default: Fashion-MNIST's T-shirt, pullover and shirt (FedFV Table 3, after
    AFL and q-FFL)."""

    def check_clients(self, num_clients: int) -> None:
        """Raises IncompatibleData unless K = len(classes)."""
        if num_clients != len(self.classes):
            raise IncompatibleData("data.num_clients", f"one_class_per_client needs num_clients "
                                   f"== len(classes) ({len(self.classes)}), got {num_clients}")


@register_partition("one_class_per_client", params=OneClassParams, needs=(LABELS, RAW))
def one_class_per_client(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
                         pool: DataPool, classes: list[int]) -> Partitioned:
    """The chosen classes' samples only, relabelled 0..K-1, each pixel standardised over them
    on raw values, split 80/10/10 (FedFV Table 3; :func:`mpifl.data.partition.
    one_class_per_client`)."""
    bad = [c for c in classes if not 0 <= c < pool.num_classes]
    if bad:
        raise DataError(f"one_class_per_client: classes {bad} are not in "
                        f"0..{pool.num_classes - 1}")
    assert pool.raw is not None, "needs=(RAW,): the data set's pool has its raw images"
    parts = P.one_class_per_client(labels, num_clients, classes)
    x = _standardise_pixels(pool.raw[np.concatenate(parts)])
    y = np.repeat(np.arange(len(parts), dtype=np.int64), [len(p) for p in parts])
    return Partitioned(P.natural([len(p) for p in parts]), DataPool(x, y, len(classes)),
                       ONE_CLASS_FRACTIONS)


def _standardise_pixels(raw: np.ndarray) -> np.ndarray:
    """Per pixel ``(x - mean) / (std + 0.001)`` over the samples given, on raw 0..255 values.

    As in the q-FFL / AFL preprocessing that FedFV's one-class experiment reuses
    (ALGORITHMS.md §8).
    """
    xf = raw.astype(np.float32)
    mean = xf.mean(axis=0, dtype=np.float64)
    std = xf.std(axis=0, dtype=np.float64)
    xf -= mean.astype(np.float32)
    xf /= (std + 0.001).astype(np.float32)
    return xf


@register_partition("natural", params=NoParams, needs=(CLIENTS,))
def natural(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
            pool: DataPool) -> list[np.ndarray]:
    """The data set's own clients (:func:`mpifl.data.partition.natural`)."""
    assert pool.client_sizes is not None, "needs=(CLIENTS,): the data set's pool has its clients"
    return P.natural(pool.client_sizes)


class GroupSkewParams(Params):
    legacy: ClassVar[dict[str, str]] = {"heterogeneity": "heterogeneity",
                                        "group_proportions": "group_proportions"}
    heterogeneity: Literal["high", "low"] = "high"
    """The mFairFL paper's split (Su et al., AAAI 2024) of the two sensitive groups over 5
    clients, "high" or "low" heterogeneity (the shares: GROUP_SKEW_PRESETS in
    mpifl/data/partition.py); needs data.num_clients = 5. Ignored when group_proportions is
    set."""
    group_proportions: list[list[float]] | None = None
    """Explicit shares instead of the preset: one row per sensitive group (row a for group
    id a), each of K shares >= 0 summing to 1; group a's shuffled samples are dealt to the
    clients in row a's shares (counts within one of n_a p_k)."""

    def proportions(self) -> list[list[float]]:
        """The shares used: the explicit ones, else the preset's."""
        if self.group_proportions is not None:
            return self.group_proportions
        return [list(row) for row in P.GROUP_SKEW_PRESETS[self.heterogeneity]]

    def check_clients(self, num_clients: int) -> None:
        """Raises IncompatibleData unless every row has K shares >= 0 summing to 1."""
        if self.group_proportions is None and num_clients != 5:
            raise IncompatibleData("data.num_clients", f"the group_skew '{self.heterogeneity}' "
                                   f"preset splits each group over 5 clients, got {num_clients} "
                                   f"clients; set data.partition_params.group_proportions for "
                                   f"another number of clients")
        key = "data.partition_params.group_proportions"
        for a, row in enumerate(self.proportions()):
            if len(row) != num_clients:
                raise IncompatibleData(key, f"group {a} has {len(row)} shares, data.num_clients "
                                            f"is {num_clients}")
            if any(v < 0 for v in row) or abs(sum(row) - 1.0) > 1e-6:
                raise IncompatibleData(key, f"group {a}'s shares must be >= 0 and sum to 1 "
                                            f"(got {row})")


@register_partition("group_skew", params=GroupSkewParams, needs=(SENSITIVE,))
def group_skew(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
               sensitive: np.ndarray, heterogeneity: str,
               group_proportions: list[list[float]] | None) -> list[np.ndarray]:
    """Sensitive-group skew (mFairFL; :func:`mpifl.data.partition.group_skew`)."""
    explicit = group_proportions
    shares = P.GROUP_SKEW_PRESETS[heterogeneity] if explicit is None else explicit
    return P.group_skew(sensitive, num_clients, rng, shares)


# The federated benchmarks as published (LEAF, TFF, FLAIR) and their generated stand-ins
# register themselves on import, beside the sets above.
from mpifl.data.published import PUBLISHED  # noqa: E402
from mpifl.data.standins import STANDINS  # noqa: E402

#: The built-in names, in the order the docs list them (all registered above or on import).
DATASETS = (*IMAGES, "synthetic", *TABULAR, *PUBLISHED, *STANDINS)
PARTITIONS = ("iid", "shards", "pathological", "dirichlet", "one_class_per_client", "natural",
              "group_skew")
