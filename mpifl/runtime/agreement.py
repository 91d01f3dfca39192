"""Set-up as one agreed phase: every rank runs each step, and all of them learn together whether
any rank failed, was stopped by a signal or never arrived.

A run's set-up (plugins and config, the start plan, data, model, trainer, shards) is a sequence
of steps (``with setup.stage(name): ...`` or :meth:`SetUp.step`), the same on every rank. After each step the ranks exchange one small
record: the step's error, if any (one line and its exit status), and the signal that asked this
rank to stop, if any. So

* an exception on any rank ends every rank with that rank's one-line message and its status (2
  for a user's mistake), never a hang and never a mix of statuses (mpiexec ORs the ranks'
  statuses: 2 | 1 would read as 3, "checkpointed, requeue me");
* a rank that does not reach the end of a step within ``timeout_s`` (it crashed hard, was
  stopped with SIGSTOP, or hangs) is named by rank 0 (a missing rank 0 by rank 1), which ends
  the job with ``MPI_Abort`` and status 2;
* SIGINT, SIGTERM or SIGUSR1 during set-up (recorded by :class:`mpifl.runtime.signals.StopRequest`,
  installed before mpifl's heavy imports) ends every rank at the next step with status 130
  (SIGINT) or 3 (SIGTERM, SIGUSR1: a preempted job is requeued and resumes where its last
  checkpoint left it).

The records travel as small Python objects (set-up only: the rounds use flat buffers).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar, cast

import numpy as np

from mpifl.core.errors import EXIT_BAD_INPUT, MpiflError
from mpifl.runtime.comm import ABORT_GRACE_S, Pending
from mpifl.runtime.installs import rank_ranges
from mpifl.runtime.signals import EXIT_CHECKPOINTED, StopRequest

log = logging.getLogger("mpifl")
T = TypeVar("T")

#: Exit status of a command interrupted by SIGINT (128 + 2, as a shell reports it).
EXIT_INTERRUPTED = 130
_ARRIVED_TAG = 0x5E7  # a worker's "I finished this step" message to rank 0
_ROOT_ARRIVED_TAG = 0x5E8  # rank 0's "I finished this step" message to each worker
#: extra seconds a worker waits beyond ``timeout_s``, so that rank 0, which can name the rank
#: that is missing, is the one that ends the job
WORKER_GRACE_S = 5.0


class SetupStopped(MpiflError):
    """A signal asked a rank to stop during set-up: every rank ends with the signal's status."""

    label = "stopped"

    def __init__(self, signal_name: str, step: str) -> None:
        super().__init__(f"{signal_name} during set-up ({step}), before the first round; "
                         + ("run the same command again to start it" if signal_name == "SIGINT"
                            else "resume continues from the last checkpoint, if any"))
        self.exit_status = EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_CHECKPOINTED


def one_line(exc: BaseException) -> str:
    """A failure as one line: mpifl's own message, or the exception's type and first line."""
    if isinstance(exc, MpiflError):
        return str(exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return f"{what} (unexpected; mpifl -v logs the traceback)"


class Outcome(Generic[T]):
    """What one rank's attempt at a step gave: a value, or an error line and its status."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.value: T | None = None
        self.error: str | None = None
        self.status = EXIT_BAD_INPUT
        self.exc: MpiflError | None = None  # raised as it is where its message is the agreed one
        try:
            self.value = fn()
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """Record ``exc`` as this rank's failure: mpifl's own line and status, or one line."""
        if isinstance(exc, MpiflError):
            self.error, self.status, self.exc = str(exc), exc.exit_status, exc
        else:
            self.error = one_line(exc)
            log.debug("set-up failed", exc_info=True)

    def get(self) -> T:
        """The value (raises :class:`MpiflError` with the error, if the attempt failed)."""
        if self.error is not None:
            raise self.exc if self.exc is not None else _error(self.error, self.status)
        return cast(T, self.value)  # fn's own value (None only where T allows it)


class SetUp:
    """The set-up steps of one run on every rank of ``comm`` (None: one process).

    Args:
        comm: the world communicator (mpi4py), or None.
        timeout_s: the most seconds a rank waits for the others at the end of a step (0 = no
            bound); ``run.setup_timeout_s``.
        stop: this process's stop request (signals seen so far).
    """

    def __init__(self, comm: Any, timeout_s: float, stop: StopRequest) -> None:
        self.comm, self.timeout_s, self.stop = comm, float(timeout_s), stop
        self.size = comm.Get_size() if comm is not None else 1
        self.rank = comm.Get_rank() if comm is not None else 0

    def step(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this rank, then agree with every rank on the outcome.

        Raises:
            MpiflError: ``fn`` raised on some rank: that rank's one line ("rank r: ..." when not
                every rank failed) and its exit status, on every rank.
            SetupStopped: a rank received SIGINT, SIGTERM or SIGUSR1.
        """
        return self.settle(name, Outcome(fn))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """``with setup.stage(name): ...``: the block is one step, as :meth:`step`: an exception
        in it is agreed on by every rank, and the code after the block runs only when every
        rank finished it.

        Raises:
            MpiflError, SetupStopped: as :meth:`step`.
        """
        outcome = Outcome(lambda: None)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it
            outcome.fail(exc)
        self.settle(name, outcome)

    def settle(self, name: str, outcome: Outcome[T]) -> T:
        """Agree on an outcome computed already (the config, loaded before MPI_Init)."""
        mine = (outcome.error, outcome.status, self.stop.reason)
        records = [mine]
        if self.size > 1:
            self._arrive(name)
            records = self.comm.allgather(mine)
        failed = [(r, err, status) for r, (err, status, _) in enumerate(records) if err]
        if failed:
            r, err, status = failed[0]
            partial = self.size > 1 and len(failed) < self.size
            if not partial and r == self.rank and outcome.exc is not None:
                raise outcome.exc  # its own class (ConfigError, OutputError) for mpifl.run
            raise _error(f"rank {r}: {err}" if partial else str(err), status)
        if signal := next((sig for _, _, sig in records if sig), None):
            raise SetupStopped(signal, name)
        return cast(T, outcome.value)  # no rank failed: fn's own value

    def share(self, name: str, value: T | None) -> T:
        """Rank 0's ``value`` on every rank (a small object: a path, the config's JSON)."""
        if self.size == 1:
            return cast(T, value)  # rank 0's own
        self._arrive(name)
        return cast(T, self.comm.bcast(value, root=0))  # mpi4py's objects are untyped

    def gather(self, name: str, value: T) -> list[T] | None:
        """Every rank's ``value`` on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [value]
        self._arrive(name)
        return cast("list[T] | None", self.comm.gather(value, root=0))

    def split(self, name: str, member: bool) -> Any:
        """A communicator of the ranks with ``member`` True, in rank order (None elsewhere)."""
        from mpi4py import MPI

        self._arrive(name)
        return self.comm.Split(0 if member else MPI.UNDEFINED, self.rank)

    def allgather(self, name: str, value: T) -> list[T]:
        """Every rank's ``value`` on every rank (a small object), in rank order."""
        if self.size == 1:
            return [value]
        self._arrive(name)
        return cast("list[T]", self.comm.allgather(value))

    def together(self, name: str, fn: Callable[[object], T]) -> T:
        """``fn(comm)`` on every rank once all have arrived (a collective over the world
        communicator; ``comm`` is None in one process)."""
        if self.size > 1:
            self._arrive(name)
        return fn(self.comm)

    def _arrive(self, name: str) -> None:
        """Wait, within ``timeout_s``, until every rank has finished step ``name``; otherwise end
        the job (``MPI_Abort``, status 2) with one line naming the ranks that did not arrive:
        rank 0 names the workers (it hears from each), a worker names rank 0 (rank 0 tells every
        worker that it arrived)."""
        if not self.timeout_s:
            return
        from mpi4py import MPI

        flag = np.zeros(1, np.int8)
        if self.rank == 0:
            reqs = [self.comm.Irecv([np.zeros(1, np.int8), MPI.INT8_T], source=r, tag=_ARRIVED_TAG)
                    for r in range(1, self.size)]
            told = [self.comm.Isend([flag, MPI.INT8_T], dest=r, tag=_ROOT_ARRIVED_TAG)
                    for r in range(1, self.size)]
            missing = _wait(reqs, self.timeout_s)
            if missing:
                ranks = rank_ranges([i + 1 for i in missing])
                self._abort(f"rank(s) {ranks} did not finish set-up step '{name}' within "
                            f"run.setup_timeout_s = {self.timeout_s:g} s (failed hard, stopped or "
                            "hung; their own output may say why)")
            for req in [*told, self.comm.Ibarrier()]:  # all have arrived: these complete
                req.Wait()
            return
        send = self.comm.Isend([flag, MPI.INT8_T], dest=0, tag=_ARRIVED_TAG)
        root = self.comm.Irecv([np.zeros(1, np.int8), MPI.INT8_T], source=0, tag=_ROOT_ARRIVED_TAG)
        # rank 0 ends the job first when a worker is missing; among the workers rank 1 speaks
        # first when rank 0 is, the others after a longer grace (one line, not one a rank: the
        # ranks reach a step seconds apart on a loaded node, and rank 1's abort takes its time)
        grace = WORKER_GRACE_S * (1 if self.rank == 1 else 4)
        pending = _wait([send, root, self.comm.Ibarrier()], self.timeout_s + grace)
        if 1 in pending:
            self._abort(f"rank 0 did not finish set-up step '{name}' within run.setup_timeout_s "
                        f"= {self.timeout_s:g} s (failed hard, stopped or hung; its own output "
                        "may say why)")
        elif pending:
            self._abort(f"rank 0 finished set-up step '{name}' but another rank did not within "
                        f"run.setup_timeout_s = {self.timeout_s:g} s, and rank 0 did not end the "
                        "job (their own output may say why)")

    def _abort(self, line: str) -> None:
        print(f"mpifl: error: rank {self.rank}: {line}; ending every rank of the job",
              file=sys.stderr, flush=True)
        time.sleep(ABORT_GRACE_S)  # let mpiexec forward the line before the job is torn down
        self.comm.Abort(EXIT_BAD_INPUT)
        os._exit(EXIT_BAD_INPUT)  # MPICH's MPI_Abort can return while a peer is stopped


def _wait(requests: Sequence[Pending], timeout_s: float) -> list[int]:
    """Test ``requests`` until all complete or ``timeout_s`` passes, sleeping between tests
    (no spinning: ranks share cores). The indices of those still pending ([] when all done)."""
    pending, pause, start = list(range(len(requests))), 1e-4, time.monotonic()
    while pending:
        pending = [i for i in pending if not requests[i].Test()]
        if pending and time.monotonic() - start > timeout_s:
            return pending
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return []


def _error(message: str, status: int) -> MpiflError:
    exc = MpiflError(message)
    exc.exit_status = status
    return exc
