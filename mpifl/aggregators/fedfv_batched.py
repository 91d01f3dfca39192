"""FedFV's projection recursion (Wang et al., "Federated Learning with Fair Averaging", IJCAI
2021, Algorithm 2; ALGORITHMS.md §3) as a blocked triangular solve, for large rounds.

In the Gram form each free client i keeps ``g_i = u_i - sum_j C_ij u_j``, and for every target
``j = PO[n]`` in turn its dot product with the original update is

    dots_i(n) = G_{i,PO[n]} - sum_{k<n} C_{i,PO[k]} G_{PO[k],PO[n]}
    C_{i,PO[n]} = min(dots_i(n), 0) / G_{PO[n],PO[n]}       (0 for i = PO[n])

(:func:`mpifl.aggregators.fedfv.internal_coefficients` runs exactly this, one GEMV per target).
This is a forward substitution with a lower-triangular matrix and a clamp at each step, with one
right-hand side per client: the rows are independent, and the sum over ``k < n`` can be split at
any point. So it is solved like a recursive TRSM: solve the first half of the targets, subtract
their contribution from the second half's dots with one GEMM, solve the second half; small leaf
blocks run the GEMV loop. The flops are the loop's (``n_free m^2 / 2`` multiply-adds) but
almost all of them are in GEMMs instead of memory-bound GEMVs, and the GEMMs skip the rows and
targets whose coefficients are all zero (with few conflicts C is sparse: about 1.6% non-zero on
``mpifl bench aggregation``'s synthetic updates).

Everything is in PO space (``Gp = G[PO][:, PO]``): the clients that keep their update are the
last ``num_kept`` positions, so the free rows are positions ``0 .. n_free-1`` and the row that
must skip target n is row n. Rows can be split into blocks (one per server shard, each solving
``O(m^3 / P)``); FedFV needs only the column sums of C, which add up over blocks.

Exactness: the sums over ``k`` are associated differently from the loop's, so coefficients
differ from :func:`~mpifl.aggregators.fedfv.internal_coefficients` by rounding (at most 1e-15
of ``||u_i||`` in the updates' space in the tests), and a dot product within rounding of 0
may be projected in one and not in the other. That flip is harmless: the projection it
decides moves ``g_i`` by ``|dots| / ||u_j||``, itself of the order of the rounding. Each step
is the projection of ``g_i`` onto the half-space ``{x : x . u_j >= 0}``, a 1-Lipschitz map,
so the rounding differences are not amplified by later steps
(``tests/inprocess/test_fedfv_batched.py`` bounds them in the norm of the updates' space,
``sqrt(dC G dC^T)``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BATCHED_MIN_CLIENTS", "coefficient_column_sums", "po_coefficients", "row_block"]

#: clients per round from which FedFV uses this solver (measured on the 2-core VM, see
#: docs/BENCHMARKS.md "FedFV's recursion at 10,000 clients"); smaller rounds — the main job
#: has 10 — keep the GEMV loop, bit-identical to earlier versions
BATCHED_MIN_CLIENTS = 256

#: leaf width in targets: the GEMV loop inside a leaf, GEMMs between leaves (48 to 128 time
#: alike at m = 1,000 to 5,000; narrower leaves make the GEMMs thin)
LEAF = 48


def row_block(n_free: int, shards: int, index: int) -> tuple[int, int]:
    """Shard ``index``'s contiguous block ``[lo, hi)`` of the ``n_free`` free rows (PO
    positions), blocks of sizes differing by at most one (each row costs the same)."""
    return n_free * index // shards, n_free * (index + 1) // shards


def po_coefficients(Gp: np.ndarray, n_free: int, lo: int = 0, hi: int | None = None,
                    leaf: int = LEAF) -> np.ndarray:
    """Rows ``lo .. hi-1`` of FedFV's coefficient matrix, in PO space.

    Args:
        Gp: (m, m) float64 Gram matrix in projection order, ``Gp[a, b] = G[PO[a], PO[b]]``.
        n_free: clients that project (the first ``n_free`` positions of PO; the last
            ``num_kept`` keep their update and have no coefficients).
        lo, hi: the block of free rows to solve, ``0 <= lo <= hi <= n_free`` (default all).
        leaf: targets per leaf of the recursion (tests use tiny leaves to exercise the GEMMs).

    Returns:
        (hi - lo, m) float64, Fortran order: row ``r`` is position ``lo + r``,
        ``out[r, n] = C[PO[lo + r], PO[n]]`` of :func:`~mpifl.aggregators.fedfv.
        internal_coefficients`, up to rounding (module docstring).

    Raises:
        ValueError: a block outside the free rows.
    """
    hi = n_free if hi is None else hi
    m = Gp.shape[0]
    if not 0 <= lo <= hi <= n_free <= m:
        raise ValueError(f"need 0 <= lo <= hi <= n_free <= m, got {lo}, {hi}, {n_free}, {m}")
    D = np.asfortranarray(Gp[lo:hi])     # the dots still missing the targets not yet solved
    C = np.zeros((hi - lo, m), order="F")
    if hi > lo:
        _solve(_Work(Gp, D, C, lo, max(int(leaf), 1)), 0, m)
    return C


def coefficient_column_sums(G: np.ndarray, po: np.ndarray, n_free: int, lo: int = 0,
                            hi: int | None = None) -> np.ndarray:
    """(m,) float64 ``C[rows, :].sum(axis=0)`` in client order, over the free rows at PO
    positions ``lo .. hi-1`` (all free rows by default; a shard's :func:`row_block`).

    Args:
        G: (m, m) float64 Gram matrix ``U U^T`` in the round's row order.
        po: (m,) projection order (positions). n_free: ``m - num_kept``.
    """
    Gp = np.take(np.take(G, po, axis=0), po, axis=1)     # 1.5x faster than G[np.ix_(po, po)]
    sums = np.zeros(G.shape[0])
    sums[po] = po_coefficients(Gp, n_free, lo, hi).sum(axis=0)
    return sums


class _Work:
    """The arrays one solve shares: ``Gp`` (m, m); ``D`` and ``C`` (h, m) Fortran order (a
    target's column is contiguous), ``D`` updated in place and ``C`` filled; ``lo`` the PO
    position of row 0."""

    def __init__(self, Gp: np.ndarray, D: np.ndarray, C: np.ndarray, lo: int, leaf: int):
        self.Gp, self.D, self.C, self.lo, self.leaf = Gp, D, C, lo, leaf


def _solve(w: _Work, b0: int, b1: int) -> None:
    """Targets ``b0 .. b1-1``; on entry ``w.D[:, b0:b1]`` holds every target before b0."""
    if b1 - b0 <= w.leaf:
        _leaf(w, b0, b1)
        return
    mid = (b0 + b1) // 2
    _solve(w, b0, mid)
    _update(w, b0, mid, b1)
    _solve(w, mid, b1)


def _leaf(w: _Work, b0: int, b1: int) -> None:
    """The GEMV loop of the Gram form on the targets ``b0 .. b1-1`` (h x (n - b0) each)."""
    D, C, Gp = w.D, w.C, w.Gp
    for n in range(b0, b1):
        dots = D[:, n] - C[:, b0:n] @ Gp[b0:n, n] if n > b0 else D[:, n].copy()
        hit = dots < 0                  # a zero u_n gives dots == 0 exactly: never a hit
        own = n - w.lo
        if 0 <= own < hit.shape[0]:
            hit[own] = False            # a client does not project on itself
        if hit.any():
            C[hit, n] = dots[hit] / Gp[n, n]


def _update(w: _Work, b0: int, mid: int, b1: int) -> None:
    """``D[:, mid:b1] -= C[:, b0:mid] @ Gp[b0:mid, mid:b1]`` on the non-zero part of the
    coefficient block only: targets nobody projected on, and rows that projected on none of
    them, contribute exact zeros (C is sparse when few updates conflict)."""
    blk = w.C[:, b0:mid]
    cols = np.flatnonzero(blk.any(axis=0))
    if cols.size == 0:
        return
    A = blk[:, cols]
    rows = np.flatnonzero(A.any(axis=1))
    B = w.Gp[b0 + cols, mid:b1]
    if 2 * rows.size >= A.shape[0]:     # dense enough: a gather/scatter would cost more
        w.D[:, mid:b1] -= A @ B
    else:
        w.D[rows, mid:b1] -= A[rows] @ B
