"""Partitions of a labelled sample pool over K clients (ALGORITHMS.md §8).

Every function is a pure function of the labels, K, a ``numpy.random.Generator`` and its
parameters, and returns a list of K int64 index arrays into ``labels`` (disjoint; they cover the
pool unless the docstring says otherwise). Bad parameters raise :class:`mpifl.core.errors.DataError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mpifl.core.errors import DataError

DIRICHLET_MAX_DRAWS = 1000


def _check_clients(labels: np.ndarray, num_clients: int, per_client: int = 1) -> None:
    if num_clients < 1:
        raise DataError(f"num_clients must be >= 1, got {num_clients}")
    if len(labels) < num_clients * per_client:
        raise DataError(
            f"{num_clients} clients need at least {num_clients * per_client} samples, "
            f"the pool has {len(labels)}"
        )


def _group(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Index arrays per client from an owner-per-sample array (-1 = unassigned)."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    order = order[len(owner) - counts.sum():]  # drop the unassigned (-1 sorts first)
    return np.split(order.astype(np.int64), np.cumsum(counts)[:-1])


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the pool and deal it out in K shares whose sizes differ by at most one.

    McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
    Data", AISTATS 2017 (the IID setting). Raises DataError when K exceeds the pool.
    """
    _check_clients(labels, num_clients)
    return [a.astype(np.int64) for a in np.array_split(rng.permutation(len(labels)), num_clients)]


def shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sort by label, cut 2K equal shards, give every client 2 random shards (equal sizes).

    McMahan et al. (AISTATS 2017) pathological non-IID split, as used by FedFV (Wang et al.,
    IJCAI 2021). When the pool is not a multiple of 2K, ``N mod 2K`` random samples are left
    out so that all shards stay equal. A client holds at most 2 classes whenever each class
    count is a multiple of the shard size (e.g. Fashion-MNIST's 7,000 per class with K = 100);
    otherwise a shard may straddle two classes. Raises DataError when N < 2K.
    """
    _check_clients(labels, num_clients, per_client=2)
    n_shards = 2 * num_clients
    size = len(labels) // n_shards
    # Random order first, then a stable sort by label: the dropped remainder is random and the
    # order within a class is random, so which samples of a class form a shard is random too.
    kept = rng.permutation(len(labels))[: size * n_shards]
    by_label = kept[np.argsort(labels[kept], kind="stable")].reshape(n_shards, size)
    pick = rng.permutation(n_shards).reshape(num_clients, 2)
    return [by_label[p].reshape(-1).astype(np.int64) for p in pick]


def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
                 classes_per_client: int = 2, num_classes: int | None = None
                 ) -> list[np.ndarray]:
    """FedLF's "Pat-k": every client gets at most k classes.

    Pan et al., "FedLF: Layer-wise Fair Federated Learning", AAAI 2024. For each class c in
    order, the first ``m = floor(K k / C)`` clients that still have a free class slot (or all
    that remain, if fewer) share class c's shuffled samples equally (sizes differ by at most
    one). The floor of ALGORITHMS.md §8 is followed; PFLlib's ``pat`` split, a common implementation
    of this rule, uses ceil; the two agree when C divides K k. Clients are filled in blocks of m, so
    when m does not divide K the last clients can get fewer than k classes, or none
    (:func:`mpifl.data.load_federated` rejects clients with fewer than 2 samples).

    Raises:
        DataError: k not in 1..C, ``K k < C`` (a class would have no client), or K exceeds
            the pool.
    """
    _check_clients(labels, num_clients)
    c_total = int(num_classes if num_classes is not None else labels.max() + 1)
    k = classes_per_client
    if not 1 <= k <= c_total:
        raise DataError(f"classes_per_client must be in 1..{c_total}, got {k}")
    m = num_clients * k // c_total
    if m < 1:
        raise DataError(f"pathological partition: {num_clients} clients x {k} classes cannot "
                        f"cover {c_total} classes")
    used = np.zeros(num_clients, dtype=np.int64)  # class slots taken per client
    owner = np.full(len(labels), -1, dtype=np.int64)
    for c in range(c_total):
        takers = np.flatnonzero(used < k)[:m]
        idx = rng.permutation(np.flatnonzero(labels == c))
        for client, part in zip(takers, np.array_split(idx, len(takers))):
            owner[part] = client
        used[takers] += 1
    return _group(owner, num_clients)


def _dirichlet_draw(class_idx: list[np.ndarray], num_clients: int, alpha: float,
                    rng: np.random.Generator, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """One attempt: (owner per sample, samples per client)."""
    n = sum(len(i) for i in class_idx)
    owner = np.empty(n, dtype=np.int64)
    counts = np.zeros(num_clients, dtype=np.int64)
    for idx in class_idx:
        idx = rng.permutation(idx)
        p = rng.dirichlet(np.full(num_clients, alpha))
        p[counts >= cap] = 0.0  # clients that already hold their fair share N/K get no more
        total = p.sum()
        # Tiny alphas can underflow every open client's share to 0: fall back to uniform.
        p = p / total if total > 0 else (counts < cap) / np.count_nonzero(counts < cap)
        cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
        sizes = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
        owner[idx] = np.repeat(np.arange(num_clients), sizes)
        counts += sizes
    return owner, counts


def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
              alpha: float = 0.5, num_classes: int | None = None,
              max_draws: int = DIRICHLET_MAX_DRAWS) -> list[np.ndarray]:
    """Label-skew by per-class Dirichlet proportions (FedLF's "Dir(alpha)").

    Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
    Visual Classification", 2019, in the form of Li et al.'s NIID-Bench (ICDE 2022): for each
    class draw ``p ~ Dir(alpha 1_K)``, zero the share of clients already holding >= N/K samples,
    renormalise, and split the shuffled class samples at the cumulative proportions. The whole
    draw is repeated until every client holds at least C samples (C = number of classes).

    Raises:
        DataError: alpha <= 0, N < K C (no draw can succeed), or ``max_draws`` draws all left
            some client with fewer than C samples.
    """
    c_total = int(num_classes if num_classes is not None else labels.max() + 1)
    if not alpha > 0:
        raise DataError(f"dirichlet_alpha must be > 0, got {alpha}")
    _check_clients(labels, num_clients, per_client=c_total)
    class_idx = [np.flatnonzero(labels == c) for c in range(c_total)]
    for _ in range(max_draws):
        owner, counts = _dirichlet_draw(class_idx, num_clients, alpha, rng,
                                        cap=len(labels) / num_clients)
        if counts.min() >= c_total:
            return _group(owner, num_clients)
    raise DataError(
        f"dirichlet partition: {max_draws} draws with alpha={alpha} all left a client with "
        f"fewer than {c_total} samples; use fewer clients or a larger dirichlet_alpha"
    )


def one_class_per_client(labels: np.ndarray, num_clients: int,
                         classes: Sequence[int]) -> list[np.ndarray]:
    """Client k holds every sample of class ``classes[k]`` (samples of other classes: none).

    FedFV (Wang et al., IJCAI 2021) Table 3, after AFL (Mohri et al., ICML 2019) and q-FFL
    (Li et al., ICLR 2020): Fashion-MNIST classes [0, 2, 6] (T-shirt, pullover, shirt).
    Raises DataError when ``len(classes) != K``, classes repeat, or a class has no samples.
    """
    classes = [int(c) for c in classes]
    if len(classes) != num_clients:
        raise DataError(f"one_class_per_client needs num_clients == len(classes) "
                        f"({len(classes)}), got {num_clients}")
    if len(set(classes)) != len(classes):
        raise DataError(f"one_class_per_client: classes repeat: {classes}")
    parts = [np.flatnonzero(labels == c).astype(np.int64) for c in classes]
    for c, p in zip(classes, parts):
        if len(p) == 0:
            raise DataError(f"one_class_per_client: class {c} has no samples")
    return parts


#: the mFairFL paper's splits of each sensitive group over 5 clients (Su et al., AAAI 2024)
GROUP_SKEW_PRESETS: dict[str, tuple[tuple[float, ...], ...]] = {
    "high": ((0.5, 0.1, 0.1, 0.2, 0.1), (0.1, 0.4, 0.3, 0.1, 0.1)),
    "low": ((0.3, 0.3, 0.2, 0.1, 0.1), (0.1, 0.2, 0.2, 0.2, 0.3)),
}


def group_skew(groups: np.ndarray, num_clients: int, rng: np.random.Generator,
               proportions: Sequence[Sequence[float]]) -> list[np.ndarray]:
    """Sensitive-group skew (mFairFL, Su et al., "Multi-dimensional Fair Federated Learning",
    AAAI 2024; ALGORITHMS.md §8): group a's samples are shuffled and dealt to the clients in the
    shares ``proportions[a]``.

    Client k gets the samples of group a between positions ``floor(n_a * cumsum(p)[k-1])`` and
    ``floor(n_a * cumsum(p)[k])`` of the shuffled group (so counts are within one of
    ``n_a * p_k``). :data:`GROUP_SKEW_PRESETS` holds the paper's "high" and "low" heterogeneity
    splits of two groups over 5 clients.

    Args:
        groups: (N,) int group id per sample, in ``0 .. len(proportions)-1``.
        proportions: one row of K non-negative shares per group, each summing to 1 (to 1e-6;
            renormalised).
    Raises:
        DataError: a row of the wrong length, negative or not summing to 1, a group id without
            a row, or a group without samples.
    """
    props = [np.asarray(p, dtype=np.float64) for p in proportions]
    _check_proportions(props, num_clients)
    groups = np.asarray(groups)
    if len(groups) and (groups.min() < 0 or groups.max() >= len(props)):
        raise DataError(f"group_skew: group ids {groups.min()}..{groups.max()} need "
                        f"{groups.max() + 1} proportion rows, got {len(props)}")
    owner = np.full(len(groups), -1, dtype=np.int64)
    for a, p in enumerate(props):
        idx = rng.permutation(np.flatnonzero(groups == a))
        if len(idx) == 0:
            raise DataError(f"group_skew: group {a} has no samples")
        cuts = np.floor(np.cumsum(p / p.sum()) * len(idx)).astype(np.int64)
        cuts[-1] = len(idx)
        owner[idx] = np.repeat(np.arange(num_clients), np.diff(np.concatenate([[0], cuts])))
    return _group(owner, num_clients)


def _check_proportions(props: list[np.ndarray], num_clients: int) -> None:
    if not props:
        raise DataError("group_skew: no proportion rows given")
    for a, p in enumerate(props):
        if p.shape != (num_clients,):
            raise DataError(f"group_skew: group {a} has {p.size} proportions, but there are "
                            f"{num_clients} clients (one share per client)")
        if not np.isfinite(p).all() or (p < 0).any() or abs(p.sum() - 1.0) > 1e-6:
            raise DataError(f"group_skew: group {a}'s proportions must be >= 0 and sum to 1, "
                            f"got {p.tolist()}")


def natural(client_sizes: Sequence[int] | np.ndarray) -> list[np.ndarray]:
    """The generator's own clients: client k holds the next ``client_sizes[k]`` samples.

    For Synthetic(alpha, beta) (Li et al., MLSys 2020), whose samples come grouped by client.
    """
    ptr = np.concatenate([[0], np.cumsum(np.asarray(client_sizes, dtype=np.int64))])
    return [np.arange(ptr[k], ptr[k + 1], dtype=np.int64) for k in range(len(ptr) - 1)]
