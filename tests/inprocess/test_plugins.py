"""Users' own rules, models, data sets and partitions: the registries, the ``[plugins]`` config
key, the ``mpifl.plugins`` entry points, the vmap contract for models, and the worked example in
examples/plugin/ run from a folder outside the repository (one process and 3 MPI ranks, resume,
sweep, benchmark; the 3-rank runs come from the shared MPI world, tests/world.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from mpifl import aggregators
from mpifl.cli import main
from mpifl.core.errors import ConfigError, DataError
from mpifl.core.registry import Registry, UnknownName
from mpifl.data import load_federated
from mpifl.experiment.config import load_config
from mpifl.models import build_model, check_model

from tests.world import world_run
from .test_training import assert_same, make_data, run_both, split

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugin"


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A copy of examples/plugin/ in a folder outside the repository."""
    folder = tmp_path_factory.mktemp("outside") / "plugin"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.fixture(scope="module", autouse=True)
def _registries_restored():
    """What these tests register (the example's parts, test partitions) is gone afterwards, so
    other test modules see only the built-in entries."""
    from mpifl.aggregators.base import RULES
    from mpifl.clients import TRAINERS
    from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS
    from mpifl.models import MODEL_FACTORIES

    registries = (RULES, MODEL_FACTORIES, DATASET_LOADERS, PARTITIONERS, TRAINERS)
    saved = [dict(r._entries) for r in registries]
    yield
    for r, entries in zip(registries, saved):
        r._entries = entries
    for name in [m for m in sys.modules if m == "mpifl_example" or m.startswith("mpifl_example.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def example(outside):
    """The example's modules imported in this process (as a job's [plugins] would)."""
    load_config(outside / "job.toml")
    import mpifl_example

    return mpifl_example


def _cli(args: list[str], cwd: Path, timeout: int = 300):
    cmd = [sys.executable, "-m", "mpifl", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- registry


def test_registry_names_clashes_and_import_paths():
    reg: Registry = Registry("widget")

    @reg.register("alpha")
    def a():
        return 1

    reg.register("alpha")(a)  # the same object again (a re-import) is not a clash
    with pytest.raises(ValueError, match="widget name 'alpha' is already registered by"):
        reg.register("alpha")(lambda: 2)
    with pytest.raises(ValueError, match="without ':'"):
        reg.register("x:y")
    with pytest.raises(UnknownName, match=r"unknown widget 'alpah' \(did you mean 'alpha'\?\)"):
        reg.get("alpah")
    assert reg.get("json:dumps") is json.dumps and "json:dumps" in reg
    with pytest.raises(UnknownName, match="cannot import module 'no_such_mod_xyz'"):
        reg.get("no_such_mod_xyz:f")
    with pytest.raises(UnknownName, match="has no attribute 'nope'"):
        reg.get("json:nope")


def test_rule_by_import_path_and_refused_non_rules(example):
    cls = aggregators.rule("mpifl_example.rules:TrimmedMean")
    assert cls is aggregators.rule("trimmed_mean") and cls.name == "trimmed_mean"
    with pytest.raises(TypeError, match="must be an Aggregator subclass"):
        aggregators.rule("json:dumps")


def test_every_rule_params_round_trip_through_the_config():
    """Each rule's table is its Params: defaults, --set overrides and the constructor agree."""
    for name in aggregators.available():
        cls = aggregators.rule(name)
        if not name.isidentifier():
            continue
        cfg = load_config(None, [f"{name}.{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                 for k, v in cls.Params().model_dump().items() if v is not None])
        assert getattr(cfg, name) == cls.Params()
        stored = json.loads(cfg.to_json())[name]
        assert cls.validate_params(stored) == cls.Params()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("override,message", [
    ("trimmed_mean.trim=0.7", "trimmed_mean.trim: input should be less than 0.5 (got 0.7)"),
    ("trimmed_mean.trimm=0.1", "unknown key 'trimmed_mean.trimm' (did you mean 'trimmed_mean.trim'?)"),
    ("model.name=small_cn", "model.name: unknown model 'small_cn' (did you mean 'small_cnn'?)"),
    ("data.partition=sorted_block", "unknown partition 'sorted_block' (did you mean 'sorted_blocks'?)"),
])
def test_plugin_table_errors_are_one_line(outside, override, message, tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert main(["run", str(outside / "job.toml"), "--set", override, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_plugin_module_that_fails_to_import_is_a_config_error(tmp_path):
    (tmp_path / "broken_plugin_mod.py").write_text("raise RuntimeError('boom')\n")
    job = tmp_path / "job.toml"
    job.write_text('[plugins]\nmodules = ["broken_plugin_mod"]\n')
    with pytest.raises(ConfigError, match="plugins.modules: cannot import 'broken_plugin_mod': "
                                          "RuntimeError: boom"):
        load_config(job)


def test_entry_point_plugins_load_and_broken_ones_are_skipped(tmp_path):
    site = tmp_path / "site"
    (site / "ep_plugin_mod").mkdir(parents=True)
    (site / "ep_plugin_mod" / "__init__.py").write_text(textwrap.dedent("""
        from mpifl.plugin import register_rule
        from mpifl.aggregators.fedavg import FedAvg

        @register_rule("ep_rule")
        class EpRule(FedAvg):
            pass
    """))
    dist = site / "ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[mpifl.plugins]\nrules = ep_plugin_mod\nbroken = no_such_module_ep\n")
    code = ("from mpifl.experiment.config import load_config; "
            "print(load_config(None, ['server.algorithm=ep_rule']).server.algorithm)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ep_rule"
    assert "plugin entry point broken (no_such_module_ep) failed to load and is skipped" \
        in out.stderr


# --------------------------------------------------------------------------- models


class _WithBatchNorm(nn.Module):
    def __init__(self, **bn):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 3), nn.BatchNorm1d(3, **bn)

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("factory,message", [
    (lambda s, c, *, seed: _WithBatchNorm(track_running_stats=False),
     "'bn' is BatchNorm without running statistics"),
    (lambda s, c, *, seed: _WithBatchNorm().to(torch.float64),
     "parameter 'fc.weight' is torch.float64"),
    (lambda s, c, *, seed: nn.Linear(4, 3).double(), "parameter 'weight' is torch.float64"),
    (lambda s, c, *, seed: nn.Linear(4, 5), r"output shape \(2, 5\) for a batch of 2"),
    (lambda s, c, *, seed: nn.ReLU(), "has no parameters to train"),
    (lambda s, c, *, seed: "not a module", "must return a torch.nn.Module"),
])
def test_model_contract_refusals_name_the_reason(factory, message):
    with pytest.raises(ConfigError, match=message):
        check_model(factory((4,), 3, seed=0), (4,), 3, "bad")


def test_plugin_model_is_deterministic_and_trains_like_the_per_client_loop(example):
    a = build_model("small_cnn", (1, 8, 8), 8, seed=3, channels=4, width=16)
    b = build_model("mpifl_example.models:small_cnn", (1, 8, 8), 8, seed=3, channels=4, width=16)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    state = torch.random.get_rng_state()
    c = build_model("small_cnn", (1, 8, 8), 8, seed=4, channels=4, width=16)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG untouched
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    with pytest.raises(ConfigError, match="model 'small_cnn' takes no parameter 'depth'"):
        build_model("small_cnn", (1, 8, 8), 8, depth=3)
    # vmapped training of three uneven clients equals the per-client torch.optim.SGD loop
    from mpifl.core.layout import ParamLayout

    sizes = (7, 20, 13)
    x, y = make_data(sum(sizes), (1, 8, 8), 8)
    got, want, _, _ = run_both(a, ParamLayout.from_module(a), x, y, split(sizes), epochs=2,
                               batch_size=5, momentum=0.5)
    assert_same(got, want)


# --------------------------------------------------------------------------- data


def test_plugin_data_set_is_split_by_built_in_and_plugin_partitions(example):
    fed = load_federated("bars", partition="dirichlet", num_clients=10, seed=1,
                         dataset_params={"num_samples": 500}, partition_params={"alpha": 0.5})
    assert fed.x.shape == (500, 1, 8, 8) and fed.num_classes == 8 and fed.num_clients == 10
    again = load_federated("bars", partition="dirichlet", num_clients=10, seed=1,
                           dataset_params={"num_samples": 500}, partition_params={"alpha": 0.5})
    assert np.array_equal(fed.train_idx, again.train_idx) and np.array_equal(fed.x, again.x)
    blocks = load_federated("bars", partition="sorted_blocks", num_clients=8, seed=0,
                            dataset_params={"num_samples": 800})
    labels = [np.unique(blocks.y[blocks.train_indices(k)]) for k in range(8)]
    assert max(len(c) for c in labels) <= 3  # a few neighbouring classes each, not all 8
    with pytest.raises(DataError, match="data set 'bars': .*unexpected keyword argument 'size'"):
        load_federated("bars", partition="iid", num_clients=4, seed=0, dataset_params={"size": 1})
    with pytest.raises(DataError, match="partition 'group_skew' needs a dataset with a sensitive"):
        load_federated("bars", partition="group_skew", num_clients=5, seed=0)


def test_plugin_partition_results_are_checked(example):
    from mpifl.data.registry import PARTITIONERS

    PARTITIONERS.add("too_few_clients_test", lambda y, k, rng: [np.arange(len(y))])
    PARTITIONERS.add("out_of_range_test", lambda y, k, rng: [np.arange(len(y) + 1)] * k)
    with pytest.raises(DataError, match="returned 1 clients, expected 4"):
        load_federated("bars", partition="too_few_clients_test", num_clients=4, seed=0)
    with pytest.raises(DataError, match="must return 1-D integer index arrays into the 4000"):
        load_federated("bars", partition="out_of_range_test", num_clients=4, seed=0)


# --------------------------------------------------------------------------- the worked example


def _final_model(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["model/global"][()]


#: the example's job on 3 ranks in the shared MPI world (tests/world.py): the world's folder
#: cannot hold the package, so the job names it on plugins.path
EXAMPLE_JOB = {"plugin-example.toml": (EXAMPLE / "job.toml").read_text().replace(
    "[plugins]\n", f'[plugins]\npath = ["{EXAMPLE}"]\n', 1)}
THREE = world_run("plugin-example-3", ["run", "{dir}/plugin-example.toml", "--out",
                                       "{dir}/plugin-example-3.h5", "--no-progress"],
                  files=EXAMPLE_JOB)
PART = world_run("plugin-example-part", ["run", "{dir}/plugin-example.toml", "--set",
                                         "run.rounds=10", "--out", "{dir}/plugin-example-part.h5",
                                         "--no-progress"], files=EXAMPLE_JOB)
RESUMED = world_run("plugin-example-resumed", ["resume", "{dir}/plugin-example-part.h5",
                                               "--rounds", "20", "--no-progress"])


@pytest.mark.slow
def test_example_runs_under_mpi_resumes_and_matches_one_process(world, outside, tmp_path):
    """From outside the repository, in fresh processes: 10 rounds on 1 process, resumed to 20
    from another folder (the paths are stored) == 3 MPI ranks; on 3 ranks, 10 rounds then
    resume to 20 == 20 rounds straight."""
    one = tmp_path / "one.h5"
    res = _cli(["run", "job.toml", "--set", "run.rounds=10", "--out", str(one),
                "--no-progress"], outside)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _cli(["resume", str(one), "--rounds", "20", "--no-progress"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]  # from another folder: paths are stored
    three = world.file(THREE)
    np.testing.assert_allclose(_final_model(three), _final_model(one), rtol=0, atol=1e-5)
    assert world.status(PART) == 0, world.output(PART)[-3000:]
    assert np.array_equal(_final_model(world.file(RESUMED, "plugin-example-part.h5")),
                          _final_model(three))
    with h5py.File(one, "r") as f:
        acc = f["eval/mean"][()]
        assert json.loads(f.attrs["config"])["server"]["algorithm"] == "trimmed_mean"
    assert acc[-1] > 0.5  # it learns (8 classes: chance is 0.125)


def test_sweep_of_only_a_plugin_rule_expands(outside, tmp_path):
    """The sweep loads the job's plugins before it checks the algorithm names (no other rule
    has to come first)."""
    text = (outside / "sweep.toml").read_text().replace("[algorithms.fedavg]\n", "")
    (outside / "only-plugin.toml").write_text(text)
    res = _cli(["sweep", "only-plugin.toml", "--dry-run", "--out", str(tmp_path / "sw")], outside)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "4 runs: 4 new" in res.stdout and "not implemented" not in res.stdout


@pytest.mark.slow
def test_example_sweeps_and_benchmarks(outside, tmp_path):
    small = (outside / "sweep.toml").read_text().replace('"run.seed" = [0, 1]', '"run.seed" = [0]')
    small = small.replace('"trimmed_mean.trim" = [0.1, 0.2]', '"trimmed_mean.trim" = [0.1]')
    (outside / "small-sweep.toml").write_text(small)
    res = _cli(["sweep", "small-sweep.toml", "--executor", "local", "--out", str(tmp_path / "sw")],
               outside, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rep = _cli(["report", str(tmp_path / "sw")], outside)
    assert rep.returncode == 0 and "trimmed_mean" in rep.stdout, rep.stdout + rep.stderr
    res = _cli(["bench", "aggregation", "--plugins", "mpifl_example", "--algorithms",
                "fedavg,trimmed_mean", "--m", "5", "--d", "1000", "--repeats", "1", "--json"],
               outside)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)["rows"]
    assert {r["algorithm"] for r in rows} == {"fedavg", "trimmed_mean"}
