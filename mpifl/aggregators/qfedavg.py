"""q-FedAvg (q-FFL) — Li, Sanjabi, Beirami & Smith, "Fair Resource Allocation in Federated
Learning", ICLR 2020 (arXiv:1905.10497), Algorithm 2; ALGORITHMS.md §7.

With ``L = 1/lr`` (the paper's estimate of the local Lipschitz constant from the client learning
rate of the round), ``Delta_k = L u_k`` and ``F_k = l_k + 1e-10`` (``l_k`` the global model's
training loss before local training; the 1e-10 is the reference code's):

    d_k = F_k^q Delta_k,    h_k = q F_k^(q-1) ||Delta_k||^2 + L F_k^q,    s = sum_k d_k / sum_k h_k

``s`` is one GEMV ``c @ U`` with ``c_k = L F_k^q / sum_j h_j``; the only other d-dimensional
work is the row norms ``||u_k||``. The m scalars are computed in float64.
``q = 0`` gives ``s = mean_k u_k`` (FedAvg with uniform weights).
"""

from __future__ import annotations


import numpy as np
import torch

from typing import Any

from pydantic import Field

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.needs import Needs, Shards
from mpifl.core.params import Params

LOSS_EPS = 1e-10


@register("qfedavg")
class QFedAvg(Aggregator):
    """q-FedAvg aggregation (Li et al., ICLR 2020); ALGORITHMS.md §7.

    Args:
        q: fairness exponent, ``>= 0`` (0 is FedAvg with uniform weights; larger q weights
            high-loss clients more). Default 1.0 (the FLGo reference code's default).
        seed: unused (nothing is drawn); kept for the common constructor.

    Stateless: ``state_dict()`` is ``{}``.

    Raises:
        ValueError: q not a finite number >= 0; in ``aggregate``, a negative or non-finite loss.
    """

    class Params(Params):
        q: float = Field(1.0, ge=0.0)
        """Fairness exponent; ``q = 0`` is FedAvg with uniform weights."""

    needs = Needs(shards=Shards())  # row norms summed over shards, then a weighted sum of rows

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.q = self.params.q

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step in the dtype and on the device of ``r.updates``."""
        U = r.updates
        c = self.coefficients(r, r.norm(U, dim=1).double().cpu().numpy())
        return torch.as_tensor(c, dtype=U.dtype, device=U.device) @ U

    def coefficients(self, r: RoundUpdates, norms: np.ndarray) -> np.ndarray:
        """(m,) float64 ``c`` with ``s = c @ U``, given the row norms ``||u_k||``."""
        F = check_losses(r, "qfedavg") + LOSS_EPS
        L = 1.0 / r.lr
        Fq = F ** self.q
        h = self.q * F ** (self.q - 1.0) * (L * np.asarray(norms, dtype=np.float64)) ** 2 + L * Fq
        return L * Fq / h.sum()

    def __repr__(self) -> str:
        return f"QFedAvg(q={self.q}, seed={self.seed})"


def check_losses(r: RoundUpdates, who: str) -> np.ndarray:
    """The round's losses as (m,) float64, all finite and >= 0.

    Raises:
        ValueError: naming the first client whose loss is negative or not finite.
    """
    losses = r.losses.double().cpu().numpy()
    bad = ~np.isfinite(losses) | (losses < 0)
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"{who}: round {r.round}: client {int(r.client_ids[k])} has loss "
                         f"{losses[k]!r}; loss-weighted aggregation needs finite losses >= 0")
    return losses
