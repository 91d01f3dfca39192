"""The default checkpoint schedule (mpifl/runtime/schedule.py): by rounds (2% of the run) and by
minutes, held back while checkpoints would take more than their share of the run's time; an
explicit ``run.checkpoint_every`` is kept exactly. End to end: a run with the default schedule,
SIGKILLed part-way, resumes from a checkpoint near the kill, bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.runtime.schedule import DEFAULT_SHARE, CheckpointSchedule, default_every
from tests.helpers import kill_tree, write_fmnist_job
from tests.inprocess.test_cluster_comforts import _report


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def due_rounds(schedule: CheckpointSchedule, clock: Clock, rounds: int, round_s: float,
               cost_s: float) -> list[int]:
    """Drive ``schedule`` as Server.run does: rounds of ``round_s`` seconds, checkpoints of
    ``cost_s``; the rounds after which it checkpointed."""
    out = []
    schedule.start(0)
    for done in range(1, rounds + 1):
        clock.t += round_s
        if schedule.due(done):
            clock.t += cost_s
            schedule.written(done, cost_s)
            out.append(done)
    return out


def test_default_every_is_two_percent_of_the_rounds_at_least_one():
    assert [default_every(r) for r in (1, 10, 50, 51, 100, 1000)] == [1, 1, 1, 2, 2, 20]


def test_an_explicit_every_is_kept_exactly_whatever_it_costs():
    clock = Clock()
    s = CheckpointSchedule(20, every=5, minutes=0.0, share=0.0, clock=clock)
    assert due_rounds(s, clock, 20, round_s=0.01, cost_s=10.0) == [5, 10, 15, 20]


def test_cheap_checkpoints_follow_the_rounds():
    clock = Clock()
    s = CheckpointSchedule(100, every=2, minutes=5.0, share=DEFAULT_SHARE, clock=clock)
    assert due_rounds(s, clock, 100, round_s=1.0, cost_s=0.01) == list(range(2, 101, 2))


def test_costly_checkpoints_are_held_to_their_share_of_the_time():
    """Rounds of 0.25 s, checkpoints of 0.0625 s (about the main job here): every 2 rounds
    would spend 11% of the time checkpointing; the schedule waits 24 x 0.0625 = 1.5 s between
    them (binary fractions, so the arithmetic is exact)."""
    clock = Clock()
    s = CheckpointSchedule(100, every=2, minutes=5.0, share=DEFAULT_SHARE, clock=clock)
    done = due_rounds(s, clock, 100, round_s=0.25, cost_s=0.0625)
    gaps = np.diff([0, *done])
    assert done[-1] == 100 and set(gaps[1:-1]) == {6}  # 1.5 s / 0.25 s, after the first
    spent = 0.0625 * len(done)
    # the first (no cost known yet) and the last are not held; the others keep to the share
    assert spent <= DEFAULT_SHARE * clock.t + 2 * 0.0625


def test_minutes_trigger_between_rare_round_checkpoints():
    clock = Clock()
    s = CheckpointSchedule(1000, every=500, minutes=1.0, share=DEFAULT_SHARE, clock=clock)
    done = due_rounds(s, clock, 400, round_s=7.0, cost_s=0.1)
    assert done[:3] == [9, 18, 27]  # 63 s after the previous one


def test_a_stop_request_and_the_last_round_always_checkpoint():
    clock = Clock()
    s = CheckpointSchedule(10, every=0, minutes=0.0, clock=clock)
    s.start(0)
    assert not s.due(3) and s.due(3, stopping=True) and s.due(10)


JOB = """
[run]
name = "default-ckpt"
rounds = 200
eval_every = 50
progress_every_s = 0
[data]
dataset = "fashion_mnist"
partition = "shards"
num_clients = 10
[model]
name = "mlp"
hidden = [16]
[client]
batch_size = 0
[server]
algorithm = "fedavg"
clients_per_round = 4
"""
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mpifl", *args, "--no-progress"], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _computed(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        out = {"w": f["model/global"][()]}
        for key in ("client_accuracy", "client_loss"):
            out[key] = f["eval"][key][()]
        out["train_loss"] = f["rounds/train_loss"][()]
    return out


@pytest.mark.slow
def test_a_killed_run_with_default_checkpoints_resumes_near_the_kill(tmp_path_factory):
    """With nothing set about checkpoints, a run SIGKILLed after round 100 of 200 is reported
    interrupted and resumable, resumes from a checkpoint after round 100 or later (before, from
    round 0 unless 10 minutes had passed), and ends bit-identical to the uninterrupted run.
    (The kill of a multi-rank run and its exact resume: tests/mpi/test_resume.py.)"""
    job = write_fmnist_job(tmp_path_factory, "default-ckpt.toml", JOB)
    tmp = job.parent
    ref = tmp / "ref.h5"
    _run("run", str(job), "--out", str(ref))
    out = tmp / "killed.h5"
    proc = subprocess.Popen([sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out),
                             "--no-progress"], env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = Path(f"{out}.ckpt")
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            rounds = [int(m.group(1)) for p in folder.glob("round-*.h5")
                      if (m := re.fullmatch(r"round-(\d+)\.h5", p.name))]
            if rounds and max(rounds) >= 100:
                break
            time.sleep(0.05)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    assert proc.returncode != 0, "the run ended before it could be killed"
    status = _report(out)  # what a user sees of the killed run
    assert "interrupted at round" in status and re.search(r"resumable from round \d+", status)
    resumed = _run("run", str(job), "--out", str(out), "--resume")
    after = int(re.search(r"resuming after round (\d+)", resumed.stderr).group(1))
    assert after >= 100, resumed.stderr[-2000:]
    a, b = _computed(ref), _computed(out)
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=True), key
    assert "complete" in _report(out)
