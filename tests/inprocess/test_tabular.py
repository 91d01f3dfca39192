"""Tabular fairness data (Adult, COMPAS, German credit): row counts, stable feature widths,
encoding, standardisation with training-pool statistics, checksums, the group_skew partition
(docs/ALGORITHMS.md §8) and the config keys. Reads the original UCI and ProPublica files from
tests.helpers.TABULAR_DATA (adult/, compas/, german/)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from mpifl.experiment.config import load_config
from mpifl.data import fetch_dataset, load_federated
from mpifl.data import partition as P
from mpifl.data.tabular import (ROW_COUNTS, TABULAR, feature_width, load_tabular,
                                standardise_numeric)
from mpifl.core.errors import ConfigError, DataError
from tests.helpers import TABULAR_DATA

DATA = TABULAR_DATA

# documented in mpifl/data/tabular.py: rows kept, width with / without the sensitive columns
WIDTHS = {"adult": (105, 103), "compas": (18, 16), "german": (63, 58)}
ROWS = {"adult": 45_222, "compas": 6_172, "german": 1_000}


@pytest.fixture(scope="module")
def data_root() -> str:
    if not all((DATA / d).is_dir() for d in TABULAR):
        pytest.fail(f"the tabular test data folder {DATA} (adult/, compas/, german/; "
                    "MPIFL_TEST_DATA names another) is missing")
    return str(DATA)


@pytest.fixture(scope="module")
def pools(data_root):
    return {name: load_tabular(name, data_root) for name in TABULAR}


# ----------------------------------------------------------------------------- readers

@pytest.mark.parametrize("name", TABULAR)
def test_row_counts_and_widths(pools, name):
    pool = pools[name]
    assert ROW_COUNTS[name] == ROWS[name]
    assert pool.x.shape == (ROWS[name], WIDTHS[name][0])
    assert pool.x.dtype == np.float32 and pool.y.dtype == pool.sensitive.dtype == np.int64
    assert pool.y.shape == pool.sensitive.shape == (ROWS[name],)
    assert set(np.unique(pool.y)) == {0, 1} and set(np.unique(pool.sensitive)) == {0, 1}
    assert feature_width(name) == WIDTHS[name][0] == len(pool.feature_names)
    assert feature_width(name, sensitive_feature=False) == WIDTHS[name][1]


def test_adult_counts_by_hand(data_root, pools):
    # independent count of the rows without '?' (adult.test: comment line, labels with '.')
    rows = positives = 0
    for fname in ("adult.data", "adult.test"):
        for line in (DATA / "adult" / fname).read_text().splitlines():
            if line.strip() and not line.startswith("|") and "?" not in line:
                rows += 1
                positives += ">50K" in line
    assert rows == 45_222 == len(pools["adult"].y)
    assert positives == int(pools["adult"].y.sum())


def test_known_group_sizes(pools):
    assert int((pools["german"].sensitive == 0).sum()) == 310        # A92 (A95 never occurs)
    assert int((pools["german"].y == 1).sum()) == 700                # good credit
    assert int((pools["compas"].sensitive == 0).sum()) == 1_175      # women after the filter
    assert int((pools["adult"].sensitive == 0).sum()) == 14_695      # women without '?'


@pytest.mark.parametrize("name", TABULAR)
def test_one_hot_blocks(pools, name):
    pool = pools[name]
    cat = ~pool.numeric
    assert set(np.unique(pool.x[:, cat])) <= {0.0, 1.0}
    blocks = {}
    for j, fname in enumerate(pool.feature_names):
        if "=" in fname:
            blocks.setdefault(fname.split("=")[0], []).append(j)
    for cols in blocks.values():               # exactly one category per row and attribute
        assert np.array_equal(pool.x[:, cols].sum(axis=1), np.ones(len(pool.x)))


@pytest.mark.parametrize("name", TABULAR)
def test_sensitive_columns_follow_the_group(data_root, pools, name):
    pool = pools[name]
    if name == "german":
        female = [pool.feature_names.index(f"A9_status_sex={c}") for c in ("A92", "A95")]
        is_female = pool.x[:, female].sum(axis=1)
    else:
        is_female = pool.x[:, pool.feature_names.index("sex=Female")]
    assert np.array_equal(is_female == 1, pool.sensitive == 0)
    blind = load_tabular(name, data_root, sensitive_feature=False)
    assert blind.x.shape[1] == WIDTHS[name][1]
    assert not any(n.startswith(("sex=", "A9_")) for n in blind.feature_names)
    assert np.array_equal(blind.sensitive, pool.sensitive) and np.array_equal(blind.y, pool.y)


def test_standardise_uses_the_given_rows_only():
    x = np.array([[1.0, 0.0], [3.0, 1.0], [100.0, 0.0]], dtype=np.float32)
    standardise_numeric(x, np.array([True, False]), np.array([0, 1]))
    assert x[:, 0].tolist() == pytest.approx([-1.0, 1.0, 98.0])   # mean 2, std 1 from rows 0,1
    assert x[:, 1].tolist() == [0.0, 1.0, 0.0]                      # one-hot untouched
    with pytest.raises(ValueError):
        standardise_numeric(x, np.array([True, False]), np.array([], dtype=np.int64))


def test_checksum_mismatch_and_missing_folder(tmp_path, data_root):
    (tmp_path / "german").mkdir()
    blob = bytearray((DATA / "german" / "german.data").read_bytes())
    blob[5] ^= 1
    (tmp_path / "german" / "german.data").write_bytes(bytes(blob))
    with pytest.raises(DataError, match="SHA-256"):
        load_tabular("german", tmp_path)
    with pytest.raises(DataError, match="not found") as info:
        load_tabular("compas", tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / "compas") in str(info.value)


def test_fetch_verifies_sha256(tmp_path, data_root):
    mirror = (DATA / "german").as_uri()
    folder = fetch_dataset("german", root=tmp_path, base_url=mirror)
    assert folder == tmp_path / "german"
    assert load_tabular("german", tmp_path).x.shape == (1_000, 63)
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(DATA / "adult" / "adult.names", bad / "german.data")
    with pytest.raises(DataError, match="checksum mismatch"):
        fetch_dataset("german", root=tmp_path / "out", base_url=bad.as_uri())


# ----------------------------------------------------------------------------- federated

def test_load_federated_stable_width_and_standardisation(data_root):
    a = load_federated("compas", partition="iid", num_clients=7, seed=0, data_root=data_root)
    b = load_federated("compas", partition="dirichlet", num_clients=4, seed=3,
                       data_root=data_root)
    assert a.input_shape == b.input_shape == (18,) and a.num_classes == 2
    assert a.sensitive is not None and a.sensitive.shape == a.y.shape
    pool = load_tabular("compas", data_root)
    num = np.flatnonzero(pool.numeric)
    train = a.x[a.train_idx][:, num].astype(np.float64)
    assert np.allclose(train.mean(axis=0), 0, atol=1e-5)
    assert np.allclose(train.std(axis=0), 1, atol=1e-5)
    test = a.x[a.test_idx][:, num].astype(np.float64)
    assert not np.allclose(test.mean(axis=0), 0, atol=1e-5)    # test rows did not set the stats
    assert np.array_equal(a.x[:, ~pool.numeric], pool.x[:, ~pool.numeric])
    assert load_federated("synthetic", partition="natural", num_clients=3, seed=0).sensitive \
        is None


@pytest.mark.parametrize("preset", ["high", "low"])
def test_group_skew_adult_presets(data_root, preset):
    fed = load_federated("adult", partition="group_skew", num_clients=5, seed=0,
                         data_root=data_root, partition_params={"heterogeneity": preset})
    again = load_federated("adult", partition="group_skew", num_clients=5, seed=0,
                           data_root=data_root, partition_params={"heterogeneity": preset})
    assert np.array_equal(fed.train_idx, again.train_idx)
    totals = np.bincount(fed.sensitive, minlength=2)
    for a, props in enumerate(P.GROUP_SKEW_PRESETS[preset]):
        held = [int((fed.sensitive[np.concatenate([fed.train_indices(k), fed.test_indices(k)])]
                     == a).sum()) for k in range(5)]
        assert sum(held) == totals[a]
        assert np.abs(np.array(held) - totals[a] * np.array(props)).max() <= 1


def test_group_skew_rules():
    groups = np.array([0] * 10 + [1] * 20)
    parts = P.group_skew(groups, 3, np.random.default_rng(0), [[0.5, 0.5, 0], [0.1, 0.2, 0.7]])
    assert [int((groups[p] == 0).sum()) for p in parts] == [5, 5, 0]
    assert [int((groups[p] == 1).sum()) for p in parts] == [2, 4, 14]
    assert sorted(np.concatenate(parts).tolist()) == list(range(30))
    with pytest.raises(DataError, match="3 clients"):
        P.group_skew(groups, 3, np.random.default_rng(0), [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(DataError, match="sum to 1"):
        P.group_skew(groups, 2, np.random.default_rng(0), [[0.5, 0.6], [0.5, 0.5]])
    with pytest.raises(DataError, match="proportion rows"):
        P.group_skew(groups, 2, np.random.default_rng(0), [[0.5, 0.5]])


def test_group_skew_errors(data_root):
    with pytest.raises(DataError, match="3 clients"):
        load_federated("german", partition="group_skew", num_clients=3, seed=0,
                       data_root=data_root)
    with pytest.raises(DataError, match="sensitive attribute"):
        load_federated("fashion_mnist", partition="group_skew", num_clients=5, seed=0)
    fed = load_federated("german", partition="group_skew", num_clients=2, seed=0,
                         data_root=data_root,
                         partition_params={"group_proportions": [[1, 0], [0, 1]]})
    assert set(fed.sensitive[fed.train_indices(0)]) == {0}


def test_config_keys():
    cfg = load_config(None, ["data.dataset=adult", "data.partition=group_skew",
                             "data.num_clients=5", "server.clients_per_round=5",
                             "data.heterogeneity=low", "data.sensitive_feature=false"])
    assert cfg.data.partition_params == {"heterogeneity": "low", "group_proportions": None}
    assert cfg.data.params == {"sensitive_feature": False}  # the old flat keys, nested
    with pytest.raises(ConfigError, match="5 clients"):
        load_config(None, ["data.dataset=adult", "data.partition=group_skew"])
    with pytest.raises(ConfigError, match="sensitive attribute"):
        load_config(None, ["data.partition=group_skew", "data.num_clients=5",
                           "server.clients_per_round=5"])
    with pytest.raises(ConfigError, match="group 1 has 2 shares"):
        load_config(None, ["data.dataset=compas", "data.partition=group_skew",
                           "data.num_clients=3", "server.clients_per_round=3",
                           "data.group_proportions=[[0.2,0.3,0.5],[0.5,0.5]]"])
