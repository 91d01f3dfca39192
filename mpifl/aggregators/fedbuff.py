"""FedBuff — Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated Learning with
Buffered Asynchronous Aggregation", AISTATS 2022 (ALGORITHMS.md, "Asynchronous rules").

Clients train asynchronously, ``concurrency`` (C) of them at a time, each from the model
version current when it started; the server aggregates as soon as ``buffer_size`` (B) updates
have arrived, each down-weighted by its staleness. The server loop is
:class:`mpifl.runtime.asynchronous.AsyncServer` (``needs.asynchronous``).

Staleness functions f(tau) of tau = server steps since the update's start model are those of
Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", 2019, §5.2 (shared with FedAsync).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, ValidationInfo, field_validator

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.needs import Needs
from mpifl.core.params import Params

__all__ = ["FedBuff", "STALENESS", "staleness_weights"]

#: staleness functions (Xie et al. 2019, §5.2)
STALENESS = ("constant", "polynomial", "hinge")

ASYNC_NOTE = ("an asynchronous rule's server keeps the in-flight clients' model versions at "
              "one place")


def staleness_weights(tau: np.ndarray, kind: str, a: float, b: float) -> np.ndarray:
    """f(tau), (m,) float64 in (0, 1], of (m,) staleness ``tau >= 0`` (server steps):
    ``constant`` 1; ``polynomial`` (1 + tau)^-a; ``hinge`` 1 if tau <= b else
    1 / (a (tau - b) + 1) (Xie et al. 2019, §5.2). f(0) = 1 for each.

    Raises:
        ValueError: an unknown ``kind`` or a negative staleness.
    """
    tau = np.asarray(tau, dtype=np.float64)
    if tau.size and tau.min() < 0:
        raise ValueError(f"staleness must be >= 0, got {tau.min()}")
    if kind == "constant":
        return np.ones_like(tau)
    if kind == "polynomial":
        return (1.0 + tau) ** -a
    if kind == "hinge":
        return 1.0 / (a * np.maximum(tau - b, 0.0) + 1.0)  # 1 up to b
    raise ValueError(f"unknown staleness function {kind!r} (known: {', '.join(STALENESS)})")


class StalenessParams(Params):
    """The staleness function's keys, shared by FedBuff and FedAsync."""

    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    """f(tau): "constant" (1), "polynomial" ((1+tau)^-a) or "hinge" (1 up to b, then
    1/(a(tau-b)+1))."""
    a: float = Field(0.5, ge=0.0)
    """The exponent of "polynomial", the slope of "hinge"; 0 = no down-weighting."""
    b: float = Field(4.0, ge=0.0)
    """With "hinge": staleness up to b is not down-weighted."""


def staleness_of(r: RoundUpdates, rule: str) -> np.ndarray:
    """(m,) int64 ``r.stats["staleness"]`` (0 for every update when absent: a synchronous
    round)."""
    tau = r.stats.get("staleness")
    if tau is None:
        return np.zeros(r.m, dtype=np.int64)
    return tau.detach().cpu().numpy().astype(np.int64)


def stale_weights(r: RoundUpdates, rule: str, params: StalenessParams,
                  scale: float) -> np.ndarray:
    """(m,) float64 ``scale f(tau_k) / m``: the buffered mean's weights of FedBuff (scale
    eta_g) and FedAsync (scale alpha)."""
    f = staleness_weights(staleness_of(r, rule), params.staleness, params.a, params.b)
    return np.full(r.m, 1.0 / r.m) * f * scale


def weighted_step(p: np.ndarray, r: RoundUpdates) -> torch.Tensor:
    """(d,) ``p @ updates`` in the dtype and on the device of ``r.updates`` (FedAvg's
    arithmetic, so that equal weights give its step bit for bit)."""
    return torch.as_tensor(p, dtype=r.updates.dtype, device=r.updates.device) @ r.updates


@register("fedbuff")
class FedBuff(Aggregator):
    """Buffered asynchronous aggregation: ``s = eta_g (1/B) sum_k f(tau_k) u_k`` over the B
    buffered updates, u_k = w_start_k - w_k from the model client k started at.

    With every tau = 0 and ``server_lr = 1`` the step is FedAvg's uniform mean, computed with
    its arithmetic (float64 weights, then ``p @ updates`` in the updates' dtype), so FedBuff
    with ``buffer_size = concurrency = m`` and ``staleness = "constant"`` equals FedAvg with
    ``weighting = "uniform"`` bit for bit.

    Args:
        buffer_size: B, updates per server step (>= 1).
        concurrency: C >= B, clients training at once.
        staleness, a, b: f(tau) (:func:`staleness_weights`).
        server_lr: eta_g > 0 (the paper's server learning rate).
        seed: unused (FedBuff draws nothing; the server draws the clients).

    Raises:
        ValueError: a parameter out of range, or ``concurrency < buffer_size``.
    """

    needs = Needs(losses=False, asynchronous=True, shards_note=ASYNC_NOTE)

    class Params(StalenessParams):
        buffer_size: int = Field(10, ge=1, le=2**31 - 1)
        """B: updates aggregated per server step."""
        concurrency: int = Field(100, ge=1, le=2**31 - 1)
        """C: clients training at once (>= buffer_size)."""
        server_lr: float = Field(1.0, gt=0.0)
        """eta_g: the server learning rate scaling the buffered mean."""

        @field_validator("concurrency")
        @classmethod
        def _fits(cls, c: int, info: ValidationInfo) -> int:
            b = info.data.get("buffer_size", 1)
            if c < b:
                raise ValueError(f"must be >= buffer_size ({b})")
            return c

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        p = self.params
        self.buffer_size, self.concurrency = p.buffer_size, p.concurrency

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """(d,) step in the dtype and on the device of ``r.updates`` (B = r.m, the updates
        buffered: fewer than ``buffer_size`` only when some were rejected)."""
        return weighted_step(self.weights(r), r)

    def weights(self, r: RoundUpdates) -> np.ndarray:
        """(m,) float64 ``eta_g f(tau_k) / m``."""
        return stale_weights(r, self.name, self.params, self.params.server_lr)
