"""FedProx — Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020
(arXiv:1812.06127; ALGORITHMS.md §7).

Clients minimise their loss plus ``(mu/2) ||w - w^t||^2`` (the proximal term keeps local models
near the round's global model); the server aggregates exactly as FedAvg (sample-weighted mean).
The proximal term is applied in local training (:class:`mpifl.clients.VmapTrainer`'s
``prox_mu``), which this rule requests through :meth:`client_options`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from mpifl.aggregators.base import register
from mpifl.aggregators.fedavg import FedAvg


@register("fedprox")
class FedProx(FedAvg):
    """FedAvg aggregation of updates trained with a proximal term.

    Args:
        mu: proximal coefficient >= 0 (``mu = 0`` is FedAvg).
        weighting: as :class:`FedAvg` (default ``"samples"``).
        seed: unused; kept for the common constructor.

    Raises:
        ValueError: ``mu < 0`` or an unknown weighting.
    """

    class Params(FedAvg.Params):
        mu: float = Field(0.01, ge=0.0)
        """Proximal coefficient; ``mu = 0`` is FedAvg."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.mu = self.params.mu

    @classmethod
    def client_options(cls, p: Params) -> dict[str, Any]:
        return {"prox_mu": p.mu}
