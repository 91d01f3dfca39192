"""The launcher base: how a sweep's runs become :class:`~mpifl.sweep.job.MpiRun` jobs.

:meth:`Launcher.launch` is written once: it builds each run's command and job. A launcher
supplies one hook, :meth:`Launcher._start` (start those jobs its way), says with
:meth:`Launcher.fit` how well it fits this machine and why (``--executor auto`` takes the
highest), and may put an MPI launcher in front of the command (:meth:`Launcher.prefix`).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from mpifl.core.errors import MpiflError
from mpifl.sweep.job import MpiRun, thread_env
from mpifl.sweep.plan import RunState
from mpifl.sweep.spec import Sweep


class Launcher(ABC):
    """Starts a sweep's runs; one subclass per place they run (this machine, SLURM).

    Attributes:
        name: the ``--executor`` value that picks it.
        blocks: :meth:`launch` returns only when the runs are over (else :meth:`wait` does).
        requeues: the job requeues itself after a checkpoint (a SLURM job's own business).
    """

    name: ClassVar[str]
    blocks: ClassVar[bool] = False
    requeues: ClassVar[bool] = False

    def __init__(self, sweep: Sweep, folder: Path):
        self.sweep, self.folder = sweep, folder

    @classmethod
    @abstractmethod
    def fit(cls) -> tuple[int, str]:
        """How well this launcher fits this machine, and why in a few words: 0 when it cannot
        run here at all; among those that can, ``--executor auto`` takes the highest."""

    @classmethod
    def require(cls) -> None:
        """Check that this launcher can run here, for an explicit ``--executor NAME``.

        Raises:
            MpiflError: it cannot (one line: why, and what to do).
        """
        score, why = cls.fit()
        if score == 0:
            raise MpiflError(f"--executor {cls.name}: {why}; pick another --executor")

    def launch(self, runs: list[RunState]) -> None:
        """Start every run of ``runs`` as one :class:`MpiRun` job; record in each run its job id,
        log and status."""
        if not runs:
            return
        env = thread_env(self.sweep.threads)
        jobs = [MpiRun(r.id, self.command(r), r.results, env, self.requeues) for r in runs]
        self._start(runs, jobs)

    def command(self, run: RunState) -> list[str]:
        """The command that runs one point on all its ranks: ``mpifl run --resume`` behind
        :meth:`prefix`."""
        argv = [sys.executable, "-m", "mpifl", "run", str(self.sweep.base), "--out",
                str(self.folder / run.results), "--resume", "--no-progress"]
        for o in run.overrides:
            argv += ["--set", o]
        return [*self.prefix(), *argv]

    def prefix(self) -> list[str]:
        """The MPI launcher in front of each run's command (none: a one-process run)."""
        return []

    def wait(self, runs: dict[str, RunState], timeout_s: float | None = None) -> None:
        """Block until none of ``runs``' jobs is still going (a blocking launcher has nothing
        left to wait for)."""

    @abstractmethod
    def _start(self, runs: list[RunState], jobs: list[MpiRun]) -> None:
        """Start ``jobs`` (``jobs[i]`` runs ``runs[i]``); set each run's ``job_id``, ``log``
        (relative to the sweep folder), ``status`` and ``error``."""
