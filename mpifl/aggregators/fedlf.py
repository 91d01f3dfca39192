"""FedLF — Layer-wise Fair Federated Learning: Pan, Li, Yu, Wang, Wang, Tang & Zhao, "FedLF:
Layer-wise Fair Federated Learning", AAAI 2024 (authors' code: github.com/zibinpan/FedLF);
ALGORITHMS.md §5, in Gram space per layer.

One round, with ``g_k = u_k / lr_t`` the selected clients' gradient estimates and ``l_k`` their
losses at ``w^t``:

1. fair-driven weights ``h = [(e·L) L / ||L||^2 - e] / ||L||`` (``e = 1/sqrt(m)``), the gradient
   of ``-cos(1, L)`` with respect to the losses (:func:`fair_weights`);
2. per layer l (a module's weight and bias, from ``RoundUpdates.layers``): every client slice
   ``g_{k,l}`` rescaled to the mean norm ``mu_l``, the fair row ``p_l = sum_k h_k ĝ_{k,l}``
   rescaled to ``mu_l``, the history rows of absent clients rescaled to ``mu_l``; the min-norm
   point of their convex hull ``d_l = λ^T Q_l`` (simplex QP, cvxopt via
   :func:`~mpifl.aggregators.qp.solve_simplex_qp`);
3. a layer whose ``d_l`` is zero is merged with the next one (the previous one if it is last)
   and solved again, until non-zero or everything is merged (paper Alg. 1);
4. ``d = concat(d_l)`` rescaled to ``||(1/m) sum_k g_k||`` (unscaled if a selected client then
   conflicts with it), and the step is ``s = lr_t d``.

**Gram form.** All rows of a layer are combinations of the raw rows ``X_l`` (the m gradient
slices and the history slices): ``Q_l = S_l X_l`` with an (r, n) coefficient matrix ``S_l``
holding the normalisations and h. With the layer Gram ``K_l = X_l X_l^T`` (one GEMM) the QP
matrix is ``P_l = S_l K_l S_l^T`` and ``d_l = (S_l^T λ) X_l`` (one GEMV); a merged layer's Gram
is the sum of its members'. The Grams and ``d`` are computed in float64 (X is upcast once:
n D 8 bytes of scratch), so the zero test and the no-conflict guarantee do not depend on float32
rounding.

**Zero test.** ``d_l`` counts as zero when ``||d_l|| <= zero_tol * mu_l`` with ``zero_tol = 1e-8``
by default (ALGORITHMS.md §5.5). A tighter 1e-12 would not do: the QP resolves a hull that
contains 0 only to ``||d_l|| ~ 1e-12 .. 2e-10 mu_l`` (measured with cvxopt in float64), on both
sides of 1e-12; with 1e-8 every direction declared non-zero keeps every row's conflict above
``-1e-8`` relative.

**Rows left out.** A row whose slice is exactly zero constrains nothing (``0 · d = 0``) and
is left out of the QP instead of being normalised (the reference code divides by its norm). The
fair row is left out when ``h = 0`` (equal losses: L is parallel to 1, or m = 1) or when
``||p_l|| <= 1e-6 sum_k |h_k| mu_l`` (no fair direction to follow).

**Absent clients** (paper's history, ALGORITHMS.md §5.6). ``M`` = clients ever seen before this
round; when ``M > m``, ``tau = floor(M / m)`` and every client not selected now whose last gradient
is at most tau rounds old joins with it. ``m`` here is the nominal round size: the largest round
seen so far (``server.clients_per_round`` unless every round so far lost clients to dropout or
rejection), which can only grow. At most m new clients join per round, so tau grows by at most
one per round and the window's left end ``t - tau`` never moves back: after round t, rounds
before ``t + 1 - floor(M/m)`` (M counted after round t) can never be used again and are freed.
**Memory bound:** the history (a :class:`~mpifl.aggregators.history.HistoryRing`) holds only
each client's latest gradient (superseded rows are freed at once), and only while a later
round can still use it: at most ``min(M, floor(M/m) m) <= M`` rows of d floats. The rule
itself grows with K: with uniform sampling, once all K clients have been seen, ``tau = K/m``
and about ``(1 - 1/e) K`` clients are within the window, so the history approaches O(K d) by
design of the paper's rule, as in the reference code (which keeps every client's last
gradient). Seen clients cost two int64 each.

**Conflict fallback** (ALGORITHMS.md §5.7). After rescaling, if some selected client has
``g_k · d < -1e-6 ||g_k|| ||d||``, the unscaled d is used. The test is invariant under rescaling,
so it can only fire when the QP direction itself conflicts (numerical trouble); then the step is
at least not enlarged. The reference code's test is absolute (``max(-G d) > 1e-6``) and halves d.

**Invariant** (ALGORITHMS.md §5.8), as the rule guarantees it: for every solved group (a layer, or
layers merged by step 3) and every selected or history row, ``g_{k,g} · d_g >= 0``, and
``p_g · d_g >= 0`` for the fair row built from the *normalised* slices. Inside a merged group a
single layer can conflict, and the raw ``g_P = sum_k h_k g_k`` is not a QP row, so
``g_P,l · d_l`` can be negative; a per-layer promise for the raw g_P would be more than the
paper's rule gives. The authors' released ``FedLF.py`` solves every layer alone (no merging).

Defaults: no hyper-parameters besides ``zero_tol``; the paper's rules (ALGORITHMS.md §5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from mpifl.aggregators.base import (Aggregator, RoundUpdates, check_round_order, register,
                                    state_scalar)
from mpifl.aggregators.gram import gram
from mpifl.aggregators.history import HistoryRing, RingKeys, Selection
from mpifl.aggregators.needs import Needs, Shards, StateRows
from mpifl.aggregators.qp import solve_simplex_qp

ZERO_TOL = 1e-8          # d_l is zero when ||d_l|| <= ZERO_TOL * mu_l (see the module docstring)
FAIR_TOL = 1e-6          # p_l is dropped when ||p_l|| <= FAIR_TOL * sum|h_k| * mu_l
PARALLEL_TOL = 1e-12     # h = 0 when sin(angle(L, 1)) <= PARALLEL_TOL
CONFLICT_TOL = 1e-6      # ALGORITHMS.md §5.7's relative conflict threshold


def fair_weights(losses: Any) -> np.ndarray:
    """FedLF's fair-driven weights ``h = [(e·L) L / ||L||^2 - e] / ||L||``, ``e = 1/sqrt(m)``.

    ``sum_k h_k g_k`` is the gradient of ``P(w) = -cos(1, L(w))`` (ALGORITHMS.md §5.2); ``h ⟂ L``.

    Args:
        losses: (m,) finite losses.
    Returns:
        (m,) float64; all zeros when ``||L|| = 0`` or L is parallel to 1 (``sin`` of the angle
        at most 1e-12), where the fair objective is already optimal.
    Raises:
        ValueError: empty or non-finite losses.
    """
    L = np.asarray(losses, dtype=np.float64).reshape(-1)
    if L.size == 0 or not np.isfinite(L).all():
        raise ValueError("fedlf: losses must be finite and non-empty")
    norm = float(np.linalg.norm(L))
    if norm == 0.0:
        return np.zeros_like(L)
    unit = L / norm
    e = np.full(L.size, 1.0 / math.sqrt(L.size))
    b = (e @ unit) * unit - e                     # ||b|| = sin(angle(L, 1))
    if float(np.linalg.norm(b)) <= PARALLEL_TOL:
        return np.zeros_like(L)
    return b / norm


@dataclass
class GroupSolution:
    """The QP of one (possibly merged) layer group: ``d_g = coef @ X[:, group]``.

    Attributes:
        layers: indices into the layer list, ascending.
        coef: (n,) float64 coefficients over the raw rows of X.
        lam: (r,) float64 simplex weights over the QP rows actually used.
        status: :func:`solve_simplex_qp`'s status, or ``"empty"`` (no usable row).
        fair_row: whether the fair row ``p_l`` was among the QP rows.
        mu: the mean norm of the selected clients' slices.
        norm: ``||d_g||`` (float64, computed from the vector).
    """

    layers: list[int]
    coef: np.ndarray
    lam: np.ndarray
    status: str
    fair_row: bool
    mu: float
    norm: float


@dataclass
class Direction:
    """:func:`fedlf_direction`'s result: the unscaled ``d`` (D,) float64 and the solved groups
    (in layer order; more than one layer in a group means the combine rule fired)."""

    d: torch.Tensor
    groups: list[GroupSolution] = field(default_factory=list)


def fedlf_direction(X: torch.Tensor, m: int, losses: Any, layers: Sequence[slice] | None = None,
                    zero_tol: float = ZERO_TOL, total: Callable[[Any], np.ndarray] | None = None) -> Direction:
    """FedLF's unscaled direction ``d = concat(d_l)`` (ALGORITHMS.md §5.2-5.5).

    Args:
        X: (n, D) floating tensor; rows ``0 .. m-1`` are the selected clients' gradient
            estimates ``g_k``, rows ``m .. n-1`` absent clients' history gradients.
        m: number of selected clients (``1 <= m <= n``).
        losses: (m,) the selected clients' losses at ``w^t``.
        layers: slices that tile ``[0, D)`` in order (None: the whole model is one layer).
        zero_tol: ``d_l`` is zero when ``||d_l|| <= zero_tol * mu_l``.
        total: sums a partial sum over X's columns over every shard of a sharded server
            (:meth:`RoundUpdates.total`; X is then one shard's column block and ``layers`` the
            layer map clipped to it, empty layers allowed); None: X has every column.
    Returns:
        :class:`Direction` with ``d`` (D,) float64 on ``X.device``.
    Raises:
        ValueError: bad shapes, layers that do not tile ``[0, D)``, non-finite losses.
    """
    if X.ndim != 2 or not 1 <= m <= X.shape[0]:
        raise ValueError(f"fedlf: X must be (n, D) with n >= m >= 1, got {tuple(X.shape)}, m={m}")
    total = total or (lambda x: np.asarray(x, dtype=np.float64))
    slices = layer_slices(layers, X.shape[1], allow_empty=total is not None)
    h = fair_weights(losses)
    if h.shape != (m,):
        raise ValueError(f"fedlf: {h.size} losses for {m} clients")
    X = X.to(torch.float64)             # one upcast (n D 8 bytes), shared by Grams and d
    grams = [total(gram(X[:, s])) for s in slices]
    groups: list[list[int]] = [[i] for i in range(len(slices))]
    solved: list[GroupSolution | None] = [None] * len(groups)
    d = torch.zeros(X.shape[1], dtype=torch.float64, device=X.device)
    i = 0
    while i < len(groups):
        sol = _solve_group(groups[i], cast(np.ndarray, sum(grams[j] for j in groups[i])), m, h)
        sol.norm = _fill(d, X, [slices[j] for j in groups[i]], sol.coef, total)
        if sol.norm <= zero_tol * sol.mu and len(groups) > 1:
            lo = i if i + 1 < len(groups) else i - 1           # merge with next (prev if last)
            groups[lo:lo + 2] = [groups[lo] + groups[lo + 1]]
            solved[lo:lo + 2] = [None]
            i = lo
            continue
        solved[i] = sol
        i += 1
    return Direction(d, [s for s in solved if s is not None])


def layer_slices(layers: Sequence[slice] | None, D: int, allow_empty: bool = False) -> list[slice]:
    """The layer slices, checked to tile ``[0, D)`` in order; ``[slice(0, D)]`` for None.
    ``allow_empty``: a shard's clipped layer map, where layers outside its block are empty."""
    if layers is None:
        return [slice(0, D)]
    out, pos = [], 0
    for s in layers:
        empty_ok = allow_empty and s.stop == s.start
        if s.start != pos or (s.stop <= s.start and not empty_ok) or s.step not in (None, 1):
            raise ValueError(f"fedlf: layers must tile [0, {D}) in order, got {list(layers)}")
        out.append(slice(s.start, s.stop))
        pos = s.stop
    if pos != D:
        raise ValueError(f"fedlf: layers cover [0, {pos}), the model has {D} parameters")
    return out


def _fill(d: torch.Tensor, X: torch.Tensor, slices: list[slice], coef: np.ndarray,
          total: Callable[[Any], np.ndarray]) -> float:
    """Write ``coef @ X[:, s]`` into ``d[s]`` for the group's slices; return the group's norm
    (over every shard's columns)."""
    c = torch.as_tensor(coef, dtype=torch.float64, device=X.device)
    sq = 0.0
    for s in slices:
        d[s] = c @ X[:, s]
        sq += float(d[s] @ d[s])
    return math.sqrt(float(total(sq)))


def _solve_group(layers: list[int], K: np.ndarray, m: int, h: np.ndarray) -> GroupSolution:
    """The QP of one layer group from its Gram ``K`` (n, n): rows, normalisation, solve."""
    n = K.shape[0]
    norms = np.sqrt(np.clip(np.diag(K), 0.0, None))
    mu = float(norms[:m].mean())
    if mu == 0.0:                       # no selected client has a gradient here
        return GroupSolution(layers, np.zeros(n), np.zeros(0), "empty", False, 0.0, 0.0)
    scale = np.divide(mu, norms, out=np.zeros(n), where=norms > 0)
    fair = _fair_row(K[:m, :m], scale[:m], h, mu)
    S = _row_matrix(scale, m, fair)     # (r, n): Q = S X
    lam, status, _ = solve_simplex_qp(S @ K @ S.T)
    return GroupSolution(layers, S.T @ lam, lam, status, fair is not None, mu, 0.0)


def _row_matrix(scale: np.ndarray, m: int, fair: np.ndarray | None) -> np.ndarray:
    """Rows of Q as combinations of X's rows: the selected clients' normalised slices, the fair
    row (if any), the history's normalised slices; zero slices are left out."""
    live = np.flatnonzero(scale > 0)
    cur, hist = live[live < m], live[live >= m]
    S = np.zeros((len(live) + (fair is not None), len(scale)))
    S[np.arange(len(cur)), cur] = scale[cur]
    if fair is not None:
        S[len(cur), :m] = fair
    S[np.arange(len(S) - len(hist), len(S)), hist] = scale[hist]
    return S


def _fair_row(Kc: np.ndarray, scale: np.ndarray, h: np.ndarray, mu: float) -> np.ndarray | None:
    """Coefficients (m,) of ``p_l = sum_k h_k ĝ_{k,l}`` rescaled to ``mu``, or None if p_l ~ 0."""
    a = h * scale
    bound = float(np.abs(h).sum()) * mu        # ||p_l|| <= sum |h_k| mu
    norm = math.sqrt(max(float(a @ Kc @ a), 0.0))
    if bound == 0.0 or norm <= FAIR_TOL * bound:
        return None
    return a * (mu / norm)


#: the checkpoint keys of the history ring (the layout FedLF has always written); superseded
#: rows are freed at once, so no ``latest`` flags
_RING_KEYS = {"rounds": "history_rounds", "sizes": "history_sizes",
              "ids": "history_client_ids", "rows": "history_rows"}


@register("fedlf")
class FedLF(Aggregator):
    """FedLF aggregation (Pan et al., AAAI 2024), layer-wise Gram form; ALGORITHMS.md §5.

    Args:
        zero_tol: > 0, the zero test of a layer direction (``||d_l|| <= zero_tol mu_l``);
            default 1e-8 (see the module docstring for why not 1e-12).
        seed: unused (nothing is drawn); kept for the common constructor.

    After each ``aggregate``: ``last_direction`` (:class:`Direction`; its ``groups`` show
    merged layers), ``last_tau``, ``last_history_ids`` (the absent clients whose rows joined),
    ``last_fallback`` (the conflict fallback fired) describe the round.

    Raises:
        ValueError: zero_tol out of range; in ``aggregate``, a round not after the previous one,
            a changed dimension, layers that do not tile the model, non-finite losses.
    """

    #: layer Grams summed over shards; the ring holds this shard's columns
    needs = Needs(shards=Shards(state=("history_rows",)))

    @classmethod
    def memory_rows(cls, p: Any, *, num_clients: int, per_round: int,
                    rounds: int) -> StateRows:
        """Its history: the latest gradient of each absent client, up to min(K, rounds x m)
        rows (:class:`~mpifl.aggregators.needs.MemoryRows`)."""
        rows = min(num_clients, rounds * per_round)
        return StateRows("data.num_clients", f"FedLF's history of up to {rows:,} absent "
                         "clients' gradients", rows)

    def __init__(self, *, zero_tol: float = ZERO_TOL, seed: int = 0) -> None:
        super().__init__(seed=seed)
        if isinstance(zero_tol, bool) or not isinstance(zero_tol, (int, float)) \
                or not 0 < zero_tol < 1:
            raise ValueError(f"fedlf: zero_tol must be in (0, 1), got {zero_tol!r}")
        self.zero_tol = float(zero_tol)
        self._seen: dict[int, int] = {}      # client -> round of its latest gradient
        self._ring = HistoryRing("fedlf")    # absent clients' latest gradients g = u / lr
        # (on a sharded server: this shard's columns of them)
        self._m_ref = 0                      # nominal round size: the largest m so far
        self._last_round = -1
        self.last_direction: Direction | None = None
        self.last_tau = 0
        self.last_history_ids = np.zeros(0, dtype=np.int64)
        self.last_fallback = False

    # ---- public -----------------------------------------------------------------------------

    @property
    def history_rows(self) -> int:
        """Gradient rows held for absent clients."""
        return self._ring.num_rows

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``s = lr_t d`` (d,), dtype and device of ``r.updates``."""
        self._check_round(r)
        U, m = r.updates, r.m
        g = U / r.lr
        self._m_ref = max(self._m_ref, m)
        self.last_tau = self._tau(len(self._seen))
        hist = self._history(r.round, r.client_ids, self.last_tau)
        X = torch.cat([g, hist.rows]) if hist.rows is not None else g
        direction = fedlf_direction(X, m, r.losses.cpu().numpy(), r.layers, self.zero_tol,
                                    None if r.shards is None else r.total)
        d = self._rescale(direction.d, g, r)
        self.last_direction, self.last_history_ids = direction, hist.ids
        self._record(r, g)
        return (r.lr * d).to(dtype=U.dtype)

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """Counters, the clients seen (sorted by id) and the history blocks as flat arrays:
        ``history_rows`` (N, d) stacks the blocks' rows, ``history_sizes`` (B,) splits it."""
        ids = np.array(sorted(self._seen), dtype=np.int64)
        return {
            "zero_tol": self.zero_tol, "seed": self.seed, "last_round": self._last_round,
            "m_ref": self._m_ref, "seen_ids": ids,
            "seen_rounds": np.array([self._seen[int(k)] for k in ids], dtype=np.int64),
            **self._ring.state_dict(**_RING_KEYS),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (rows land on the CPU and move to the updates'
        device on the next round).

        Raises:
            ValueError: missing keys, inconsistent arrays, or a different ``zero_tol``.
        """
        keys = {"zero_tol", "seed", "last_round", "m_ref", "seen_ids", "seen_rounds",
                *_RING_KEYS.values()}
        if missing := keys - set(state):
            raise ValueError(f"fedlf state is missing {sorted(missing)}")
        if float(state_scalar(state["zero_tol"])) != self.zero_tol:
            raise ValueError(f"fedlf state was saved with zero_tol={state_scalar(state['zero_tol'])}, "
                             f"this aggregator has zero_tol={self.zero_tol}")
        seen_ids = np.asarray(state["seen_ids"], dtype=np.int64)
        seen_rounds = np.asarray(state["seen_rounds"], dtype=np.int64)
        if len(seen_ids) != len(seen_rounds):
            raise ValueError("fedlf state: arrays have inconsistent lengths")
        self._ring.load_state_dict(state, **cast(RingKeys, _RING_KEYS))
        self._seen = {int(k): int(t) for k, t in zip(seen_ids, seen_rounds)}
        self._m_ref = int(state_scalar(state["m_ref"]))
        self._last_round = int(state_scalar(state["last_round"]))

    def __repr__(self) -> str:
        return f"FedLF(zero_tol={self.zero_tol}, seed={self.seed})"

    # ---- steps ------------------------------------------------------------------------------

    def _rescale(self, d: torch.Tensor, g: torch.Tensor, r: RoundUpdates) -> torch.Tensor:
        """``d * ||mean g|| / ||d||`` (float64), or d itself if it conflicts (ALGORITHMS.md §5.7);
        norms and dots over every shard's coordinates."""
        self.last_fallback = False
        dn = float(r.norm(d))
        if dn == 0.0:
            return d
        g64 = g.to(torch.float64)
        target = float(r.norm(g64.mean(dim=0)))
        scaled = d * (target / dn)
        dots = r.dots(g64, scaled)
        bound = CONFLICT_TOL * r.norm(g64, dim=1) * float(r.norm(scaled))
        if bool((dots < -bound).any()):
            self.last_fallback = True
            return d
        return scaled

    # ---- history ----------------------------------------------------------------------------

    def _tau(self, seen: int) -> int:
        """``floor(M / m)`` when ``M > m`` (m the nominal round size), else 0 (no history)."""
        return seen // self._m_ref if seen > self._m_ref else 0

    def _history(self, t: int, selected: np.ndarray, tau: int) -> Selection:
        """The absent clients whose latest gradient is at most tau rounds old (ids, rows),
        oldest round first."""
        return self._ring.absent(selected, since=t - tau)   # tau = 0: no stored round

    def _record(self, r: RoundUpdates, g: torch.Tensor) -> None:
        """Store this round's gradients, free superseded rows and rows no later round can use."""
        self._last_round = r.round
        for k in r.client_ids:
            self._seen[int(k)] = r.round
        self._ring.supersede(r.client_ids, free=True)
        # No later round t' uses a round before t+1-T, T = floor(M/m) now: at most m new clients
        # join per round and m only grows, so tau grows by at most 1 per round (docstring).
        horizon = r.round + 1 - len(self._seen) // self._m_ref
        self._ring.push(r.round, r.client_ids, g, horizon=horizon)    # g is a fresh tensor

    def _check_round(self, r: RoundUpdates) -> None:
        check_round_order("fedlf", r.round, self._last_round)
        self._ring.prepare(r.d, r.updates.device, r.updates.dtype)
