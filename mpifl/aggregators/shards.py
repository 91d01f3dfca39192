"""Coordinate shards of the server: the flat parameter vector cut into P contiguous blocks, one
per shard rank, so that no rank holds a round's whole (m, d) update matrix
(docs/ARCHITECTURE.md, "Sharded server").

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

The totals must be identical bit for bit on every shard (the runtime reduces them to shard 0 and
broadcasts them back, not MPI_Allreduce: the MPI standard does not promise that an Allreduce of
floats gives bit-identical results on every rank), because the shards must take identical
decisions (FedFV's projections, a QP's active set) from them.

This module never sees MPI: a :class:`ShardGroup` talks to the other shards through the narrow
:class:`ShardCollectives` interface, which the runtime implements over a communicator
(:class:`mpifl.runtime.shard_comm.MPIShardCollectives`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["ShardCollectives", "ShardGroup", "local_layers", "shard_bounds"]

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


def row_sq_norms(X: torch.Tensor, finite: bool = False,
                 chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """(n,) float64 squared norms of the rows of an (n, w) matrix, accumulated in float64 a
    few rows at a time (a whole float64 copy of a shard's block would double its memory).

    Args:
        finite: count non-finite entries as 0 (``torch.nan_to_num``), chunk by chunk.
    """
    n, w = X.shape
    out = torch.empty(n, dtype=torch.float64, device=X.device)
    step = max(1, chunk_bytes // max(8 * w, 1))
    for i in range(0, n, step):
        rows = X[i:i + step]
        rows = torch.nan_to_num(rows) if finite else rows
        out[i:i + step] = torch.linalg.vector_norm(rows.double(), dim=1) ** 2
    return out


class ShardCollectives(Protocol):
    """The collectives a :class:`ShardGroup` needs among its P shards (all rooted at shard 0;
    every shard calls each one, in the same order). The runtime's implementation is
    :class:`mpifl.runtime.shard_comm.MPIShardCollectives`.

    Attributes:
        size: P (>= 2). index: this shard's j in ``[0, P)``.
    """

    size: int
    index: int

    def allsum_f64(self, flat: np.ndarray) -> None:
        """Replace the contiguous (n,) float64 ``flat`` by the sum over shards of every
        shard's ``flat``, in place, identical bit for bit on every shard."""

    def gatherv_f32(self, block: np.ndarray, out: np.ndarray | None, counts: np.ndarray,
                    displs: np.ndarray) -> None:
        """Shard 0: fill the float32 ``out`` with every shard j's contiguous float32 ``block``
        (``counts[j]`` values) at offset ``displs[j]``; other shards pass ``out = None``."""

    def bcast(self, arr: np.ndarray) -> None:
        """Shard 0's contiguous ``arr`` (any numeric dtype; same shape and dtype on every
        shard), written in place into the others'."""


class ShardGroup:
    """The P shard ranks of a sharded server, as seen by one of them.

    Args:
        collectives: how this shard talks to the others (:class:`ShardCollectives`, shard j =
            its ``index`` j), or None for a single shard (P = 1: every method is the
            identity; the rank-0 server).
        d: number of parameters of the full vector.

    Attributes:
        size: P. index: this shard's j. bounds: :func:`shard_bounds`. lo, hi: this block.
    """

    def __init__(self, collectives: ShardCollectives | None, d: int) -> None:
        self.collectives = collectives
        self.size = 1 if collectives is None else int(collectives.size)
        self.index = 0 if collectives is None else int(collectives.index)
        self.d = d
        self.bounds = shard_bounds(d, self.size)
        self.lo, self.hi = int(self.bounds[self.index]), int(self.bounds[self.index + 1])
        self.reset_timing()

    def reset_timing(self) -> None:
        """Start the benchmark's clock (``mpifl bench aggregation --shards``): from now on
        :attr:`allsum_seconds` adds up the time in :meth:`allsum`, :attr:`local_seconds` the
        local work before each allsum (partial statistics, coefficients), and
        :attr:`last_allsum_end` is when the last allsum returned (the rest is the apply)."""
        self.allsum_seconds = 0.0
        self.local_seconds = 0.0
        self.last_allsum_end = time.perf_counter()

    @property
    def counts(self) -> np.ndarray:
        """(P,) int64 coordinates per block."""
        return np.diff(self.bounds)

    def block(self, x: Any) -> Any:
        """This shard's block of a full (..., d) array or tensor (a view)."""
        return x[..., self.lo:self.hi]

    def allsum(self, x: Any) -> np.ndarray:
        """The sum over shards of every shard's partial ``x`` (array-like of float64 numbers),
        identical bit for bit on every shard (:meth:`ShardCollectives.allsum_f64`).

        Returns:
            a float64 numpy array of ``x``'s shape (a 0-d array for a scalar).
        """
        t0 = time.perf_counter()
        self.local_seconds += t0 - self.last_allsum_end
        buf = np.array(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x,
                       dtype=np.float64, copy=True)
        if self.collectives is None or self.size == 1:
            self.last_allsum_end = time.perf_counter()
            return buf
        self.collectives.allsum_f64(buf.reshape(-1))
        self.last_allsum_end = time.perf_counter()
        self.allsum_seconds += self.last_allsum_end - t0
        return buf

    def gather(self, block: np.ndarray) -> np.ndarray | None:
        """Shard 0: the full (d,) float32 vector from every shard's (hi - lo,) block (a step or
        the model); other shards: None."""
        block = np.ascontiguousarray(block, dtype=np.float32)
        if self.collectives is None or self.size == 1:
            return block
        out = np.empty(self.d, dtype=np.float32) if self.index == 0 else None
        self.collectives.gatherv_f32(block, out, self.counts, self.bounds[:-1])
        return out

    def bcast(self, x: np.ndarray) -> np.ndarray:
        """Shard 0's array ``x`` (any numeric dtype; same shape and dtype on every shard),
        in place on the others; returned."""
        if self.collectives is None or self.size == 1:
            return x
        self.collectives.bcast(x)
        return x
