"""Coordinate shards of the server: the flat parameter vector cut into P contiguous blocks, one
per shard rank, so that no rank holds a round's whole (m, d) update matrix (issue 14;
docs/ARCHITECTURE.md, "Sharded server").

Every Gram-space rule (FedFV, FedMGDA+, mFairFL, FedLF, FedMDFG) needs from the d-dimensional
updates only sums over coordinates — the (m, m) Gram matrix (per layer for FedLF), dot products
with a few vectors, norms — and returns a step that is a linear combination of the rows; the
linear rules (FedAvg, FedProx, qFedAvg, DRFL, UGA) are weighted sums of rows. A sum over
coordinates is the sum over shards of the same sum over each shard's block, so each shard
computes its partial sums on its block, :meth:`ShardGroup.allsum` adds them up, every shard
derives the same coefficients from the same totals, and applies them to its own block.

Blocks need no alignment to layer boundaries: a layer cut by a block boundary contributes a
partial Gram matrix on each side, and their sum is the layer's Gram matrix. Each shard sees the
layer map clipped to its block (:func:`local_layers`; a layer outside it is an empty slice).

The totals are reduced to shard 0 and broadcast back (not MPI_Allreduce): the MPI standard does
not promise that an Allreduce of floats gives bit-identical results on every rank, and the shards
must take identical decisions (FedFV's projections, a QP's active set) from them.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ShardGroup", "local_layers", "shard_bounds"]

#: block boundaries are multiples of this many float32 (64 bytes: whole cache lines)
ALIGN = 16


def shard_bounds(d: int, shards: int) -> np.ndarray:
    """Cut ``[0, d)`` into ``shards`` contiguous blocks of about equal size.

    Args:
        d: number of parameters (>= 1). shards: P >= 1.

    Returns:
        (P + 1,) int64 bounds, block j is ``[bounds[j], bounds[j+1])``; inner bounds are
        multiples of :data:`ALIGN` (a block may be empty when d < P * ALIGN).

    Raises:
        ValueError: ``shards < 1`` or ``d < 1``.
    """
    if shards < 1 or d < 1:
        raise ValueError(f"shard_bounds needs d >= 1 and shards >= 1, got d={d}, shards={shards}")
    inner = [min(d, (j * d // shards) // ALIGN * ALIGN) for j in range(1, shards)]
    return np.array([0, *inner, d], dtype=np.int64)


def local_layers(layers: list[slice] | None, lo: int, hi: int) -> list[slice] | None:
    """The layer map clipped to the block ``[lo, hi)``, in the block's coordinates: layer l
    becomes ``slice(a - lo, b - lo)`` with ``a, b`` its start and stop clamped into the block
    (an empty slice where it lies outside), so the clipped layers still tile the block in order."""
    if layers is None:
        return None
    return [slice(min(max(s.start, lo), hi) - lo, min(max(s.stop, lo), hi) - lo) for s in layers]


class ShardGroup:
    """The P shard ranks of a sharded server, as seen by one of them.

    Args:
        comm: an mpi4py intracommunicator of the P shard ranks (shard j = its rank j), or None
            for a single shard (P = 1: every method is the identity; the rank-0 server).
        d: number of parameters of the full vector.

    Attributes:
        size: P. index: this shard's j. bounds: :func:`shard_bounds`. lo, hi: this block.
    """

    def __init__(self, comm, d: int) -> None:
        self.comm = comm
        self.size = 1 if comm is None else comm.Get_size()
        self.index = 0 if comm is None else comm.Get_rank()
        self.d = d
        self.bounds = shard_bounds(d, self.size)
        self.lo, self.hi = int(self.bounds[self.index]), int(self.bounds[self.index + 1])
        self.allsum_seconds = 0.0  # time spent in allsum (the benchmark's Allreduce column)

    @property
    def counts(self) -> np.ndarray:
        """(P,) int64 coordinates per block."""
        return np.diff(self.bounds)

    def block(self, x):
        """This shard's block of a full (..., d) array or tensor (a view)."""
        return x[..., self.lo:self.hi]

    def allsum(self, x) -> np.ndarray:
        """The sum over shards of every shard's partial ``x`` (array-like of float64 numbers),
        identical bit for bit on every shard (reduced to shard 0, then broadcast).

        Returns:
            a float64 numpy array of ``x``'s shape (a 0-d array for a scalar).
        """
        buf = np.array(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x,
                       dtype=np.float64, copy=True)
        if self.comm is None or self.size == 1:
            return buf
        import time

        from mpi4py import MPI

        t0 = time.perf_counter()
        flat = buf.reshape(-1)
        total = np.empty_like(flat) if self.index == 0 else None
        self.comm.Reduce([flat, MPI.DOUBLE], [total, MPI.DOUBLE] if total is not None else None,
                         op=MPI.SUM, root=0)
        if self.index == 0:
            flat[:] = total
        self.comm.Bcast([flat, MPI.DOUBLE], root=0)
        self.allsum_seconds += time.perf_counter() - t0
        return buf

    def gather(self, block: np.ndarray) -> np.ndarray | None:
        """Shard 0: the full (d,) float32 vector from every shard's (hi - lo,) block (a step or
        the model); other shards: None."""
        block = np.ascontiguousarray(block, dtype=np.float32)
        if self.comm is None or self.size == 1:
            return block
        from mpi4py import MPI

        out = np.empty(self.d, dtype=np.float32) if self.index == 0 else None
        counts = self.counts
        displs = self.bounds[:-1]
        self.comm.Gatherv([block, MPI.FLOAT],
                          [out, counts, displs, MPI.FLOAT] if out is not None else None, root=0)
        return out
