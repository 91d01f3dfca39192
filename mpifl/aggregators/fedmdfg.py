"""FedMDFG — Pan et al., "FedMDFG: Federated Learning with Multi-Gradient Descent and Fair
Guidance", AAAI 2023 (authors' code: github.com/zibinpan/FedMDFG,
``fedplat/algorithm/FedMDFG/FedMDFG.py`` and ``fedplat/algorithm/common/utils.py``
(``get_fedmdfg_d``)); ALGORITHMS.md §7, in Gram space.

One round, with ``g_k = u_k / lr_t`` the selected clients' full-batch gradients at ``w^t`` (the
job runs E = 1, B = 0) and ``l_k`` their losses at ``w^t``:

1. **Loss tracking** (reference code). Each client keeps an expected loss: its first loss, then
   the running mean ``(exp * joins + l) / (joins + 1)`` over the rounds in which its loss did not
   exceed the expectation (``joins`` counts every participation, including rounds in which the
   loss rose and the mean was not updated). A client *rose* when ``l_k > exp_k``. The guidance
   is forced when ``0 < #rose < m`` (m = the round's clients, live or not): "some client's loss
   rose", and — as in the reference code — not when every client's loss rose.
2. **Live clients.** Clients with ``||g_k|| <= 1e-6`` (absolute, as in the reference code) are
   left out of everything below (their rows, losses, and the line-search test). If no client is
   live, the step is 0 (no ``loss_at`` call) and the absent-client rows stay those of the last
   round that had live clients, as in the reference code.
3. **Rescaling.** ``ĝ_k = g_k * mu / ||g_k||`` with ``mu`` the mean live gradient norm.
4. **Fair guidance.** ``L`` the live losses, ``L̂ = L / ||L||``, ``e = 1 / sqrt(n)``; the angle
   between L and 1 is ``arccos(e · L̂)`` in degrees. If it exceeds ``theta`` or the guidance is
   forced (step 1), the row ``p = h^T Ĝ`` with ``h = normalise((e · L̂) L̂ - e)`` joins the QP
   (not rescaled: as in the reference code and ALGORITHMS.md §7). When L is parallel to 1 (or
   ``||L|| = 0``, or n = 1) h is undefined (the reference code divides by 0) and no fair row is
   added.
5. **Absent clients.** The live clients of the last round that are not selected now join with
   their last round's rescaled gradients (at that round's ``mu``, as the reference code keeps
   them; ALGORITHMS.md §7: "clients present last round but absent now join as rows").
6. **QP.** ``min ||λ^T Q||^2`` over the simplex (cvxopt via
   :func:`~mpifl.aggregators.qp.solve_simplex_qp`), ``Q`` = [live ĝ; p; absent rows];
   ``d0 = λ^T Q``.
7. **Rescale** ``d = d0 * ||(1/n) sum_k ĝ_k|| / ||d0||`` (the reference code's ``g_norm``: the
   norm of the mean of the rescaled gradients). If some row of Q then conflicts with d
   (``q · d < -1e-6 ||q|| ||d||``, numerically only: the min-norm point has ``q · d0 >= ||d0||^2``
   for every row) the unscaled ``d0`` is used instead. The reference code's test is absolute
   (``max(-Q d) > 1e-6``) and halves d while it is more than twice ``||d0||``; the relative
   test does not depend on the gradients' scale.
8. **Line search** over ``eta = 2^s lr, 2^(s-1) lr, ..., 0.5^s lr`` (largest first); when
   absent-client rows joined (the reference's ``same_user_flag`` is false) it starts at ``lr``.
   The first ``eta`` with ``l_k(w^t - eta d) <= l_k - beta eta max(ĝ_k · d, 0)`` for every live
   client (``beta = 1e-4``) is taken; the step is ``s = eta d``.
   **Fallback** (reference code) when no candidate passes: the first (largest) candidate whose
   sum of live losses is below the current sum; else the candidate with the smallest sum; if
   every candidate gave non-finite losses, the step is 0.

**Calls to** ``r.loss_at`` **per round:** at most ``2 s + 1`` (11 with s = 5) when no
absent-client row joined, at most ``s + 1`` otherwise; 0 when no client is live or ``d0 = 0``.
Each call asks the workers for the live clients' training losses at one candidate (the
accepted step is the last candidate evaluated or one evaluated earlier; no extra call).

**Where this follows the reference code rather than the paper, or departs from both:**

- Armijo test: the reference code accepts ``l_0 - l >= eta beta c`` with ``c = -(ĝ · d)``, which
  lets each loss *rise* by up to ``beta eta ĝ_k · d``; here the sign is the usual Armijo one
  (every live client's loss must fall, as ALGORITHMS.md §7 says), and the directional term uses the
  rescaled gradients ``ĝ_k`` as the reference code does.
- Range: ``2^s lr ... 0.5^s lr`` (ALGORITHMS.md §7). The reference code lowers the end to
  ``0.5^s lr / scale`` (``scale = ||d|| / ||d0|| >= 1``), which adds ``log2(scale)`` candidates
  (unbounded as ``d0 -> 0``); the fixed range bounds the calls.
- Under guidance the reference code also asks the cosine between the new losses and 1 to
  grow, but compares with ``l_0 · e / (sum(l_0) ||e||) = 1/sqrt(n)`` (sum, not norm), which
  the cosine of every non-negative loss vector with at least two non-zero entries exceeds: the
  test is vacuous and left out.
- The reference code multiplies every row by ``||q|| / (||q|| + 1e-6)`` before the QP (a
  near-identity guard against division by zero) and shuffles the history rows' norms (all equal,
  so it changes nothing); neither is done here.
- ``d0`` counts as zero when ``||d0|| <= 1e-8 mu`` (the QP resolves a hull that contains 0 only
  to ~1e-10 mu): the step is then 0 with no line search (the reference code divides by
  ``||d0||``).

**Gram form.** With ``X = [U; H]`` (the round's m updates and the absent clients' stored
updates, upcast to float64), every QP row is a combination ``Q = S X`` (S holds the rescalings
and h), so one GEMM ``K = X X^T`` gives ``P = S K S^T``, the norms, ``||mean ĝ||`` and the
dots ``Q d0 = P λ``; one GEMV ``v = (rho S^T λ) X`` gives d. Candidates are ``(eta v)`` cast to
the updates' dtype, and the returned step is exactly the candidate that was evaluated.

**State** (``state_dict``; the history is a one-round
:class:`~mpifl.aggregators.history.HistoryRing`): the last round's live client ids, their
updates (m x d, dtype of the updates) and rescaling coefficients (history row = coef *
update), and for every client seen its expected loss and participation count: O(m d + K).

Defaults: ``theta = 11.25`` degrees (pi/16, the paper's and the reference code's), ``s = 5``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import Aggregator, RoundUpdates, check_round_order, register
from mpifl.aggregators.needs import BenchSpec, Needs, StateRows
from mpifl.aggregators.gram import gram
from mpifl.aggregators.history import HistoryRing
from mpifl.aggregators.qp import solve_simplex_qp
from mpifl.core.params import Params

LIVE_TOL = 1e-6          # a client is live when ||g_k|| > LIVE_TOL (absolute, reference code)
ZERO_TOL = 1e-8          # d0 is zero when ||d0|| <= ZERO_TOL * mu
PARALLEL_TOL = 1e-12     # no fair row when sin(angle(L, 1)) <= PARALLEL_TOL
CONFLICT_TOL = 1e-6      # relative conflict test after rescaling (step 7)
ARMIJO_BETA = 1e-4       # the reference code's beta

#: the checkpoint keys of the one-round history ring (the layout FedMDFG has always written)
_RING_KEYS = {"ids": "last_ids", "rows": "last_rows", "coef": "last_coef"}


def loss_angle(losses: Any) -> float:
    """The angle in degrees between the loss vector and ``1`` (0 when ``||L|| = 0``)."""
    L = np.asarray(losses, dtype=np.float64).reshape(-1)
    norm = float(np.linalg.norm(L))
    if L.size == 0 or norm == 0.0:
        return 0.0
    cos = float(L.sum() / (norm * math.sqrt(L.size)))
    return math.degrees(math.acos(min(1.0, max(-1.0, cos))))


def guidance_weights(losses: Any) -> np.ndarray | None:
    """``h = normalise((e · L̂) L̂ - e)`` (unit norm, ``h ⟂ L``), or None when undefined (L
    parallel to 1 up to ``sin <= 1e-12``, ``||L|| = 0``, or a single loss)."""
    L = np.asarray(losses, dtype=np.float64).reshape(-1)
    norm = float(np.linalg.norm(L))
    if L.size < 2 or norm == 0.0:
        return None
    unit = L / norm
    e = np.full(L.size, 1.0 / math.sqrt(L.size))
    b = (e @ unit) * unit - e                 # ||b|| = sin(angle(L, 1))
    nb = float(np.linalg.norm(b))
    return None if nb <= PARALLEL_TOL else b / nb


def candidate_rates(lr: float, s: int, same_users: bool) -> list[float]:
    """The line search's step sizes, largest first: ``2^s lr ... 0.5^s lr`` when no absent
    client joined, else ``lr ... 0.5^s lr`` (exact powers of two times lr)."""
    top = s if same_users else 0
    return [lr * 2.0 ** (top - j) for j in range(top + s + 1)]


@register("fedmdfg")
class FedMDFG(Aggregator):
    """FedMDFG aggregation (Pan et al., AAAI 2023), Gram form with a line search; ALGORITHMS.md §7.

    Args:
        theta: the fairness angle in degrees, ``0 < theta < 90``; default 11.25 (pi/16).
        s: ``>= 0``, the line search's range ``2^s lr ... 0.5^s lr``; default 5.
        seed: unused (nothing is drawn); kept for the common constructor.

    ``aggregate`` needs ``RoundUpdates.loss_at`` (the server's evaluation-only request); it
    calls it at most ``2 s + 1`` times per round (see the module docstring).

    After each ``aggregate`` these describe the round: ``last_angle`` (degrees, live losses),
    ``last_rose`` (clients whose loss exceeded their expectation), ``last_forced``,
    ``last_guidance`` (the fair row joined the QP), ``last_live`` (ids of the live clients),
    ``last_history_ids`` (absent clients whose rows joined), ``last_lambda``, ``last_status``
    (the QP status, or ``"no live client"`` / ``"zero direction"``), ``last_direction`` (d,
    float64 tensor, the rescaled direction; None without one), ``last_conflict_fallback``,
    ``last_dots`` (``ĝ_k · d`` of the live clients), ``last_rates`` and ``last_trials``
    ((rate, live losses) per ``loss_at`` call), ``last_rate`` (0.0 for a zero step) and
    ``last_search`` (``"armijo"``, ``"sum"``, ``"min_sum"``, ``"none"`` or ``"skipped"``).

    Raises:
        ValueError: theta or s out of range; in ``aggregate``, no ``loss_at``, a round not after
            the previous one, a changed dimension, non-finite losses, or ``loss_at`` returning
            the wrong shape.
    """

    needs = Needs(shards_note="its line search asks the clients for their losses at trial "
                              "models in the middle of the aggregation, which the shards' "
                              "protocol does not carry")

    last_lambda: np.ndarray | None
    last_status: str | None
    last_direction: torch.Tensor | None

    class Params(Params):
        theta: float = Field(11.25, gt=0.0, lt=90.0)
        """Angle in degrees between the loss vector and 1 above which the fair guidance joins."""
        s: int = Field(5, ge=0, le=20)
        """The line search tries step scales 2^s .. 0.5^s; 0: no line search."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.theta, self.s = self.params.theta, self.params.s
        self._expected: dict[int, float] = {}     # client -> expected loss
        self._joins: dict[int, int] = {}          # client -> participations
        # one round: the last live clients' raw updates; history row = coef * update
        self._ring = HistoryRing("fedmdfg", scalars={"coef": np.float64})
        self._last_round = -1
        self._reset_diagnostics()

    @classmethod
    def bench_inputs(cls) -> BenchSpec:
        """The benchmarks give it a synthetic ``loss_at`` probe (:class:`~mpifl.aggregators.
        needs.BenchInputs`)."""
        return BenchSpec(loss_at=True)

    @classmethod
    def memory_rows(cls, p: Params, *, num_clients: int, per_round: int,
                    rounds: int) -> StateRows:
        """Its last round of m updates (:class:`~mpifl.aggregators.needs.MemoryRows`)."""
        return StateRows("server.clients_per_round",
                         f"FedMDFG's last round of {per_round:,} updates", per_round)

    # ---- public -----------------------------------------------------------------------------

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``eta d`` (d,), dtype and device of ``r.updates``."""
        if r.loss_at is None:
            raise ValueError("fedmdfg: the line search needs the clients' losses at candidate "
                             "weights, but RoundUpdates.loss_at is None (the server must "
                             "provide the evaluation-only request)")
        check_round_order("fedmdfg", r.round, self._last_round)
        self._ring.prepare(r.d, r.updates.device, r.updates.dtype)
        losses = r.losses.double().cpu().numpy()
        if not np.isfinite(losses).all():
            raise ValueError("fedmdfg: losses must be finite")
        self._reset_diagnostics()
        U, m = r.updates, r.m
        zero = torch.zeros(r.d, dtype=U.dtype, device=U.device)

        self.last_rose = self._track_losses(r.client_ids, losses)
        self.last_forced = 0 < self.last_rose < m
        self._last_round = r.round

        hist = self._ring.absent(r.client_ids)
        self.last_history_ids = hist.ids
        X = (torch.cat([U, hist.rows]) if hist.rows is not None else U).to(torch.float64)
        K = gram(X)                                             # the one O(n^2 d) product
        norms = np.sqrt(np.clip(np.diag(K), 0.0, None))
        live = np.flatnonzero(norms[:m] / r.lr > LIVE_TOL)
        self.last_live = r.client_ids[live]
        if len(live) == 0:
            self.last_status, self.last_search = "no live client", "skipped"
            return zero

        n, N = len(live), X.shape[0]
        mu = float(norms[live].mean()) / r.lr                   # mean gradient norm
        a = np.zeros(N)
        a[live] = mu / norms[live]                              # ĝ_k = a_k u_k
        L = losses[live]
        self.last_angle = loss_angle(L)
        h = guidance_weights(L) if (self.last_angle > self.theta or self.last_forced) else None
        self.last_guidance = h is not None

        S = np.zeros((n + (h is not None) + len(hist), N))
        S[np.arange(n), live] = a[live]
        if h is not None:
            S[n, live] = h * a[live]
        S[np.arange(N - m) + n + (h is not None), np.arange(m, N)] = hist.scalars["coef"]
        P = S @ K @ S.T
        lam, self.last_status, _ = solve_simplex_qp(P)
        self.last_lambda = lam
        dots0 = P @ lam                                         # q_i · d0
        d0 = math.sqrt(max(float(lam @ dots0), 0.0))
        self._record(r, live, a)
        if d0 <= ZERO_TOL * mu:
            self.last_status, self.last_search = "zero direction", "skipped"
            return zero

        ab = a / n
        rho = math.sqrt(max(float(ab @ K @ ab), 0.0)) / d0      # ||mean ĝ|| / ||d0||
        rownorm = np.sqrt(np.clip(np.diag(P), 0.0, None))
        if bool((dots0 < -CONFLICT_TOL * rownorm * d0).any()):
            rho, self.last_conflict_fallback = 1.0, True
        self.last_dots = rho * dots0[:n]
        coef = torch.as_tensor(rho * (S.T @ lam), dtype=torch.float64, device=X.device)
        v = coef @ X                                            # d, the one GEMV out
        self.last_direction = v
        rate = self._line_search(r, live, L, v, same_users=not len(hist))
        self.last_rate = rate
        return (rate * v).to(U.dtype) if rate > 0 else zero

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """The last round's live clients (ids, updates, rescaling coefficients) and every seen
        client's expected loss and participation count (sorted by id)."""
        ids = np.array(sorted(self._expected), dtype=np.int64)
        return {
            "last_round": self._last_round,
            "loss_ids": ids,
            "loss_expected": np.array([self._expected[int(k)] for k in ids], dtype=np.float64),
            "loss_joins": np.array([self._joins[int(k)] for k in ids], dtype=np.int64),
            **self._ring.state_dict(**_RING_KEYS),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (rows land on the CPU and move to the updates'
        device on the next round).

        Raises:
            ValueError: missing keys or inconsistent arrays.
        """
        keys = {"last_round", "loss_ids", "loss_expected", "loss_joins", *_RING_KEYS.values()}
        if missing := keys - set(state):
            raise ValueError(f"fedmdfg state is missing {sorted(missing)}")
        ids = np.asarray(state["loss_ids"], dtype=np.int64).reshape(-1)
        exp = np.asarray(state["loss_expected"], dtype=np.float64).reshape(-1)
        joins = np.asarray(state["loss_joins"], dtype=np.int64).reshape(-1)
        if not (len(ids) == len(exp) == len(joins)):
            raise ValueError("fedmdfg state: arrays have inconsistent lengths")
        # the round of the stored rows is not saved (nothing uses it): any round before the next
        self._ring.load_state_dict(state, **_RING_KEYS, default_round=-1)
        self._expected = {int(k): float(x) for k, x in zip(ids, exp)}
        self._joins = {int(k): int(j) for k, j in zip(ids, joins)}
        self._last_round = int(np.asarray(state["last_round"]).item())

    def __repr__(self) -> str:
        return f"FedMDFG(theta={self.theta}, s={self.s}, seed={self.seed})"

    # ---- steps ------------------------------------------------------------------------------

    def _track_losses(self, ids: np.ndarray, losses: np.ndarray) -> int:
        """Update the expected losses (reference code); return how many clients rose."""
        rose = 0
        for k, l in zip(ids.tolist(), losses.tolist()):
            joins = self._joins.get(k, 0)
            if joins == 0:
                self._expected[k] = l
            elif l <= self._expected[k]:
                self._expected[k] = (self._expected[k] * joins + l) / (joins + 1)
            else:
                rose += 1
            self._joins[k] = joins + 1
        return rose

    def _record(self, r: RoundUpdates, live: np.ndarray, a: np.ndarray) -> None:
        """Keep this round's live clients' updates as next round's absent-client rows."""
        rows = r.updates[torch.as_tensor(live, device=r.updates.device)]   # a fresh copy
        self._ring.push(r.round, r.client_ids[live], rows, horizon=r.round, coef=a[live])

    def _line_search(self, r: RoundUpdates, live: np.ndarray, l0: np.ndarray,
                     v: torch.Tensor, same_users: bool) -> float:
        """The accepted step size (0.0: no step), after at most ``2 s + 1`` ``loss_at`` calls."""
        loss_at = r.loss_at
        assert loss_at is not None  # aggregate() refuses a round without it
        rates = candidate_rates(r.lr, self.s, same_users)
        cpos = np.maximum(self.last_dots, 0.0)
        sums = []
        for rate in rates:
            got = loss_at((rate * v).to(r.updates.dtype))
            out = (got.detach().double().cpu().numpy() if isinstance(got, torch.Tensor)
                   else np.asarray(got, dtype=np.float64))
            if out.shape != (r.m,):
                raise ValueError(f"fedmdfg: loss_at must return ({r.m},) losses, got shape "
                                 f"{out.shape}")
            new = out[live]
            self.last_rates.append(rate)
            self.last_trials.append((rate, new))
            total = float(new.sum())
            sums.append(total if math.isfinite(total) else math.inf)
            if bool(np.all(new <= l0 - ARMIJO_BETA * rate * cpos)):
                self.last_search = "armijo"
                return rate
        old = float(l0.sum())
        for rate, total in zip(rates, sums):
            if total < old:
                self.last_search = "sum"
                return rate
        j = int(np.argmin(sums))
        if not math.isfinite(sums[j]):
            self.last_search = "none"
            return 0.0
        self.last_search = "min_sum"
        return rates[j]

    def _reset_diagnostics(self) -> None:
        self.last_angle = 0.0
        self.last_rose = 0
        self.last_forced = False
        self.last_guidance = False
        self.last_live = np.zeros(0, dtype=np.int64)
        self.last_history_ids = np.zeros(0, dtype=np.int64)
        self.last_lambda = None
        self.last_status = None
        self.last_direction = None
        self.last_conflict_fallback = False
        self.last_dots = np.zeros(0)
        self.last_rates: list[float] = []
        self.last_trials: list[tuple[float, np.ndarray]] = []
        self.last_rate = 0.0
        self.last_search = "skipped"
