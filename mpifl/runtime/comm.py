"""MPI process plumbing: the world communicator (with a bounded MPI_Init), waits that do not
spin, the launcher's rank and size before MPI_Init, and how clients are cut into contiguous
blocks of the worker ranks. The round protocol itself is :mod:`mpifl.runtime.protocol`.

A rank that waits for another's long phase (workers while rank 0 aggregates, rank 0 while the
workers train or evaluate) does not busy-poll: :func:`wait_idle` completes nonblocking requests
and sleeps between tests. MPICH's blocking calls spin, and when ranks share cores (3 ranks on a
2-core machine) the spinning ranks take CPU time from the one doing the work.

mpi4py is imported lazily so that one-process runs work without an MPI library.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from mpifl.core.errors import PeerLost
from mpifl.runtime import init_watch

#: seconds between a failing rank's message and its MPI_Abort (see :meth:`mpifl.runtime.protocol.MPITransport.abort`)
ABORT_GRACE_S = 0.5


class Pending(Protocol):
    """What :func:`wait_idle` completes: an mpi4py request, or any object testing one."""

    def Test(self) -> bool: ...  # noqa: N802 -- mpi4py's name


def wait_idle(request: Pending, max_sleep: float = 2e-4, timeout: float = 0.0,
              waiting_for: str = "") -> None:
    """Complete an MPI request without holding a core while it is pending.

    Tests the request, sleeping between tests with a pause that doubles from 1 us up to
    ``max_sleep`` seconds: at most about ``max_sleep`` of added latency, negligible against a
    phase long enough to be worth not spinning through. (The main job on 3 ranks of the 2-core
    VM: 0.21 s a round with MPICH's spinning waits, 0.13 s with these; docs/BENCHMARKS.md.)

    Raises:
        PeerLost: ``timeout`` > 0 seconds passed first (a rank that hangs or whose node is
            lost would otherwise keep every other rank waiting forever).
    """
    pause, start = 1e-6, time.monotonic()
    while not request.Test():
        if timeout and time.monotonic() - start > timeout:
            raise PeerLost(f"no answer from {waiting_for} within run.peer_timeout_s = {timeout:g} s "
                           "(a rank hangs or its node is lost)")
        time.sleep(pause)
        pause = min(2 * pause, max_sleep)


#: the communicator :func:`communicator` put in place of MPI_COMM_WORLD, or None
_OVERRIDE: Any = None


@contextmanager
def communicator(comm: Any) -> Iterator[Any]:
    """Run what follows on ``comm`` (an mpi4py communicator) as if it were the whole job.

    Inside the block :func:`world` returns ``comm`` and :func:`launched_rank` and
    :func:`launched_size` its rank and size, so ``mpifl.cli.main`` and :func:`mpifl.run` run an
    experiment on a sub-communicator of a larger world exactly as they would on a world of
    that size (the test suite runs many small experiments in one launched world this way).
    Blocks nest; leaving one restores the communicator before it.
    """
    global _OVERRIDE
    before, _OVERRIDE = _OVERRIDE, comm
    try:
        yield comm
    finally:
        _OVERRIDE = before


def substituted() -> bool:
    """Whether a :func:`communicator` block is in force (its size is then the job's)."""
    return _OVERRIDE is not None


def world(init_timeout_s: float = 0.0) -> Any:
    """The MPI world communicator (or the one :func:`communicator` put in its place), or None
    when mpi4py is not installed.

    Args:
        init_timeout_s: seconds this rank may spend in MPI_Init (the first import of
            ``mpi4py.MPI``; every rank waits there for all the others), 0 = forever. Then the
            first waiting rank of the node prints one line naming the ranks that did not reach
            MPI_Init (:mod:`mpifl.runtime.init_watch`: when every rank runs on this node; else
            the ranks that arrived here) and every waiting rank is ended with SIGKILL, so the
            launcher ends the job and a SLURM job's next launch can follow. Seen under
            ``srun --mpi=pmi2`` when the PMI exchange breaks (slurm/README.md).
    """
    if _OVERRIDE is not None:
        return _OVERRIDE
    try:
        import mpi4py  # noqa: F401  (installed? MPI_Init comes with mpi4py.MPI)
    except ImportError:
        return None
    if init_timeout_s <= 0 or "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    rank, agent = launched_rank(), init_watch.launcher_agent()
    mark = init_watch.mark_arrival(agent, rank)
    watchdog = init_watch.start(init_timeout_s, rank, launched_size(), agent)
    try:
        from mpi4py import MPI
    finally:
        if watchdog.stdin is not None:  # started with a pipe
            watchdog.stdin.close()  # the watchdog reads end-of-file and leaves
        watchdog.wait()
        if mark is not None:
            mark.close()
    return MPI.COMM_WORLD


def launched_rank() -> int:
    """This process's rank from the launcher's environment, before MPI_Init (0 without one);
    inside :func:`communicator`, the rank in that communicator."""
    if _OVERRIDE is not None:
        return int(_OVERRIDE.Get_rank())
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def launched_size() -> int:
    """The number of ranks the launcher started (mpiexec, srun), from its environment, before
    MPI_Init; 1 when started without one; inside :func:`communicator`, that communicator's
    size."""
    if _OVERRIDE is not None:
        return int(_OVERRIDE.Get_size())
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def local_rank(rank: int) -> int:
    """This process's rank on its node (for picking a GPU), from the launcher's environment."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return rank


def split_by_samples(num_samples: np.ndarray, parts: int) -> np.ndarray:
    """Cut a sequence of clients into ``parts`` contiguous blocks of about equal sample counts.

    Args:
        num_samples: (m,) int, samples per client (training cost is about proportional).
        parts: number of worker ranks.

    Returns:
        (parts + 1,) int64 bounds: block r is ``[bounds[r], bounds[r+1])``. Contiguous blocks keep
        the gathered updates in client-id order with no reordering copy.
    """
    cum = np.cumsum(np.asarray(num_samples, dtype=np.float64))
    total = cum[-1] if cum.size else 0.0
    targets = total * np.arange(1, parts) / parts
    inner = np.searchsorted(cum, targets, side="left") + 1 if cum.size else np.zeros(parts - 1)
    bounds = np.concatenate([[0], np.minimum(inner, len(cum)), [len(cum)]]).astype(np.int64)
    return np.maximum.accumulate(bounds)


def rank_counts(bounds: np.ndarray) -> np.ndarray:
    """(workers + 1,) int64 rows per rank from the workers' block bounds of
    :func:`split_by_samples`: rank 0 holds none, rank r block r - 1 (the counts of a
    Gatherv or Scatterv over the whole communicator)."""
    return np.concatenate([[0], np.diff(bounds)]).astype(np.int64)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``; elsewhere
    nothing). Called when a lazy population's window of clients is released
    (:func:`mpifl.runtime.backends.client_rows`) and after a worker's round is replied:
    windows and replies leave the heap fragmented, and without it a worker's resident memory
    climbed round after round (K = 10^6: 2.6 GB in round 1 to 5.9 GB by round 41)."""
    if _TRIM is not None:
        _TRIM(0)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
