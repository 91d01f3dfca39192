"""Coordinate-wise trimmed mean — Yin, Chen, Kannan & Bartlett, "Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates", ICML 2018 (arXiv:1803.01498), Option II.

For every coordinate j, the m client updates u_kj are sorted, the ``floor(trim * m)`` largest and
smallest are dropped and the rest averaged: ``s_j = mean(sorted(u_:j)[b : m - b])``. ``trim = 0``
is the plain (unweighted) mean; a trimmed mean tolerates up to b arbitrary (Byzantine) updates.
Cost: one sort of the (m, d) matrix along m, O(m log m d).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field

from mpifl.plugin import Aggregator, Params, RoundUpdates, register_rule


@register_rule("trimmed_mean")
class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean of the updates (Yin et al., ICML 2018).

    Raises:
        ValueError: ``trim`` outside [0, 0.5).
    """

    needs_losses = False  # it never reads r.losses: clients skip the pre-training pass

    class Params(Params):
        #: share of the updates dropped at each end of every coordinate; 0: the plain mean.
        trim: float = Field(0.1, ge=0.0, lt=0.5)

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.trim = self.params.trim

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step, dtype and device of ``r.updates``."""
        b = math.floor(self.trim * r.m)
        kept = torch.sort(r.updates, dim=0).values[b:r.m - b]
        return kept.mean(dim=0)
