"""Reliability around a run on real MPI ranks started by mpiexec: one writer per run while a
2-rank run is live, set-up failures and a damaged checkpoint on rank 0 ending or recovering every
rank, a full disk under mpiexec ending every rank in one line, and Ctrl-C to mpiexec's process
group resumed. Real ranks, because the guarantees are about the launched processes: the lock a
live job holds, the signal hydra forwards, the set-up stage that hands rank 0's failure to every
rank. The finished run they copy and compare with comes from the shared MPI world
(tests/world.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mpifl.core.locking import lock_path
from mpifl.store import checkpoint
from mpifl.store.results import read_results
from tests.inprocess.test_reliability import (ENV, _world, cmd, copy_run, error_line,
                                              interrupt_and_resume, model_of, mpifl)
from tests.inprocess.test_reliability import job, tmpfs  # noqa: F401 (fixtures)

#: the finished run of this tier (tests/inprocess/test_reliability.py declares the same run)
FINISHED_MPI = _world("reliability-finished-mpi", for_mpi=True)


@pytest.fixture
def finished(world) -> Path:
    """A finished 4-round run (one process) with its checkpoints, copied by the tests (never
    changed: it is the world's)."""
    return world.file(FINISHED_MPI)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


# -- 1. one writer per run ---------------------------------------------------------------------

@pytest.mark.mpi
def test_a_second_writer_is_refused_and_the_live_run_survives(job, tmp_path):
    out = tmp_path / "live.h5"
    live = subprocess.Popen(cmd(2, "run", job, "--out", out, "--set", "run.rounds=100000",
                                "--set", "run.eval_every=1000", "--set", "run.checkpoint_every=3"),
                            env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    ckpt = checkpoint.folder_for(out)
    try:
        wait_for(lambda: len(list(ckpt.glob("round-*.h5"))) >= 2 or live.poll() is not None,
                 180, "the live run's second checkpoint")
        assert live.poll() is None, live.stderr.read()[-3000:]
        host, pid = lock_path(out).read_text().split()
        assert host == socket.gethostname() and int(pid) > 0
        second = [("run", job, "--out", out), ("run", job, "--out", out, "--overwrite"),
                  ("run", job, "--out", out, "--resume"), ("resume", out)]
        procs = [subprocess.Popen(cmd(1, *args), env=ENV, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for args in second]
        for args, proc in zip(second, procs):
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 2, (args, err[-3000:])
            assert "in use by a live run" in error_line(err), args
        assert live.poll() is None, "the live run died"
        assert len(list(ckpt.glob("round-*.h5"))) >= 1, "--overwrite deleted the live checkpoints"
    finally:
        if live.poll() is None:
            os.killpg(live.pid, signal.SIGTERM)
        _, err = live.communicate(timeout=120)
    assert live.returncode == 3, err[-3000:]
    res = read_results(out)  # valid, verified, not damaged by the second writers
    assert res["attrs"]["status"] == "running" and len(res["rounds"]["round"]) >= 2
    assert checkpoint.load_latest(ckpt).round == len(res["rounds"]["round"])
    assert not lock_path(out).exists()


# -- 2. bounded time to fail, on every rank ----------------------------------------------------

@pytest.mark.mpi
def test_setup_failures_on_rank_0_end_every_rank_with_one_line(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    t0 = time.monotonic()
    proc = mpifl(2, "resume", run, "--rounds", "0", code=2, timeout=120)
    assert "--rounds 0" in error_line(proc.stderr)
    # a results file damaged beyond HDF5 and no checkpoint: refused, not a hang. Both refusals
    # are raised by plan_start on rank 0 inside the same set-up stage ("start plan"), which
    # hands any exception to every rank alike: one process shows this one is refused cleanly
    damaged = tmp_path / "damaged.h5"
    raw = bytearray(finished.read_bytes())
    raw[600:700] = bytes(100)
    damaged.write_bytes(bytes(raw))
    proc = mpifl(1, "resume", damaged, code=2, timeout=120)
    assert "damaged results file" in error_line(proc.stderr)
    assert time.monotonic() - t0 < 120


@pytest.mark.mpi
def test_a_checkpoint_with_damaged_hdf5_metadata_falls_back_to_the_previous(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    newest = checkpoint.load_latest(checkpoint.folder_for(run)).path
    raw = bytearray(newest.read_bytes())
    raw[512 + 8:512 + 96] = b"\xff" * 88  # the HDF5 superblock (after mpifl's 512-byte header)
    newest.write_bytes(bytes(raw))
    back = checkpoint.load_latest(checkpoint.folder_for(run))
    assert back.round == 2
    proc = mpifl(2, "resume", run, timeout=300)
    assert "skipping damaged checkpoint" in proc.stderr
    np.testing.assert_array_equal(model_of(run), model_of(finished))


@pytest.mark.mpi
def test_a_full_disk_under_mpi_ends_every_rank_with_one_line(job, tmpfs):
    mnt = tmpfs("256k")
    out = mnt / "full.h5"
    t0 = time.monotonic()  # checkpoints of d=12,730 floats (51 KB): the disk fills in a few rounds
    proc = mpifl(2, "run", job, "--out", out, "--set", "run.rounds=50", "--set",
                 "run.checkpoint_every=1", "--set", "model.hidden=[16]", code=2, timeout=300)
    assert time.monotonic() - t0 < 300
    line = error_line(proc.stderr)
    assert "cannot write" in line and "No space left on device" in line, line
    res = read_results(out)  # a complete file, verified, with every row computed
    done = len(res["rounds"]["round"])
    assert done >= 1 and 0 <= checkpoint.load_latest(checkpoint.folder_for(out)).round <= done


# -- 7. SIGINT -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.mpi)])
def test_sigint_checkpoints_and_exits_3_then_resume_is_exact(finished, job, tmp_path, ranks):
    """Ctrl-C to mpiexec's process group (hydra forwards it to the ranks)."""
    interrupt_and_resume(finished, job, tmp_path, ranks)
