"""Stop requests: SIGTERM and SIGUSR1 (what SLURM sends before a time limit or preemption), and
SIGINT (Ctrl-C), which takes the same path: a second SIGINT interrupts at once.

Every rank installs the handler, so no rank dies mid-collective; rank 0 acts on it, within
seconds in any phase (:meth:`mpifl.runtime.server.Server.run` lists them): a round stopped at its
training is dropped (resume runs it again), an evaluation stops at its next window on every
worker and is left for ``mpifl resume`` to run first, an aggregation or a checkpoint write ends
first. Rank 0 then checkpoints the state after the last whole round, releases the workers (STOP)
and every rank exits with :data:`EXIT_CHECKPOINTED`.

Training is the one phase every rank watches for itself: a rank that trains (rank 0 alone in
one process, else each worker) reads its own request before every local step
(:func:`mpifl.clients.trainer.stop_between_steps`) and abandons the round's training at once;
a worker that does tells rank 0 in its reply, which then drops the round and stops the run as
if signalled itself (:meth:`request`). A signal to the whole job (``kill`` of the process
group, SLURM's, ``mpiexec``'s forwarding of Ctrl-C) reaches every rank, so the round ends
within one step of the slowest rank.
"""

from __future__ import annotations

import signal
from types import FrameType

#: Exit status of a run stopped by a signal after checkpointing: resume to continue.
EXIT_CHECKPOINTED = 3


_PROCESS: "StopRequest | None" = None


class StopRequest:
    """Set by SIGTERM/SIGUSR1/SIGINT; read by the server loop between phases, while the workers
    evaluate every :data:`mpifl.runtime.protocol.POLL_S` seconds, and by every rank that
    trains before each local step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def install(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def request(self, reason: str) -> None:
        """Ask for a stop without a signal (``reason`` is logged, e.g. a worker rank's signal
        reported in its reply); the first reason is kept, as for signals."""
        if self.reason is None:
            self.reason = reason

    @classmethod
    def process(cls) -> "StopRequest":
        """This process's stop request, installed on first use: the command line installs it
        before its heavy imports (``mpifl run``/``resume``), so a signal during start-up is
        recorded (and acted on at the next set-up step) instead of raising inside an import or
        MPI_Init."""
        global _PROCESS
        if _PROCESS is None:
            _PROCESS = cls().install()
        return _PROCESS

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.reason == "SIGINT":
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait
        # keep the first: under srun a requeue sends SIGTERM to the ranks and the sweep job
        # forwards SIGUSR1 as well, and the log should name what started the stop
        if self.reason is None:
            self.reason = signal.Signals(signum).name
