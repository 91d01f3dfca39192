"""End-to-end runs on real Fashion-MNIST: one process and real MPI ranks (runs of the shared MPI
world, tests/world.py), the HDF5 results, the report, and the user-facing errors of a run
(missing data, unwritable output)."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.data import load_federated
from mpifl.runtime.server import select_clients
from mpifl.store.results import ROUND_COLUMNS
from tests.helpers import write_fmnist_job
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]

SMALL = """
[run]
name = "small"
seed = 3
rounds = 4
eval_every = 2
[data]
dataset = "fashion_mnist"
partition = "shards"
num_clients = 12
[model]
name = "mlp"
hidden = [32]
[client]
epochs = 1
batch_size = 20
lr = 0.05
[server]
algorithm = "fedfv"
clients_per_round = 5
[fedfv]
alpha = 0.2
tau = 1
"""


@pytest.fixture(scope="module")
def small_job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "small.toml", SMALL)


def _run(name: str, ranks: int, *sets: str, job: str = "{dir}/run-small.toml"):
    """A world run (tests/world.py) of ``job`` into ``{dir}/<name>.h5``."""
    return world_run(name, ["run", job, "--out", f"{{dir}}/{name}.h5", "--no-progress",
                            *[a for s in sets for a in ("--set", s)]], ranks=ranks,
                     files={"run-small.toml": SMALL})


#: the same small FedFV job on 1, 2 and 3 ranks (the report labels runs by file stem)
RUNS = {ranks: _run(f"run-n{ranks}", ranks) for ranks in (1, 2, 3)}
COUNTER = {ranks: _run(f"run-counter{ranks}", ranks, "client.minibatch_order=counter")
           for ranks in (1, 3)}
FEDAVG = _run("run-fedavg", 1, "server.algorithm=fedavg", "run.rounds=20",
              job=str(ROOT / "jobs" / "fedfv-fmnist3.toml"))


@pytest.fixture(scope="module")
def runs(world) -> dict[int, Path]:
    return {ranks: world.file(run) for ranks, run in RUNS.items()}


def test_results_file_has_the_documented_layout(runs):
    with h5py.File(runs[3], "r") as f:
        assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 3
        assert f.attrs["schema_version"] == 2 and '"algorithm": "fedfv"' in f.attrs["config"]
        for col in ROUND_COLUMNS:
            assert f["rounds"][col].shape == (4,), col
        assert list(f["rounds/round"][()]) == [0, 1, 2, 3]
        assert list(f["eval/round"][()]) == [2, 4]
        acc = f["eval/client_accuracy"][()]
        assert acc.shape == (2, 12) and np.all((acc >= 0) & (acc <= 1))
        assert f["eval/client_loss"].shape == (2, 12)
        d = f["model/global"].shape[0]
        assert d == 784 * 32 + 32 + 32 * 10 + 10 and f["model/global"].dtype == np.float32
        assert f["model/layer_stop"][-1] == d and f["model/layer_start"][0] == 0
        assert np.all(f["rounds/bytes_moved"][()] > 5 * d * 4)  # the updates crossed MPI
        assert np.all(f["rounds/num_clients"][()] == 5)
        lc = f["rounds/conflicts_layer"][()]  # 2 layers: fc1, out
        assert lc.shape == (4, 2) and np.all((lc >= 0) & (lc <= 5))
        num_train = f["clients/num_train"][()]
        for t, ids in enumerate(f["rounds/selected"][()]):  # the sampler, called directly
            np.testing.assert_array_equal(ids, select_clients(3, t, num_train, 5, "uniform"))
        assert f["rounds/aggregated"][()].all()  # no dropout, nothing rejected
        fed = load_federated("fashion_mnist", partition="shards", num_clients=12, seed=3)
        for k, row in enumerate(f["clients/label_counts"][()]):  # counted here, one client at a time
            np.testing.assert_array_equal(row, np.bincount(fed.y[fed.train_indices(k)], minlength=10))
        np.testing.assert_array_equal(num_train, fed.num_train)
        assert f["clients/num_test"].shape == (12,) and f["eval/std"].attrs["unit"].startswith("fraction")


def test_one_two_three_ranks_give_the_same_accuracies(runs):
    acc = {n: h5py.File(p, "r")["eval/client_accuracy"][()] for n, p in runs.items()}
    model = {n: h5py.File(p, "r")["model/global"][()] for n, p in runs.items()}
    for n in (2, 3):
        np.testing.assert_array_equal(acc[n], acc[1])
        np.testing.assert_allclose(model[n], model[1], rtol=0, atol=1e-5)
    assert acc[1][-1].mean() > 0.3  # it learned something in 4 rounds (10 classes: chance 0.1)


def test_the_counter_minibatch_order_gives_the_same_run_on_one_and_three_ranks(world, runs):
    out = {n: world.file(run) for n, run in COUNTER.items()}
    files = {n: h5py.File(p, "r") for n, p in {**out, "pcg64": runs[1]}.items()}
    acc = {n: f["eval/client_accuracy"][()] for n, f in files.items()}
    model = {n: f["model/global"][()] for n, f in files.items()}
    np.testing.assert_array_equal(acc[3], acc[1])
    np.testing.assert_allclose(model[3], model[1], rtol=0, atol=1e-5)
    assert np.abs(model[1] - model["pcg64"]).max() > 1e-3  # another order, another model
    assert acc[1][-1].mean() > 0.3  # and it learns as well
    assert '"minibatch_order": "counter"' in files[1].attrs["config"]


def test_report_prints_runs_side_by_side(runs, capsys):
    assert main(["report", str(runs[1]), str(runs[3])]) == 0
    out = capsys.readouterr().out
    assert "run-n1" in out and "run-n3" in out and "worst 5% (%)" in out and "fedfv" in out
    assert "client 0 (%)" not in out  # K = 12 > 10: no per-client rows


def test_fedavg_override_runs_in_one_process(world):
    out = world.file(FEDAVG)
    with h5py.File(out, "r") as f:
        assert f.attrs["algorithm"] == "fedavg" and f.attrs["world_size"] == 1
        acc = f["eval/client_accuracy"][()]
    assert acc.shape == (2, 3) and acc[-1].mean() > 0.5
    assert main(["report", str(out)]) == 0


def test_existing_output_is_not_replaced_without_overwrite(small_job, runs, tmp_path, capsys):
    out = Path(shutil.copy2(runs[1], tmp_path))  # a copy: the world's file stays as it ran
    before = out.read_bytes()
    assert main(["run", str(small_job), "--out", str(out)]) == 2
    assert "already exists; pass --resume to continue it or --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output_fails_before_training(small_job, tmp_path, capsys, where):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    out = blocker / "run.h5" if where == "under_a_file" else Path("/proc/mpifl-test/run.h5")
    assert main(["run", str(small_job), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mpifl: error: --out {out}: cannot write there")


def test_missing_dataset_lists_the_paths_tried(small_job, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MPIFL_DATA", str(tmp_path / "envdata"))
    out = tmp_path / "r.h5"
    code = main(["run", str(small_job), "--out", str(out), "--set", "data.dataset=cifar10",
                 "--set", f"data.data_root={tmp_path / 'mydata'}", "--set", "model.name=mlp"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("mpifl: error:")
    assert str(tmp_path / "mydata") in err and str(tmp_path / "envdata") in err
    assert "mpifl data fetch cifar10" in err
    assert not out.exists()


def test_report_on_a_foreign_or_damaged_file(tmp_path, capsys):
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = 1
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    for path, msg in [(foreign, "not an mpifl results file"), (damaged, "cannot read as HDF5"),
                      (tmp_path / "none.h5", "no such file")]:
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_run_resume_of_a_run_not_started_yet_starts_it(small_job, tmp_path):
    """SLURM's templates always pass --resume (a requeued job continues, a first one starts):
    into a folder that does not exist yet it starts at round 0; `mpifl resume` of nothing
    refuses in one line."""
    out = tmp_path / "new" / "runs" / "r.h5"
    assert main(["run", str(small_job), "--resume", "--set", "run.rounds=2", "--out", str(out),
                 "--no-progress"]) == 0
    with h5py.File(out, "r") as f:
        assert list(f["rounds/round"][()]) == [0, 1]
    assert main(["resume", str(tmp_path / "none" / "r.h5")]) == 2
