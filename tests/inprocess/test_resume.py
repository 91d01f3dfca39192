"""Exact resume and faults, with real MPI ranks on real Fashion-MNIST.

The main guarantee: with the same world size, a run SIGKILLed at any instant and resumed ends
with exactly the same model and metrics (timings aside) as the run left alone. The tests that
start mpiexec themselves are in tests/mpi/test_resume.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.store import checkpoint
from mpifl.store.results import MEASURED_COLUMNS
from tests.helpers import mpiexec, write_fmnist_job
from tests.world import world_run

JOB = """
[run]
name = "resume"
seed = 5
rounds = 24
eval_every = 3
checkpoint_every = 2
[data]
dataset = "fashion_mnist"
partition = "shards"
num_clients = 16
[model]
name = "mlp"
hidden = [32]
[client]
batch_size = 25
lr = 0.05
[server]
algorithm = "fedfv"
clients_per_round = 6
[fedfv]
alpha = 0.2
tau = 2
"""

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def command(ranks: int, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "mpifl", *args, "--no-progress"]
    return [mpiexec(), "-n", str(ranks), *cmd] if ranks > 1 else cmd


def run(ranks: int, *args: str, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(ranks, *args), capture_output=True, text=True, env=ENV,
                          timeout=600)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def contents(path: Path) -> dict[str, np.ndarray]:
    """Everything a run computes: model, /eval, /rounds (timings and memory aside)."""
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        out = {"model/global": f["model/global"][()]}
        for group in ("eval", "rounds"):  # subgroups too (/eval/group/..., /eval/personal/...)
            keys: list[str] = []
            f[group].visit(keys.append)
            for key in keys:
                if isinstance(f[group][key], h5py.Dataset) and key not in MEASURED_COLUMNS:
                    out[f"{group}/{key}"] = f[group][key][()]
    return out


def assert_same(a: Path, b: Path) -> None:
    x, y = contents(a), contents(b)
    assert x.keys() == y.keys()
    for key in x:
        assert np.array_equal(x[key], y[key], equal_nan=True), key


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "resume.toml", JOB)


# runs only read, in the shared world (tests/world.py); the job file is written beside them
JOB_FILE = {"resume.toml": JOB}
NINE = world_run("resume-9", ["run", "{dir}/resume.toml", "--out", "{dir}/resume-9.h5",
                              "--no-progress", "--set", "run.rounds=9"], files=JOB_FILE)
NINE_ON_2 = world_run("resume-9-on-2", ["resume", "{dir}/resume-9.h5", "--rounds", "24",
                                        "--no-progress"], ranks=2)
WHOLE = world_run("resume-whole", ["run", "{dir}/resume.toml", "--out", "{dir}/resume-whole.h5",
                                   "--no-progress"], files=JOB_FILE)
NAN = world_run("resume-nan", ["run", "{dir}/resume.toml", "--out", "{dir}/resume-nan.h5",
                               "--no-progress", "--set", "run.rounds=6",
                               "--set", "faults.nan_clients=[0,1,2,3,4,5,6,7]"], files=JOB_FILE)
DROPOUT = {ranks: world_run(f"resume-dropout-{ranks}", [
    "run", "{dir}/resume.toml", "--out", f"{{dir}}/resume-dropout-{ranks}.h5", "--no-progress",
    "--set", "run.rounds=6", "--set", "client.dropout=0.5"], files=JOB_FILE, ranks=ranks)
    for ranks in (1, 3)}


def test_resume_on_another_world_size_agrees(world):
    """9 rounds on 3 ranks (eval_every = 3), resumed to 24 on 2, against all 24 on 3."""
    assert world.status(NINE) == 0
    a, b = contents(world.file(NINE_ON_2, "resume-9.h5")), contents(world.file(WHOLE))
    np.testing.assert_array_equal(a["eval/client_accuracy"], b["eval/client_accuracy"])
    np.testing.assert_allclose(a["model/global"], b["model/global"], atol=1e-5)


@pytest.mark.slow
def test_changed_config_on_resume_is_refused_with_the_differences(job, tmp_path):
    out = tmp_path / "c.h5"
    run(1, "run", str(job), "--out", str(out), "--set", "run.rounds=2")
    proc = run(1, "run", str(job), "--out", str(out), "--resume", "--set", "fedfv.tau=3",
               "--set", "client.lr=0.1", code=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"mpifl: error: cannot resume {out} with a changed config: client.lr: 0.05 -> 0.1; "
        "fedfv.tau: 2 -> 3")
    with h5py.File(out, "r") as f:  # nothing lost
        assert f.attrs["status"] == "complete" and f["rounds/round"].shape == (2,)
    run(1, "run", str(job), "--out", str(out), "--resume", "--set", "run.rounds=3")  # allowed


def test_nan_clients_are_rejected_and_counted(world):
    with h5py.File(world.file(NAN), "r") as f:
        rejected = f["rounds/rejected"][()]
        aggregated = f["rounds/num_clients"][()]
        assert np.all(np.isfinite(f["model/global"][()]))
        assert np.all(rejected + aggregated == 6) and rejected.sum() > 0
    # exactly the selected clients with ids < 8, from the keyed sampling itself
    from mpifl.runtime.server import select_clients

    expected = [int((select_clients(5, t, np.ones(16), 6, "uniform") < 8).sum()) for t in range(6)]
    assert list(rejected) == expected


@pytest.mark.slow
def test_a_round_where_every_update_is_rejected_leaves_the_model(job, tmp_path):
    out = tmp_path / "allnan.h5"
    ids = list(range(16))
    run(1, "run", str(job), "--out", str(out), "--set", "run.rounds=2",
        "--set", f"faults.nan_clients={ids}")
    initial = checkpoint.read(Path(str(out) + ".ckpt") / "round-000000.h5").w
    with h5py.File(out, "r") as f:
        assert list(f["rounds/rejected"][()]) == [6, 6] and list(f["rounds/num_clients"][()]) == [0, 0]
        assert np.array_equal(f["model/global"][()], initial)


def test_dropout_is_keyed_and_counted(world):
    a, b = world.file(DROPOUT[1]), world.file(DROPOUT[3])
    with h5py.File(a, "r") as f:
        dropped, n = f["rounds/dropped"][()], f["rounds/num_clients"][()]
    assert np.all(dropped + n == 6) and 0 < dropped.sum() < 36
    with h5py.File(a, "r") as f, h5py.File(b, "r") as g:  # keyed: same on 1 and 3 ranks
        assert np.array_equal(g["rounds/dropped"][()], dropped)
        assert np.array_equal(g["eval/client_accuracy"][()], f["eval/client_accuracy"][()])


@pytest.mark.slow
def test_truncated_results_file_report_errors_and_resume_rebuilds_it(job, tmp_path):
    full, out = tmp_path / "full.h5", tmp_path / "cut.h5"
    run(1, "run", str(job), "--out", str(full), "--set", "run.rounds=6")
    run(1, "run", str(job), "--out", str(out), "--set", "run.rounds=3")
    out.write_bytes(out.read_bytes()[:3000])  # as if the disk lost its tail
    proc = subprocess.run([sys.executable, "-m", "mpifl", "report", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"1 damaged results file(s): {out} (truncated" in proc.stderr, proc.stderr
    run(1, "resume", str(out), "--rounds", "6")  # the checkpoint holds the whole history
    assert_same(out, full)


@pytest.mark.slow
def test_resume_of_a_foreign_or_missing_run_is_a_clear_error(tmp_path):
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = 1
    for path, msg in [(foreign, "not an mpifl results file"),
                      (tmp_path / "none.h5", "no such run to resume")]:
        proc = run(1, "resume", str(path), code=2)
        assert msg in proc.stderr and "Traceback" not in proc.stderr


def test_stop_request_names_the_first_signal():
    """A requeue under srun delivers SIGTERM and then the sweep job's forwarded SIGUSR1: the
    log must name the first, and a second signal must not undo the request."""
    from mpifl.runtime.signals import StopRequest

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = StopRequest().install()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.reason == "SIGTERM"
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
