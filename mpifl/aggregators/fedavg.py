"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017 (ALGORITHMS.md §2)."""

from __future__ import annotations

import numpy as np
import torch

from typing import Any, Literal

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.needs import Needs, Shards
from mpifl.core.params import Params

WEIGHTINGS = ("samples", "uniform")


@register("fedavg")
class FedAvg(Aggregator):
    """Weighted mean of the updates: ``s = sum_k p_k u_k``.

    Args:
        weighting: ``"samples"`` (default, the paper's ``p_k = n_k / sum_{j in S_t} n_j``) or
            ``"uniform"`` (``p_k = 1/m``).
        seed: unused (FedAvg draws nothing); kept for the common constructor.

    Raises:
        ValueError: unknown ``weighting``; in ``aggregate``, a round whose clients hold no
            samples at all under ``"samples"``.
    """

    # reads no RoundUpdates.losses (nor do FedProx, Ditto, FedMeta); shards: weighted sums of
    # rows, each shard applies the weights to its block
    needs = Needs(losses=False, shards=Shards())

    class Params(Params):
        weighting: Literal["samples", "uniform"] = "samples"
        """``"samples"``: p_k = n_k / sum n_j (the paper); ``"uniform"``: p_k = 1/m."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.weighting = self.params.weighting

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step in the dtype and on the device of ``r.updates``."""
        p = self.weights(r)
        return torch.as_tensor(p, dtype=r.updates.dtype, device=r.updates.device) @ r.updates

    def weights(self, r: RoundUpdates) -> np.ndarray:
        """(m,) float64 weights ``p_k`` summing to 1."""
        if self.weighting == "uniform":
            return np.full(r.m, 1.0 / r.m)
        n = r.num_samples.cpu().numpy().astype(np.float64)
        total = n.sum()
        if total <= 0:
            raise ValueError(f"fedavg: round {r.round} has no training samples to weight by")
        return n / total
