"""UGA — unbiased gradient aggregation (Yao et al., "Federated Learning with Unbiased Gradient
Aggregation and Controllable Meta Updating", NeurIPS 2019 FL workshop, arXiv:1910.08234;
ALGORITHMS.md §6), the server side.

The clients' local work is :class:`mpifl.clients.uga.UGATrainer` (keep-trace local training
and the gradient with respect to the round's starting weights); the server steps

    w^{t+1} = w^t - eta_g * sum_k (n_k / n_S) g_k,      n_S = sum_{j in S_t} n_j.

Contract with the server: the rows of ``RoundUpdates.updates`` are UGATrainer's **gradients**
``g_k`` (no learning rate in them), not pseudo-gradients. The server builds that trainer
instead of :class:`~mpifl.clients.VmapTrainer` for this rule (``needs.trainer = "uga"``), with the
keyword options of :meth:`UGA.client_options`. ``server.max_update_norm`` then bounds gradient
norms.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import Aggregator, RoundUpdates, register
from mpifl.aggregators.needs import Needs, Shards
from mpifl.core.params import Params


@register("uga")
class UGA(Aggregator):
    """Sample-weighted mean of the clients' UGA gradients times the server step size.

    Args:
        eta_g: server step size eta_g > 0 (finite).
        max_traced_clients: passed to the trainer through :meth:`client_options` (None: the
            memory budget alone bounds how many clients are traced at once); unused here.
        seed: unused (UGA draws nothing); kept for the common constructor.

    Raises:
        ValueError: ``eta_g`` not finite and > 0, ``max_traced_clients < 1``; in ``aggregate``,
            a round whose clients hold no samples at all.
    """

    #: which local computation the server must run for this rule (VmapTrainer's is "sgd")
    # keep-trace local training; reads no RoundUpdates.losses (UGATrainer measures them
    # anyway); shards: weighted sums of rows, each shard applies the weights to its block
    needs = Needs(trainer="uga", losses=False, shards=Shards())

    class Params(Params):
        eta_g: float = Field(1.0, gt=0.0)
        """Server step size (> 0)."""
        max_traced_clients: int | None = Field(None, ge=1, le=2**31 - 1)
        """Cap on the clients traced at once; None: the memory budget alone decides."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.eta_g = self.params.eta_g
        self.max_traced_clients = self.params.max_traced_clients

    @classmethod
    def client_options(cls, p: Params) -> dict[str, Any]:
        """``{"max_traced_clients": n}`` for UGATrainer when the table sets it, else ``{}``."""
        return {} if p.max_traced_clients is None else {"max_traced_clients": p.max_traced_clients}

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``eta_g * sum_k (n_k/n_S) g_k``: (d,), dtype and device of ``r.updates``."""
        n = r.num_samples.cpu().numpy().astype(np.float64)
        total = n.sum()
        if total <= 0:
            raise ValueError(f"uga: round {r.round} has no training samples to weight by")
        p = torch.as_tensor(self.eta_g * n / total, dtype=r.updates.dtype, device=r.updates.device)
        return p @ r.updates

    def __repr__(self) -> str:
        return f"UGA(eta_g={self.eta_g}, seed={self.seed})"
