"""AFL — Agnostic Federated Learning: Mohri, Sivek & Suresh, "Agnostic Federated Learning",
ICML 2019 (arXiv:1902.00146), Stochastic-AFL (Algorithm 1); ALGORITHMS.md §7.

Every client takes part in every round. The server keeps mixture weights ``λ`` over all K clients,
starting at ``1/K``; in round t

    s = sum_k λ_k u_k,        then   λ <- proj_simplex(λ + eta_lambda * l)

where ``l_k`` is client k's loss of the global model ``w^t`` (the gradient of the λ-mixed loss
with respect to λ; projected gradient ascent) and ``proj_simplex`` is the sort-based Euclidean
projection onto the probability simplex. As in the paper (and the FedFV authors' easyFL code,
``result_model``), the model that is **evaluated** is the running average of the global iterates
after each step, ``w̄^t = (1/t) sum_{i=1..t} w^i`` (``w^0`` excluded); the model that is trained
on stays ``w^t``. The paper also averages the λ iterates as an output; nothing uses that, so it is
not kept.

Server contract (the aggregator never sees ``w``, so the server reports it):

1. each round: ``s = agg.aggregate(r)``, ``w = w - s``, then ``agg.observe_params(w)`` exactly
   once with the new global parameters, before that round's checkpoint is written (also in a
   round where the server skipped ``aggregate`` because no update was left: ``w`` repeats);
2. to evaluate: ``agg.evaluation_params(w)`` (with the current ``w``) returns the parameters to
   evaluate — the running average — instead of ``w``;
3. ``num_clients=K`` should be passed at construction (λ covers all K clients); with the default
   None, K is the first round's m, and that round must then hold exactly the clients ``0..m-1``.

Every round selects all clients (``server.sampling = "all"``). If some of them are missing from
``r`` anyway (client dropout, or updates the server rejected) — a case the paper does not
covers — the step uses the present clients' weights renormalised,
``s = sum_{k in S_t} λ_k u_k / sum_{k in S_t} λ_k`` (``s = 0`` if that sum is 0: λ puts no weight on
any present client), and only the present clients' losses enter the ascent on λ (absent clients
get a zero gradient entry). With every client present this is exactly the formula above.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import (Aggregator, RoundUpdates, check_num_clients,
                                    check_round_order, register, state_scalar)
from mpifl.aggregators.needs import Needs
from mpifl.aggregators.qfedavg import check_losses
from mpifl.core.params import Params


def project_simplex(v: Any) -> np.ndarray:
    """Euclidean projection of ``v`` onto ``{x >= 0, sum x = 1}``, sort-based, O(K log K).

    With ``u`` = v sorted descending, ``rho = max{j : u_j - (sum_{i<=j} u_i - 1) / j > 0}`` and
    ``theta = (sum_{i<=rho} u_i - 1) / rho``; the projection is ``max(v - theta, 0)``
    (Held, Wolfe & Crowder 1974; Wang & Carreira-Perpiñán 2013).
    """
    v = np.asarray(v, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.isfinite(v).all():
        raise ValueError("project_simplex: v must be a non-empty 1-D finite vector")
    u = np.sort(v)[::-1]
    css = np.cumsum(u)
    j = np.arange(1, v.size + 1)
    rho = int(j[u - (css - 1.0) / j > 0][-1])       # j = 1 always qualifies
    theta = (css[rho - 1] - 1.0) / rho
    return np.maximum(v - theta, 0.0)


@register("afl")
class AFL(Aggregator):
    """Agnostic FL aggregation (Mohri et al., ICML 2019); ALGORITHMS.md §7. See the module docstring
    for the server contract (``observe_params`` / ``evaluation_params``).

    Args:
        eta_lambda: ``>= 0``, step size of the ascent on λ (0 keeps λ uniform). Default 0.01
            (the reference code's ``learning_rate_lambda``).
        num_clients: K, the number of clients λ covers (the server passes it); None: the first
            round's m.
        seed: unused (nothing is drawn); kept for the common constructor.

    State (``state_dict``): λ (K,) float64, the last aggregated round, and the running sum of the
    observed iterates (d,) float64 with their count — a resumed run continues bit for bit.

    Raises:
        ValueError: eta_lambda or num_clients out of range; in ``aggregate``, a round that is not
            later than the previous one, a client id outside ``0 .. K-1`` (or, with
            ``num_clients=None``, a first round that is not ``0 .. m-1``), a negative or
            non-finite loss; in ``observe_params``, a changed parameter size.
    """

    needs = Needs(num_clients=True, all_clients=True,
                  shards_note="its running sum of the global models (d,) for evaluation lives "
                              "on rank 0; not adapted to shards yet")

    class Params(Params):
        eta_lambda: float = Field(0.01, ge=0.0)
        """Step size of the mixture weights lambda; ``eta_lambda = 0`` keeps them uniform."""

    def __init__(self, *, num_clients: int | None = None, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.eta_lambda = self.params.eta_lambda
        self.num_clients = check_num_clients("afl", num_clients)
        self._lam: np.ndarray | None = None
        self._last_round = -1
        self._sum: torch.Tensor | None = None        # float64 sum of observed iterates
        self._count = 0

    # ---- aggregation ------------------------------------------------------------------------

    @property
    def lam(self) -> np.ndarray:
        """(K,) float64 copy of the current mixture weights (uniform before the first round)."""
        if self._lam is None:
            if self.num_clients is None:
                raise ValueError("afl: K is not known before the first round (num_clients=None)")
            return np.full(self.num_clients, 1.0 / self.num_clients)
        return self._lam.copy()

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``sum_k λ_k u_k`` (d,), dtype and device of ``r.updates``; then updates λ."""
        check_round_order("afl", r.round, self._last_round)
        ids = r.client_ids
        if self._lam is None:
            if self.num_clients is None and not np.array_equal(np.sort(ids), np.arange(r.m)):
                raise ValueError(f"afl: num_clients was not given and round {r.round} does not "
                                 f"hold every client 0..{r.m - 1}; pass num_clients=K")
            k = self.num_clients if self.num_clients is not None else r.m
            self._lam = np.full(k, 1.0 / k)
        K = self._lam.size
        if ids.min() < 0 or ids.max() >= K:
            raise ValueError(f"afl: round {r.round} has client ids outside 0..{K - 1}")
        losses = check_losses(r, "afl")
        weights = self._lam[ids]
        if r.m < K:                                   # dropout / rejected updates: renormalise
            total = weights.sum()
            weights = weights / total if total > 0 else np.zeros(r.m)
        s = torch.as_tensor(weights, dtype=r.updates.dtype, device=r.updates.device) @ r.updates
        v = self._lam.copy()
        v[r.client_ids] += self.eta_lambda * losses
        self._lam = project_simplex(v)
        self._last_round = r.round
        return s

    # ---- evaluated model --------------------------------------------------------------------

    @torch.no_grad()
    def observe_params(self, w: torch.Tensor) -> None:
        """Record the global parameters ``w^{t+1}`` at the end of round t.

        Call exactly once per round, after ``w <- w - s`` (also in a round whose step was
        skipped, e.g. every client dropped out: the iterate then repeats) and before that
        round's checkpoint is written. ``w`` is not modified or kept (a float64 running sum is).

        Raises:
            ValueError: ``w``'s size changed.
        """
        w64 = w.detach().reshape(-1).to(torch.float64)
        if self._sum is None:
            self._sum = w64.clone()
        else:
            if self._sum.numel() != w64.numel():
                raise ValueError(f"afl: parameter size changed from {self._sum.numel()} to "
                                 f"{w64.numel()}")
            self._sum = self._sum.to(w64.device)
            self._sum += w64
        self._count += 1

    @torch.no_grad()
    def evaluation_params(self, w: torch.Tensor) -> torch.Tensor:
        """The parameters to evaluate: the running average ``(1/t) sum_{i=1..t} w^i`` of the
        observed iterates, as a new tensor of ``w``'s shape, dtype and device; ``w`` itself
        (the same object) when nothing has been observed yet."""
        if self._count == 0 or self._sum is None:  # the sum exists from the first observation
            return w
        avg = self._sum.to(w.device) / self._count
        return avg.to(w.dtype).reshape(w.shape)

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """λ, round counters and the running sum, as numpy arrays and Python scalars.

        ``num_clients`` is K (-1 while unknown), ``lam`` (K,) float64 (empty before the first
        round), ``iterate_sum`` (d,) float64 (empty before the first observation).
        """
        k = self._lam.size if self._lam is not None else self.num_clients
        return {
            "eta_lambda": self.eta_lambda,
            "num_clients": -1 if k is None else int(k),
            "lam": (self._lam.copy() if self._lam is not None else np.zeros(0)),
            "last_round": self._last_round,
            "iterate_sum": (self._sum.cpu().numpy().copy() if self._sum is not None
                            else np.zeros(0)),
            "iterate_count": self._count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the running sum lands on the CPU and moves to the
        parameters' device on the next call).

        Raises:
            ValueError: missing keys, inconsistent arrays, or an ``eta_lambda`` / ``num_clients``
                that differs from this object's (a resumed run must use the same configuration).
        """
        keys = {"eta_lambda", "num_clients", "lam", "last_round", "iterate_sum", "iterate_count"}
        missing = keys - set(state)
        if missing:
            raise ValueError(f"afl state is missing {sorted(missing)}")
        eta = float(state_scalar(state["eta_lambda"]))
        if eta != self.eta_lambda:
            raise ValueError(f"afl state was saved with eta_lambda={eta!r}, this aggregator has "
                             f"eta_lambda={self.eta_lambda!r}")
        k = int(state_scalar(state["num_clients"]))
        if self.num_clients is not None and k != -1 and k != self.num_clients:
            raise ValueError(f"afl state was saved with num_clients={k}, this aggregator has "
                             f"num_clients={self.num_clients}")
        lam = np.asarray(state["lam"], dtype=np.float64).reshape(-1)
        total = np.asarray(state["iterate_sum"], dtype=np.float64).reshape(-1)
        count = int(state_scalar(state["iterate_count"]))
        if lam.size not in (0, k) or (lam.size == 0) != (int(state_scalar(state["last_round"])) < 0) \
                or (total.size == 0) != (count == 0) or count < 0:
            raise ValueError("afl state: arrays are inconsistent with their counters")
        self._lam = lam.copy() if lam.size else None
        if self._lam is None and k > 0 and self.num_clients is None:
            self.num_clients = k
        self._last_round = int(state_scalar(state["last_round"]))
        self._sum = torch.from_numpy(total.copy()) if total.size else None
        self._count = count

    def __repr__(self) -> str:
        return (f"AFL(eta_lambda={self.eta_lambda}, num_clients={self.num_clients}, "
                f"seed={self.seed})")
