"""The loop of every worker rank (rank >= 1): serve TRAIN, LOSSES, EVAL and CHECKPOINT requests
until STOP.

A worker trains its contiguous block of each round's selected clients as one vectorised
computation, and evaluates a static share of all K clients (blocks by test-set size). On a lazy
population (:mod:`mpifl.data.lazy`) it draws only the clients of each request, and streams its
share of a full evaluation in windows (:func:`mpifl.runtime.backends.stream_blocks`), telling
rank 0 how far it is between windows and stopping at the next one when rank 0 asks
(:class:`mpifl.runtime.protocol.EvalReport`).

The parameters come in and a TRAIN's (m_r, d) updates, losses and statistics go out through
:class:`mpifl.runtime.staging.Staging`: on a GPU, reused pinned host buffers and
``non_blocking`` copies with one synchronisation before MPI reads them; on a CPU, numpy views
of the tensors, no copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpifl.clients.interface import ClientTrainer
from mpifl.clients.trainer import TrainingStopped, stop_between_steps
from mpifl.runtime.backends import (client_rows, evaluate_clients, group_setup, stats_rows,
                                    stats_width)
from mpifl.runtime.comm import rank_counts, release_free_memory, split_by_samples
from mpifl.runtime.protocol import (TRAIN, EvalReport, Evaluated, MPITransport, Request,
                                    TrainBlock)
from mpifl.runtime.staging import Staging

if TYPE_CHECKING:
    from mpifl.runtime.sharding import ShardServer


def serve(transport: MPITransport, trainer: ClientTrainer, fed: Any, device: torch.device,
          adapter: ClientTrainer | None = None, shard: ShardServer | None = None,
          checkpoints: Path | None = None, stopping: Callable[[], bool] | None = None) -> int:
    """Answer rank 0's requests until it sends STOP; returns the exit status STOP carries.

    Args:
        transport: the worker end of the protocol.
        trainer: the run's :class:`~mpifl.clients.interface.ClientTrainer` over the whole
            sample store (of a lazy population: an empty one, each request's window staged in
            it).
        fed: the federated data or lazy population (every rank builds the same one from the
            same seed).
        device: where this rank trains.
        adapter: the trainer of evaluation after local adaptation (``run.adapt_epochs``), or None.
        shard: on a sharded server, this rank's :class:`mpifl.runtime.sharding.ShardServer`
            when it is one of the shards (ranks 1 .. P-1), else None.
        checkpoints: the run's checkpoint folder (a shard writes its files there).
        stopping: ``stopping() -> bool``, this rank's stop request: True ends a TRAIN's
            training at its next local step (:meth:`Worker.train`); None: never (a sharded
            server, whose shards aggregate what the workers send).
    """
    worker = Worker(transport.rank, transport.workers, trainer, fed, device, adapter, shard,
                    checkpoints, stopping)
    while (status := transport.serve_next(worker)) is None:
        pass
    return status


class Worker:
    """One worker rank's part of each command (:class:`mpifl.runtime.protocol.WorkerRank`):
    its contiguous block of a round's selected clients (by training samples) and its static
    share of all K clients in an evaluation (by test samples). Arguments as :func:`serve`;
    ``rank`` and ``workers`` the transport's."""

    def __init__(self, rank: int, workers: int, trainer: ClientTrainer, fed: Any,
                 device: torch.device, adapter: ClientTrainer | None = None,
                 shard: ShardServer | None = None, checkpoints: Path | None = None,
                 stopping: Callable[[], bool] | None = None) -> None:
        self.block, self.workers = rank - 1, workers
        self.trainer, self.fed, self.device, self.adapter = trainer, fed, device, adapter
        self.shard, self.checkpoints, self.stopping = shard, checkpoints, stopping
        bounds = split_by_samples(fed.num_test, workers)
        self.eval_ids = np.arange(bounds[self.block], bounds[self.block + 1], dtype=np.int64)
        self.groups = group_setup(fed, device)
        self.staging = Staging(device)

    def split(self, client_ids: np.ndarray, sizes: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """(this rank's block of ``client_ids``, every rank's block bounds (workers + 1,)),
        blocks of about equal ``sizes`` (default: training samples)."""
        sizes = self.fed.num_train if sizes is None else sizes
        bounds = split_by_samples(sizes[client_ids], self.workers)
        return client_ids[bounds[self.block]:bounds[self.block + 1]], bounds

    def mine(self, client_ids: np.ndarray, sizes: np.ndarray | None = None) -> np.ndarray:
        """This rank's block of ``client_ids`` by ``sizes`` (default: training samples)."""
        return self.split(client_ids, sizes)[0]

    def tested(self, client_ids: np.ndarray) -> np.ndarray:
        """This rank's clients of an evaluation: its static share of all K, or its block of
        the sampled ones (``run.eval_clients``) by test samples."""
        return self.eval_ids if not len(client_ids) else self.mine(client_ids, self.fed.num_test)

    def rows(self, command: int, client_ids: np.ndarray) -> int:
        return len(self.mine(client_ids)) if command == TRAIN else len(self.tested(client_ids))

    def _w(self, req: Request) -> torch.Tensor:
        """The request's (d,) float32 parameters on the device."""
        return self.staging.to_device(req.w, "w")

    def train(self, req: Request) -> TrainBlock:
        """This rank's block of the round's clients trained (nothing of the round is kept:
        the next round's updates never sit beside this round's).

        On a GPU the block's arrays are views of :attr:`staging`'s reused buffers, valid
        until the next TRAIN: :meth:`mpifl.runtime.protocol.Train.serve` gathers them before
        the worker serves another request.

        A stop request of this rank (``stopping``) ends the training at its next local step:
        the block is then NaN with NaN seconds, which tells rank 0 to drop the round
        (:meth:`mpifl.runtime.backends.RemoteClients.train`); the reply's collectives are
        the same.
        """
        ids, bounds = self.split(req.client_ids)
        t0 = time.perf_counter()
        cols = self.trainer.columns
        if len(ids) == 0:
            return TrainBlock(np.empty((0, len(req.w)), np.float32), np.empty(0, np.float32),
                              np.empty((0, cols.stats_width), np.float32),
                              time.perf_counter() - t0, rank_counts(bounds))
        state = None if req.state is None else self.staging.to_device(req.state, "state")
        try:
            with client_rows(self.fed, ids, self.trainer) as (idx, _), \
                    stop_between_steps(self.stopping):
                updates, losses, stats = self.trainer.run_round(self._w(req), req.round,
                                                                req.lr, ids, idx, req.inputs,
                                                                state)
        except TrainingStopped:
            nan = np.float32(np.nan)
            return TrainBlock(np.full((len(ids), len(req.w)), nan, np.float32),
                              np.full(len(ids), nan, np.float32),
                              np.full((len(ids), cols.stats_width), nan, np.float32),
                              float("nan"), rank_counts(bounds))
        u, loss, rows = self.staging.to_host(updates, losses, stats_rows(cols, stats, len(ids)))
        return TrainBlock(u, loss, rows, time.perf_counter() - t0, rank_counts(bounds))

    def trained(self, req: Request, columns: np.ndarray | None) -> None:
        release_free_memory()  # the replied updates' pages too (client_rows freed the window's)
        if self.shard is not None and columns is not None:  # this shard's part of the rule
            self.shard.aggregate(req.round, req.lr, req.client_ids,
                                 torch.from_numpy(columns).to(self.device))

    def losses(self, req: Request) -> np.ndarray:
        ids = self.mine(req.client_ids)
        if not len(ids):
            return np.empty(0, np.float32)
        with client_rows(self.fed, ids, self.trainer) as (idx, _):
            return self.trainer.evaluate(self._w(req), idx)[1]

    def evaluate(self, req: Request, report: EvalReport) -> Evaluated:
        """This rank's clients of the evaluation (none when there are more ranks than
        clients), in windows of ``req.window`` samples, ``report`` told the clients done
        before each (and stopping there when rank 0 says so: NaN for the rest)."""
        ids = self.tested(req.client_ids)
        if not len(ids):
            width = 0 if self.groups is None else stats_width(self.groups[1])
            pair = (np.empty(0), np.empty(0))
            return Evaluated(np.empty(0), np.empty(0), np.empty((0, width)) if width else None,
                             pair if req.personal is not None else None,
                             pair if req.adapt else None)
        on: Callable[[np.ndarray | None], torch.Tensor | None] = (  # noqa: E731
            lambda a: None if a is None else torch.from_numpy(a).to(self.device))
        return evaluate_clients(self.trainer, self.fed, self._w(req), ids, self.groups,
                                on(req.personal), on(req.local), self.adapter,
                                (req.round, req.lr) if req.adapt else None, req.window or None,
                                report)

    def checkpoint(self, req: Request) -> float:
        if self.shard is None:
            return 0.0
        assert self.checkpoints is not None, "a shard writes into the run's checkpoint folder"
        return self.shard.write_checkpoint(self.checkpoints, req.round)
