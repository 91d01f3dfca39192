"""The local launcher: each run under ``mpiexec -n RANKS`` on this machine, through submitit's
LocalExecutor, at most ``local.parallelism`` at once, in the foreground."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from mpifl.sweep.job import MpiRun
from mpifl.sweep.launch.base import Launcher
from mpifl.sweep.plan import RunState
from mpifl.sweep.status import log_error

log = logging.getLogger(__name__)


class LocalLauncher(Launcher):
    """Runs here; always possible, so ``--executor auto`` takes it when nothing fits better."""

    name = "local"
    blocks = True

    @classmethod
    def fit(cls) -> tuple[int, str]:
        return 1, "runs on this machine"

    def prefix(self) -> list[str]:
        if self.sweep.ranks == 1:
            return []
        return [self.sweep.local.mpiexec, "-n", str(self.sweep.ranks)]

    def _start(self, runs: list[RunState], jobs: list[MpiRun]) -> None:
        """Run the jobs, ``parallelism`` at a time, and wait for them; a failed run's error
        (from its log) is kept in its state."""
        import submitit

        ex = submitit.LocalExecutor(folder=self.folder / "logs")
        ex.update_parameters(timeout_min=self.sweep.local.time_min)
        todo = list(zip(runs, jobs))
        active: list[tuple[RunState, Any]] = []
        while todo or active:
            while todo and len(active) < self.sweep.local.parallelism:
                r, fn = todo.pop(0)
                job = ex.submit(fn)
                r.job_id, r.status, r.error = None, "running", None
                r.log = os.path.relpath(job.paths.stdout, self.folder)
                active.append((r, job))
            time.sleep(0.5)
            for r, job in [a for a in active if a[1].done()]:
                active.remove((r, job))
                assert r.log is not None  # set at submission
                r.error = log_error(self.folder, r.log) if job.exception() else None
                log.info("%s: %s", r.id, f"failed: {r.error}" if r.error else "over")
