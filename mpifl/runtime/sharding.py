"""The sharded server's part of a round (``server.shards = P > 1``; docs/ARCHITECTURE.md
"Sharded server").

Ranks 0 .. P-1 are the shards (rank 0 is also the coordinator; ranks 1 .. P-1 also train
clients). After a TRAIN request shard j holds column block j of every selected client's update
(:meth:`mpifl.runtime.protocol.Train.reply`); then every shard runs
:meth:`ShardServer.aggregate` with the same inputs, in the same order:

1. shard 0 broadcasts the round's losses and statistics rows (per-client scalars it gathered);
2. the accepted-update test (finite, norm bound) from partial sums over the blocks;
3. the rule's ``aggregate`` on the block (:class:`~mpifl.aggregators.RoundUpdates` with
   ``shards``), which adds up its coordinate sums with :meth:`ShardGroup.allsum`;
4. the conflict counts (MC, LC) from partial dot products, one more allsum;
5. shard 0 gathers the step's blocks into the full (d,) step and moves the model.

Checkpoints: each shard writes the column blocks of the rule's ``needs.sharded_state`` keys to
its own file beside rank 0's checkpoint (:mod:`mpifl.store.checkpoint`), which lists them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from mpifl.aggregators import RoundUpdates
from mpifl.aggregators.base import Aggregator
from mpifl.aggregators.shards import ShardGroup, local_layers, row_sq_norms
from mpifl.core.errors import OutputError
from mpifl.core.wire import Columns
from mpifl.runtime.backends import split_stats, stats_rows
from mpifl.store import checkpoint

log = logging.getLogger("mpifl.shards")


@dataclass
class ShardOutcome:
    """One round's aggregation on the shards.

    Attributes:
        keep: (m,) bool, the updates accepted (finite, within ``server.max_update_norm``).
        step: shard 0: the full (d,) float32 step, None when nothing was accepted; other
            shards: None.
        conflicts_model: clients whose update conflicts with the step (MC).
        conflicts_layer: (L,) int64, per layer (LC).
    """

    keep: np.ndarray
    step: torch.Tensor | None
    conflicts_model: int
    conflicts_layer: np.ndarray


class ShardServer:
    """One shard of a sharded server.

    Args:
        group: the shard ranks (:class:`~mpifl.aggregators.shards.ShardGroup`).
        aggregator: this shard's instance of the rule (same config and seed on every shard).
        layers: the full layer map, L slices of [0, d).
        num_train: (K,) training samples per client.
        max_update_norm: ``server.max_update_norm`` (None: no bound).
        columns: the trainer's :class:`~mpifl.core.wire.Columns` (statistics rows' layout).
    """

    def __init__(self, group: ShardGroup, aggregator: Aggregator, layers: list[slice],
                 num_train: np.ndarray, max_update_norm: float | None, columns: Columns) -> None:
        self.group, self.aggregator, self.columns = group, aggregator, columns
        self.layers = layers
        self.local = local_layers(layers, group.lo, group.hi) or []  # never None: layers is given
        self.num_train, self.max_update_norm = num_train, max_update_norm
        #: inside the shards' collectives: a failure now must abort the job (a STOP on the
        #: world communicator would not reach shards waiting in them)
        self.busy = False

    def aggregate(self, rnd: int, lr: float, ids: np.ndarray, block: torch.Tensor,
                  losses: torch.Tensor | None = None,
                  stats: dict[str, torch.Tensor] | None = None) -> ShardOutcome:
        """This shard's part of round ``rnd`` (module docstring); every shard calls it.

        Args:
            ids: (m,) int64 selected clients (every rank has them from the TRAIN request).
            block: (m, hi - lo) float32 this shard's columns of their updates.
            losses, stats: shard 0 only: (m,) float32 losses and the named statistics columns.
        """
        self.busy = True
        out = self._aggregate(rnd, lr, ids, block, losses, stats)
        self.busy = False  # left True when it raised
        return out

    def _aggregate(self, rnd: int, lr: float, ids: np.ndarray, block: torch.Tensor,
                   losses: torch.Tensor | None, stats: dict[str, torch.Tensor] | None
                   ) -> ShardOutcome:
        m, g = len(ids), self.group
        losses_np = np.empty(m, np.float32)
        rows = np.empty((m, self.columns.stats_width), np.float32)
        if g.index == 0:
            assert losses is not None  # shard 0 passes the round's losses and statistics
            losses_np[:] = losses.cpu().numpy()
            if self.columns.stats_width:
                assert stats is not None
                rows[:] = stats_rows(self.columns, stats, m).cpu().numpy()
        g.bcast(losses_np)
        if self.columns.stats_width:
            g.bcast(rows)
        keep = self._accepted(block)
        none = ShardOutcome(keep, None, 0, np.zeros(len(self.layers), dtype=np.int64))
        if not keep.any():
            return none
        kept = torch.as_tensor(keep)
        U = block if keep.all() else block[kept]
        stat_cols = split_stats(self.columns, torch.from_numpy(rows[keep]).to(block.device))
        r = RoundUpdates(round=rnd, client_ids=ids[keep], updates=U,
                         losses=torch.from_numpy(losses_np[keep]).to(block.device),
                         num_samples=self.num_train[ids[keep]], lr=lr, layers=self.local,
                         stats=stat_cols, shards=g)
        step = self.aggregator.aggregate(r)
        mc, lc = self._conflicts(U, step)
        full = g.gather(step.detach().cpu().numpy())
        return ShardOutcome(keep, None if full is None else torch.from_numpy(full), mc, lc)

    def _accepted(self, block: torch.Tensor) -> np.ndarray:
        """(m,) bool, like :func:`mpifl.clients.faults.accepted` over all shards' columns:
        non-finite entries counted and squared norms summed over the blocks."""
        bad = ~(torch.isfinite(block.amax(dim=1)) & torch.isfinite(block.amin(dim=1)))
        sq = row_sq_norms(block, finite=True)
        tot = self.group.allsum(torch.stack([bad.double(), sq]))
        ok: np.ndarray = tot[0] == 0
        if self.max_update_norm is not None:
            ok &= np.sqrt(tot[1]) <= self.max_update_norm
        return ok

    def _conflicts(self, U: torch.Tensor, step: torch.Tensor) -> tuple[int, np.ndarray]:
        """MC and LC (:func:`mpifl.metrics.summary.count_conflicts`) from partial dots."""
        parts = [(U @ step).double()] + [(U[:, s] @ step[s]).double() for s in self.local]
        dots = self.group.allsum(torch.stack(parts, dim=1))
        return int((dots[:, 0] < 0).sum()), (dots[:, 1:] < 0).sum(axis=0).astype(np.int64)

    # ---- checkpoints -----------------------------------------------------------------------

    def write_checkpoint(self, folder: Path, rounds_done: int) -> float:
        """Write this shard's blocks of the rule's sharded state for the checkpoint after
        ``rounds_done`` rounds; 0.0 when written, 1.0 on failure (logged in one line: rank 0
        then refuses the checkpoint, and the previous ones stay)."""
        try:
            state = self.aggregator.state_dict()
            checkpoint.save_shard(folder, rounds_done, self.group.index, self.group.size,
                                  self.group.lo, self.group.hi, self.group.d,
                                  # Shards.state names arrays: (N, block) column blocks
                                  {k: cast(np.ndarray, state[k])
                                   for k in self.aggregator.needs.sharded_state})
        except OutputError as exc:
            log.error("shard %d: %s", self.group.index, exc)
            return 1.0
        return 0.0

    def load(self, ckpt: checkpoint.Checkpoint) -> None:
        """Restore the rule's state for this shard's block from a checkpoint (a sharded one
        with any P, or an unsharded one): re-cut when P changed.

        Raises:
            OutputError: a missing or damaged shard file, or one that does not match.
        """
        state = dict(ckpt.aggregator)
        state.update(checkpoint.state_block(ckpt, self.aggregator.needs.sharded_state,
                                            self.group.lo, self.group.hi))
        self.aggregator.load_state_dict(state)
