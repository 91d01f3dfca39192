"""Ditto's client work: FedAvg local SGD for the global model plus a personal model per client.

Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (ALGORITHMS.md §7). Every client k keeps a personal model v_k next to
the global model. In round t a selected client

* trains the global model exactly as FedAvg (:class:`~mpifl.clients.VmapTrainer`: E epochs of
  minibatch SGD from w^t, reporting ``u_k = w^t - w_k``), and
* trains its personal model on ``F_k(v) + (lam/2) ||v - w^t||^2`` starting from its stored v_k.

The paper (Algorithm 1) leaves open how v_k starts, how many personal steps a round takes and on
which samples; this module follows the authors' code (github.com/litian96/ditto,
``flearn/trainers_MTL/ditto.py``) there:

* the personal model takes **one step per global step, on the same minibatch** (the reference
  draws a batch, takes the personal step on it, then the global step on it): here both walk
  the minibatches of ALGORITHMS.md §1 (``batch_order(seed, round, client, epoch, n)``), so the
  personal model takes ``E * ceil(n_k / B)`` steps, like the global one;
* the proximal anchor is the round's global model w^t, held fixed during the round (not the
  client's moving copy of the global model), with the same learning rate ``lr_t``;
* v_k starts as a copy of the initial global model (kept by the aggregator,
  :mod:`mpifl.aggregators.ditto`; the server sends v_k as the client's state row);
* the reference's plain SGD step is this trainer's ``torch.optim.SGD`` step: with the default
  ``momentum = weight_decay = 0`` they are the same; otherwise the personal model uses the
  client section's momentum (a fresh buffer every round, as for the global model) and weight
  decay. The reference's ``dynamic_lam`` (picking lam per client on validation data) is not
  implemented.

Both trainings are batched as in VmapTrainer: a chunk of clients is one stacked ``(m, d)``
tensor per model, one ``vmap(grad)`` call per step index, padded and masked minibatches; there is
no loop over clients. :meth:`VmapTrainer.evaluate_each` (inherited) evaluates K per-client
parameter rows the same way (``vmap`` of ``functional_call`` over the rows, padded/masked test
samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mpifl.clients.interface import TrainOptions
from mpifl.clients.trainer import VmapTrainer
from mpifl.core.layout import ParamLayout
from mpifl.core.wire import Columns


class DittoTrainer(VmapTrainer):
    """Global (FedAvg) and personal (proximal) local training of many clients at once.

    Args:
        model, layout, x, y, options: :class:`~mpifl.clients.VmapTrainer`'s arguments;
            ``options.prox_mu`` (FedProx) applies to the global model only.
        lam: Ditto's lambda >= 0, the coefficient of ``(lam/2) ||v_k - w^t||^2`` in the personal
            objective (``lam = 0``: purely local personal models).

    Raises:
        ValueError: lam negative or not finite, or VmapTrainer's errors.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor,
                 options: TrainOptions, *, lam: float = 0.1) -> None:
        if isinstance(lam, bool) or not (math.isfinite(float(lam)) and float(lam) >= 0):
            raise ValueError(f"ditto: lam must be a finite number >= 0, got {lam!r}")
        super().__init__(model, layout, x, y, options)
        self.lam = float(lam)

    @classmethod
    def columns_for(cls, d: int, num_groups: int = 0, **options: Any) -> Columns:
        """The personal model v_k travels as the client's state row (d wide) and comes back,
        trained, as the statistic ``client_state`` (d wide)."""
        extra = (("train_accuracy", 1),) if options.get("report_accuracy") else ()
        return Columns(state=d, stats=(("client_state", d),) + extra)

    @torch.no_grad()
    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """One Ditto round of the selected clients.

        Args:
            w, round, lr, client_ids, sample_idx: as in :meth:`VmapTrainer.run_round`.
            inputs: unused (Ditto has no round inputs).
            state: ``(m, d)`` float32, the clients' personal models v_k before the round.

        Returns:
            ``updates`` (m, d) and ``losses`` (m,) of the global model, exactly as
            :meth:`VmapTrainer.run_round`; ``stats["client_state"]`` (m, d) float32, the personal
            models after the round (and ``train_accuracy`` (m, 1) with ``report_accuracy``).

        Raises:
            ValueError: missing or mis-shaped state rows, or :meth:`VmapTrainer.run_round`'s errors.
        """
        m = len(sample_idx)
        if state is None or tuple(state.shape) != (m, self.layout.d):
            got = None if state is None else tuple(state.shape)
            raise ValueError(f"ditto: run_round needs the personal models as state rows "
                             f"({m}, {self.layout.d}), got {got}")
        updates, losses, acc = self._train(w, round, lr, client_ids, sample_idx)  # FedAvg part
        personal = self.train_personal(w, round, lr, client_ids, sample_idx, state)
        stats = {"client_state": personal}
        if self.report_accuracy:
            stats["train_accuracy"] = acc.float().view(-1, 1)
        return updates, losses, stats

    @torch.no_grad()
    def train_personal(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                       sample_idx: Sequence[np.ndarray], v: Tensor) -> Tensor:
        """The personal models after the round: local SGD from ``v`` (m, d) on
        ``F_k(v) + (lam/2) ||v - w||^2``, on the same minibatches as the global model.

        Returns:
            ``(m, d)`` float32 on ``device``.
        """
        w = self._check_w(w)
        client_ids, sizes = self._check_clients(client_ids, sample_idx)
        v = v.detach().to(self.device, torch.float32)
        out = torch.empty(len(sizes), self.layout.d, device=self.device)
        for chunk in self.plan_chunks(sizes):
            pos = torch.as_tensor(chunk, device=self.device)
            out[pos] = self._train_chunk(w, round, lr, client_ids[chunk],
                                         [sample_idx[i] for i in chunk], start=v[pos],
                                         prox_mu=self.lam)
        return out
