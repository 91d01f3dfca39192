"""Set-up bounds on real mpiexec ranks, naming the rank that did not arrive: an MPMD launch
whose rank 1 only sleeps and never reaches MPI_Init (mpifl.runtime.init_watch), and rank 0
stopped during set-up, named by rank 1 (mpifl.runtime.agreement). Real ranks, because the
bounds are about launched processes that do not arrive, and a job ended by them would end the
shared world too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import kill_tree, mpiexec, small_fmnist_job, write_fmnist_job
from tests.inprocess.test_setup_agreement import mpifl_lines
from tests.mpi.test_setup_agreement import finish, job, launch  # noqa: F401 (fixture)

# --------------------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def fmnist_job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "bounds.toml", small_fmnist_job(
        "bounds", seed=1, rounds=1, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg"))


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.mpi
def test_a_rank_that_never_reaches_mpi_init_is_named(fmnist_job, tmp_path):
    """MPMD: rank 1 sleeps and never calls MPI_Init; ranks 0 and 2 wait in it. After
    run.init_timeout_s = 5 s one line names rank 1 (not the ranks that waited) and the job
    ends; nothing is written."""
    out = tmp_path / "run.h5"
    mpifl = [sys.executable, "-m", "mpifl", "run", str(fmnist_job), "--out", str(out),
             "--no-progress", "--set", "run.init_timeout_s=5"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    t0 = time.monotonic()
    proc = subprocess.Popen([mpiexec(), "-n", "1", *mpifl, ":", "-n", "1", *sleeper, ":", "-n",
                             "1", *mpifl], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env())
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        kill_tree(proc.pid)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 5 + 40, (took, err[-3000:])
    assert mpifl_lines(err) == [
        "mpifl: error: rank(s) 1 did not reach MPI_Init within run.init_timeout_s = 5 s, while "
        "rank(s) 0, 2 waited there for them (hung or failed before it: their own output may say "
        "why); ending the job (start it again; a larger run.init_timeout_s helps when ranks "
        "start slowly)"], err[-3000:]
    assert not out.exists() and not Path(f"{out}.ckpt").exists()


@pytest.mark.mpi
def test_rank_0_stopped_during_set_up_is_named_by_rank_1(job, tmp_path):  # noqa: F811
    """After MPI_Init: rank 0 is SIGSTOPped while loading the data; rank 1 names it (rank 0
    names missing workers: tests/mpi/test_setup_agreement.py) and the job ends with status 2."""
    proc = launch(job, tmp_path / "run.h5", "data:stop:0")
    try:
        code, err, took = finish(proc, 120)
    finally:
        kill_tree(proc.pid)
    assert code == 2, err[-3000:]
    assert mpifl_lines(err) == [
        "mpifl: error: rank 1: rank 0 did not finish set-up step 'data and model' within "
        "run.setup_timeout_s = 6 s (failed hard, stopped or hung; its own output may say why); "
        "ending every rank of the job"], err[-3000:]
    assert took < 6 + 5 + 40
    assert not (tmp_path / "run.h5").exists()
