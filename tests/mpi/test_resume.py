"""Exact resume after kills and signals, on real MPI ranks started by mpiexec: SIGKILL at
random instants of the rounds and SIGTERM mid-run, each resumed bit for bit against the
uninterrupted run of the shared world, and a killed worker rank ending the job quickly. They
need real ranks because the kill, the signal and the lost rank hit the launched processes
themselves (mpiexec, hydra's proxy, each rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.store import checkpoint
from tests.helpers import kill_tree, process_tree
from tests.inprocess.test_resume import ENV, JOB_FILE, assert_same, command, run
from tests.inprocess.test_resume import job  # noqa: F401 (a fixture)
from tests.world import world_run

#: the uninterrupted run the resumed ones must equal (the real-rank tier's world: tests/world.py)
REFERENCE = world_run("resume-ref", ["run", "{dir}/resume.toml", "--out", "{dir}/resume-ref.h5",
                                     "--no-progress"], files=JOB_FILE, for_mpi=True)


def round_seconds(path: Path) -> float:
    """Seconds a finished run spent in its rounds (every measured phase)."""
    with h5py.File(path, "r") as f:
        return float(sum(f["rounds"][k][()].sum() for k in f["rounds"] if k.startswith("time_")))


def kill_job_within(cmd: list[str], ckpt: Path, seconds: float) -> int | None:
    """Start an mpiexec job and SIGKILL every process of it (ranks, proxy, mpiexec)
    ``seconds`` after its set-up is done (a new run: its first checkpoint, round 0, appears; a
    resumed one: it logs "resuming after round"); returns None if it was killed, else its exit
    status."""
    proc = subprocess.Popen(cmd, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    resumed = threading.Event()

    def read() -> None:  # drained to the end: a full pipe would stall the ranks
        for line in proc.stderr:
            if "resuming after round" in line:
                resumed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first = ckpt / "round-000000.h5"
    fresh = not first.exists()
    while proc.poll() is None and not (first.exists() if fresh else resumed.is_set()):
        time.sleep(0.01)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return None
    finally:
        reader.join(timeout=60)
    return proc.returncode  # finished before the kill


@pytest.mark.mpi
@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_is_bit_exact(job, world, tmp_path):
    """Two kills at random instants of the rounds, the second in the run resumed after the
    first (set-up is the same code in every run and its kill is in
    tests/mpi/test_reliability.py); resumed again to the end and compared."""
    ref = world.file(REFERENCE)
    rng = np.random.default_rng(int(time.time()))
    points = rng.uniform(0.1, 0.45, size=2) * round_seconds(ref)
    out = tmp_path / "k.h5"
    killed = 0
    for i, seconds in enumerate(points):
        cmd = command(3, "run", str(job), "--out", str(out), *(["--resume"] if i else []))
        killed += kill_job_within(cmd, Path(f"{out}.ckpt"), seconds) is None
    run(3, "run", str(job), "--out", str(out), "--resume")
    assert_same(out, ref)
    assert killed >= 1, f"the job finished before the kill points {points}"


@pytest.mark.mpi
@pytest.mark.slow
def test_sigterm_checkpoints_exits_3_and_resume_is_exact(job, world, tmp_path):
    ref = world.file(REFERENCE)
    out = tmp_path / "t.h5"
    proc = subprocess.Popen(command(3, "run", str(job), "--out", str(out)), env=ENV,
                            start_new_session=True, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # signal mid-run, whatever the machine's load: after round 12
        seen.append(line)
        if "round 12/24" in line:
            break
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 3, err[-2000:]
    assert "stop requested (SIGTERM): checkpointed after round" in err
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "running"
    run(3, "resume", str(out))
    assert_same(out, ref)


@pytest.mark.mpi
def test_a_killed_worker_rank_ends_the_job_quickly(job, tmp_path):
    out = tmp_path / "dead.h5"
    proc = subprocess.Popen(command(3, "run", str(job), "--out", str(out), "--set", "run.rounds=400"),
                            env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    ckpt = Path(str(out) + ".ckpt")
    deadline = time.monotonic() + 120
    while not len(list(ckpt.glob("round-*.h5"))) >= 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    # deepest first: the ranks (children of hydra's proxy), in launch order reversed
    tree = process_tree(proc.pid)
    ranks = [p for p in tree if "mpifl" in Path(f"/proc/{p}/cmdline").read_text()
             and p != proc.pid]
    assert len(ranks) == 3, tree
    worker = [p for p in ranks if b"PMI_RANK=2\0" in Path(f"/proc/{p}/environ").read_bytes()]
    assert len(worker) == 1
    os.kill(worker[0], signal.SIGKILL)
    t0 = time.monotonic()
    proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30 and proc.returncode != 0
    assert checkpoint.load_latest(ckpt).round >= 2
