"""The loop of every worker rank (rank >= 1): serve TRAIN, LOSSES, EVAL and CHECKPOINT requests
until STOP.

A worker trains its contiguous block of each round's selected clients as one vectorised
computation, and evaluates a static share of all K clients (blocks by test-set size). On a lazy
population (:mod:`mpifl.data.lazy`) it draws only the clients of each request, and streams its
share of a full evaluation in windows (:func:`mpifl.runtime.backends.stream_blocks`), telling
rank 0 how far it is between windows and stopping at the next one when rank 0 asks
(:class:`mpifl.runtime.protocol.EvalReport`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from mpifl.runtime.backends import client_rows, evaluate_clients, group_setup, stats_rows
from mpifl.runtime.comm import rank_counts, release_free_memory, split_by_samples
from mpifl.runtime.protocol import CHECKPOINT, EVAL, LOSSES, STOP, TRAIN, MPITransport


def serve(transport: MPITransport, trainer, fed, device: torch.device, adapter=None,
          shard=None, checkpoints: Path | None = None) -> int:
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
    """
    block = transport.rank - 1
    workers = transport.workers
    eval_bounds = split_by_samples(fed.num_test, workers)
    eval_ids = np.arange(eval_bounds[block], eval_bounds[block + 1], dtype=np.int64)
    groups = group_setup(fed, device)

    def mine(client_ids: np.ndarray, sizes: np.ndarray = fed.num_train) -> np.ndarray:
        bounds = split_by_samples(sizes[client_ids], workers)
        return client_ids[bounds[block]:bounds[block + 1]]

    def tested(client_ids: np.ndarray) -> np.ndarray:
        """This rank's clients of an evaluation: its static share of all K, or its block of
        the sampled ones (``run.eval_clients``) by test samples."""
        return eval_ids if not len(client_ids) else mine(client_ids, fed.num_test)

    def rows_mine(command: int, client_ids: np.ndarray) -> int:
        return len(mine(client_ids)) if command == TRAIN else len(tested(client_ids))

    while True:
        req = transport.receive(rows_mine)
        if req.command == STOP:
            return req.round
        if req.command == CHECKPOINT:
            ok = 0.0 if shard is None else shard.write_checkpoint(checkpoints, req.round)
            transport.checkpoint.reply(ok)
            continue
        w = torch.from_numpy(req.w).to(device)
        if req.command == TRAIN:  # a function: the round's (m, d) arrays die with its frame
            _serve_train(transport, trainer, fed, w, req, block, device, shard)
        elif req.command == LOSSES:
            ids = mine(req.client_ids)
            loss = np.empty(0)
            if len(ids):
                with client_rows(fed, ids, trainer) as (idx, _):
                    loss = trainer.evaluate(w, idx)[1]
            transport.losses.reply(loss)
        elif req.command == EVAL:
            report = transport.eval.report()
            transport.eval.reply(report, *_evaluate(trainer, fed, w, tested(req.client_ids),
                                                    groups, req, device, adapter, report))


def _serve_train(transport, trainer, fed, w, req, block, device, shard) -> None:
    """Train this rank's block of the round's clients and reply; on a sharded server, then
    aggregate this shard's column block. Nothing of the round outlives the call, so the next
    round's updates never sit beside this round's."""
    bounds = split_by_samples(fed.num_train[req.client_ids], transport.workers)
    ids = req.client_ids[bounds[block]:bounds[block + 1]]
    t0 = time.perf_counter()
    state = None if req.state is None else torch.from_numpy(req.state).to(device)
    out = _train(trainer, fed, w, req.round, req.lr, ids, req.inputs, state)
    cols = transport.train.reply(*out, time.perf_counter() - t0, rank_counts(bounds))
    del out
    release_free_memory()  # the replied updates' pages too (client_rows freed the window's)
    if shard is not None:  # this shard's part of the aggregation
        shard.aggregate(req.round, req.lr, req.client_ids, torch.from_numpy(cols).to(device))


def _train(trainer, fed, w, rnd, lr, ids, inputs, state):
    cols = trainer.columns
    if len(ids) == 0:
        return (np.empty((0, w.numel()), np.float32), np.empty(0, np.float32),
                np.empty((0, cols.stats_width), np.float32))
    with client_rows(fed, ids, trainer) as (idx, _):
        updates, losses, stats = trainer.run_round(w, rnd, lr, ids, idx, inputs, state)
    return (updates.cpu().numpy(), losses.cpu().numpy(),
            stats_rows(cols, stats, len(ids)).cpu().numpy())


def _evaluate(trainer, fed, w, ids, groups, req, device, adapter, report):
    """The EVAL reply's arrays for this rank's clients ``ids`` (empty when there are more ranks
    than clients), in windows of ``req.window`` samples, ``report`` told the clients done
    before each (and stopping there when rank 0 says so: NaN for the rest)."""
    if not len(ids):
        width = 0 if groups is None else groups[1] * 6
        empty = (np.empty(0), np.empty(0))
        return (*empty, np.empty((0, width)) if width else None,
                empty if req.personal is not None else None, empty if req.adapt else None)
    on = lambda a: None if a is None else torch.from_numpy(a).to(device)  # noqa: E731
    out = evaluate_clients(trainer, fed, w, ids, groups, on(req.personal), on(req.local),
                           adapter, (req.round, req.lr) if req.adapt else None,
                           req.window or None, report)
    return out.accuracy, out.loss, out.counts, out.personal, out.adapted
