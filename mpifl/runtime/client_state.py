"""State the server keeps per client outside the rule: the coordinates of w that stay with each
client (local BatchNorm, ``model.batchnorm = "local"`` — FedBN, Li et al., ICLR 2021 — or
``"local_stats"``).

The server sends the selected clients' rows with TRAIN (the trainer's state rows), stores the
trained rows that come back (statistic ``local_state``) for the clients whose updates were
aggregated, sends every client's row with EVAL so each is evaluated with its own, and
checkpoints the rows (``client_state/local_rows``), so a resumed run is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["LocalCoordinates"]


class LocalCoordinates:
    """The (K, s) float32 rows of the s local coordinates of every client.

    Args:
        index: (s,) int64 positions in w (:func:`mpifl.models.zoo.batchnorm_coordinates`).
        w0: (d,) the initial global state: every client's row starts as ``w0[index]``.
        num_clients: K.

    Raises:
        ValueError: a restored row array of the wrong shape (:meth:`load_state_dict`).
    """

    def __init__(self, index: np.ndarray, w0: torch.Tensor, num_clients: int):
        self.index = np.asarray(index, dtype=np.int64)
        start = w0.detach().cpu().float()[torch.as_tensor(self.index)]
        self.rows = start.expand(int(num_clients), -1).clone()

    def of(self, client_ids: np.ndarray) -> torch.Tensor:
        """(m, s) rows of these clients (a copy)."""
        return self.rows[torch.as_tensor(np.asarray(client_ids, dtype=np.int64))].clone()

    def store(self, client_ids: np.ndarray, rows: torch.Tensor) -> None:
        """Keep the trained rows (m, s) of these clients."""
        ids = torch.as_tensor(np.asarray(client_ids, dtype=np.int64))
        self.rows[ids] = rows.detach().cpu().float().reshape(len(ids), -1)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"local_rows": self.rows.numpy().copy(), "local_index": self.index.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rows, index = np.asarray(state["local_rows"]), np.asarray(state["local_index"])
        if rows.shape != tuple(self.rows.shape) or not np.array_equal(index, self.index):
            raise ValueError(f"checkpointed local coordinates {rows.shape} do not match this "
                             f"run's {tuple(self.rows.shape)}")
        self.rows = torch.from_numpy(rows.astype(np.float32))
