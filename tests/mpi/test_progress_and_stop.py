"""A stop signal acted on within seconds on real MPI ranks: SIGTERM to ``mpiexec -n 3`` during
a streamed full evaluation (a lazy population, ``run.eval_window_samples``) stops it at a window,
and ``mpifl resume`` gives the shared world's uninterrupted run bit for bit (times, memory and
bytes aside). Real ranks, because the signal goes to the launched processes and every rank must
leave the evaluation's EVAL progress channel together.
"""

from __future__ import annotations

import pytest

from tests.inprocess.test_progress_and_stop import (EVAL_JOB, _reference,
                                                    stop_a_streamed_evaluation_and_resume)

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
    stop_a_streamed_evaluation_and_resume(world.file(EVAL_REF[ranks, rounds]), tmp_path, ranks,
                                          rounds)
