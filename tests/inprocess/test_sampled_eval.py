"""run.eval_clients: each evaluation tests a keyed random subset of N clients.

The oracle is the full evaluation: a run with the option trains the same model (evaluation
changes nothing of training), and its tested clients' values equal the full run's at those
clients (bit for bit in one process; under mpiexec the losses up to float32 rounding, as
mpifl's full evaluation on other blocks of clients); the others are NaN. Any number of ranks
tests the same clients, and a resumed run draws the same ones. The runs come from the shared MPI
world (tests/world.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.runtime.server import eval_sample
from tests.world import world_run

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


def run(name: str, *sets: str, ranks: int = 1, resume: bool = False):
    """A world run (tests/world.py) of the job into ``{dir}/<name>.h5``, or ``mpifl resume``
    of ``{dir}/<name>.h5`` (``sets`` are then its words)."""
    out = f"{{dir}}/{name}.h5"
    if resume:
        return world_run(f"{name}-resumed", ["resume", out, "--no-progress", *sets], ranks=ranks)
    return world_run(name, ["run", "{dir}/sampled.toml", "--out", out, "--no-progress",
                            *[a for s in sets for a in ("--set", s)]], ranks=ranks,
                     files={"sampled.toml": JOB})


FULL = run("sampled-full")
SUB = run("sampled-sub", f"run.eval_clients={N}")
SUB3 = run("sampled-sub3", f"run.eval_clients={N}", ranks=3)
FULL3 = run("sampled-full3", ranks=3)
HALF = run("sampled-half", f"run.eval_clients={N}", "run.rounds=2")
RESUMED = run("sampled-half", "--rounds", "4", resume=True)
SETS = [f"run.eval_clients={N}", "server.algorithm=ditto", "run.adapt_epochs=1", "run.rounds=2"]
DITTO = {"one": run("sampled-ditto-one", *SETS),
         "three": run("sampled-ditto-three", *SETS, ranks=3),
         "all": run("sampled-ditto-all", *SETS[1:])}
BIG = run("sampled-big", "run.eval_clients=31")


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
def runs(world) -> dict[str, Path]:
    return {r.name: world.file(r) for r in (FULL, SUB, SUB3, FULL3)}


def same_clients(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.isnan(a), np.isnan(b))


def test_tested_clients_equal_the_full_evaluation_and_the_rest_are_nan(runs):
    full, sub = read(runs["sampled-full"]), read(runs["sampled-sub"])
    assert np.array_equal(full["model"], sub["model"])  # the option changes no trained model
    for r, row in enumerate(sub["client_accuracy"]):
        ids = eval_sample(3, r + 1, 30, N)
        assert np.array_equal(np.flatnonzero(~np.isnan(row)), ids)
        assert np.array_equal(row[ids], full["client_accuracy"][r][ids])
        assert np.array_equal(sub["client_loss"][r][ids], full["client_loss"][r][ids])
        assert sub["mean"][r] == pytest.approx(row[ids].mean(), abs=1e-15)  # over the tested
    assert not np.array_equal(sub["mean"], full["mean"])  # an estimate, not the full figure


def test_mpi_ranks_evaluate_the_same_clients_as_one_process_and_as_the_full_evaluation(runs):
    one, three, full3 = (read(runs[f"sampled-{f}"]) for f in ("sub", "sub3", "full3"))
    assert same_clients(one["client_accuracy"], three["client_accuracy"])
    assert np.array_equal(three["model"], full3["model"])
    for r, row in enumerate(three["client_accuracy"]):
        ids = eval_sample(3, r + 1, 30, N)
        assert np.array_equal(row[ids], full3["client_accuracy"][r][ids])
        np.testing.assert_allclose(three["client_loss"][r][ids], full3["client_loss"][r][ids],
                                   rtol=1e-6)


def test_the_report_says_the_metrics_are_estimates(runs, capsys):
    assert main(["report", str(runs["sampled-sub"])]) == 0
    out = capsys.readouterr().out
    assert f"each evaluation tested {N} of 30 clients" in out
    assert "client 0 (%)" not in out  # no per-client column of mostly untested clients


def test_a_resumed_run_draws_the_same_clients(world, runs):
    assert world.status(HALF) == 0
    resumed, straight = read(world.file(RESUMED, "sampled-half.h5")), read(runs["sampled-sub"])
    for name in straight:
        assert np.array_equal(resumed[name], straight[name], equal_nan=True), name


def test_personal_and_adapted_evaluations_are_sampled_alike_on_every_rank(world):
    one, three, full = (read(world.file(DITTO[f])) for f in ("one", "three", "all"))
    for name in ("personal_accuracy", "adapted/client_accuracy", "adapted/client_loss"):
        assert same_clients(one[name], three[name]), name
        for r, row in enumerate(one[name]):
            ids = eval_sample(3, r + 1, 30, N)
            assert np.array_equal(np.flatnonzero(~np.isnan(row)), ids), name
            if name.endswith("loss"):  # adapted in a batch of other clients: rounding
                np.testing.assert_allclose(row[ids], full[name][r][ids], rtol=1e-6)
            else:
                assert np.array_equal(row[ids], full[name][r][ids]), name


def test_more_clients_than_the_population_is_refused_in_one_line(world):
    output = world.output(BIG)
    assert world.status(BIG) == 2 and "Traceback" not in output
    assert "run.eval_clients: 31 exceeds data.num_clients (30)" in output
    assert not world.path("sampled-big.h5").exists()
