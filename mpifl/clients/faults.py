"""Robustness: client dropout, fault injection, and screening of bad updates (issue: faults).

* ``client.dropout = p``: each selected client drops out of the round with probability p,
  keyed by (seed, round, client) — the FedFV paper's "client dropping out" setting.
* ``faults.nan_clients = [ids]``: those clients send NaN updates (tests, robustness studies).
* ``server.max_update_norm``: updates with NaN/Inf or a larger L2 norm are excluded from the
  round's aggregation and counted in ``/rounds/rejected``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from mpifl.clients.interface import ClientTrainer, TrainerWrapper
from mpifl.core.rng import DROPOUT_TAG



def dropped_out(seed: int, rnd: int, client_ids: np.ndarray, p: float) -> np.ndarray:
    """(m,) bool: which selected clients drop out of round ``rnd`` (one keyed draw per client)."""
    if p <= 0:
        return np.zeros(len(client_ids), dtype=bool)
    draws = [np.random.default_rng([seed, rnd, int(k), DROPOUT_TAG]).random() for k in client_ids]
    return np.asarray(draws) < p


def accepted(updates: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """(m,) bool: updates that are finite and, if ``max_norm`` is set, of L2 norm <= max_norm."""
    # amax/amin propagate NaN and carry +-inf: 12x faster than isfinite(...).all() on the CPU
    ok = torch.isfinite(updates.amax(dim=1)) & torch.isfinite(updates.amin(dim=1))
    if max_norm is not None:
        ok &= torch.linalg.vector_norm(torch.nan_to_num(updates), dim=1) <= max_norm
    return ok


class NaNClients(TrainerWrapper):
    """Wraps a trainer so that the listed clients' updates come back as NaN; every other call
    is the wrapped trainer's.

    Args:
        trainer: a :class:`~mpifl.clients.interface.ClientTrainer`.
        nan_clients: client ids whose updates are replaced by NaN after training.
    """

    def __init__(self, trainer: ClientTrainer, nan_clients: list[int]):
        super().__init__(trainer)
        self.nan_clients = np.asarray(sorted(set(nan_clients)), dtype=np.int64)

    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        updates, losses, stats = super().run_round(w, round, lr, client_ids, sample_idx,
                                                   inputs, state)
        return self._poison(updates, client_ids), losses, stats

    def _poison(self, updates: Tensor, client_ids: np.ndarray) -> Tensor:
        bad = torch.as_tensor(np.isin(client_ids, self.nan_clients), device=updates.device)
        updates[bad] = float("nan")
        return updates
