"""Set-up agreed on every rank, on real ranks (mpiexec -n 3) with a real plugin module and
real signals: an exception on one rank, a rank stopped with SIGSTOP and a signal to the job
during set-up each end every rank within seconds with one line and one status (2; 130 for
SIGINT; 3 for SIGTERM/SIGUSR1), never a hang. Real ranks, because the faults hit one launched
process and the others must see them (and a failing world run would end the shared world).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import kill_tree, mpiexec, process_tree
from tests.inprocess.test_setup_agreement import JOB, PLUGIN, mpifl_lines


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("agree")
    (folder / "setup_faults.py").write_text(PLUGIN)
    (folder / "job.toml").write_text(JOB)
    return folder / "job.toml"


def launch(job: Path, out: Path, fault: str, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out),
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=job.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MPIFL_FAULT": fault, **env})


def finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, float]:
    """Wait for the job; its status, standard error and seconds taken (killed after limit)."""
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        _, err = proc.communicate()
        pytest.fail(f"the job hung for {limit} s:\n{err[-3000:]}")
    return proc.returncode, err, time.monotonic() - t0


def is_rank(pid: int) -> bool:
    try:
        return b"mpifl\0run" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.mpi
@pytest.mark.parametrize("fault,message", [
    ("import:raise:1", "rank 1: plugins.modules: cannot import 'setup_faults': RuntimeError: "
                       "import fails on rank 1 only"),
    ("data:raise:2", "rank 2: data set 'tiny' (setup_faults:tiny) failed to load: RuntimeError: "
                     "data fails on rank 2 only"),
])
def test_an_exception_on_one_rank_ends_every_rank_with_its_line_and_status_2(
        job, tmp_path, fault, message):
    out = tmp_path / "run.h5"
    code, err, took = finish(launch(job, out, fault), 120)
    assert code == 2, err[-3000:]
    assert mpifl_lines(err) == [f"mpifl: error: {message}"], err[-3000:]
    assert not out.exists() and not Path(f"{out}.ckpt").exists()
    assert took < 60


@pytest.mark.mpi
def test_a_rank_stopped_during_set_up_is_named_and_the_job_ends(job, tmp_path):
    proc = launch(job, tmp_path / "run.h5", "data:stop:2")
    try:
        code, err, took = finish(proc, 90)
    finally:
        kill_tree(proc.pid)  # the SIGSTOPped rank, if mpiexec left it
    assert code == 2, err[-3000:]
    lines = mpifl_lines(err)
    assert lines and lines[0] == (
        "mpifl: error: rank 0: rank(s) 2 did not finish set-up step 'data and model' within "
        "run.setup_timeout_s = 6 s (failed hard, stopped or hung; their own output may say "
        "why); ending every rank of the job"), err[-3000:]
    assert took < 6 + 30


@pytest.mark.mpi
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 3),
                                        (signal.SIGUSR1, 3)])
def test_a_signal_during_set_up_ends_every_rank_cleanly(job, tmp_path, sig, status):
    """The signal reaches every rank while rank 1 is still importing the plugins (it waits
    there): each records it, and at the end of that step all of them stop together."""
    ready = tmp_path / "ready"
    proc = launch(job, tmp_path / "run.h5", "import:wait:1", MPIFL_READY=str(ready))
    t0 = time.monotonic()
    while not ready.exists():
        assert time.monotonic() - t0 < 60 and proc.poll() is None, "rank 1 never got ready"
        time.sleep(0.1)
    ranks = [p for p in process_tree(proc.pid) if p != proc.pid and is_rank(p)]
    assert len(ranks) == 3
    for pid in ranks:  # as srun and mpiexec pass a signal on: to every rank
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    code, err, _ = finish(proc, 60)
    assert code == status, err[-3000:]
    name = signal.Signals(sig).name
    assert mpifl_lines(err) == [
        f"mpifl: stopped: {name} during set-up (plugins and config), before the first round; "
        + ("run the same command again to start it" if sig == signal.SIGINT
           else "resume continues from the last checkpoint, if any")], err[-3000:]
    assert not (tmp_path / "run.h5").exists()
