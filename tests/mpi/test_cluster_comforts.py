"""Long cluster runs on real MPI ranks started by mpiexec: ``checkpoint_every = 0`` leaving a
killed run not resumable (a killed run with the default checkpoints resumes exactly:
tests/inprocess/test_checkpoint_schedule.py), and the recorded peak memory against the OS's peak
of each rank's process (GNU time around every rank). They need real ranks because the kill
hits the launched processes, and the OS's peak is that of each rank's own process."""

from __future__ import annotations

import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from tests.helpers import kill_tree
from tests.inprocess.test_cluster_comforts import _job, _report


def _kill_when(cmd, ready, tmp_path) -> None:
    """Start ``cmd`` (an mpiexec job), SIGKILL it once ``ready()`` holds."""
    from tests.inprocess.test_resume import ENV

    proc = subprocess.Popen(cmd, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, "the job ended before the kill point"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)
        proc.wait()


def _rounds_written(path) -> int:
    try:
        with h5py.File(path, "r") as f:
            return len(f["rounds/round"])
    except (OSError, KeyError):
        return 0


@pytest.mark.mpi
@pytest.mark.slow
def test_checkpoint_every_0_turns_periodic_checkpoints_off_and_report_says_not_resumable(
        tmp_path):
    from mpifl.store.checkpoint import folder_for
    from tests.inprocess.test_resume import command

    job = _job(tmp_path, "checkpoint_every = 0")
    out = tmp_path / "off.h5"
    _kill_when(command(3, "run", str(job), "--out", str(out)),
               lambda: _rounds_written(out) >= 3, tmp_path)
    assert not any(folder_for(out).glob("round-*.h5"))
    assert "interrupted at round" in _report(out) and "(not resumable)" in _report(out)


@pytest.mark.mpi
@pytest.mark.slow
def test_recorded_peak_memory_is_the_ranks_os_peak_after_the_last_evaluation(tmp_path):
    """/rounds/peak_rss_*_mb of the last round (with its evaluation of every client) match
    the maximum RSS the OS reports for each rank's process (GNU time's %M), within the few MiB
    a rank allocates after its last evaluation (writing the results, exiting)."""
    from tests.helpers import mpiexec
    from tests.inprocess.test_resume import ENV

    job = _job(tmp_path, "checkpoint_every = 0")
    out = tmp_path / "mem.h5"
    cmd = [mpiexec(), "-n", "3", "/usr/bin/time", "-f", "maxrss %M", sys.executable, "-m",
           "mpifl", "run", str(job), "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    os_peaks = sorted(int(x.split()[1]) / 1024 for x in proc.stderr.splitlines()
                      if x.startswith("maxrss "))  # MiB, one line per rank
    assert len(os_peaks) == 3
    with h5py.File(out) as f:
        server = f["rounds/peak_rss_server_mb"][()]
        worker = f["rounds/peak_rss_worker_mb"][()]
    assert (np.diff(server) >= 0).all() and (np.diff(worker) >= 0).all()  # peaks only grow
    recorded = max(server[-1], worker[-1])
    assert os_peaks[-1] - 32 <= recorded <= os_peaks[-1] + 1, (recorded, os_peaks)
