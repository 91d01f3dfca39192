"""FedFV — Federated Fair Averaging: Wang et al., "Federated Learning with Fair Averaging",
IJCAI 2021 (arXiv:2104.14937), ALGORITHMS.md §3, in the Gram-matrix form.

Each projected update is kept as a combination of the original ones, ``g_i = u_i - sum_j c_ij u_j``.
With ``G = U U^T`` (one GEMM) every dot product the paper's Algorithm 2 needs is
``g_i . u_j = G_ij - sum_k c_ik G_kj``, so all clients are advanced together, target by target,
on m x m numbers; ``g = (1/m) 1^T (I - C) U`` is one GEMV back in d dimensions. Algorithm 3
(external conflicts) needs one GEMV ``H_r g`` per stored round. The d-dimensional work is
O(m^2 d) in the GEMM and O((m + tau m) d) elsewhere; :class:`~mpifl.aggregators.fedfv_direct.
DirectFedFV` is the per-pair loop it is tested against.

The m x m recursion is O(m^3): from :data:`~mpifl.aggregators.fedfv_batched.BATCHED_MIN_CLIENTS`
clients per round it runs as a blocked triangular solve (:mod:`mpifl.aggregators.fedfv_batched`,
GEMMs instead of one GEMV per target, equal to the loop up to rounding), and a sharded server
splits its rows over the shards (each solves ``m / P`` clients' coefficients, one allsum of their
(m,) column sums); smaller rounds keep the GEMV loop :func:`internal_coefficients`, unchanged.

Defaults: ``alpha=0.1, tau=1`` as in the authors' FLGo code; the kept-clients count and the
history window follow ALGORITHMS.md §3 (the paper's window by default, FLGo's as
``external_window="flgo"``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, cast

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import (Aggregator, RoundUpdates, check_round_order, register,
                                    state_scalar)
from mpifl.aggregators.fedfv_batched import BATCHED_MIN_CLIENTS, coefficient_column_sums, row_block
from mpifl.aggregators.history import HistoryRing, RingKeys
from mpifl.aggregators.needs import BenchSpec, Needs, Shards, StateRows
from mpifl.core.params import Params



def num_kept(m: int, alpha: float) -> int:
    """Clients that keep their original update: ``m - ceil((m-1)(1-alpha))`` if ``alpha > 0``.

    Computed in Python floats exactly like the reference code (m=10, alpha=0.1 -> 1;
    m=3, alpha=2/3 -> 2; m=11, alpha=0.7 -> 7, where exact arithmetic would give 8).
    """
    return m - math.ceil((m - 1) * (1 - alpha)) if alpha > 0 else 0


def projection_order(client_ids: np.ndarray, losses: np.ndarray, order: str, seed: int,
                     rnd: int) -> np.ndarray:
    """The projection order ``PO`` as (m,) positions into the round's rows (ALGORITHMS.md §3.2).

    ``"loss"``: ascending loss, ties by ascending client id. ``"reverse"``: descending loss,
    ties still by ascending client id. ``"random"``: the clients sorted by id, permuted by
    ``np.random.default_rng([seed, rnd])`` — independent of the row order the server used.
    """
    ids = np.asarray(client_ids)
    if order == "random":
        by_id = np.argsort(ids, kind="stable")
        return by_id[np.random.default_rng([seed, rnd]).permutation(len(ids))]
    key = np.asarray(losses, dtype=np.float64)
    return np.lexsort((ids, key if order == "loss" else -key))


def internal_coefficients(G: np.ndarray, po: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The m x m matrix C of Algorithm 2 in Gram form: ``g_i = u_i - sum_j C_ij u_j``.

    Args:
        G: (m, m) float64 Gram matrix ``U U^T``.
        po: (m,) projection order (positions).
        kept: (m,) bool, clients that keep their original update (their rows of C stay 0).

    Every client only ever projects against the original targets, so advancing all clients
    together for each target j in PO is the direct loop reordered. O(m^3) flops, no d. The
    columns are kept in PO order, so the targets already used are a contiguous prefix and each
    step reads only those (half the work of a full ``C @ col`` on average, in cache-friendly
    slices).
    """
    m = G.shape[0]
    Gp = np.ascontiguousarray(G[np.ix_(po, po)])  # Gp[a, b] = G[po[a], po[b]]
    rows_g = np.ascontiguousarray(G[:, po])       # rows_g[i, n] = G[i, po[n]]
    Cp = np.zeros((m, m))                         # Cp[:, n] = C[:, po[n]]
    free = ~kept
    for n, j in enumerate(po):
        dots = rows_g[:, n] - Cp[:, :n] @ Gp[:n, n]   # g_i . u_j for every i at once
        hit = free & (dots < 0)
        hit[j] = False
        if hit.any():                            # a zero u_j gives dots == 0 exactly: no hit
            Cp[hit, n] += dots[hit] / G[j, j]
    C = np.empty((m, m))
    C[:, po] = Cp
    return C


#: the checkpoint keys of the history ring (the layout FedFV has always written)
_RING_KEYS = {"rounds": "history_rounds", "sizes": "history_sizes",
              "ids": "history_client_ids", "latest": "history_latest", "rows": "history_updates"}


@register("fedfv")
class FedFV(Aggregator):
    """FedFV aggregation (Wang et al., IJCAI 2021), Gram form; ALGORITHMS.md §3.

    Args:
        alpha: in [0, 1): share of high-loss clients that keep their update (paper's alpha;
            the count is :func:`num_kept`). Default 0.1 (FLGo's default).
        tau: >= 0, rounds of history used against external conflicts; 0 disables Algorithm 3.
            Default 1 (FLGo's default).
        order: ``"loss"`` (default), ``"random"`` or ``"reverse"`` — the paper's Table 4 ablation.
        external_window: ``"paper"`` (default; rounds ``t-tau .. t-1``, oldest first) or
            ``"flgo"`` (the later reference code: rounds ``t-tau+1 .. t``, current round included).
        seed: keys the ``"random"`` order's RNG together with the round.

    History is a :class:`~mpifl.aggregators.history.HistoryRing` of at most ``tau`` stored
    rounds (``tau - 1`` for ``"flgo"``; the current round is the input itself), each row
    flagged while it is its client's latest update (``H[k]`` of ALGORITHMS.md §3.1): O(tau m d)
    memory however many clients exist.

    Raises:
        ValueError: a hyper-parameter out of range; in ``aggregate``, a round that is not later
            than the previous one, or a dimension that changed.
    """

    class Params(Params):
        alpha: float = Field(0.1, ge=0.0, lt=1.0)
        """Share of the highest-loss clients whose conflicts are not projected; 0: all are."""
        tau: int = Field(1, ge=0, le=10_000)
        """Rounds of absent clients' history projected against; 0: no history."""
        order: Literal["loss", "random", "reverse"] = "loss"
        """Projection order: by loss (the paper), random, or reverse (FedFV Table 4)."""
        external_window: Literal["paper", "flgo"] = "paper"
        """History window of the paper, or the FLGo reference code's."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        p = self.params
        self.alpha, self.tau, self.order, self.external_window = (
            p.alpha, p.tau, p.order, p.external_window)
        self._ring = HistoryRing("fedfv")
        self._last_round = -1

    #: Gram form: every d-sum goes through RoundUpdates; the ring holds this shard's columns
    needs = Needs(shards=Shards(state=("history_updates",)))

    @classmethod
    def bench_inputs(cls) -> BenchSpec:
        """Timed beside its direct form :class:`~mpifl.aggregators.fedfv_direct.DirectFedFV`
        (:class:`~mpifl.aggregators.needs.BenchInputs`)."""
        return BenchSpec(baseline="mpifl.aggregators.fedfv_direct:direct_like",
                         forms=("gram", "direct"))

    @classmethod
    def memory_rows(cls, p: Params, *, num_clients: int, per_round: int,
                    rounds: int) -> StateRows:
        """Its history: ``tau`` rounds of m updates (``tau - 1`` with ``external_window =
        "flgo"``; :class:`~mpifl.aggregators.needs.MemoryRows`)."""
        keep = p.tau if p.external_window == "paper" else max(p.tau - 1, 0)
        return StateRows("fedfv.tau", f"FedFV's history of {keep} round(s) of {per_round:,} "
                         "updates", keep * per_round)

    # ---- public -----------------------------------------------------------------------------

    @property
    def history_rows(self) -> int:
        """Update rows held in the history ring (superseded rows included)."""
        return self._ring.num_rows

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``s`` (d,), dtype and device of ``r.updates``; records the round in history."""
        U, t, m = r.updates, r.round, r.m
        self._check_round(r)
        po = projection_order(r.client_ids, r.losses.cpu().numpy(), self.order, self.seed, t)
        kept = np.zeros(m, dtype=bool)
        kept[po[m - num_kept(m, self.alpha):]] = True
        # the only O(m^2 d) work; the m x m recursion then runs in float64 on the CPU (O(m^3),
        # no kernel launch per target), so reordering the sums costs no accuracy
        G = r.gram(U)                                # summed over shards when sharded
        a = (1.0 - self.coefficient_sums(G, po, kept, r)) / m   # g = (1/m) 1^T (I - C) U
        g = torch.as_tensor(a, dtype=U.dtype, device=U.device) @ U
        self._ring.supersede(r.client_ids)           # history takes the current round first
        g = self._external(g, r)
        self._push(r)
        return rescale_to_mean(g, U, r)

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """Hyper-parameters, last round and the history ring as flat numpy arrays.

        ``history_updates`` is (N, d) with the blocks' rows stacked; ``history_sizes`` (B,)
        splits it back into the ``history_rounds`` (B,) blocks.
        """
        return {
            "alpha": self.alpha, "tau": self.tau, "order": self.order,
            "external_window": self.external_window, "seed": self.seed,
            "last_round": self._last_round, **self._ring.state_dict(**_RING_KEYS),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (blocks land on the CPU and move to the updates'
        device on the next round).

        Raises:
            ValueError: missing keys, inconsistent arrays, or hyper-parameters that differ from
                this object's (a resumed run must use the same configuration).
        """
        missing = {"alpha", "tau", "order", "external_window", "seed", "last_round",
                   *_RING_KEYS.values()} - set(state)
        if missing:
            raise ValueError(f"fedfv state is missing {sorted(missing)}")
        for key in ("alpha", "tau", "order", "external_window", "seed"):
            saved = state_scalar(state[key])
            if saved != getattr(self, key):
                raise ValueError(f"fedfv state was saved with {key}={saved!r}, "
                                 f"this aggregator has {key}={getattr(self, key)!r}")
        self._ring.load_state_dict(state, **cast(RingKeys, _RING_KEYS))
        self._last_round = int(state_scalar(state["last_round"]))

    def __repr__(self) -> str:
        return (f"FedFV(alpha={self.alpha}, tau={self.tau}, order={self.order!r}, "
                f"external_window={self.external_window!r}, seed={self.seed})")

    # ---- internal conflicts -------------------------------------------------------------------

    #: clients per round from which the recursion is the blocked solve; a class attribute, not a
    #: hyper-parameter (same result up to rounding): tests and benchmarks set it per instance
    batched_from: int = BATCHED_MIN_CLIENTS

    def coefficient_sums(self, G: np.ndarray, po: np.ndarray, kept: np.ndarray,
                         r: RoundUpdates) -> np.ndarray:
        """(m,) float64 column sums of Algorithm 2's coefficients C (:func:`internal_coefficients`)
        for the round ``r`` (only its ``shards`` is used): ``g = (1/m) (1 - sums) U``.

        Small rounds: the GEMV loop, every shard alone (bit-identical to earlier versions).
        Large ones: :func:`~mpifl.aggregators.fedfv_batched.coefficient_column_sums`, each shard
        solving its :func:`~mpifl.aggregators.fedfv_batched.row_block` of the free clients, and
        one allsum of the partial sums (identical on every shard, so they decide alike).
        """
        m = len(po)
        if m < self.batched_from:
            return internal_coefficients(G, po, kept).sum(axis=0)
        n_free = m - int(kept.sum())
        if not kept[po[n_free:]].all():             # the blocked solve relies on it
            raise ValueError("fedfv: the kept clients must be the last positions of the order")
        shards, index = (1, 0) if r.shards is None else (r.shards.size, r.shards.index)
        part = coefficient_column_sums(G, po, n_free, *row_block(n_free, shards, index))
        return part if shards == 1 else r.total(part)

    # ---- history ----------------------------------------------------------------------------

    def _check_round(self, r: RoundUpdates) -> None:
        check_round_order("fedfv", r.round, self._last_round)
        # after a checkpoint load the rows sit on the CPU; moved once
        self._ring.prepare(r.d, r.updates.device, r.updates.dtype)

    def _push(self, r: RoundUpdates) -> None:
        """Store the current round if a later round can use it, and drop what none can.

        The round is copied (the server may reuse its gather buffer for the next round) into
        the rows of a block being dropped when one has the same shape (``copy=True``): a fresh
        (m, d) allocation pays its page faults every round (a third of the call at m = 60,
        d = 199,210 on the 2-core VM).
        """
        self._last_round = r.round
        # a later round t' uses stored rounds >= t' - tau (paper) or >= t' - tau + 1 (flgo)
        keep = self.tau if self.external_window == "paper" else self.tau - 1
        horizon = r.round - keep + 1
        if keep > 0:
            self._ring.push(r.round, r.client_ids, r.updates, horizon=horizon, copy=True)
        else:
            self._ring.drop(horizon)

    def _window(self, r: RoundUpdates) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The (rows, latest) blocks of Algorithm 3, oldest round first: rounds ``t - tau ..
        t - 1`` (paper) or ``t - tau + 1 .. t`` (flgo, the current round last)."""
        paper = self.external_window == "paper"
        out = [(b.rows, b.latest)
               for b in self._ring.since(r.round - (self.tau if paper else self.tau - 1))]
        if not paper:
            out.append((r.updates, np.ones(r.m, dtype=bool)))
        return out

    def _external(self, g: torch.Tensor, r: RoundUpdates) -> torch.Tensor:
        """Algorithm 3: project g off the summed conflicting history of each round in turn."""
        if self.tau == 0 or r.round < self.tau:
            return g
        for H, latest in self._window(r):
            p = r.dots(H, g).to(torch.float64).cpu().numpy()  # g . u_k, with the current g
            conflict = latest & (p < 0)
            if not conflict.any():
                continue
            g_con = torch.as_tensor(conflict, dtype=H.dtype, device=H.device) @ H
            dot = float(p[conflict].sum())                 # = g . g_con
            if dot < 0:
                # g_con is needed explicitly for the update, so its norm costs one O(d) dot
                g = g - (dot / r.dot(g_con, g_con)) * g_con
        return g


def rescale_to_mean(g: torch.Tensor, U: torch.Tensor, r: RoundUpdates) -> torch.Tensor:
    """``g * ||mean u|| / ||g||``, or zeros when ``||g|| == 0`` (ALGORITHMS.md §3.6); norms
    over all shards' coordinates."""
    gn = r.norm(g)
    if float(gn) == 0.0:
        return torch.zeros_like(g)
    return g * (r.norm(U.mean(dim=0)) / gn)
