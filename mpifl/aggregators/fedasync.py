"""FedAsync — Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", 2019
(arXiv:1903.03934; ALGORITHMS.md, "Asynchronous rules").

Every arriving client model is mixed into the global one at once:
``w <- (1 - alpha_t) w + alpha_t w_k`` with ``alpha_t = alpha f(tau)`` (Algorithm 1, the
staleness functions of §5.2, :func:`mpifl.aggregators.fedbuff.staleness_weights`). The server
loop is :class:`mpifl.runtime.asynchronous.AsyncServer` with a buffer of one update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.fedbuff import ASYNC_NOTE, StalenessParams, stale_weights, weighted_step
from mpifl.aggregators.needs import Needs

__all__ = ["FedAsync"]


@register("fedasync")
class FedAsync(Aggregator):
    """Asynchronous mixing, one update per server step (B = 1).

    The server passes ``r.updates`` against the current model (``needs.current_updates``):
    row k is ``w - w_k``, so the step ``s = alpha_t (w - w_k)`` gives
    ``w - s = (1 - alpha_t) w + alpha_t w_k``. (With several rows, as a plugin server might
    pass, the step is their mean, each with its own alpha_t.)

    Args:
        concurrency: C, clients training at once.
        alpha: the mixing weight in (0, 1].
        staleness, a, b: f(tau) (:func:`mpifl.aggregators.fedbuff.staleness_weights`).
        seed: unused.

    Raises:
        ValueError: a parameter out of range.
    """

    needs = Needs(losses=False, asynchronous=True, current_updates=True,
                  shards_note=ASYNC_NOTE)

    class Params(StalenessParams):
        concurrency: int = Field(100, ge=1, le=2**31 - 1)
        """C: clients training at once."""
        alpha: float = Field(0.6, gt=0.0, le=1.0)
        """alpha: the weight of an arriving client model (before its staleness factor)."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.buffer_size, self.concurrency = 1, self.params.concurrency

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step ``alpha f(tau) (w - w_k)`` in the dtype and on the device of
        ``r.updates``."""
        return weighted_step(self.weights(r), r)

    def weights(self, r: RoundUpdates) -> np.ndarray:
        """(m,) float64 ``alpha f(tau_k) / m``."""
        return stale_weights(r, self.name, self.params, self.params.alpha)
