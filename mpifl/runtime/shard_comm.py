"""The sharded server's collectives over MPI: :class:`MPIShardCollectives` implements
:class:`mpifl.aggregators.shards.ShardCollectives` on a communicator of the P shard ranks, so
that :class:`~mpifl.aggregators.shards.ShardGroup` (and the rules it serves) never sees MPI.

Sums are reduced to shard 0 and broadcast back (not MPI_Allreduce): the MPI standard does not
promise that an Allreduce of floats gives bit-identical results on every rank, and the shards
must take identical decisions from them. mpi4py is imported lazily, as in
:mod:`mpifl.runtime.comm`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["MPIShardCollectives"]


class MPIShardCollectives:
    """:class:`~mpifl.aggregators.shards.ShardCollectives` over an mpi4py communicator.

    Args:
        comm: an mpi4py intracommunicator of the P shard ranks (shard j = its rank j).
        wait: completes a nonblocking MPI request (the runtime's peer-timeout wait,
            :func:`mpifl.runtime.comm.wait_idle`), or None to use the blocking collectives.

    Attributes:
        size: P. index: this shard's j (its rank in ``comm``).
    """

    def __init__(self, comm: Any, wait: Callable[[Any], None] | None = None) -> None:
        self.comm, self.wait = comm, wait
        self.size = comm.Get_size()
        self.index = comm.Get_rank()

    def _run(self, name: str, *args: Any, **kwargs: Any) -> None:
        """The collective ``name`` rooted at shard 0: blocking, or its nonblocking form
        completed by :attr:`wait` (so a lost shard cannot hold the others forever)."""
        if self.wait is None:
            getattr(self.comm, name)(*args, root=0, **kwargs)
        else:
            self.wait(getattr(self.comm, "I" + name.lower())(*args, root=0, **kwargs))

    def allsum_f64(self, flat: np.ndarray) -> None:
        """``Reduce`` (sum) of the contiguous float64 ``flat`` to shard 0, then ``Bcast`` of
        shard 0's total, in place: the same bits on every shard."""
        from mpi4py import MPI

        total = np.empty_like(flat) if self.index == 0 else None
        self._run("Reduce", [flat, MPI.DOUBLE], [total, MPI.DOUBLE] if total is not None else None,
                  op=MPI.SUM)
        if self.index == 0:
            flat[:] = total
        self._run("Bcast", [flat, MPI.DOUBLE])

    def gatherv_f32(self, block: np.ndarray, out: np.ndarray | None, counts: np.ndarray,
                    displs: np.ndarray) -> None:
        """``Gatherv`` of the float32 blocks into shard 0's ``out`` (None elsewhere)."""
        from mpi4py import MPI

        self._run("Gatherv", [block, MPI.FLOAT],
                  [out, counts, displs, MPI.FLOAT] if out is not None else None)

    def bcast(self, arr: np.ndarray) -> None:
        """``Bcast`` of shard 0's ``arr`` into the others', in place."""
        self._run("Bcast", arr)
