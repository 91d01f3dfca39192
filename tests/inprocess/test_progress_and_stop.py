"""Progress lines in every phase and a stop signal acted on within seconds in any phase
(mpifl/runtime/progress.py, Server.run, the EVAL progress channel of mpifl/runtime/protocol.py).

The oracle of a stopped run is the same run uninterrupted: a SIGTERM during a streamed full
evaluation (a lazy population, ``run.eval_window_samples``) or during training, then
``mpifl resume``, gives the same results file bit for bit (times, memory and bytes aside), in
one process and under ``mpiexec -n 3``; the uninterrupted runs come from the shared MPI world
(tests/world.py). The ETA arithmetic is checked on an injected clock against sums done by hand.
The tests that start mpiexec themselves are in tests/mpi/test_progress_and_stop.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.runtime.plan import RoundPlan
from mpifl.runtime.progress import ProgressLog
from tests.helpers import mpiexec
from tests.world import world_run

#: A full evaluation of 1,500 clients of a lazy population in windows of ~1,000 samples (~4
#: clients, ~375 windows: seconds on this machine) after round 2 and the last, sampled ones
#: (5 clients) after the others.
EVAL_JOB = """
[run]
name = "stop"
seed = 5
rounds = 3
eval_every = 1
eval_clients = 5
full_eval_every = 2
checkpoint_every = 1
progress_every_s = 0.2
eval_window_samples = 1000
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 1500
lazy = true
[model]
name = "mlp"
hidden = [16]
[client]
epochs = 1
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 12
"""
#: Rounds of seconds of training (60 clients, 6 epochs) and a short evaluation.
TRAIN_JOB = """
[run]
name = "train"
seed = 2
rounds = 2
eval_every = 1
checkpoint_every = 1
progress_every_s = 0.1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 100
[model]
name = "mlp"
hidden = [64]
[client]
epochs = 6
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 60
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MEASURED = ("time_", "peak_rss", "bytes")


def _reference(name: str, ranks: int, text: str, for_mpi: bool = False):
    """The uninterrupted run of the job ``text``, in the shared world."""
    return world_run(f"stop-{name}", ["run", f"{{dir}}/stop-{name}.toml", "--out",
                                       f"{{dir}}/stop-{name}.h5", "--no-progress"],
                     ranks=ranks, files={f"stop-{name}.toml": text}, for_mpi=for_mpi)


#: (ranks, rounds) -> the streamed-evaluation job's reference (tests/mpi/test_progress_and_stop.py
#: declares the 3-rank one)
EVAL_REF = {(1, 3): _reference("eval-1", 1, EVAL_JOB)}
TRAIN_REF = _reference("train", 1, TRAIN_JOB)


def command(ranks: int, *args: str) -> list[str]:
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    return [*launch, sys.executable, "-m", "mpifl", *args, "--no-progress"]


def run(ranks: int, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(ranks, *args), capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def stop_at(ranks: int, marker: str, *args: str) -> tuple[int, float, str]:
    """Start a run, SIGTERM every process of it once a stderr line contains ``marker``;
    (exit status, seconds from the signal to the exit, stderr)."""
    proc = subprocess.Popen(command(ranks, *args), stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            break
    else:
        proc.wait()
        pytest.fail(f"no line with {marker!r} before the run ended:\n" + "".join(seen)[-3000:])
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    return proc.returncode, time.monotonic() - t0, "".join(seen) + rest


def datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def assert_same(path: Path, reference: Path) -> None:
    """Every dataset but the measured ones equal bit for bit."""
    a, b = datasets(path), datasets(reference)
    assert set(a) == set(b)
    compared = 0
    for name, x in a.items():
        if any(m in name for m in MEASURED):
            continue
        y = b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.dtype.kind == "f":
            x, y = x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
        np.testing.assert_array_equal(x, y, err_msg=name)
        compared += 1
    assert {"model/global", "eval/client_accuracy", "eval/round"} <= set(a) and compared >= 20


def rounds_and_evals(path: Path) -> tuple[list, list, str]:
    with h5py.File(path, "r") as f:
        return (f["rounds/round"][()].tolist(), f["eval/round"][()].tolist(),
                str(f.attrs["status"]))


def stop_a_streamed_evaluation_and_resume(ref: Path, tmp_path: Path, ranks: int,
                                          rounds: int) -> None:
    """SIGTERM during round 2's streamed evaluation of the job on ``ranks`` ranks: it stops at
    a window with exit 3, the round kept and its evaluation not; ``mpifl resume`` evaluates it
    first and ends equal to ``ref`` (tests/mpi/test_progress_and_stop.py on 3 ranks too)."""
    job = tmp_path / "job.toml"
    job.write_text(EVAL_JOB.replace("rounds = 3", f"rounds = {rounds}"))
    out = tmp_path / "stopped.h5"

    code, seconds, err = stop_at(ranks, f"progress: round 2/{rounds}, evaluation: ", "run",
                                 str(job), "--out", str(out))
    assert code == 3, err[-3000:]
    # progress lines inside the evaluation, the phase named and counted
    assert re.search(rf"progress: round 2/{rounds}, evaluation: [\d,]+/1,500 clients "
                     r"\(\d+%\), \d+ s in", err), err[-3000:]
    # stopped at a window, not at the end of the evaluation: fewer clients than all of them
    stop = re.search(rf"stop requested \(SIGTERM\): checkpointed after round 2 of {rounds} "
                     r"without its evaluation \(stopped at ([\d,]+) of 1,500 clients; "
                     r"`mpifl resume` runs it first\)", err)
    assert stop and int(stop.group(1).replace(",", "")) < 1500, err[-3000:]
    assert seconds < 60, f"{seconds:.1f} s from SIGTERM to the exit"  # bounded (a few here)
    # the round is kept, its evaluation is not
    assert rounds_and_evals(out) == ([0, 1], [1], "running")

    proc = run(ranks, "resume", str(out))
    assert (f"round 2/{rounds}: its evaluation was stopped by the last run; evaluating first"
            in proc.stderr)
    assert rounds_and_evals(out) == (list(range(rounds)), list(range(1, rounds + 1)),
                                     "complete")
    assert_same(out, ref)


@pytest.mark.parametrize("ranks, rounds", [
    # resumed: the evaluation after round 2, then round 3 (one process: no mpiexec)
    pytest.param(1, 3, marks=pytest.mark.slow),
])
def test_sigterm_during_a_streamed_evaluation_stops_it_and_resume_is_exact(world, tmp_path, ranks,
                                                                         rounds):
    stop_a_streamed_evaluation_and_resume(world.file(EVAL_REF[ranks, rounds]), tmp_path, ranks,
                                          rounds)


@pytest.mark.slow
def test_sigterm_during_training_drops_the_round_and_resume_is_exact(world, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(TRAIN_JOB)
    ref, out = world.file(TRAIN_REF), tmp_path / "stopped.h5"

    code, _, err = stop_at(1, "progress: round 2/2, training", "run", str(job), "--out", str(out))
    assert code == 3, err[-3000:]
    assert ("stop requested (SIGTERM): checkpointed after round 1 of 2 (round 2 was stopped at "
            "its training; it runs again on resume)") in err, err[-3000:]
    assert rounds_and_evals(out) == ([0], [1], "running")
    run(1, "resume", str(out))
    assert_same(out, ref)


def plan(rounds: int = 4, every: int = 1, n: int = 10, full_every: int = 2) -> RoundPlan:
    return RoundPlan(name="t", seed=0, rounds=rounds, clients_per_round=10, sampling="uniform",
                     lr=0.1, lr_decay=1.0, dropout=0.0, max_update_norm=None, eval_every=every,
                     checkpoint_every=0, checkpoint_minutes=0.0, progress_every_s=5.0,
                     adapt=False, rule="fedavg", config_json="{}", eval_clients=n,
                     full_eval_every=full_every)


def test_the_evaluations_still_due_are_counted_as_the_run_does_them():
    for rounds in (1, 5, 12):
        for every in (1, 2, 3, 5):
            for n, full_every in ((0, 0), (7, 0), (7, 1), (7, 2), (7, 4)):
                p = plan(rounds, every, n, full_every)
                for after in range(rounds + 1):
                    done = [r for r in range(after + 1, rounds + 1) if p.evaluates(r)]
                    full = sum(p.tests_all(r) for r in done)
                    assert p.evaluations(after) == (full, len(done) - full), (p, after)


def test_the_run_eta_counts_rounds_and_each_kind_of_evaluation_apart(caplog):
    now = [0.0]
    lines = ProgressLog(4, 0, 5.0, clock=lambda: now[0], plan=plan(), num_clients=1000)
    lines.round_begins(0)
    lines.begin("training", 1)
    assert lines.run_eta(0.5) == (None, "")  # no round timed yet
    now[0] = 1.0
    lines.begin("evaluation", 1, 10, full=False)  # after round 1: 10 clients, 0.6 s
    now[0] = 1.6
    lines.advance(10)
    lines.end()
    now[0] = 2.0
    with caplog.at_level(logging.INFO, logger="mpifl.server"):
        assert lines.round_done(0, {}, {"mean": 0.5, "worst5": 0.25})
    # 1.4 s a round (2 s less the 0.6 s evaluation), 3 rounds left; evaluations after rounds
    # 2 and 4 test all 1,000 clients (0.06 s a client of the one timed: 60 s each), after
    # round 3 ten (0.6 s): 4.2 + 120 + 0.6 = 124.8 s
    assert caplog.records[-1].getMessage() == (
        "progress: round 1/4 (25%), 1.4 s/round, ETA 0:02:05 (with 2 full evaluations, "
        "0:01:00 each and 1 sampled evaluation, 0:00:01 each), peak memory 0.00 GB/rank, "
        "mean acc 0.5000, worst5 0.2500")
    lines.round_begins(1)
    lines.begin("training", 2)
    now[0] = 3.0
    lines.begin("evaluation", 2, 1000)
    now[0] = 13.0
    lines.advance(250)
    # 10 s for 250 of 1,000 clients: 30 s left in it, so 40 s a full evaluation; then the
    # 2 rounds left at 1.4 s, the sampled evaluation after round 3 and the full one after 4
    assert lines.phase_line(13.0) == (
        "round 2/4, evaluation: 250/1,000 clients (25%), 10 s in, phase ETA 0:00:30, run ETA "
        "0:01:13 (with 1 full evaluation, 0:00:40 each and 1 sampled evaluation, 0:00:01 each)")
    assert lines.run_eta(13.0)[0] == pytest.approx(2.8 + 30 + 40 + 0.6)


def test_phase_lines_follow_the_interval_and_say_what_is_not_timed_yet(caplog):
    now = [0.0]
    lines = ProgressLog(3, 1, 5.0, clock=lambda: now[0], plan=plan(3, 1, 0, 0), num_clients=50)
    with caplog.at_level(logging.INFO, logger="mpifl.server"):
        lines.round_begins(1)
        lines.begin("training", 2)
        now[0] = 4.0
        assert not lines.tick()  # 4 s < 5 s since the round began
        now[0] = 6.0
        lines.begin("aggregation", 2)
        assert lines.tick()
        now[0] = 8.0
        assert not lines.tick()  # 2 s since the last line
        assert caplog.records[-1].getMessage() == "progress: round 2/3, aggregation, 0 s in"
        now[0] = 9.0
        assert not lines.round_done(1, {}, None)  # 3 s since the last line, no evaluation
    # one round of 9 s (a resumed run: round 2 of 3) and one left; no evaluation timed yet
    assert lines.run_eta(9.0) == (9.0, " + 1 evaluation not timed yet")
    lines.round_begins(2)
    lines.begin("training", 3)
    now[0] = 13.0  # 4 s into the last round: 5 s of it left, by the last training's 6 s: 2
    assert lines.phase_eta(13.0) == pytest.approx(2.0)
    assert lines.run_eta(13.0) == (5.0, " + 1 evaluation not timed yet")
