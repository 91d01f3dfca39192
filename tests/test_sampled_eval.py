"""run.eval_clients: each evaluation tests a keyed random subset of N clients.

The oracle is the full evaluation: a run with the option trains the same model (evaluation
changes nothing of training), and its tested clients' values equal the full run's at those
clients (bit for bit in one process; under mpiexec the losses up to float32 rounding, as
mpifl's full evaluation on other blocks of clients); the others are NaN. Any number of ranks
tests the same clients, and a resumed run draws the same ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.runtime.server import eval_sample
from tests.helpers import mpiexec

JOB = """
[run]
name = "sampled"
seed = 3
rounds = 4
eval_every = 1
checkpoint_every = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 30
[model]
name = "mlp"
hidden = [16]
[client]
epochs = 1
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 6
"""
N = 7
PER_CLIENT = ("client_accuracy", "client_loss", "personal_accuracy", "personal_loss",
              "adapted/client_accuracy", "adapted/client_loss")


def run(tmp: Path, out: str, *sets: str, ranks: int = 1, command: str = "run",
        check: bool = True) -> subprocess.CompletedProcess:
    job = tmp / "job.toml"
    job.write_text(JOB)
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    target = [str(tmp / out)] if command == "resume" else [str(job), "--out", str(tmp / out)]
    args = [a for s in sets for a in ("--set", s)] if command == "run" else list(sets)
    proc = subprocess.run([*launch, sys.executable, "-m", "mpifl", command, *target,
                           "--no-progress", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        out = {name: f[f"eval/{name}"][()] for name in PER_CLIENT if f"eval/{name}" in f}
        out.update(mean=f["eval/mean"][()], model=f["model/global"][()],
                   num_test=f["clients/num_test"][()])
    return out


def test_the_subset_is_keyed_sorted_and_distinct():
    a = eval_sample(3, 5, 1000, 50)
    assert np.array_equal(a, eval_sample(3, 5, 1000, 50))  # keyed: the same draw again
    assert a.dtype == np.int64 and len(np.unique(a)) == 50 and np.all(np.diff(a) > 0)
    assert not np.array_equal(a, eval_sample(3, 6, 1000, 50))  # a new draw each evaluation
    assert not np.array_equal(a, eval_sample(4, 5, 1000, 50))
    assert eval_sample(3, 5, 1000, 0) is None and eval_sample(3, 5, 1000, 1000) is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sampled")
    run(tmp, "full.h5")
    run(tmp, "sub.h5", f"run.eval_clients={N}")
    run(tmp, "sub3.h5", f"run.eval_clients={N}", ranks=3)
    run(tmp, "full3.h5", ranks=3)
    return tmp


def same_clients(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.isnan(a), np.isnan(b))


@pytest.mark.mpi
def test_tested_clients_equal_the_full_evaluation_and_the_rest_are_nan(runs):
    full, sub = read(runs / "full.h5"), read(runs / "sub.h5")
    assert np.array_equal(full["model"], sub["model"])  # the option changes no trained model
    for r, row in enumerate(sub["client_accuracy"]):
        ids = eval_sample(3, r + 1, 30, N)
        assert np.array_equal(np.flatnonzero(~np.isnan(row)), ids)
        assert np.array_equal(row[ids], full["client_accuracy"][r][ids])
        assert np.array_equal(sub["client_loss"][r][ids], full["client_loss"][r][ids])
        assert sub["mean"][r] == pytest.approx(row[ids].mean(), abs=1e-15)  # over the tested
    assert not np.array_equal(sub["mean"], full["mean"])  # an estimate, not the full figure


@pytest.mark.mpi
def test_mpi_ranks_evaluate_the_same_clients_as_one_process_and_as_the_full_evaluation(runs):
    one, three, full3 = (read(runs / f) for f in ("sub.h5", "sub3.h5", "full3.h5"))
    assert same_clients(one["client_accuracy"], three["client_accuracy"])
    assert np.array_equal(three["model"], full3["model"])
    for r, row in enumerate(three["client_accuracy"]):
        ids = eval_sample(3, r + 1, 30, N)
        assert np.array_equal(row[ids], full3["client_accuracy"][r][ids])
        np.testing.assert_allclose(three["client_loss"][r][ids], full3["client_loss"][r][ids],
                                   rtol=1e-6)


@pytest.mark.mpi
def test_the_report_says_the_metrics_are_estimates(runs):
    out = subprocess.run([sys.executable, "-m", "mpifl", "report", str(runs / "sub.h5")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"each evaluation tested {N} of 30 clients" in out.stdout
    assert "client 0 (%)" not in out.stdout  # no per-client column of mostly untested clients


@pytest.mark.mpi
def test_a_resumed_run_draws_the_same_clients(tmp_path, runs):
    run(tmp_path, "resumed.h5", f"run.eval_clients={N}", "run.rounds=2")
    run(tmp_path, "resumed.h5", "--rounds", "4", command="resume")
    resumed, straight = read(tmp_path / "resumed.h5"), read(runs / "sub.h5")
    for name in straight:
        assert np.array_equal(resumed[name], straight[name], equal_nan=True), name


@pytest.mark.mpi
def test_personal_and_adapted_evaluations_are_sampled_alike_on_every_rank(tmp_path):
    sets = [f"run.eval_clients={N}", "server.algorithm=ditto", "run.adapt_epochs=1",
            "run.rounds=2"]
    run(tmp_path, "one.h5", *sets)
    run(tmp_path, "three.h5", *sets, ranks=3)
    run(tmp_path, "all.h5", *sets[1:])
    one, three, full = (read(tmp_path / f) for f in ("one.h5", "three.h5", "all.h5"))
    for name in ("personal_accuracy", "adapted/client_accuracy", "adapted/client_loss"):
        assert same_clients(one[name], three[name]), name
        for r, row in enumerate(one[name]):
            ids = eval_sample(3, r + 1, 30, N)
            assert np.array_equal(np.flatnonzero(~np.isnan(row)), ids), name
            if name.endswith("loss"):  # adapted in a batch of other clients: rounding
                np.testing.assert_allclose(row[ids], full[name][r][ids], rtol=1e-6)
            else:
                assert np.array_equal(row[ids], full[name][r][ids]), name


def test_more_clients_than_the_population_is_refused_in_one_line(tmp_path):
    proc = run(tmp_path, "big.h5", "run.eval_clients=31", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "run.eval_clients: 31 exceeds data.num_clients (30)" in proc.stderr
    assert not (tmp_path / "big.h5").exists()
