"""Each rank's threads fit the node, on real ranks: a plain ``mpiexec -n 3`` with no
OMP_NUM_THREADS at all gives each rank its share of the cores (1 on 2 cores), read back from the
results file and rank 0's log line. Fresh processes of their own, because a rank of the shared
world keeps the threads its earlier runs set (tests/inprocess/test_threads.py says more).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import mpiexec, write_fmnist_job
from tests.inprocess.test_threads import JOB, expected_auto, line_of, stored_threads


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "threads.toml", JOB)


def run(job: Path, out: Path, ranks: int, *extra: str, omp: str | None = None) -> str:
    """``mpifl run`` (under mpiexec when ranks > 1) with OMP_NUM_THREADS as given (None: unset);
    rank 0's log."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONUNBUFFERED"] = "1"
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    cmd = [sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out), "--no-progress",
           *extra]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.mpi
def test_three_ranks_share_the_cores(job, tmp_path):
    """Plain ``mpiexec -n 3``, no OMP_NUM_THREADS: each rank its share (1 on 2 cores)."""
    log = run(job, tmp_path / "three.h5", 3)
    n = expected_auto(3)
    assert stored_threads(tmp_path / "three.h5") == [n, n, n]
    assert line_of(log).startswith(f"threads: {n} a rank (auto: ")
