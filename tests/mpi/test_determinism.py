"""``run.deterministic`` on real MPI ranks: a kernel without a deterministic form (torch's
``put_``) ends a job of 3 ranks started by mpiexec in one line. Every rank meets ``put_`` in the
set-up's model check today, but where a worker first met it in training it would end the job
with MPI_Abort, which would end the shared world too: so real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import mpiexec
from tests.inprocess.test_determinism import JOB, PLUGIN, _ends_in_one_line, _world_run

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _job(folder: Path, loss: str) -> Path:
    (folder / "det_plugin.py").write_text(PLUGIN)
    job = folder / "job.toml"
    job.write_text(JOB.format(loss=loss))
    return job


def _run(job: Path, out: Path, *sets: str, ranks: int = 1, probe: Path | None = None,
         extra: tuple[str, ...] = ()):
    cmd = [sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out), "--no-progress",
           *[x for s in sets for x in ("--set", s)], *extra]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    env = {**ENV, "MPIFL_PROBE": str(probe or out.with_suffix(".probe"))}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


#: the 3-rank job with the setting off, in the real-rank tier's world (tests/world.py)
PUT_FAST = {3: _world_run("det-put-fast-3", "det-put", "run.deterministic=false", ranks=3,
                          for_mpi=True)}


@pytest.mark.mpi
def test_a_kernel_without_a_deterministic_form_ends_three_ranks_in_one_line(world, tmp_path):
    """On real ranks: every rank meets put_ in the set-up's model check today (agreed, exit
    2), but where a worker first met it in training it would end the job with MPI_Abort,
    which would end the shared world too. The same job with the setting off comes from the
    world."""
    job = _job(tmp_path, "det_put_ce")
    proc = _run(job, tmp_path / "put.h5", ranks=3)
    _ends_in_one_line(proc.returncode, proc.stderr)
    assert world.status(PUT_FAST[3]) == 0, world.output(PUT_FAST[3])[-3000:]
