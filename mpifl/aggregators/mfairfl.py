"""mFairFL, server side — Su, Yu, Wang, Li, Li & Yu, "Multi-dimensional Fair Federated
Learning", AAAI 2024 (arXiv:2312.05551); ALGORITHMS.md §4: the multiplier update (Alg. S1 line 8)
and the gradient curation with EMA similarity goals (Alg. S2, Eq. 15).

**Multipliers.** Clients minimise the Lagrangian ``F_k + sum_a λ_a c_a`` with the λ they received
and report their constraint values ``c_{a,k}(w^t)`` (``RoundUpdates.stats["constraints"]``,
(m, A)); the server then sets ``λ_a <- max(0, λ_a + eta_lambda * sum_k p_k c_{a,k})`` with
``p_k = n_k / sum_{j in S_t} n_j``. :attr:`MFairFL.multipliers` is what to broadcast next round.

**Curation.** ``PO`` = ascending (Lagrangian) loss, ties by client id; the first
``ceil(alpha * m)`` clients of PO are adjusted, the others keep ``u_i``. For an adjusted client i,
``g_i = u_i``; for every j in PO, j != i (targets are always the **original** ``u_j``)::

    phi = cos(g_i, u_j)
    if phi < phi_hat[i, j]:          # Gradient Vaccine's rule (Wang et al., ICLR 2021)
        g_i += u_j * ||g_i|| (phi_hat sqrt(1-phi^2) - phi sqrt(1-phi_hat^2))
                   / (||u_j|| sqrt(1-phi_hat^2))
    phi_hat[i, j] <- (1 - beta) phi_hat[i, j] + beta * phi

``g = (1/m) sum_i g_i`` rescaled to ``||(1/m) sum_k u_k||``; ``w^{t+1} = w^t - g``.

Reading of the paper (GradVac's Algorithm 1, which mFairFL's Alg. S2 and Eq. 15 follow):

- ``phi`` is the cosine of the *partly curated* ``g_i`` (after the adjustments for the targets
  before j in PO) with the original ``u_j``, measured **before** the adjustment for j; the EMA
  takes that same ``phi`` (after the adjustment the cosine would be ``phi_hat`` by construction).
- The goal used by the rule is the value from before the round: each ordered pair is visited at
  most once per round, so updating the EMA at the visit or after the round is the same.
- Goals are per **ordered** pair (i adjusted, j target), as GradVac's ``φ̂_ij`` (not symmetric);
  initial 0. "Visited" = i is adjusted, j != i is in the round: the EMA moves whether or not the
  rule fired; kept (not adjusted) clients visit nothing, so their goals do not move.
- A pair where ``g_i`` or ``u_j`` is the zero vector has no cosine: it is skipped (no
  adjustment, goal unchanged). The cosine is clipped to [-1, 1]. A goal of 1 asks ``g_i`` to be
  parallel to ``u_j``, which no finite step reaches (the rule's norm factor is
  ``sqrt(1-phi^2)/sqrt(1-phi_hat^2)``), so the rule uses ``min(phi_hat, GOAL_MAX)``,
  ``GOAL_MAX = 1 - 1e-6``; the stored EMA is not clipped.
- ``alpha = 0`` adjusts nobody: the step is the plain (unweighted) mean ``(1/m) sum u_k``, returned
  exactly. ``ceil(alpha m)`` is taken after rounding ``alpha m`` to 9 decimals, so that
  ``0.7 * 10 = 7.000000000000001`` adjusts 7 clients, not 8.

**Gram form** (as FedFV's, ALGORITHMS.md §3): ``g_i = u_i + sum_j C_ij u_j``. With ``G = U U^T``
(one GEMM) ``g_i . u_j = (G_ij + sum_k C_ik G_kj)`` and ``||g_i||^2`` follows each step exactly
(``||g + a u_j||^2 = ||g||^2 + 2 a g.u_j + a^2 G_jj``), so all adjusted clients advance together
target by target on m x m float64 numbers (O(m^3)); ``g = (1/m) 1^T (I + C) U`` is one GEMV.

**Goals storage.** Sparse: only ordered pairs that have been visited, as a sorted int64 key
``(i << 32) | j`` (client ids in ``[0, 2^31)``) with float64 values; a round's m x m goals are one
vectorised ``np.searchsorted``, new pairs are merged with one ``np.insert``. Memory is bounded by
the pairs actually visited, never by K^2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from mpifl.metrics import fairness
from mpifl.aggregators.base import (Aggregator, RoundUpdates, _index, check_round_order, register,
                                    state_scalar)
from mpifl.aggregators.fedfv import projection_order, rescale_to_mean
from mpifl.aggregators.needs import BenchSpec, Needs, Shards
from mpifl.core.params import Params

NOTIONS = ("dp", "eo", "ap")
#: the goal the GradVac rule aims at is at most this (a goal of 1 needs an infinite step)
GOAL_MAX = 1.0 - 1e-6
#: client ids must be below this to fit the combined pair key ``(i << 32) | j``
MAX_CLIENT_ID = 2 ** 31
_SHIFT = np.int64(32)
_LOW = np.int64(0xFFFFFFFF)


def num_adjusted(m: int, alpha: float) -> int:
    """Clients that are curated: ``ceil(alpha * m)`` (``alpha * m`` rounded to 9 decimals first,
    so float noise such as ``0.7 * 10 = 7.000000000000001`` does not add a client)."""
    return min(m, math.ceil(round(alpha * m, 9)))


def gradvac_coefficient(norm_g: Any, norm_u: Any, phi: Any, goal: Any) -> Any:
    """GradVac's step size a in ``g <- g + a u`` that turns ``cos(g, u) = phi`` into ``goal``:
    ``a = ||g|| (goal sqrt(1-phi^2) - phi sqrt(1-goal^2)) / (||u|| sqrt(1-goal^2))``.

    Works elementwise on numpy arrays or floats; the caller applies it only where
    ``phi < goal <= GOAL_MAX`` and both norms are > 0 (then a > 0).
    """
    root_goal = np.sqrt(1.0 - goal * goal)
    return norm_g * (goal * np.sqrt(1.0 - phi * phi) - phi * root_goal) / (norm_u * root_goal)


def curation_coefficients(G: np.ndarray, po: np.ndarray, adjusted: np.ndarray,
                          goals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Alg. S2 in Gram form: the m x m matrix C with ``g_i = u_i + sum_j C_ij u_j``.

    Args:
        G: (m, m) float64 Gram matrix ``U U^T``.
        po: (m,) projection order (row positions).
        adjusted: (m,) bool, the clients that are curated (others keep C's row 0).
        goals: (m, m) float64, ``goals[i, j]`` = phi_hat of the ordered pair (row i, row j)
            before the round.

    Returns:
        ``(C, phi, visited)``: C (m, m) float64; phi (m, m) float64, the cosine measured at each
        visited pair (before its adjustment; NaN elsewhere); visited (m, m) bool, the pairs whose
        goal the EMA moves (adjusted i, j != i, neither vector zero).

    Every client is curated against the original targets only and reads only its own goals, so
    advancing all clients together for each target j in PO is the per-client loop reordered.
    """
    m = G.shape[0]
    C = np.zeros((m, m))
    phi_out = np.full((m, m), np.nan)
    visited = np.zeros((m, m), dtype=bool)
    sq = np.clip(np.diag(G).copy(), 0.0, None)            # ||g_i||^2, starts at ||u_i||^2
    eff_goals = np.minimum(goals, GOAL_MAX)
    for j in po:
        gjj = G[j, j]
        if not gjj > 0:                                    # u_j = 0: no cosine with anybody
            continue
        dots = G[:, j] + C @ G[:, j]                       # g_i . u_j for every i at once
        norm_g = np.sqrt(sq)
        act = adjusted & (sq > 0)
        act[j] = False
        if not act.any():
            continue
        phi = np.clip(dots[act] / (norm_g[act] * math.sqrt(gjj)), -1.0, 1.0)
        rows = np.flatnonzero(act)
        phi_out[rows, j] = phi
        visited[rows, j] = True
        goal = eff_goals[rows, j]
        hit = phi < goal
        if hit.any():
            r, p, gl = rows[hit], phi[hit], goal[hit]
            a = gradvac_coefficient(norm_g[r], math.sqrt(gjj), p, gl)
            C[r, j] += a
            sq[r] = np.maximum(sq[r] + 2.0 * a * dots[r] + a * a * gjj, 0.0)
    return C, phi_out, visited


@register("mfairfl")
class MFairFL(Aggregator):
    """mFairFL server (Su et al., AAAI 2024); ALGORITHMS.md §4. See the module docstring.

    Args:
        notion: ``"dp"``, ``"eo"`` or ``"ap"``, the fairness notion (client side; the server only
            checks that EO's constraint count is even).
        eps: >= 0, fairness tolerance (client side: ``c = gap - eps``); kept for the state check.
        eta_lambda: >= 0, step size of the multiplier ascent.
        alpha: in [0, 1], gradient projecting rate: the first ``ceil(alpha m)`` clients of PO
            (lowest losses) are curated (opposite sense to FedFV's alpha).
        beta: in (0, 1], EMA rate of the similarity goals (Eq. 15).
        num_constraints: A, if known (G for dp/ap, 2G for eo; see
            :func:`mpifl.metrics.fairness.num_constraints`); None: sized by the first round that reports
            constraints, and :attr:`multipliers` is empty (meaning zeros) until then.
        num_groups: G, the number of sensitive groups of the data, from which A follows
            (``num_constraints(notion, G)``); what a run passes (``needs.num_groups``).
            Given together with ``num_constraints``, the two must agree.
        seed: unused (nothing is drawn); kept for the common constructor.

    Server contract: pass ``stats={"constraints": (m, A) float}`` in every :class:`RoundUpdates`
    (the values ``c_{a,k}(w^t)`` each client measured before local training) and the Lagrangian
    losses ``l_k`` as ``losses``; broadcast :attr:`multipliers` to the next round's clients. A
    round without ``"constraints"`` leaves the multipliers unchanged (the curation still runs).
    In a run, the client side is :class:`mpifl.clients.LagrangianTrainer` (``needs.trainer``),
    which gets the notion and eps through :meth:`client_options` and λ through
    :meth:`round_inputs` with every TRAIN request.

    State: hyper-parameters, the last round, the goals as ``goal_pairs`` (P, 2) int64 (client
    ids i, j; sorted) with ``goal_values`` (P,) float64, and ``multipliers`` (A,) float64.

    Raises:
        ValueError: a hyper-parameter out of range; in ``aggregate``, a round not after the last
            one, a client id outside ``[0, 2^31)``, a non-finite loss, or constraint values that
            are non-finite, not 2-D, of a changed width, or of odd width for EO.
    """

    #: the run passes ``num_groups=G`` (the sensitive groups of the data) to the constructor;
    #: Lagrangian local training (:class:`mpifl.clients.LagrangianTrainer`); shards: Gram form,
    #: goals and multipliers are per client, no d-sized state
    needs = Needs(num_groups=True, trainer="mfairfl", shards=Shards())

    class Params(Params):
        notion: Literal["dp", "eo", "ap"] = "dp"
        """The group-fairness notion constrained: demographic parity, equalized odds or accuracy
        parity."""
        eps: float = Field(0.05, ge=0.0)
        """Tolerance of each constraint; 0: exact parity asked."""
        eta_lambda: float = Field(0.1, ge=0.0)
        """Step size of the multipliers; 0: they stay at 0 (no fairness pressure)."""
        alpha: float = Field(0.9, ge=0.0, le=1.0)
        """Gradient projecting rate, the share of low-loss clients curated; 0: no curation."""
        beta: float = Field(0.01, gt=0.0, le=1.0)
        """EMA rate of the pairwise similarity goals."""

    def __init__(self, *, num_constraints: int | None = None, num_groups: int | None = None,
                 seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        p = self.params
        self.notion, self.eps, self.eta_lambda, self.alpha, self.beta = (
            p.notion, p.eps, p.eta_lambda, p.alpha, p.beta)
        if num_groups is not None:
            num_groups = _index(num_groups, "mfairfl: num_groups")
            if num_groups < 1:
                raise ValueError(f"mfairfl: needs data with a sensitive attribute (num_groups "
                                 f">= 1), got num_groups={num_groups}")
            from_groups = fairness.num_constraints(self.notion, num_groups)
            if num_constraints is not None and _index(num_constraints, "mfairfl: "
                                                      "num_constraints") != from_groups:
                raise ValueError(f"mfairfl: num_constraints={num_constraints} contradicts "
                                 f"num_groups={num_groups} for notion {self.notion!r}")
            num_constraints = from_groups
        if num_constraints is not None:
            num_constraints = _index(num_constraints, "mfairfl: num_constraints")
            if num_constraints < 1:
                raise ValueError(f"mfairfl: num_constraints must be >= 1, got {num_constraints}")
            self._check_width(num_constraints)
        self._lam = np.zeros(num_constraints or 0)
        self._keys = np.zeros(0, dtype=np.int64)          # sorted (i << 32) | j
        self._values = np.zeros(0, dtype=np.float64)
        self._last_round = -1

    @classmethod
    def client_options(cls, p: Params) -> dict[str, Any]:
        """The client side's Lagrangian needs the notion and the tolerance."""
        return {"fair_notion": p.notion, "fair_eps": p.eps}

    def round_inputs(self) -> np.ndarray:
        """The multipliers λ (A,) float64 broadcast with every TRAIN request (:attr:`multipliers`;
        :class:`~mpifl.aggregators.needs.RoundInputs`)."""
        return self.multipliers

    @classmethod
    def bench_inputs(cls) -> BenchSpec:
        """The benchmarks give it (m, 4) constraint values (DP with 4 groups) and
        ``num_constraints=4`` (:class:`~mpifl.aggregators.needs.BenchInputs`)."""
        return BenchSpec(params={"num_constraints": 4}, stats={"constraints": (4,)})

    # ---- public -----------------------------------------------------------------------------

    @property
    def multipliers(self) -> np.ndarray:
        """(A,) float64 copy of λ, to broadcast to the next round's clients (zeros before the
        first update; (0,) while A is unknown, which means all zeros)."""
        return self._lam.copy()

    @property
    def num_goals(self) -> int:
        """Number of stored similarity goals (ordered pairs visited so far)."""
        return int(self._keys.size)

    def goals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(pairs (P, 2) int64, values (P,) float64)``, sorted by (i, j); copies."""
        return _split(self._keys), self._values.copy()

    def goal(self, i: int, j: int) -> float:
        """phi_hat of the ordered pair (client i, client j); 0 if it never met."""
        k = (np.int64(i) << _SHIFT) | np.int64(j)
        pos = int(np.searchsorted(self._keys, k))
        return float(self._values[pos]) if pos < self._keys.size and self._keys[pos] == k else 0.0

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``s`` (d,), dtype and device of ``r.updates``; then updates goals and λ."""
        check_round_order("mfairfl", r.round, self._last_round)
        ids = r.client_ids
        if ids.min() < 0 or ids.max() >= MAX_CLIENT_ID:
            raise ValueError(f"mfairfl: client ids must be in [0, 2^31), got round {r.round} "
                             f"ids {int(ids.min())} .. {int(ids.max())}")
        losses = r.losses.double().cpu().numpy()
        if not np.isfinite(losses).all():
            k = int(np.argmax(~np.isfinite(losses)))
            raise ValueError(f"mfairfl: round {r.round}: client {int(ids[k])} has loss "
                             f"{losses[k]!r}; the projection order needs finite losses")
        lam = self._next_multipliers(r)                    # validate before changing anything

        U, m = r.updates, r.m
        po = projection_order(ids, losses, "loss", self.seed, r.round)
        adjusted = np.zeros(m, dtype=bool)
        adjusted[po[:num_adjusted(m, self.alpha)]] = True
        if adjusted.any() and m > 1:
            keys = (ids[:, None] << _SHIFT) | ids[None, :]  # (m, m) ordered pair keys
            pos, found = self._lookup(keys.ravel())
            goals: np.ndarray = np.zeros(m * m)
            goals[found] = self._values[pos[found]]
            goals = goals.reshape(m, m)
            G = r.gram(U)  # the only O(m^2 d) work (summed over shards)
            C, phi, visited = curation_coefficients(G, po, adjusted, goals)
            self._store(keys[visited], (1.0 - self.beta) * goals[visited]
                        + self.beta * phi[visited])
        else:
            C = None
        self._lam = lam
        self._last_round = r.round
        if C is None or not C.any():                       # nothing curated: the plain mean
            return U.mean(dim=0)
        a = (1.0 + C.sum(axis=0)) / m                      # g = (1/m) 1^T (I + C) U
        g = torch.as_tensor(a, dtype=U.dtype, device=U.device) @ U
        return rescale_to_mean(g, U, r)

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        return {
            "notion": self.notion, "eps": self.eps, "eta_lambda": self.eta_lambda,
            "alpha": self.alpha, "beta": self.beta, "seed": self.seed,
            "last_round": self._last_round,
            "goal_pairs": _split(self._keys),
            "goal_values": self._values.copy(),
            "multipliers": self._lam.copy(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: missing keys, inconsistent or unsorted goal arrays, hyper-parameters
                that differ from this object's, or a multiplier count that contradicts
                ``num_constraints``.
        """
        need = {"notion", "eps", "eta_lambda", "alpha", "beta", "seed", "last_round",
                "goal_pairs", "goal_values", "multipliers"}
        missing = need - set(state)
        if missing:
            raise ValueError(f"mfairfl state is missing {sorted(missing)}")
        for key in ("notion", "eps", "eta_lambda", "alpha", "beta", "seed"):
            saved = state_scalar(state[key])
            if saved != getattr(self, key):
                raise ValueError(f"mfairfl state was saved with {key}={saved!r}, "
                                 f"this aggregator has {key}={getattr(self, key)!r}")
        pairs = np.asarray(state["goal_pairs"], dtype=np.int64).reshape(-1, 2)
        values = np.asarray(state["goal_values"], dtype=np.float64).reshape(-1)
        lam = np.asarray(state["multipliers"], dtype=np.float64).reshape(-1)
        if pairs.shape[0] != values.shape[0]:
            raise ValueError(f"mfairfl state: {pairs.shape[0]} goal pairs but "
                             f"{values.shape[0]} goal values")
        if pairs.size and (pairs.min() < 0 or pairs.max() >= MAX_CLIENT_ID):
            raise ValueError("mfairfl state: goal pair ids outside [0, 2^31)")
        keys = (pairs[:, 0] << _SHIFT) | pairs[:, 1]
        if keys.size > 1 and not (np.diff(keys) > 0).all():
            raise ValueError("mfairfl state: goal pairs are not sorted and distinct")
        if not (np.isfinite(values).all() and np.isfinite(lam).all() and (lam >= 0).all()):
            raise ValueError("mfairfl state: goals and multipliers must be finite, "
                             "multipliers >= 0")
        if self._lam.size and lam.size != self._lam.size:
            raise ValueError(f"mfairfl state has {lam.size} multipliers, this aggregator "
                             f"expects {self._lam.size}")
        self._keys, self._values, self._lam = keys, values.copy(), lam.copy()
        self._last_round = int(state_scalar(state["last_round"]))

    def __repr__(self) -> str:
        return (f"MFairFL(notion={self.notion!r}, eps={self.eps}, eta_lambda={self.eta_lambda}, "
                f"alpha={self.alpha}, beta={self.beta}, seed={self.seed})")

    # ---- internals --------------------------------------------------------------------------

    def _check_width(self, width: int) -> None:
        if self.notion == "eo" and width % 2:
            raise ValueError(f"mfairfl: equalized odds has 2 constraints per group, got an odd "
                             f"count {width}")

    def _next_multipliers(self, r: RoundUpdates) -> np.ndarray:
        """λ after this round: ``max(0, λ + eta_lambda * sum_k p_k c_k)``; unchanged if the round
        carries no ``"constraints"``."""
        stat = r.stats.get("constraints")
        if stat is None:
            return self._lam
        c = stat.double().cpu().numpy()
        if c.ndim != 2 or c.shape[1] < 1:
            raise ValueError(f"mfairfl: stats['constraints'] must be (m, A) with A >= 1, got "
                             f"shape {c.shape}")
        width = c.shape[1]
        if self._lam.size and width != self._lam.size:
            raise ValueError(f"mfairfl: round {r.round} reports {width} constraint values per "
                             f"client, expected {self._lam.size}")
        self._check_width(width)
        bad = ~np.isfinite(c).all(axis=1)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"mfairfl: round {r.round}: client {int(r.client_ids[k])} reports "
                             f"non-finite constraint values")
        n = r.num_samples.cpu().numpy().astype(np.float64)
        total = n.sum()
        p = n / total if total > 0 else np.full(r.m, 1.0 / r.m)
        lam = self._lam if self._lam.size else np.zeros(width)
        return np.maximum(0.0, lam + self.eta_lambda * (p @ c))

    def _lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of ``keys`` in the sorted store and whether each is there."""
        pos = np.searchsorted(self._keys, keys)
        found = pos < self._keys.size
        found[found] = self._keys[pos[found]] == keys[found]
        return pos, found

    def _store(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Set the goals of ``keys`` (distinct), inserting the pairs not stored yet."""
        pos, found = self._lookup(keys)
        self._values[pos[found]] = values[found]
        new = ~found
        if new.any():
            order = np.argsort(keys[new])                  # equal insert positions keep order
            nk, nv, npos = keys[new][order], values[new][order], pos[new][order]
            self._keys = np.insert(self._keys, npos, nk)
            self._values = np.insert(self._values, npos, nv)


def _split(keys: np.ndarray) -> np.ndarray:
    """(P,) combined keys -> (P, 2) client id pairs."""
    return np.stack([keys >> _SHIFT, keys & _LOW], axis=1).astype(np.int64).reshape(-1, 2)

