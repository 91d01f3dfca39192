"""Partitions (docs/ALGORITHMS.md §8), per-client train/test splits, Synthetic(alpha, beta), and
load_federated end to end."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from mpifl.data import DATASETS, PARTITIONS, FederatedData, load_federated
from mpifl.data import partition as P
from mpifl.data.federated import SPLIT_TAG, _split_counts, split_clients
from mpifl.data.synthetic import MAX_SAMPLES_PER_CLIENT, MIN_SAMPLES_PER_CLIENT
from mpifl.core.errors import DataError

C = 10


def balanced_labels(per_class: int = 200, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(C), per_class))


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_disjoint_cover(parts, n: int, cover: bool = True) -> None:
    flat = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert len(np.unique(flat)) == len(flat), "clients share samples"
    assert flat.min() >= 0 and flat.max() < n
    if cover:
        assert len(flat) == n, "some samples are not assigned"


def n_classes(labels, part) -> int:
    return len(np.unique(labels[part]))


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_public_names():
    from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS
    from mpifl.experiment.config import load_config

    assert DATASETS == ("fashion_mnist", "mnist", "cifar10", "cifar100", "synthetic", "adult",
                        "compas", "german", "leaf_femnist", "leaf_shakespeare", "leaf_sent140",
                        "leaf_synthetic", "tff_emnist", "tff_shakespeare", "tff_stackoverflow",
                        "tff_cifar100", "flair", "femnist_like", "shakespeare_like",
                        "stackoverflow_like", "cifar100_like", "cifar10_like")
    assert PARTITIONS == ("iid", "shards", "pathological", "dirichlet", "one_class_per_client",
                          "natural", "group_skew")
    # one truth: every built-in name is a registry entry, accepted by the config
    assert set(PARTITIONS) <= set(PARTITIONERS.available())
    assert set(DATASETS) <= set(DATASET_LOADERS.available())
    for name in DATASETS:  # a data set of its own clients goes with 'natural' only
        own = "clients" in (DATASET_LOADERS.get(name).provides or ())
        load_config(None, [f"data.dataset={name}", "data.partition="
                           + ("natural" if own else "iid")])


# ----------------------------------------------------------------------------- iid, shards

def test_iid_sizes_cover_and_mixing():
    y = balanced_labels()
    parts = P.iid(y, 7, rng())
    assert_disjoint_cover(parts, len(y))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(n_classes(y, p) == C for p in parts)  # ~285 random samples see every class
    assert same(parts, P.iid(y, 7, rng()))
    assert not same(parts, P.iid(y, 7, rng(1)))


def test_shards_equal_sizes_and_two_classes():
    y = balanced_labels()  # 2,000 samples, K = 10: 20 shards of 100, 2 shards per class
    parts = P.shards(y, 10, rng())
    assert_disjoint_cover(parts, len(y))
    assert {len(p) for p in parts} == {200}
    assert all(n_classes(y, p) <= 2 for p in parts)
    assert any(n_classes(y, p) == 2 for p in parts), "shards must be dealt at random"
    # each shard is a single class, and the shard count per class is exact
    shard_classes = np.concatenate([[y[p[0]], y[p[100]]] for p in parts])
    np.testing.assert_array_equal(np.bincount(shard_classes), [2] * C)
    assert same(parts, P.shards(y, 10, rng()))
    assert not same(parts, P.shards(y, 10, rng(1)))


def test_shards_remainder_dropped_sizes_stay_equal():
    y = balanced_labels()[:1993]
    parts = P.shards(y, 10, rng())
    assert_disjoint_cover(parts, len(y), cover=False)
    assert {len(p) for p in parts} == {1993 // 20 * 2}


def test_shards_too_many_clients():
    with pytest.raises(DataError, match="need at least 40 samples"):
        P.shards(np.zeros(39, np.int64), 20, rng())


# ----------------------------------------------------------------------------- pathological

@pytest.mark.parametrize("k,K", [(1, 10), (2, 20), (5, 10), (5, 20)])
def test_pathological_k_classes_per_client(k, K):
    y = balanced_labels()
    parts = P.pathological(y, K, rng(), classes_per_client=k, num_classes=C)
    assert_disjoint_cover(parts, len(y))
    assert all(n_classes(y, p) == k for p in parts)
    # every class is shared equally by floor(K k / C) clients
    m = K * k // C
    for c in range(C):
        per_client = [np.count_nonzero(y[p] == c) for p in parts]
        holders = [n for n in per_client if n > 0]
        assert len(holders) == m and max(holders) - min(holders) <= 1


def test_pathological_rule_first_free_clients():
    y = balanced_labels()
    parts = P.pathological(y, 10, rng(), classes_per_client=2, num_classes=C)
    # m = 2: classes 0 and 1 go to clients 0 and 1, classes 2 and 3 to clients 2 and 3, ...
    for k, p in enumerate(parts):
        assert set(np.unique(y[p])) == {2 * (k // 2), 2 * (k // 2) + 1}


def test_pathological_uneven_leaves_last_client_short():
    # K = 10, k = 3: m = 3 and the first free clients fill up in threes (0-2, 3-5, 6-8), so
    # class 9 is all that is left for client 9 (docs/ALGORITHMS.md §8's rule taken literally).
    y = balanced_labels()
    parts = P.pathological(y, 10, rng(), classes_per_client=3, num_classes=C)
    assert_disjoint_cover(parts, len(y))
    assert [n_classes(y, p) for p in parts] == [3] * 9 + [1]
    assert set(np.unique(y[parts[9]])) == {9}


def test_pathological_deterministic_and_errors():
    y = balanced_labels()
    a = P.pathological(y, 20, rng(), 2, C)
    assert same(a, P.pathological(y, 20, rng(), 2, C))
    assert not same(a, P.pathological(y, 20, rng(5), 2, C))
    with pytest.raises(DataError, match="classes_per_client must be in 1..10"):
        P.pathological(y, 20, rng(), 11, C)
    with pytest.raises(DataError, match="cannot cover 10 classes"):
        P.pathological(y, 3, rng(), 2, C)


# ----------------------------------------------------------------------------- dirichlet

def test_dirichlet_min_size_cover_and_determinism():
    y = balanced_labels()
    parts = P.dirichlet(y, 20, rng(), alpha=0.5, num_classes=C)
    assert_disjoint_cover(parts, len(y))
    assert min(len(p) for p in parts) >= C
    assert same(parts, P.dirichlet(y, 20, rng(), alpha=0.5, num_classes=C))
    assert not same(parts, P.dirichlet(y, 20, rng(1), alpha=0.5, num_classes=C))


def test_dirichlet_alpha_controls_skew():
    y = balanced_labels()

    def mean_classes(alpha):
        parts = P.dirichlet(y, 20, rng(), alpha=alpha, num_classes=C)
        return np.mean([np.count_nonzero(np.bincount(y[p], minlength=C) >= 5) for p in parts])

    assert mean_classes(100.0) == C  # near-IID: every client has plenty of every class
    assert mean_classes(0.1) < 5  # strongly skewed


def test_dirichlet_stops_feeding_clients_at_fair_share():
    # alpha = 0.01 gives nearly a whole class to one client; once a client holds >= N/K it
    # gets no more, so no client can collect two whole classes (200 + 200 >= 2 N/K)
    y = balanced_labels()
    for seed in range(3):
        parts = P.dirichlet(y, 10, rng(seed), alpha=0.01, num_classes=C)
        assert max(len(p) for p in parts) < 2 * len(y) / 10


def test_dirichlet_errors():
    y = balanced_labels(per_class=10)  # 100 samples
    with pytest.raises(DataError, match="need at least 110 samples"):
        P.dirichlet(y, 11, rng(), alpha=0.5, num_classes=C)  # N < K C: hopeless
    with pytest.raises(DataError, match="dirichlet_alpha must be > 0"):
        P.dirichlet(y, 2, rng(), alpha=0.0, num_classes=C)
    # N = K C exactly: every client would need exactly C samples; a few draws cannot do it
    with pytest.raises(DataError, match="3 draws with alpha=0.05"):
        P.dirichlet(y, 10, rng(), alpha=0.05, num_classes=C, max_draws=3)


# ----------------------------------------------------------------------------- one class, natural

def test_one_class_per_client_partition():
    y = balanced_labels(per_class=30)
    parts = P.one_class_per_client(y, 3, [0, 2, 6])
    assert_disjoint_cover(parts, len(y), cover=False)
    for c, p in zip([0, 2, 6], parts):
        np.testing.assert_array_equal(p, np.flatnonzero(y == c))
    with pytest.raises(DataError, match="num_clients == len"):
        P.one_class_per_client(y, 2, [0, 2, 6])
    with pytest.raises(DataError, match="repeat"):
        P.one_class_per_client(y, 2, [1, 1])


def test_natural_is_contiguous():
    parts = P.natural([3, 1, 2])
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3], [4, 5]]


# ----------------------------------------------------------------------------- splits

@pytest.mark.parametrize("n,frac,expected", [(10, 0.8, (8, 2)), (2, 0.8, (1, 1)),
                                             (3, 0.8, (2, 1)), (10, 0.99, (9, 1)),
                                             (10, 0.01, (1, 9)), (1, 0.8, (1, 0))])
def test_split_counts(n, frac, expected):
    assert _split_counts(n, (frac,)) == expected


def test_split_counts_three_way():
    assert _split_counts(7000, (0.8, 0.1)) == (5600, 700)  # 700 left for validation


def test_split_clients_csr_and_determinism():
    parts = [np.arange(0, 10), np.arange(10, 13), np.arange(13, 33)]
    tp, ti, sp, si = split_clients(parts, seed=4, fractions=(0.8,))
    np.testing.assert_array_equal(tp, [0, 8, 10, 26])
    np.testing.assert_array_equal(sp, [0, 2, 3, 7])
    for k, p in enumerate(parts):
        tr, te = ti[tp[k]:tp[k + 1]], si[sp[k]:sp[k + 1]]
        assert sorted(np.concatenate([tr, te]).tolist()) == p.tolist()
    again = split_clients(parts, seed=4, fractions=(0.8,))
    assert all(np.array_equal(a, b) for a, b in zip((tp, ti, sp, si), again))
    other = split_clients(parts, seed=5, fractions=(0.8,))
    assert not np.array_equal(ti, other[1])
    # a client's split depends on its own id and the seed only, not on the other clients
    alone = split_clients([np.arange(0, 10)], seed=4, fractions=(0.8,))
    np.testing.assert_array_equal(alone[1], ti[:8])
    # the contract: client k shuffles with default_rng([seed, k, SPLIT_TAG])
    for k, p in enumerate(parts):
        perm = np.random.default_rng([4, k, SPLIT_TAG]).permutation(p)
        np.testing.assert_array_equal(ti[tp[k]:tp[k + 1]], perm[: tp[k + 1] - tp[k]])
    # so two clients with the same number of samples are shuffled differently
    twins = split_clients([np.arange(10), np.arange(10, 20)], seed=4, fractions=(0.8,))[1]
    assert not np.array_equal(twins[:8], twins[8:] - 10)


# ----------------------------------------------------------------------------- load_federated

def test_load_federated_synthetic_end_to_end():
    d = load_federated("synthetic", partition="natural", num_clients=30, seed=3)
    assert isinstance(d, FederatedData)
    n = len(d.y)
    assert d.x.shape == (n, 60) and d.x.dtype == np.float32 and d.input_shape == (60,)
    assert d.y.dtype == np.int64 and 0 <= d.y.min() and d.y.max() < 10 and d.num_classes == 10
    assert d.num_clients == 30 and d.train_ptr.dtype == np.int64 and d.test_idx.dtype == np.int64
    sizes = d.num_train + d.num_test
    assert sizes.sum() == n
    assert ((MIN_SAMPLES_PER_CLIENT <= sizes) & (sizes <= MAX_SAMPLES_PER_CLIENT)).all()
    np.testing.assert_array_equal(d.num_train, np.round(0.8 * sizes).astype(int))
    start = np.concatenate([[0], np.cumsum(sizes)])
    for k in range(30):  # natural partition: client k owns rows start[k]:start[k+1]
        both = np.concatenate([d.train_indices(k), d.test_indices(k)])
        np.testing.assert_array_equal(np.sort(both), np.arange(start[k], start[k + 1]))

    same_again = load_federated("synthetic", partition="natural", num_clients=30, seed=3)
    np.testing.assert_array_equal(d.x, same_again.x)
    np.testing.assert_array_equal(d.train_idx, same_again.train_idx)
    other = load_federated("synthetic", partition="natural", num_clients=30, seed=4)
    assert other.x.shape != d.x.shape or not np.array_equal(other.x, d.x)
    # client k's data does not depend on K
    fewer = load_federated("synthetic", partition="natural", num_clients=5, seed=3)
    np.testing.assert_array_equal(fewer.x, d.x[: len(fewer.x)])


def test_synthetic_feature_variance_and_heterogeneity():
    d = load_federated("synthetic", partition="natural", num_clients=40, seed=0)
    sizes = d.num_train + d.num_test
    owner = np.repeat(np.arange(40), sizes)
    means = np.stack([d.x[owner == k].mean(0) for k in range(40)])
    within = ((d.x - means[owner]) ** 2).mean(0)
    j = np.arange(1, 61)
    np.testing.assert_allclose(within, j ** -1.2, rtol=0.1)  # x ~ N(v_k, diag(j^-1.2))
    # v_k ~ N(B_k, 1): client means differ by O(1) between clients
    assert means.std(0).mean() > 0.5
    # labels depend on the client's own model: label histograms differ between clients
    hist = np.stack([np.bincount(d.y[owner == k], minlength=10) / sizes[k] for k in range(40)])
    assert hist.max(1).mean() > 0.3


def test_load_federated_rejects_bad_combinations():
    with pytest.raises(DataError, match="'natural' goes with the data sets that have their own clients"):
        load_federated("synthetic", partition="iid", num_clients=3, seed=0)
    with pytest.raises(DataError, match="'natural' goes with the data sets that have their own clients"):
        load_federated("mnist", partition="natural", num_clients=3, seed=0)
    with pytest.raises(DataError, match="unknown dataset"):
        load_federated("imagenet", partition="iid", num_clients=3, seed=0)
    with pytest.raises(DataError, match="unknown partition"):
        load_federated("mnist", partition="random", num_clients=3, seed=0)
    with pytest.raises(DataError, match="train_fraction"):
        load_federated("synthetic", partition="natural", num_clients=3, seed=0,
                       train_fraction=1.0)
    with pytest.raises(DataError, match="seed"):
        load_federated("synthetic", partition="natural", num_clients=3, seed=-1)


def _write_fake_fmnist(folder: Path, n_train: int = 240, n_test: int = 60) -> np.ndarray:
    """A fake fashion-mnist/ folder (gzip IDX); returns the pooled raw images."""
    rng = np.random.default_rng(7)
    folder.mkdir(parents=True)
    xs = []
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        for kind, arr, code in (("images-idx3", x, 8), ("labels-idx1", y, 8)):
            head = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
            (folder / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(head + arr.tobytes()))
        xs.append(x)
    return np.concatenate(xs)


def test_load_federated_one_class_per_client(tmp_path):
    raw = _write_fake_fmnist(tmp_path / "fashion-mnist")  # 30 samples per class
    y_raw = np.concatenate([np.arange(240) % 10, np.arange(60) % 10])
    d = load_federated("fashion_mnist", partition="one_class_per_client", num_clients=3,
                       seed=0, data_root=tmp_path, partition_params={"classes": [0, 2, 6]},
                       train_fraction=0.5)
    assert d.num_classes == 3 and d.x.shape == (90, 1, 28, 28)
    np.testing.assert_array_equal(np.bincount(d.y), [30, 30, 30])
    # 80/10/10 whatever train_fraction says; validation (3 per client) is left out
    np.testing.assert_array_equal(d.num_train, [24, 24, 24])
    np.testing.assert_array_equal(d.num_test, [3, 3, 3])
    for k in range(3):
        idx = np.concatenate([d.train_indices(k), d.test_indices(k)])
        assert (d.y[idx] == k).all()
    # per-pixel standardisation over the chosen classes, on raw pixel values, +0.001
    sel = raw[np.isin(y_raw, [0, 2, 6])].astype(np.float64)
    order = np.argsort(y_raw[np.isin(y_raw, [0, 2, 6])], kind="stable")
    expect = (sel - sel.mean(0)) / (sel.std(0) + 0.001)
    np.testing.assert_allclose(d.x[:, 0], expect[order], rtol=1e-4, atol=1e-4)
    with pytest.raises(DataError, match="num_clients == len"):
        load_federated("fashion_mnist", partition="one_class_per_client", num_clients=2,
                       seed=0, data_root=tmp_path, partition_params={"classes": [0, 2, 6]})
    with pytest.raises(DataError, match="not in 0..9"):
        load_federated("fashion_mnist", partition="one_class_per_client", num_clients=2,
                       seed=0, data_root=tmp_path, partition_params={"classes": [0, 12]})


@pytest.mark.parametrize("partition,extra", [("iid", {}), ("shards", {}),
                                             ("pathological", {"partition_params": {"classes_per_client": 2}}),
                                             ("dirichlet", {"partition_params": {"alpha": 1.0}})])
def test_load_federated_partitions_on_disk(tmp_path, partition, extra):
    _write_fake_fmnist(tmp_path / "fashion-mnist")
    kw = dict(partition=partition, num_clients=10, seed=1, data_root=tmp_path, **extra)
    d = load_federated("fashion_mnist", **kw)
    assert d.x.shape == (300, 1, 28, 28)
    every = np.concatenate([d.train_idx, d.test_idx])
    assert len(np.unique(every)) == len(every) == 300  # all four partitions cover the pool
    assert (d.num_test >= 1).all() and (d.num_train >= 1).all()
    again = load_federated("fashion_mnist", **kw)
    np.testing.assert_array_equal(d.train_idx, again.train_idx)
    np.testing.assert_array_equal(d.test_ptr, again.test_ptr)
    other = load_federated("fashion_mnist", **{**kw, "seed": 2})
    assert not np.array_equal(d.train_idx, other.train_idx)


def test_load_federated_too_many_clients(tmp_path):
    _write_fake_fmnist(tmp_path / "fashion-mnist")
    with pytest.raises(DataError, match="fewer than 2 samples"):
        load_federated("fashion_mnist", partition="iid", num_clients=200, seed=0,
                       data_root=tmp_path)
    with pytest.raises(DataError, match="the pool has 300"):
        load_federated("fashion_mnist", partition="iid", num_clients=301, seed=0,
                       data_root=tmp_path)
