"""FedMGDA+ — Hu, Shaloudegi, Zhang & Yu, "Federated Learning Meets Multi-objective Optimization",
IEEE Transactions on Network Science and Engineering 2022 (arXiv:2006.11489); ALGORITHMS.md §7, in
Gram space.

Each update is normalised, ``û_k = u_k / (||u_k|| + 1e-8)``; with the sample weights
``λ0_k = n_k / sum_{j in S_t} n_j`` the weights solve the min-norm problem

    min ||sum_k λ_k û_k||^2   s.t.   sum λ = 1,   max(0, λ0_k - eps) <= λ_k <= min(1, λ0_k + eps)

(cvxopt, :func:`mpifl.aggregators.qp.solve_simplex_qp`) and the step is ``s = eta sum_k λ_k û_k``.
This follows the FedFV authors' reference code (easyFL/FLGo ``fedmgda+.py``): the ``+1e-8`` in
the normalisation, a fixed server step ``eta`` (no decay), and the ``||λ - λ0||_inf <= eps`` ball
intersected with [0, 1].

Gram form: ``G = U U^T`` (one GEMM) gives ``||u_k|| = sqrt(G_kk)``, so with ``D = diag(||u_k|| +
1e-8)`` the QP matrix is ``P = D^-1 G D^-1`` (m x m, float64) and ``s = (eta λ / diag(D)) @ U``
(one GEMV): nothing d-dimensional is normalised or stored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.needs import Needs, Shards
from mpifl.aggregators.qp import solve_simplex_qp
from mpifl.core.params import Params

NORM_EPS = 1e-8


@register("fedmgda_plus")
class FedMGDAPlus(Aggregator):
    """FedMGDA+ aggregation (Hu et al., IEEE TNSE 2022), Gram form; ALGORITHMS.md §7.

    Args:
        eps: ``>= 0``, how far each weight may move from ``λ0_k = n_k / sum n`` (0: fixed sample
            weights on the normalised updates; ``>= 1``: the whole simplex, i.e. MGDA).
            Default 0.1 (the FLGo reference code's default).
        eta: ``> 0``, the server step size applied to the combination of unit vectors.
            Default 1.0 (FLGo's default).
        seed: unused (nothing is drawn); kept for the common constructor.

    Stateless (``state_dict()`` is ``{}``). After each ``aggregate``, ``last_lambda`` (m,) float64
    and ``last_status`` (the QP status: ``"optimal"``, ``"unknown"``, ``"fallback"`` or
    ``"trivial"``) describe the round, for diagnostics.

    Raises:
        ValueError: eps or eta out of range; in ``aggregate``, a round whose clients hold no
            samples.
    """

    # reads no RoundUpdates.losses; shards: the Gram matrix summed over shards, then a weighted
    # sum of rows
    needs = Needs(losses=False, shards=Shards())

    class Params(Params):
        eps: float = Field(0.1, ge=0.0, le=1.0)
        """How far each weight may move from n_k / sum n; 0: fixed sample weights on the normalised
        updates, 1: the whole simplex (MGDA)."""
        eta: float = Field(1.0, gt=0.0)
        """Server step size."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.eps, self.eta = self.params.eps, self.params.eta
        self.last_lambda: np.ndarray | None = None
        self.last_status: str | None = None

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step in the dtype and on the device of ``r.updates``."""
        U = r.updates
        G = r.gram(U)  # the only O(m^2 d) work (summed over shards)
        c = self.coefficients(r, G)
        return torch.as_tensor(c, dtype=U.dtype, device=U.device) @ U

    def coefficients(self, r: RoundUpdates, G: np.ndarray) -> np.ndarray:
        """(m,) float64 ``c`` with ``s = c @ U``, from the (m, m) Gram matrix ``G = U U^T``."""
        D = np.sqrt(np.clip(np.diag(G), 0.0, None)) + NORM_EPS
        P = G / np.outer(D, D)
        lo, hi = self.bounds(r)
        lam, status, _ = solve_simplex_qp(P, lo, hi)
        self.last_lambda, self.last_status = lam, status
        return self.eta * lam / D

    def bounds(self, r: RoundUpdates) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)``: ``max(0, λ0 - eps)`` and ``min(1, λ0 + eps)``, (m,) float64 each."""
        n = r.num_samples.cpu().numpy().astype(np.float64)
        total = n.sum()
        if total <= 0:
            raise ValueError(f"fedmgda_plus: round {r.round} has no training samples to "
                             f"weight by")
        lam0 = n / total
        return np.maximum(0.0, lam0 - self.eps), np.minimum(1.0, lam0 + self.eps)

    def __repr__(self) -> str:
        return f"FedMGDAPlus(eps={self.eps}, eta={self.eta}, seed={self.seed})"
