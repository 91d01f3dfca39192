"""A stop signal acted on within seconds on real MPI ranks: SIGTERM to ``mpiexec -n 3`` during
a streamed full evaluation (a lazy population, ``run.eval_window_samples``) stops it at a window,
and ``mpifl resume`` gives the shared world's uninterrupted run bit for bit (times, memory and
bytes aside). Real ranks, because the signal goes to the launched processes and every rank must
leave the evaluation's EVAL progress channel together.
"""

from __future__ import annotations

import re

import pytest

from tests.inprocess.test_progress_and_stop import (EVAL_JOB, _reference, assert_same,
                                                    rounds_and_evals, run, stop_at)

#: (ranks, rounds) -> the streamed-evaluation job's reference on 3 ranks (the real-rank tier's
#: world: tests/world.py)
EVAL_REF = {(3, 2): _reference("eval-3", 3, EVAL_JOB.replace("rounds = 3", "rounds = 2"),
                               for_mpi=True)}


@pytest.mark.parametrize("ranks, rounds", [
    # resumed: the last evaluation, nothing after
    pytest.param(3, 2, marks=[pytest.mark.mpi, pytest.mark.slow]),
])
def test_sigterm_during_a_streamed_evaluation_stops_it_and_resume_is_exact(world, tmp_path, ranks,
                                                                         rounds):
    job = tmp_path / "job.toml"
    job.write_text(EVAL_JOB.replace("rounds = 3", f"rounds = {rounds}"))
    ref, out = world.file(EVAL_REF[ranks, rounds]), tmp_path / "stopped.h5"

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
