"""Two robust rules: coordinate-wise trimmed mean (stateless) and centered clipping (stateful,
below).

Coordinate-wise trimmed mean — Yin, Chen, Kannan & Bartlett, "Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates", ICML 2018 (arXiv:1803.01498), Option II.

For every coordinate j, the m client updates u_kj are sorted, the ``floor(trim * m)`` largest and
smallest are dropped and the rest averaged: ``s_j = mean(sorted(u_:j)[b : m - b])``. ``trim = 0``
is the plain (unweighted) mean; a trimmed mean tolerates up to b arbitrary (Byzantine) updates.
Cost: one sort of the (m, d) matrix along m, O(m log m d).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.plugin import Aggregator, Needs, Params, RoundUpdates, register_rule


@register_rule("trimmed_mean")
class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean of the updates (Yin et al., ICML 2018).

    Raises:
        ValueError: ``trim`` outside [0, 0.5).
    """

    needs = Needs(losses=False)  # it never reads r.losses: clients skip the pre-training pass

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


@register_rule("centered_clip")
class CenteredClip(Aggregator):
    """Centered clipping around the previous round's step — Karimireddy, He & Jaggi, "Learning
    from History for Byzantine Robust Optimization", ICML 2021 (arXiv:2012.10333), with the
    server's previous step as the centre.

    ``v_t = v_{t-1} + mean_k clip_tau(u_k - v_{t-1})`` repeated ``iterations`` times, where
    ``clip_tau(x) = x * min(1, tau / ||x||)``; the step is ``v_t``, and ``v_t`` is the centre of
    the next round (``v_{-1} = 0``). A stateful rule: the centre lives in :meth:`state_dict`, so
    a resumed run continues exactly (``mpifl check centered_clip --plugins mpifl_example``).

    Raises:
        ValueError: ``tau`` not positive, ``iterations`` not in 1..10, or a state of another size.
    """

    needs = Needs(losses=False)

    class Params(Params):
        #: radius of the clipping ball around the centre, in update norm units.
        tau: float = Field(1.0, gt=0.0)
        #: clipping iterations per round (the paper finds 1 enough with a good centre).
        iterations: int = Field(1, ge=1, le=10)

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.center: torch.Tensor | None = None

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step, dtype and device of ``r.updates``."""
        v = (torch.zeros_like(r.updates[0]) if self.center is None
             else self.center.to(r.updates))
        for _ in range(self.params.iterations):
            diff = r.updates - v
            scale = (self.params.tau / diff.norm(dim=1, keepdim=True).clamp(min=1e-12)).clamp(max=1)
            v = v + (diff * scale).mean(dim=0)
        self.center = v.clone()
        return v

    def state_dict(self) -> dict:
        return {} if self.center is None else {"center": self.center.cpu().numpy()}

    def load_state_dict(self, state) -> None:
        self.center = (torch.from_numpy(np.asarray(state["center"], dtype=np.float32))
                       if "center" in state else None)
