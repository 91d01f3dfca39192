"""Results a user can read: a regression run's loss summaries under documented names (no NaN
accuracy beside them), ``mpifl report`` columns named by the settings that differ, ``--json``
in fractions as the files, FedBN's per-client BatchNorm rows in the results file, a live run
reported as running, and a missing path named as such (docs/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpifl
from mpifl.cli import main
from mpifl.core.errors import OutputError
from mpifl.metrics.summary import loss_summary
from mpifl.report.load import tables
from mpifl.store import checkpoint
from mpifl.store.results import MetricHistory, ResultsWriter, read_results

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "models"

#: A plugin model with BatchNorm for the synthetic data set: Linear 60-16, BN, ReLU, Linear.
BN_PLUGIN = '''
from torch import nn
from mpifl.plugin import register_model

@register_model("readable_bn_mlp")
def bn_mlp(input_shape, num_classes, *, seed):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 16), nn.BatchNorm1d(16),
                         nn.ReLU(), nn.Linear(16, num_classes))
'''

BN_JOB = """
[plugins]
modules = ["readable_bn"]
path = ["{folder}"]
[run]
name = "bn"
rounds = 3
eval_every = 1
checkpoint_every = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 8
[model]
name = "readable_bn_mlp"
[client]
batch_size = 0
lr = 0.05
trainer = "loop"
[server]
algorithm = "fedavg"
clients_per_round = 4
"""

REGRESSION = f"""
[plugins]
modules = ["mpifl_models"]
path = ["{EXAMPLES}"]
[run]
name = "regression"
rounds = 4
eval_every = 2
checkpoint_every = 0
[data]
dataset = "sensor_regression"
partition = "iid"
num_clients = 8
[data.params]
num_samples = 400
[model]
name = "mlp"
hidden = [8]
loss = "mse"
[client]
batch_size = 20
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 4
"""

TINY = """
[run]
name = "tiny"
rounds = {rounds}
eval_every = {eval_every}
checkpoint_every = 0
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 8
[model]
name = "logreg"
[client]
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 4
"""


def run(job: Path, out: Path, *sets: str) -> Path:
    args = [x for s in sets for x in ("--set", s)]
    assert main(["run", str(job), "--out", str(out), "--no-progress", *args]) == 0
    return out


@pytest.fixture(scope="module")
def bn_runs(tmp_path_factory) -> dict[str, Path]:
    """One-process runs of the BatchNorm model: FedBN (model.batchnorm = "local") and a
    global-BatchNorm run with the Adam server optimizer."""
    folder = tmp_path_factory.mktemp("bn")
    (folder / "readable_bn.py").write_text(BN_PLUGIN)
    job = folder / "bn.toml"
    job.write_text(BN_JOB.format(folder=folder))
    return {"fedbn": run(job, folder / "fedbn.h5", 'model.batchnorm="local"'),
            "adam": run(job, folder / "adam.h5", 'server.optimizer="adam"', "server.lr=0.01")}


@pytest.fixture(scope="module")
def regression(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("regression")
    (folder / "job.toml").write_text(REGRESSION)
    return run(folder / "job.toml", folder / "regression.h5")


def test_fedbn_rows_are_in_the_results_file_and_equal_the_checkpoints(bn_runs):
    path = bn_runs["fedbn"]
    ckpt = checkpoint.load_latest(checkpoint.folder_for(path))
    assert ckpt.round == 3  # the end of the run
    rows, index = ckpt.client_state["local_rows"], ckpt.client_state["local_index"]
    with h5py.File(path) as f:
        d = f["clients/local_state"]
        assert d.dtype == np.float32 and d.shape == rows.shape == (8, 4 * 16)
        np.testing.assert_array_equal(d[()], rows)
        names = [n.decode() for n in d.attrs["names"]]
        assert names == ["2.weight", "2.bias", "2.running_mean", "2.running_var"]
        # each column block is the entry at its offset in w: the positions the checkpoint keeps
        spans = [np.arange(o, o + e - s) for s, e, o in
                 zip(d.attrs["column_start"], d.attrs["column_stop"], d.attrs["offset"])]
        np.testing.assert_array_equal(np.concatenate(spans), index)
        assert "local_state" not in h5py.File(bn_runs["adam"])["clients"]  # global BatchNorm
    # clients aggregated at least once trained their own rows; the others kept BatchNorm's
    # initial ones (weight 1, bias 0, running mean 0, running var 1)
    rounds = read_results(path)["rounds"]
    trained = np.unique(rounds["selected"][rounds["aggregated"]])
    initial = np.repeat(np.array([1, 0, 0, 1], dtype=np.float32), 16)
    for k in range(8):
        assert (k in trained) == (not np.array_equal(rows[k], initial)), k
    for lazy in (False, True):
        with mpifl.load(path, lazy=lazy) as ds:
            got = ds["local_state"]
            assert got.dims == ("run", "client", "local")
            np.testing.assert_array_equal(got.isel(run=0).values, rows)
            assert ds["local"].values[16] == "2.bias[0]"
            np.testing.assert_array_equal(
                got.sel(local="2.running_var[3]").isel(run=0).values, rows[:, 3 * 16 + 3])
            assert (ds["local_param"].values == "2.running_mean").sum() == 16


def test_report_columns_are_named_by_the_settings_that_differ(bn_runs, capsys):
    assert main(["report", str(bn_runs["fedbn"]), str(bn_runs["adam"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["metric", "fedbn", "adam"]
    assert lines[1].startswith("setting")
    cells = [c.strip() for c in lines[1][len("setting"):].split("  ") if c.strip()]
    assert cells == ["model.batchnorm=local, server.lr=1.0, server.optimizer=sgd",
                     "model.batchnorm=global, server.lr=0.01, server.optimizer=adam"]
    assert main(["report", str(bn_runs["fedbn"]), str(bn_runs["adam"]), "--json"]) == 0
    out = strict_json(capsys.readouterr().out)
    assert [r["setting"] for r in out["runs"]] == cells
    for row, path in zip(out["runs"], bn_runs.values()):  # NaN (all accuracies 0) is null
        angle = read_results(path)["eval"]["fair_angle"][-3:].mean()
        assert row["fair_angle"] == (None if np.isnan(angle) else pytest.approx(angle))


def strict_json(text: str):
    """JSON as any standard reader takes it: NaN and Infinity are refused."""
    def refuse(name):
        raise ValueError(f"not standard JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> list[Path]:
    """Two one-process logistic-regression runs, seeds 0 and 1 (4 rounds, 2 evaluations)."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "tiny.toml").write_text(TINY.format(rounds=4, eval_every=2))
    return [run(folder / "tiny.toml", folder / f"s{seed}.h5", f"run.seed={seed}")
            for seed in (0, 1)]


def test_report_json_gives_fractions_as_the_files(tiny_runs, capsys):
    assert main(["report", *map(str, tiny_runs), "--last", "2", "--json"]) == 0
    out = strict_json(capsys.readouterr().out)
    assert "fractions in [0, 1]" in out["units"]
    evs = [read_results(path)["eval"] for path in tiny_runs]
    for row, ev in zip(out["runs"], evs):
        for key in ("mean", "std", "worst5", "best5", "cf"):
            assert row[key] == pytest.approx(ev[key][-2:].mean()), key
            assert 0 <= row[key] <= 1
        assert 0.05 < row["mean"] < 0.95  # a figure that percent and fraction tell apart
        assert row["fair_angle"] == pytest.approx(ev["fair_angle"][-2:].mean())  # radians
        np.testing.assert_allclose(row["client_accuracy"], ev["client_accuracy"][-2:].mean(0))
    (group,) = out["over_seeds"]
    means = [ev["mean"][-2:].mean() for ev in evs]
    assert group["mean"] == pytest.approx(np.mean(means))
    assert group["mean_sd"] == pytest.approx(np.std(means, ddof=1))
    assert group["setting"] == "-" and [r["setting"] for r in out["runs"]] == [
        "run.seed=0", "run.seed=1"]
    assert main(["report", str(tiny_runs[0]), "--last", "2"]) == 0  # the table: percent
    table = capsys.readouterr().out
    assert f"{100 * means[0]:.2f}" in next(line for line in table.splitlines()
                                          if line.startswith("mean acc (%)"))


def test_regression_summaries_are_losses_without_nan_accuracies(regression, capsys):
    res = read_results(regression)
    ev = res["eval"]
    # the file: what the server stored, worst5 the mean of the highest 5% of the losses
    loss = ev["client_loss"][-1]
    k = max(1, int(np.floor(0.05 * loss.size)))
    assert ev["loss/worst5"][-1] == pytest.approx(np.sort(loss)[-k:].mean())
    assert ev["loss/best5"][-1] == pytest.approx(np.sort(loss)[:k].mean())
    assert ev["loss/worst5"][-1] >= ev["loss/mean"][-1] >= ev["loss/best5"][-1]
    assert loss_summary(np.array([1.0, 5.0, 3.0]))["worst5"] == 5.0
    assert np.isnan(ev["mean"]).all()  # the file keeps its NaN accuracy summaries
    ds = mpifl.load(regression)
    for name in ("mean", "worst5", "std", "best5", "weighted_mean", "fair_angle", "cf",
                 "accuracy"):
        assert name not in ds, name
    for name in ("mean", "std", "worst5", "best5"):
        np.testing.assert_array_equal(ds[f"loss_{name}"].values[0], ev[f"loss/{name}"])
    assert "loss_worst5" in mpifl.load.__doc__ and "loss_*" in ds.attrs["units"]
    t = tables(ds)
    assert len(t["evals"]) == 2 and len(t["clients"]) == 2 * 8
    assert main(["report", str(regression), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["runs"][0]
    assert row["loss_worst5"] == pytest.approx(ev["loss/worst5"][-2:].mean())
    assert row["full_evals"] == 2 and not {"mean", "worst5"} & set(row)
    doc = (ROOT / "docs" / "RESULTS.md").read_text()
    assert "loss_worst5" in doc and "/clients/local_state" in doc


@pytest.fixture
def tiny(tmp_path) -> Path:
    job = tmp_path / "tiny.toml"
    job.write_text(TINY.format(rounds=100000, eval_every=100000))
    return job


def test_a_live_run_without_an_evaluation_is_reported_as_running(tiny, tmp_path, capsys):
    folder = tmp_path / "sweep"
    out = folder / "runs" / "live.h5"
    out.parent.mkdir(parents=True)
    (folder / "index.json").write_text(json.dumps({"runs": {"live": {
        "results": "runs/live.h5", "params": {"server.algorithm": "fedavg", "run.seed": 0}}}}))
    proc = subprocess.Popen([sys.executable, "-m", "mpifl", "run", str(tiny), "--out", str(out),
                             "--no-progress"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while not (out.exists() and len(read_results(out)["rounds"]["round"]) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        assert main(["report", str(out)]) == 0
        text = capsys.readouterr().out
        lines = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.split()}
        assert lines["status"] == ["running"]
        done = int(lines["rounds"][0])
        assert done >= 2 and lines["rounds"][1:] == ["of", "100000"]
        assert "live: running, no evaluation yet" in text and "last round written 20" in text
        assert main(["report", str(out), "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["runs"][0]
        assert row["status"] == "running" and row["evals"] == 0 and row["rounds"] == 100000
        assert time.strptime(row["last_round_at"], "%Y-%m-%d %H:%M:%S")
        assert main(["report", str(folder)]) == 0  # a sweep folder with that run
        text = capsys.readouterr().out
        assert "| fedavg | - | 0/1 | - |" in text and "live: running, no evaluation yet" in text
    finally:
        proc.kill()
        proc.wait()
    assert main(["report", str(out)]) == 0  # its writer is gone: interrupted, not running
    assert "interrupted at round" in capsys.readouterr().out


def test_a_complete_run_without_an_evaluation_stays_an_error(tmp_path, capsys):
    job = tmp_path / "tiny.toml"
    job.write_text(TINY.format(rounds=2, eval_every=1))
    done = run(job, tmp_path / "done.h5")
    with h5py.File(done) as f:  # the same rows with no evaluation, written by the real writer
        history = MetricHistory.from_group(f)
        config, w = f.attrs["config"], f["model/global"][()]
    history.eval_round, history.accuracy, history.loss = [], [], []
    history.summary = {k: [] for k in history.summary}
    writer = ResultsWriter(tmp_path / "noeval.h5", config, history.metrics, world_size=1,
                           algorithm="fedavg", history=history)
    writer.finish(w, [("fc", 0, len(w))])
    assert main(["report", str(tmp_path / "noeval.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is complete but has no evaluation" in err


def test_a_missing_path_is_no_such_file(tmp_path, capsys, regression):
    missing = tmp_path / "nope.h5"
    assert main(["report", str(missing)]) == 2
    assert main(["report", str(regression), str(missing)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"mpifl: error: no such file: {missing} (mpifl report takes results files "
                   "(.h5), folders of them, or one sweep folder)"] * 2
    with pytest.raises(OutputError, match="no such file") as exc:
        mpifl.load([regression, missing])
    assert "damaged" not in str(exc.value)


def test_plugin_example_docstring_says_batchnorm_and_dropout_train():
    doc = (ROOT / "examples" / "plugin" / "mpifl_example" / "models.py").read_text()
    assert "No BatchNorm" not in doc and "ALGORITHMS.md" in doc
