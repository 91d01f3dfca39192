"""DRFL — Zhao & Joshi, "A Dynamic Reweighting Strategy for Fair Federated Learning",
ICASSP 2022; ALGORITHMS.md §7.

Each selected client is weighted by its share of the round's losses (``l_k``, the global model's
training loss before local training): ``p_k = l_k / sum_{j in S_t} l_j``, ``s = sum_k p_k u_k``.
One GEMV.

Degenerate round (not covered by the paper): if every loss is exactly 0 the weights are
undefined; they fall back to uniform ``1/m``.
"""

from __future__ import annotations

import numpy as np
import torch

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.needs import Needs, Shards
from mpifl.aggregators.qfedavg import check_losses


@register("drfl")
class DRFL(Aggregator):
    """Loss-proportional weighting (Zhao & Joshi, ICASSP 2022); ALGORITHMS.md §7.

    Args:
        seed: unused (nothing is drawn); kept for the common constructor.

    Stateless: ``state_dict()`` is ``{}``.

    Raises:
        ValueError: in ``aggregate``, a negative or non-finite loss.
    """

    needs = Needs(shards=Shards())  # weighted sums of rows: each shard weights its block

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step in the dtype and on the device of ``r.updates``."""
        p = self.weights(r)
        return torch.as_tensor(p, dtype=r.updates.dtype, device=r.updates.device) @ r.updates

    def weights(self, r: RoundUpdates) -> np.ndarray:
        """(m,) float64 weights ``p_k = l_k / sum l`` (uniform if every loss is 0)."""
        losses = check_losses(r, "drfl")
        total = losses.sum()
        return losses / total if total > 0 else np.full(r.m, 1.0 / r.m)
