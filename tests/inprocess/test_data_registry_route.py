"""One route for data: mpifl's own data sets and partitions are registry
entries like plugins', their parameters are ``[data.params]`` / ``[data.partition_params]``
validated by each entry's ``Params``, what goes with what is declared by the entries and checked
in one place, and the old flat ``[data]`` keys still work, with bit-identical data.

The golden digests below are of the partition and the splits that the code before this change
produced for the same configs (its ``load_federated`` with the flat keyword arguments): a change
of any built-in data set or partition's behaviour fails here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mpifl.cli import main
from mpifl.core.errors import ConfigError, DataError
from mpifl.data import DATASETS, PARTITIONS, load_federated
from mpifl.data.compat import nest_params
from mpifl.data.registry import (CLIENTS, DATASET_LOADERS, LABELS, PARTITIONERS, SENSITIVE,
                                 DataPool, register_dataset, register_partition)
from mpifl.experiment.config import config_diff, config_from_json, load_config, read_toml
from mpifl.experiment.naming import run_id
from mpifl.core.params import Params
from tests.helpers import TABULAR_DATA

ROOT = Path(__file__).resolve().parents[2]
SHARED = TABULAR_DATA
FMNIST = Path("/usr/share/datasets/fashion-mnist")
#: what the old DataConfig dumped into every results file and checkpoint, whatever the data set
OLD_FLAT_DEFAULTS = {"classes": [0, 2, 6], "classes_per_client": 2, "dirichlet_alpha": 0.5,
                     "group_proportions": None, "heterogeneity": "high",
                     "sensitive_feature": True, "synthetic_alpha": 1.0, "synthetic_beta": 1.0}
SKEW = [[0.2, 0.3, 0.5], [0.5, 0.25, 0.25]]

# name: (dataset, partition, K, seed, train_fraction, old flat keys, [data.params],
#        [data.partition_params]) -- every built-in data set that is here (CIFAR is not: its
# loader is covered by the fake files of test_data_readers.py) with every partition it takes
CASES = {
    "fmnist-iid": ("fashion_mnist", "iid", 20, 0, 0.8, {}, {}, {}),
    "fmnist-shards": ("fashion_mnist", "shards", 100, 1, 0.8, {}, {}, {}),
    "fmnist-pat1": ("fashion_mnist", "pathological", 10, 2, 0.8, {"classes_per_client": 1}, {},
                    {"classes_per_client": 1}),
    "fmnist-dir01": ("fashion_mnist", "dirichlet", 20, 0, 0.8, {"dirichlet_alpha": 0.1}, {},
                     {"alpha": 0.1}),
    "fmnist-one13": ("fashion_mnist", "one_class_per_client", 2, 4, 0.8, {"classes": [1, 3]}, {},
                     {"classes": [1, 3]}),
    "synthetic-00": ("synthetic", "natural", 10, 2, 0.7,
                     {"synthetic_alpha": 0.0, "synthetic_beta": 0.0}, {"alpha": 0.0, "beta": 0.0},
                     {}),
    "synthetic-0505": ("synthetic", "natural", 10, 1, 0.8,
                       {"synthetic_alpha": 0.5, "synthetic_beta": 0.5},
                       {"alpha": 0.5, "beta": 0.5}, {}),
    "german-iid": ("german", "iid", 7, 0, 0.8, {}, {}, {}),
    "german-shards": ("german", "shards", 10, 1, 0.8, {}, {}, {}),
    "german-pat1": ("german", "pathological", 6, 0, 0.8, {"classes_per_client": 1}, {},
                    {"classes_per_client": 1}),
    "german-dir": ("german", "dirichlet", 4, 3, 0.8, {"dirichlet_alpha": 0.3}, {},
                   {"alpha": 0.3}),
    "german-gs-high": ("german", "group_skew", 5, 0, 0.8, {}, {}, {}),
    "german-gs-low": ("german", "group_skew", 5, 2, 0.8, {"heterogeneity": "low"}, {},
                      {"heterogeneity": "low"}),
    "german-gs-explicit": ("german", "group_skew", 3, 1, 0.8, {"group_proportions": SKEW}, {},
                           {"group_proportions": SKEW}),
    "german-blind-gs": ("german", "group_skew", 5, 0, 0.8,
                        {"sensitive_feature": False, "heterogeneity": "low"},
                        {"sensitive_feature": False}, {"heterogeneity": "low"}),
    "compas-dir": ("compas", "dirichlet", 4, 3, 0.8, {"dirichlet_alpha": 0.3}, {},
                   {"alpha": 0.3}),
    "compas-gs-explicit": ("compas", "group_skew", 3, 1, 0.8, {"group_proportions": SKEW}, {},
                           {"group_proportions": SKEW}),
    "compas-blind": ("compas", "iid", 5, 0, 0.8, {"sensitive_feature": False},
                     {"sensitive_feature": False}, {}),
    "adult-gs-low": ("adult", "group_skew", 5, 2, 0.8, {"heterogeneity": "low"}, {},
                     {"heterogeneity": "low"}),
    "adult-blind": ("adult", "iid", 5, 0, 0.8, {"sensitive_feature": False},
                    {"sensitive_feature": False}, {}),
}
#: sha256 of y, the CSR offsets and indices of the train/test splits and the sensitive groups
#: (integers: exact on any machine), as the code before the registry route made them
GOLDEN = {
    "fmnist-iid": "699748ad59c2d5b3c0f259a30e86467dbf9a94f91285d920489797fc0be3736b",
    "fmnist-shards": "0b36d66bfd3fd4de8822a0c6e6c1bf4dc1a4b65dde6c3e0e284db044dfa81997",
    "fmnist-pat1": "562088b64698523047d09989cca22c2f7722019aeea857bd3b5672c3f3c18a29",
    "fmnist-dir01": "39625f3fd0fa452bd7001fca4cba171076984c8048689b7544e7458fa27a4108",
    "fmnist-one13": "3ffab273b0abb3fe9eaef2fba7e751120e7876419802456d8d0e54b2bf4b9cce",
    "synthetic-00": "783934db78731d53a5bdbf0933c36b7263f5aea188bd838fdd31c3281c2e2a49",
    "synthetic-0505": "863675a3ba832bc57eb8823cfe534d2cbb271c89a0ca3b3de7f75fb4fa3fa098",
    "german-iid": "53547ca3ba6b7f297b3953e9e69b5bee6cd00a7bb1f4513c183559a07a5094c4",
    "german-shards": "996dccf2abdd4e7bde402e722bc4ed9fe2af4b0a41b8f261be1499f9398193eb",
    "german-pat1": "cc41d7b5b0306ec847d1202c3fbec4710c609f8cfb11ccc5a5dcbddce25b82e8",
    "german-dir": "b999c716d694d77bc17c81acf1fd11b0d9119f9335a461954cffb28bb5e0acba",
    "german-gs-high": "f668fc47a3e7db3cce0613919f8bfb40bc588951b1ad6f8639050d3ab0f662a5",
    "german-gs-low": "6f5525cbabaa58b38de561e36586ea75d956182338315dfcfeec33d3ff8ccdff",
    "german-gs-explicit": "266a0d2737f36102486b147120d0aab614eadc21e567e582a4f75fa78e32a642",
    "german-blind-gs": "d5c174e10014f4d6074af09b2f3312d92d49c40f6499e4490b4e80b1f8482132",
    "compas-dir": "afd333f3e9c51abc7ede46b8d57340963b39b08f8a856d0b3f6db6b8fadd5083",
    "compas-gs-explicit": "63feb05ab9ac4507e5d7b6b2cb08fa75b5317f0371ee843a68418ae6e0405d1e",
    "compas-blind": "aa5d090be50d0b7992ba6826635899c798032f77adb191a19b917dcaf3ac66f4",
    "adult-gs-low": "20f7c7aece80ac0cb4bf76fcb09cf0d9e3f7ed03add964b33abec0ecdea864d0",
    "adult-blind": "8038242ba46dd9dc98bce87021caf38b414d45de85ba3c653ba6770c29315f7e",
}


def _inline(table: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def _base(name: str) -> list[str]:
    dataset, partition, k, seed, fraction, *_ = CASES[name]
    out = [f"data.dataset={dataset}", f"data.partition={partition}", f"data.num_clients={k}",
           f"run.seed={seed}", f"data.train_fraction={fraction}", "server.clients_per_round=2"]
    return out + ([f"data.data_root={SHARED}"] if dataset in ("adult", "compas", "german") else [])


def _configs(name: str):
    """The case's config from the old flat keys and from the nested tables."""
    *_, flat, params, partition_params = CASES[name]
    old = load_config(None, _base(name) + [f"data.{k}={json.dumps(v)}" for k, v in flat.items()])
    new = load_config(None, _base(name) + [f"data.params={_inline(params)}",
                                           f"data.partition_params={_inline(partition_params)}"])
    return old, new


def _load(cfg):
    d = cfg.data
    return load_federated(d.dataset, partition=d.partition, num_clients=d.num_clients,
                          seed=cfg.run.seed, train_fraction=d.train_fraction,
                          data_root=d.data_root, dataset_params=d.params,
                          partition_params=d.partition_params)


def _digest(fed) -> str:
    h = hashlib.sha256()
    for a in (fed.y, fed.train_ptr, fed.train_idx, fed.test_ptr, fed.test_idx, fed.sensitive):
        h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _needs_files(name: str) -> None:
    if CASES[name][0] == "fashion_mnist" and not FMNIST.is_dir():
        pytest.skip("no /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist)")
    if CASES[name][0] in ("adult", "compas", "german") and not SHARED.is_dir():
        pytest.fail(f"the test data folder {SHARED} is missing")


@pytest.mark.parametrize("name", list(CASES))
def test_flat_and_nested_configs_give_bit_identical_data(name, monkeypatch):
    _needs_files(name)
    monkeypatch.delenv("MPIFL_DATA", raising=False)
    old, new = _configs(name)
    assert config_diff(old, new, ignore=set()) == []
    a, b = _load(old), _load(new)
    for field in ("x", "y", "train_ptr", "train_idx", "test_ptr", "test_idx", "sensitive"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), field
    assert (a.num_classes, a.input_shape) == (b.num_classes, b.input_shape)
    assert _digest(b) == GOLDEN[name]


@pytest.mark.parametrize("name", list(CASES))
def test_a_config_stored_by_the_old_code_reads_as_the_new_one(name):
    """Results files and checkpoints hold every old flat key (``mpifl resume`` compares them)."""
    _, new = _configs(name)
    stored = json.loads(new.to_json())
    *_, flat, _, _ = CASES[name]
    stored["data"] = {**{k: v for k, v in stored["data"].items()
                         if k not in ("params", "partition_params")},
                      **OLD_FLAT_DEFAULTS, **flat, "params": {}, "partition_params": {}}
    assert config_diff(config_from_json(json.dumps(stored)), new, ignore=set()) == []


def _old_form(data: dict) -> dict:
    """A [data] table in the old flat form: the nested keys under their old names."""
    out = {k: v for k, v in data.items() if k not in ("params", "partition_params")}
    entries = (("params", DATASET_LOADERS, data.get("dataset", "fashion_mnist")),
               ("partition_params", PARTITIONERS, data.get("partition", "shards")))
    for key, registry, name in entries:
        legacy = getattr(registry.get(name).Params, "legacy", {})
        out.update({flat: data.get(key, {})[field] for flat, field in legacy.items()
                    if field in data.get(key, {})})
    return out


@pytest.mark.parametrize("job", sorted(p.name for p in (ROOT / "jobs").glob("*.toml")
                                       if not p.name.startswith("sweep-")))
def test_every_job_reads_the_same_from_its_results_of_before(job):
    cfg = load_config(ROOT / "jobs" / job)
    stored = json.loads(cfg.to_json())
    stored["data"] = {**stored["data"], **OLD_FLAT_DEFAULTS,
                      **_old_form(read_toml(ROOT / "jobs" / job)["data"]),
                      "params": {}, "partition_params": {}}
    stored["data"]["data_root"] = cfg.data.data_root
    assert config_diff(config_from_json(json.dumps(stored)), cfg, ignore=set()) == []


# --------------------------------------------------------------------------- one route


def test_built_ins_are_registry_entries_with_params_and_tags():
    assert set(DATASETS) <= set(DATASET_LOADERS.available())
    assert set(PARTITIONS) <= set(PARTITIONERS.available())
    unlabelled = set()  # sequence targets (next token at every position) or multi-hot ones
    for name in DATASETS:
        entry = DATASET_LOADERS.get(name)
        assert issubclass(entry.Params, Params) and isinstance(entry.provides, frozenset), name
        if LABELS not in entry.provides:
            unlabelled.add(name)
    assert unlabelled == {"tff_shakespeare", "tff_stackoverflow", "stackoverflow_like", "flair"}
    for name in PARTITIONS:
        assert issubclass(PARTITIONERS.get(name).Params, Params), name
    assert DATASET_LOADERS.get("synthetic").provides == {LABELS, CLIENTS}
    assert PARTITIONERS.get("group_skew").needs == {SENSITIVE}


def test_each_declared_tag_is_what_the_pool_has(tmp_path):
    from tests.inprocess.test_data_readers import make_cifar10, write_mnist_like

    write_mnist_like(tmp_path / "mnist", 30, 10)
    make_cifar10(tmp_path / "cifar-10-batches-py")
    pools = {"mnist": dict(data_root=str(tmp_path)), "cifar10": dict(data_root=str(tmp_path)),
             "synthetic": dict(num_clients=3, alpha=1.0, beta=1.0),
             "german": dict(data_root=str(SHARED), sensitive_feature=True)}
    for name, kwargs in pools.items():
        pool = DATASET_LOADERS.get(name)(seed=0, **{"data_root": None, **kwargs}).check(name)
        assert pool.provides() == DATASET_LOADERS.get(name).provides, name


@pytest.mark.parametrize("overrides,message", [
    (["data.partition=dirichlet", "data.partition_params={alpha=-1}"],
     "data.partition_params.alpha: input should be greater than 0 (got -1)"),
    (["data.partition=dirichlet", "data.partition_params={alfa=1}"],
     "unknown key 'data.partition_params.alfa'"),
    (["data.params={noise=1}"], "unknown key 'data.params.noise'"),
    (["data.dataset=synthetic", "data.partition=natural", "data.params={alpha=-0.5}"],
     "data.params.alpha: input should be greater than or equal to 0"),
    (["data.partition=dirichlet", "data.partition_params={alpha=0.2}", "data.dirichlet_alpha=0.1"],
     "data.dirichlet_alpha: contradicts data.partition_params.alpha = 0.2; set only one of them"),
    (["data.partition=one_class_per_client", "data.num_clients=2", "server.clients_per_round=2"],
     "data.num_clients: one_class_per_client needs num_clients == len(classes) (3), got 2"),
    (["data.dataset=adult", "data.partition=one_class_per_client", "data.num_clients=3",
      "server.clients_per_round=3"], "data.partition: partition 'one_class_per_client' needs a "
                                     "dataset with raw image pixels"),
    (["data.dataset=synthetic", "data.partition=dirichlet"],
     "data.partition: 'natural' goes with the data sets that have their own clients"),
])
def test_a_bad_data_table_exits_2_with_one_line_naming_the_key(overrides, message, tmp_path,
                                                                capsys):
    argv = ["run", str(ROOT / "jobs" / "fmnist-fedfv.toml"), "--out", str(tmp_path / "r.h5")]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_load_federated_checks_params_and_combinations_by_the_same_rules():
    with pytest.raises(DataError, match=r"data.partition_params.alpha: input should be greater"):
        load_federated("german", partition="dirichlet", num_clients=3, seed=0,
                       partition_params={"alpha": 0})  # refused before any file is read
    with pytest.raises(DataError, match=r"unknown key 'data.partition_params.alpha'"):
        load_federated("synthetic", partition="natural", num_clients=3, seed=0,
                       partition_params={"alpha": 0.5})
    with pytest.raises(DataError, match="needs a dataset with a sensitive attribute"):
        load_federated("fashion_mnist", partition="group_skew", num_clients=5, seed=0,
                       data_root="/nonexistent")  # refused before the files are looked for
    d = load_federated("synthetic", partition="natural", num_clients=3, seed=0,
                       dataset_params={"alpha": 0.5})  # beta: its default
    same = load_federated("synthetic", partition="natural", num_clients=3, seed=0,
                          dataset_params={"alpha": 0.5, "beta": 1.0})
    assert np.array_equal(d.x, same.x) and np.array_equal(d.train_idx, same.train_idx)


def test_flat_keys_of_another_entry_are_checked_then_dropped():
    cfg = load_config(None, ["data.dirichlet_alpha=0.1", "data.synthetic_alpha=0.0"])
    assert cfg.data.partition == "shards" and cfg.data.partition_params == {}
    assert cfg.data.params == {}
    with pytest.raises(ConfigError, match="data.dirichlet_alpha: input should be greater than 0"):
        load_config(None, ["data.dirichlet_alpha=0"])


def test_sweeps_that_vary_a_flat_key_keep_their_names_and_values():
    from mpifl.sweep.plan import check, grid_points
    from mpifl.sweep.spec import load_sweep

    assert run_id({"data.dirichlet_alpha": 0.1, "run.seed": 0}) == "dirichlet_alpha0.1_seed0"
    sweep = load_sweep(ROOT / "jobs" / "sweep-uga-map.toml")
    points = [p for p in grid_points(sweep) if p.params.get("run.seed") == 0
              and p.params.get("client.epochs") == 2 and p.params.get("client.lr") == 0.02]
    assert {p.params["data.dirichlet_alpha"] for p in points} == {0.1, 0.5, 1.0}
    for p in points:
        config, reason = check(sweep, p)
        assert reason is None and "dirichlet_alpha" in p.id
        assert config["data"]["partition_params"] == {"alpha": p.params["data.dirichlet_alpha"]}


# --------------------------------------------------------------------------- plugins


@pytest.fixture
def restore_registries():
    saved = [dict(r._entries) for r in (DATASET_LOADERS, PARTITIONERS)]
    yield
    DATASET_LOADERS._entries, PARTITIONERS._entries = saved


class _Noise(Params):
    n: int = 400
    scale: float = 1.0


def test_a_plugin_with_params_and_tags_goes_the_built_in_route(restore_registries):
    @register_dataset("route_test_groups", params=_Noise, provides=(LABELS, SENSITIVE))
    def groups(*, seed, data_root=None, n, scale):
        rng = np.random.default_rng(seed)
        x = rng.normal(0, scale, (n, 4)).astype(np.float32)
        return DataPool(x, (x[:, 0] > 0).astype(np.int64), 2,
                        sensitive=(x[:, 1] > 0).astype(np.int64))

    @register_partition("route_test_halves")  # no Params: its table is passed through
    def halves(labels, num_clients, rng, *, dirichlet_alpha=9.0):
        assert dirichlet_alpha == 0.25
        return np.array_split(rng.permutation(len(labels)), num_clients)

    base = ["data.dataset=route_test_groups", "data.num_clients=5", "server.clients_per_round=2"]
    cfg = load_config(None, [*base, "data.partition=group_skew", "data.params={n=300}"])
    assert cfg.data.params == {"n": 300, "scale": 1.0}
    fed = _load(cfg)
    assert fed.sensitive is not None and fed.num_clients == 5 and len(fed.y) == 300
    with pytest.raises(ConfigError, match=r"data.params.n: input should be a valid integer"):
        load_config(None, [*base, "data.params={n=0.5}"])
    # a plugin partition without Params that names an old flat key still gets it
    cfg = load_config(None, [*base, "data.partition=route_test_halves",
                             "data.dirichlet_alpha=0.25"])
    assert cfg.data.partition_params == {"dirichlet_alpha": 0.25}
    assert _load(cfg).num_clients == 5


def test_a_pool_with_its_own_clients_goes_only_with_natural(restore_registries):
    @register_dataset("route_test_writers")  # declares nothing: checked once loaded
    def writers(*, seed, data_root=None):
        x = np.zeros((12, 2), np.float32)
        return DataPool(x, np.arange(12) % 2, 2, client_sizes=np.array([5, 7]))

    fed = load_federated("route_test_writers", partition="natural", num_clients=2, seed=0)
    assert list(fed.num_train + fed.num_test) == [5, 7]
    with pytest.raises(DataError, match="'natural' goes with the data sets that have their own clients"):
        load_federated("route_test_writers", partition="iid", num_clients=2, seed=0)


def test_nest_params_leaves_unknown_names_to_the_name_check():
    out = nest_params({"dataset": "nope", "dirichlet_alpha": 0.3}, "nope", "shards")
    assert out == {"dataset": "nope", "partition_params": {}}  # shards: no parameters
    with pytest.raises(ConfigError, match="data.dataset: unknown data set 'nope'"):
        load_config(None, ["data.dataset=nope", "data.dirichlet_alpha=0.3"])
