"""Server optimizers: a stage after any rule that turns its step into the applied step.

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, "Adaptive Federated
Optimization", ICLR 2021 (Algorithm 2: FedAdagrad, FedAdam, FedYogi), and FedAvgM (Hsu, Qi,
Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", 2019). The papers write the server update with the pseudo-gradient
``Δ_t = Σ p_k (w_k - w) = -s_t``; in mpifl's convention ``w <- w - s`` (ALGORITHMS.md §0) the
same update, with the rule's step ``s_t`` in place of ``-Δ_t``, is::

    sgd       s' = η s
    momentum  m = β m + s;                              s' = η m            (FedAvgM)
    adagrad   m = β1 m + (1-β1) s;  v = v + s²;         s' = η m / (√v + τ)
    adam      m = β1 m + (1-β1) s;  v = β2 v + (1-β2) s²;                      "
    yogi      m = β1 m + (1-β1) s;  v = v - (1-β2) s² sign(v - s²);            "

with ``m_{-1} = 0`` and ``v_{-1} = τ²`` (the paper's "v_{-1} >= τ²"), no bias correction (as in
Algorithm 2), elementwise over the d coordinates. ``sgd`` with η = 1 is the rule alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["OPTIMIZERS", "ServerOptimizer", "ServerOptimizerParams"]

OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "yogi")


@dataclass(frozen=True)
class ServerOptimizerParams:
    """Which optimizer and its hyper-parameters (the ``[server]`` keys ``optimizer``, ``lr``,
    ``momentum``, ``betas``, ``tau``; ranges are checked by the config schema).

    Attributes:
        name: one of :data:`OPTIMIZERS`.
        lr: server learning rate η > 0.
        momentum: FedAvgM's β in [0, 1) (``momentum`` only).
        beta1, beta2: the moment decays of adagrad/adam/yogi (adagrad uses β1 only).
        tau: τ > 0, the adaptivity: added to √v, and v starts at τ².
    """

    name: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3


class ServerOptimizer:
    """Applies :class:`ServerOptimizerParams` to the rules' steps, keeping its state.

    Args:
        params: the optimizer and its hyper-parameters.

    Raises:
        ValueError: an unknown optimizer name.

    Attributes:
        m, v: ``(d,)`` float32 moment estimates on the step's device (None before the first
            step; ``v`` only for the adaptive optimizers).
    """

    def __init__(self, params: ServerOptimizerParams):
        if params.name not in OPTIMIZERS:
            raise ValueError(f"server.optimizer: unknown optimizer {params.name!r}; choose "
                             f"{', '.join(OPTIMIZERS)}")
        self.p = params
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def identity(self) -> bool:
        """Whether the stage leaves every step as it is (``sgd`` with lr 1)."""
        return self.p.name == "sgd" and self.p.lr == 1.0

    @torch.no_grad()
    def apply(self, step: torch.Tensor) -> torch.Tensor:
        """The applied step ``s'`` (d,) for the rule's step ``s`` (d,) (a new tensor).

        Raises:
            ValueError: the step's size changed since the previous call.
        """
        p, s = self.p, step.detach()
        if self.m is not None and self.m.shape != s.shape:
            raise ValueError(f"server optimizer: step size changed from {tuple(self.m.shape)} "
                             f"to {tuple(s.shape)}")
        if p.name == "sgd":
            return s * p.lr
        if self.m is None:
            self.m = torch.zeros_like(s)
            if p.name != "momentum":
                self.v = torch.full_like(s, p.tau ** 2)
        m, v = self.m.to(s), None if self.v is None else self.v.to(s)
        self.m, self.v = m, v
        if p.name == "momentum":
            m.mul_(p.momentum).add_(s)
            return m * p.lr
        assert v is not None  # made with m for every adaptive optimizer
        m.mul_(p.beta1).add_(s, alpha=1 - p.beta1)
        sq = s * s
        if p.name == "adagrad":
            v.add_(sq)
        elif p.name == "adam":
            v.mul_(p.beta2).add_(sq, alpha=1 - p.beta2)
        else:  # yogi
            v.sub_((1 - p.beta2) * sq * torch.sign(v - sq))
        return p.lr * m / (v.sqrt() + p.tau)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The moments as numpy arrays (empty before the first step or for ``sgd``)."""
        out = {}
        if self.m is not None:
            out["m"] = self.m.cpu().numpy().copy()
        if self.v is not None:
            out["v"] = self.v.cpu().numpy().copy()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = torch.from_numpy(np.asarray(state["m"], np.float32)) if "m" in state else None
        self.v = torch.from_numpy(np.asarray(state["v"], np.float32)) if "v" in state else None
