"""Rank 0's round loop: sample, broadcast, gather, aggregate, evaluate, record (docs/ARCHITECTURE.md).

Data flows one way through a round: selected ids and global parameters go out, updates and
losses come back, the aggregator turns them into a step, the step moves the model, and the
round's row goes to the results file.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from mpifl.aggregators import ObservesParams, PersonalModels, RoundInputs, RoundUpdates
from mpifl.aggregators.base import Aggregator
from mpifl.aggregators.server_opt import ServerOptimizer
from mpifl.clients.faults import accepted, dropped_out
from mpifl.clients.trainer import TrainingStopped
from mpifl.clients.meta import MetaStep
from mpifl.core.blame import blame, origin
from mpifl.core.errors import MpiflError, OutputError
from mpifl.core.layout import ParamLayout
from mpifl.core.rng import EVAL_TAG, SAMPLING_TAG
from mpifl.metrics.fairness import violations_from_counts
from mpifl.metrics.summary import (client_summary, count_conflicts, count_layer_conflicts,
                                   loss_summary)
from mpifl.runtime.backends import ClientBackend, RemoteClients, TrainResult
from mpifl.runtime.client_state import LocalCoordinates
from mpifl.runtime.clock import Clock, RoundTime
from mpifl.runtime.loggers import LoggerSet
from mpifl.runtime.plan import RoundPlan
from mpifl.runtime.progress import BAR_FORMAT, ProgressLog
from mpifl.runtime.schedule import CheckpointSchedule
from mpifl.runtime.sharding import ShardServer
from mpifl.runtime.signals import StopRequest
from mpifl.store.checkpoint import Checkpoint, save
from mpifl.store.writer import ResultsWriter

log = logging.getLogger("mpifl.server")


def select_clients(seed: int, rnd: int, num_samples: np.ndarray, m: int, sampling: str) -> np.ndarray:
    """The clients of round ``rnd`` (ALGORITHMS.md §1), sorted by id.

    Args:
        seed: the run's seed; with ``rnd`` it keys the RNG, so no RNG state needs saving.
        num_samples: (K,) training samples per client (``weighted`` samples proportionally).
        m: clients per round (ignored for ``all``).
        sampling: ``uniform`` (without replacement), ``weighted`` or ``all``.

    Returns:
        (m,) int64 client ids, ascending.
    """
    k = len(num_samples)
    if sampling == "all":
        return np.arange(k, dtype=np.int64)
    rng = np.random.default_rng([seed, rnd, SAMPLING_TAG])
    p = None
    if sampling == "weighted":
        p = np.asarray(num_samples, dtype=np.float64) / np.sum(num_samples)
    return np.sort(rng.choice(k, size=m, replace=False, p=p)).astype(np.int64)


def eval_sample(seed: int, rounds_done: int, num_clients: int, n: int) -> np.ndarray | None:
    """The clients the evaluation after ``rounds_done`` rounds tests (``run.eval_clients``).

    Args:
        seed: the run's seed; with ``rounds_done`` it keys the draw (a resumed run draws the
            same clients).
        num_clients: K. n: clients to test, 0 for all of them.

    Returns:
        (n,) int64 client ids, ascending, drawn uniformly without replacement; None when
        ``n`` is 0 or K (every client).
    """
    if n == 0 or n >= num_clients:
        return None
    rng = np.random.default_rng([seed, rounds_done, EVAL_TAG])
    return np.sort(rng.choice(num_clients, size=n, replace=False)).astype(np.int64)


def _spread(values: np.ndarray, ids: np.ndarray | None, k: int) -> np.ndarray:
    """(K,) float64 with the tested clients' ``values`` at ``ids`` and NaN elsewhere."""
    if ids is None:
        return values
    out = np.full(k, np.nan)
    out[ids] = values
    return out


def eval_due(rnd: int, rounds: int, every: int) -> bool:
    """Evaluate after every ``every`` rounds and after the last one."""
    return (rnd + 1) % every == 0 or rnd + 1 == rounds


@dataclass(frozen=True)
class ServerSetup:
    """What rank 0's round loop drives, built once by the experiment layer
    (:mod:`mpifl.experiment.run`).

    Attributes:
        fed: federated data or a lazy population (sample counts per client).
        layout: the model's :class:`mpifl.core.layout.ParamLayout`.
        clients: where the clients train (:class:`mpifl.runtime.backends.ClientBackend`: in
            this process or on MPI worker ranks).
        aggregator: the rule, from :func:`mpifl.aggregators.create`.
        writer: the results file (its history goes into checkpoints).
        device: where aggregation runs.
        checkpoints: the checkpoint folder (``RUN.h5.ckpt``), or None for no checkpoints.
        stop: when set, the loop stops within seconds, checkpoints and returns early
            (:meth:`Server.run` says where each phase stops), or None.
        world_size: MPI ranks of the run.
        meta: FedMeta's meta step, applied after every aggregation, or None.
        loggers: told every round, or None.
        shard: on a sharded server (``server.shards > 1``), rank 0's shard (shard 0): it
            aggregates with the other shards, and checkpoints ask every shard for its file
            first; else None.
        local: the clients' local coordinates (local BatchNorm), or None.
        optimizer: the server optimizer applied to every step of the rule, or None for none.
        clock: simulated time (``[system] enabled``): it selects among the available clients
            and keeps those that finish in time; None: every selected client finishes,
            instantly.
    """

    fed: Any
    layout: ParamLayout
    clients: ClientBackend
    aggregator: Aggregator
    writer: ResultsWriter
    device: torch.device
    checkpoints: Path | None = None
    stop: StopRequest | None = None
    world_size: int = 1
    meta: MetaStep | None = None
    loggers: LoggerSet | None = None
    shard: ShardServer | None = None
    local: LocalCoordinates | None = None
    optimizer: ServerOptimizer | None = None
    clock: Clock | None = None


class Server:
    """The round loop of rank 0.

    Args:
        plan: the round loop's schedule.
        parts: what the loop drives.
    """

    def __init__(self, plan: RoundPlan, parts: ServerSetup) -> None:
        self.plan, self.parts = plan, parts
        self.fed, self.layout, self.clients = parts.fed, parts.layout, parts.clients
        self.aggregator, self.writer, self.device = parts.aggregator, parts.writer, parts.device
        self.checkpoints, self.stop = parts.checkpoints, parts.stop
        self.world_size, self.meta, self.loggers = parts.world_size, parts.meta, parts.loggers
        self.shard, self.local, self.optimizer = parts.shard, parts.local, parts.optimizer
        self.clock = parts.clock
        self.layers = [layer.slice for layer in parts.layout.layers]
        self._time: RoundTime | None = None  # the round on the clock, counted once kept
        # a regression loss: no accuracy; the clients' test losses are summarised instead
        self.regression = parts.writer.history.metrics.loss
        self.lines = ProgressLog(plan.rounds, 0, 0.0, plan=plan)  # run() makes the real one
        self._saved: int | None = None  # rounds done at the newest checkpoint
        self._stopped_at = (0, 0)  # clients done and in all of the evaluation a stop ended

    def run(self, w: torch.Tensor, start: int = 0, progress: bool = True) -> tuple[torch.Tensor, bool]:
        """Run rounds ``start .. plan.rounds-1`` (first, after a resume, the evaluation a stop
        request interrupted, :meth:`_evaluate_pending`).

        A stop request (:class:`mpifl.runtime.signals.StopRequest`) is acted on within seconds
        in every phase, and the state saved is always that after a whole round:

        - during training (or before it): the training ends at its next local step (every
          rank that trains watches its own stop request between steps; a worker that stops
          tells rank 0, which stops the run too), then the round is dropped and the checkpoint
          holds the state after the round before; resume runs the round again, as it would
          have run. On a sharded server the workers train to the end (the shards aggregate
          what they send), so that round is aggregated and then stops as below;
        - during aggregation (one call, not interruptible): the round ends, its evaluation is
          not started;
        - during an evaluation: every worker stops at its next window of a lazy population's
          clients (``run.eval_window_samples``); the evaluation is dropped, the checkpoint
          holds the state after the round without its /eval row, and ``mpifl resume`` runs that
          evaluation first, so the results equal an uninterrupted run's bit for bit;
        - while the round's results or its checkpoint are written: after them.

        Returns:
            The global parameters (d,) float32 after the last round run, and whether every
            round was run (False when a stop request ended the loop early, after a checkpoint).

        Raises:
            ConfigError: on simulated time, no round trained any client
                (:meth:`_check_trained`); the rounds and checkpoints are written first.
        """
        plan = self.plan
        rounds = plan.rounds
        periodic = plan.checkpoint_every != 0  # 0: only at the end and on a stop request
        schedule = CheckpointSchedule(rounds, plan.checkpoint_every,
                                      plan.checkpoint_minutes if periodic else 0.0,
                                      plan.checkpoint_share)
        bar = tqdm(range(start, rounds), desc=plan.name, unit="round", initial=start,
                   total=rounds, disable=None if progress else True, dynamic_ncols=True,
                   bar_format=BAR_FORMAT)
        self.lines = ProgressLog(rounds, start, plan.progress_every_s, plan=plan,
                                 num_clients=self.fed.num_clients, bar=bar)
        self._saved = start if start else None  # rounds done at the newest checkpoint
        w = w.to(self.device)
        with self.lines.running():
            try:
                if start == 0 and periodic:
                    self.checkpoint(0, w)  # from now on `mpifl resume` always has a config to go on
                schedule.start(start)
                if not self._evaluate_pending(start, w):
                    return w, False
                for rnd in bar:
                    w, going = self._run_round(rnd, w, schedule)
                    if not going:
                        return w, False
            finally:
                bar.close()
        self._check_trained()
        return w, True

    def _check_trained(self) -> None:
        """After the last round on simulated time: the rounds that trained no client counted
        in a warning, and a run of nothing but such rounds refused (ConfigError,
        :func:`mpifl.runtime.clock.check_trained`)."""
        if self.clock is not None:
            self.clock.check_trained()

    def _run_round(self, rnd: int, w: torch.Tensor, schedule: CheckpointSchedule
                   ) -> tuple[torch.Tensor, bool]:
        """Round ``rnd``: train, aggregate, evaluate when due, write its row and checkpoint.
        Returns the parameters and False when a stop request ends the run here."""
        plan, lines, rounds = self.plan, self.lines, self.plan.rounds
        lines.round_begins(rnd)
        moved, row = self._round(rnd, w)
        if row is not None and self.clock is not None and self._time is not None:
            self.clock.advance(self._time)
        if row is None:  # stopped at its training: the round is dropped
            if self._saved != rnd:
                self._checkpoint_now(rnd, w)
            self.writer.flush()
            self._log_stop(rnd, f" (round {rnd + 1} was stopped at its training; it runs "
                                "again on resume)")
            return w, False
        w = moved
        if isinstance(self.aggregator, ObservesParams):
            self.aggregator.observe_params(w)
        summary, evaluated = None, True
        if eval_due(rnd, rounds, plan.eval_every):
            summary = self._evaluate_round(rnd, w, row)
            evaluated = summary is not None
        lines.round_done(rnd, row, summary)
        stopping = self._stopping()
        due = schedule.due(rnd + 1, stopping)
        lines.begin("writing results", rnd + 1)
        self.writer.append_round(row, flush=not due)  # a checkpoint round writes below
        if self.loggers is not None and evaluated:  # else logged when resume evaluates it
            self.loggers.log_round(rnd, row, summary)
        if due:  # the checkpoint first: if the results write then fails, it has the round
            self._checkpoint_timed(rnd + 1, w, schedule)
        lines.end()
        if self._stopping() and (rnd + 1 < rounds or not evaluated):
            if not due:  # the request came while the round was written
                self._checkpoint_timed(rnd + 1, w, schedule)
            self._log_stop(rnd + 1, "" if evaluated else self._eval_stopped())
            return w, False
        return w, True

    def _checkpoint_timed(self, rounds_done: int, w: torch.Tensor,
                          schedule: CheckpointSchedule) -> None:
        """The checkpoint after ``rounds_done`` rounds, its time in the round's row and the
        schedule (the results file is written either way)."""
        t0 = time.perf_counter()
        if self._checkpoint_now(rounds_done, w):
            cost = time.perf_counter() - t0
            self.writer.set_last_round("time_checkpoint", cost)
            schedule.written(rounds_done, cost)
        else:
            self.writer.flush()

    def _checkpoint_now(self, rounds_done: int, w: torch.Tensor) -> bool:
        self.lines.begin("checkpoint", rounds_done)
        written = self.checkpoint(rounds_done, w)
        self.lines.end()
        return written

    def _eval_stopped(self) -> str:
        done, total = self._stopped_at
        where = f"stopped at {done:,} of {total:,} clients" if total else "not started"
        return f" without its evaluation ({where}; `mpifl resume` runs it first)"

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _training_stopped(self) -> None:
        """The clients abandoned a round's training at a stop request (this process's, or a
        worker rank's own signal): from here on the run stops as if asked here."""
        if self.stop is None:
            self.stop = StopRequest()
        self.stop.request("a worker rank's stop signal")  # kept only when none came here

    def _log_stop(self, rounds_done: int, detail: str) -> None:
        assert self.stop is not None  # only a stop request stops a run early
        log.warning("stop requested (%s): checkpointed after round %d of %d%s",
                    self.stop.reason, rounds_done, self.plan.rounds, detail)

    def _evaluate_round(self, rnd: int, w: torch.Tensor, row: dict[str, Any]
                        ) -> dict[str, float] | None:
        """The evaluation after round ``rnd``, its time in ``row``; None when a stop request
        came first or stopped it (then it is left for resume, :meth:`_evaluate_pending`)."""
        if self._stopping():
            self._stopped_at = (0, 0)
            return None
        seconds, summary = self._evaluate(rnd, w, row)
        if summary is not None:
            row["time_eval"] = seconds
        return summary

    def _evaluate_pending(self, start: int, w: torch.Tensor) -> bool:
        """After a resume: the evaluation after ``start`` rounds when it is due but missing
        (a stop request interrupted it; the checkpoint holds the state it evaluates). Its row
        goes to the results and the loggers as if the run had not stopped. False when a stop
        request stops it again."""
        h = self.writer.history
        if start == 0 or not self.plan.evaluates(start) or h.eval_round[-1:] == [start]:
            return True
        log.info("round %d/%d: its evaluation was stopped by the last run; evaluating first",
                 start, self.plan.rounds)
        seconds, summary = self._evaluate(start - 1, w)
        if summary is None:
            self._log_stop(start, self._eval_stopped())
            return False
        row = {name: column[-1] for name, column in h.rounds.items()}
        self.writer.set_last_round("time_eval", seconds)  # written with the evaluation
        if self.loggers is not None:
            self.loggers.log_round(start - 1, {**row, "time_eval": seconds}, summary)
        return True

    def _on_progress(self, done: int, total: int) -> bool:
        """An evaluation's progress (:data:`mpifl.runtime.backends.OnProgress`): to the
        progress lines; False (stop at the next window) once a stop is requested."""
        self.lines.advance(done, total)
        return not self._stopping()

    def checkpoint(self, rounds_done: int, w: torch.Tensor) -> bool:
        """Write a checkpoint of the state after ``rounds_done`` rounds (if enabled)."""
        if (folder := self.checkpoints) is None:
            return False
        bounds = None
        if (shard := self.shard) is not None:  # every shard writes, then this one lists them
            assert isinstance(self.clients, RemoteClients)  # shards are worker ranks
            status = self.clients.checkpoint_shards(
                rounds_done, lambda: shard.write_checkpoint(folder, rounds_done))
            if failed := [j for j in range(shard.group.size) if status[j] != 0]:
                raise OutputError(f"cannot write checkpoint after round {rounds_done}: shard(s) "
                                  f"{', '.join(map(str, failed))} could not write their files "
                                  "(their ranks logged why); the previous checkpoints are kept")
            bounds = shard.group.bounds
        # after the shard files: a large rule state (its stacked history) is copied once at a time
        state = self.aggregator.state_dict()
        if self.shard is not None:
            state = {k: v for k, v in state.items()
                     if k not in self.aggregator.needs.sharded_state}
        ckpt = Checkpoint(rounds_done, w.detach().cpu().numpy(), state, self.writer.history,
                          self.plan.config_json, self.world_size, folder, bounds,
                          client_state=self.local.state_dict() if self.local else {},
                          server_state=self._server_state())
        save(folder, ckpt)
        self._saved = rounds_done
        return True

    def _server_state(self) -> dict[str, np.ndarray | np.generic]:
        """The server optimizer's and the clock's state, for the checkpoint."""
        state: dict[str, np.ndarray | np.generic] = {}
        if self.optimizer is not None:
            state.update({f"optimizer_{k}": v for k, v in self.optimizer.state_dict().items()})
        if self.clock is not None:
            state.update({f"clock_{k}": v for k, v in self.clock.state_dict().items()})
        return state

    def _round(self, rnd: int, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """Round ``rnd``'s training and aggregation: the parameters after it and its /rounds
        row; the row is None when a stop request dropped the round (before or right after its
        training, when nothing of it is kept yet)."""
        plan = self.plan
        lr = plan.lr_at(rnd)
        selected, pool = self._select(rnd)
        ids = pool[~dropped_out(plan.seed, rnd, pool, plan.dropout)]
        row: dict[str, Any] = {"round": rnd, "lr": lr, "dropped": len(pool) - len(ids), "rejected": 0,
               "num_clients": 0, "train_loss": float("nan"), "conflicts_model": 0,
               "conflicts_layer": np.zeros(len(self.layers), dtype=np.int64),
               "bytes_moved": 0, "time_broadcast": 0.0, "time_train": 0.0, "time_gather": 0.0,
               "time_aggregate": 0.0, "time_eval": 0.0, "time_checkpoint": 0.0,
               "peak_rss_server_mb": 0.0, "peak_rss_worker_mb": 0.0,
               "selected": selected, "aggregated": np.zeros(len(selected), dtype=bool)}
        if len(ids) == 0:
            return w, row  # everyone dropped out: the model does not move
        if self._stopping():
            return w, None  # stopped before training: drop the round
        agg, lines = self.aggregator, self.lines
        state = (self.local.of(ids).to(w.device) if self.local is not None
                 else agg.client_state(ids, w) if isinstance(agg, PersonalModels) else None)
        inputs = agg.round_inputs() if isinstance(agg, RoundInputs) else None
        lines.begin("training", rnd + 1)
        try:
            res = self.clients.train(rnd, lr, ids, w, inputs, state,
                                     phase=lambda name: lines.begin(name, rnd + 1))
        except TrainingStopped:
            self._training_stopped()
            return w, None  # abandoned between steps: nothing of the round is kept
        if self.shard is None and self._stopping():
            return w, None  # nothing of the round is kept yet: drop it
        lines.begin("aggregation", rnd + 1)
        row.update(train_loss=float(res.losses.double().mean()), bytes_moved=res.bytes_moved,
                   time_broadcast=res.time_broadcast, time_train=res.time_train,
                   time_gather=res.time_gather, peak_rss_server_mb=res.peak_rss_server / 2**20,
                   peak_rss_worker_mb=res.peak_rss_worker / 2**20)
        if self.shard is not None:
            return self._aggregate_sharded(rnd, lr, ids, res, w, row)
        t0 = time.perf_counter()
        keep = accepted(res.updates, plan.max_update_norm)
        row["rejected"] = int((~keep).sum())
        if not bool(keep.any()):
            log.warning("round %d: every update was rejected; the model does not move", rnd)
            return w, row
        updates, keep_np, stats = res.updates, keep.cpu().numpy(), res.stats
        if row["rejected"]:
            updates = updates[keep]
            stats = {k: v[keep] for k, v in stats.items()}
        kept = ids[keep_np]
        row["aggregated"] = np.isin(selected, kept)

        asked = [0]

        def loss_at(step: torch.Tensor) -> torch.Tensor:  # an evaluation-only request
            losses, nbytes = self.clients.losses(kept, w - step.to(w))
            row["bytes_moved"] += nbytes
            asked[0] += 1
            lines.advance(asked[0], unit="loss requests")
            return losses.float()

        r = RoundUpdates(round=rnd, client_ids=kept, updates=updates, losses=res.losses[keep],
                         num_samples=self.fed.num_train[kept], lr=lr, layers=self.layers,
                         stats=stats, loss_at=loss_at)
        step = self._aggregate(r, w)
        if self.local is not None:  # the aggregated clients keep their trained coordinates
            self.local.store(kept, stats["local_state"])
        w = w - self._server_step(step)
        if self.meta is not None:  # FedMeta (Yao et al. 2019): a step on the server's meta set
            w = self.meta.apply(w)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        row.update(num_clients=len(r.client_ids), conflicts_model=count_conflicts(updates, step),
                   conflicts_layer=count_layer_conflicts(updates, step, self.layers),
                   time_aggregate=time.perf_counter() - t0)
        return w, row

    def _select(self, rnd: int) -> tuple[np.ndarray, np.ndarray]:
        """Round ``rnd``'s selected clients and those of them that can be trained: all of
        them, or on simulated time the ones that finish in time (:class:`mpifl.runtime.clock.
        Clock`)."""
        plan = self.plan
        if self.clock is None:
            selected = select_clients(plan.seed, rnd, self.fed.num_train,
                                      plan.clients_per_round, plan.sampling)
            return selected, selected
        self._time = on_clock = self.clock.round(rnd, plan.clients_per_round, plan.sampling)
        return on_clock.selected, on_clock.kept

    def _server_step(self, step: torch.Tensor) -> torch.Tensor:
        """The step the model moves by: the rule's, through the server optimizer if any (the
        conflict counts stay those of the rule's step)."""
        return step if self.optimizer is None else self.optimizer.apply(step)

    def _aggregate(self, r: RoundUpdates, w: torch.Tensor) -> torch.Tensor:
        """The rule's step, with a plugin rule's failure named and a step of the wrong shape
        refused in one line."""
        name = self.plan.rule
        with blame([("rule", name, type(self.aggregator))], "aggregate"):
            step = self.aggregator.aggregate(r)
        if not isinstance(step, torch.Tensor) or tuple(step.shape) != tuple(w.shape):
            got = tuple(step.shape) if isinstance(step, torch.Tensor) else type(step).__name__
            raise MpiflError(f"rule '{name}' ({origin(type(self.aggregator))}): aggregate "
                             f"returned a step of shape {got}, expected {tuple(w.shape)} (one "
                             f"value per coordinate of w)")
        return step

    def _aggregate_sharded(self, rnd: int, lr: float, ids: np.ndarray, res: TrainResult,
                           w: torch.Tensor, row: dict[str, Any]
                           ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The round's aggregation on the shards (:class:`mpifl.runtime.sharding.ShardServer`):
        ``res.updates`` is this rank's column block of the updates."""
        t0 = time.perf_counter()
        assert self.shard is not None  # a sharded server's round
        out = self.shard.aggregate(rnd, lr, ids, res.updates, res.losses, res.stats)
        row["rejected"] = int((~out.keep).sum())
        if out.step is None:
            log.warning("round %d: every update was rejected; the model does not move", rnd)
            return w, row
        row["aggregated"] = np.isin(row["selected"], ids[out.keep])
        w = w - self._server_step(out.step.to(w))
        row.update(num_clients=int(out.keep.sum()), conflicts_model=out.conflicts_model,
                   conflicts_layer=out.conflicts_layer, time_aggregate=time.perf_counter() - t0)
        return w, row

    def _adapt(self, rnd: int) -> tuple[int, float] | None:
        """``(round, lr)`` of the evaluation after round ``rnd`` with local adaptation
        (``run.adapt_epochs`` > 0), else None: round = rounds completed (keys the minibatch
        order, with ADAPT_TAG), lr = the learning rate the next round's training would use."""
        if not self.plan.adapt:
            return None
        return rnd + 1, self.plan.lr_at(rnd + 1)

    def _evaluate(self, rnd: int, w: torch.Tensor, row: dict[str, Any] | None = None
                  ) -> tuple[float, dict[str, float] | None]:
        """Evaluate every client (or ``plan.eval_clients`` of them, keyed by the round, unless
        this evaluation is a full one); the round's ``row`` gets the peak memory after it.
        Untested clients' values are NaN. Returns the seconds and the summary, None (nothing
        recorded) when a stop request stopped it."""
        t0 = time.perf_counter()
        agg, k = self.aggregator, self.fed.num_clients
        ids = (None if self.plan.tests_all(rnd + 1) else
               eval_sample(self.plan.seed, rnd + 1, k, self.plan.eval_clients))
        self.lines.begin("evaluation", rnd + 1, k if ids is None else len(ids),
                         full=ids is None)
        rows: Callable[[torch.Tensor], torch.Tensor] = (
            (lambda a: a) if ids is None else (lambda a: a[torch.from_numpy(ids).to(a.device)]))
        own = agg.personal_params(w) if isinstance(agg, PersonalModels) else None
        rep = self.clients.evaluate(agg.evaluation_params(w) if isinstance(agg, ObservesParams)
                                    else w,
                                    None if own is None else rows(own),
                                    self._adapt(rnd),
                                    None if self.local is None else rows(self.local.rows),
                                    ids=ids, window=self.plan.eval_window_samples,
                                    on_progress=self._on_progress)
        if rep.stopped and (ph := self.lines.phase) is not None:  # where it stopped, for the log
            self._stopped_at = (ph.done, ph.total)
        self.lines.end(complete=not rep.stopped)
        tested = self.fed.num_test if ids is None else self.fed.num_test[ids]
        acc, loss = rep.accuracy, rep.loss
        if row is not None and rep.peak_rss is not None:  # evaluation often peaks highest
            mb = rep.peak_rss / 2**20
            row["peak_rss_server_mb"] = max(row["peak_rss_server_mb"], float(mb[0]))
            row["peak_rss_worker_mb"] = max(row["peak_rss_worker_mb"], float(mb[1:].max()
                                                                             if len(mb) > 1 else mb[0]))
        if rep.stopped:
            return time.perf_counter() - t0, None
        summary = client_summary(acc, tested)
        if rep.counts is not None:  # summed over clients: the union of all test data
            union = rep.counts.sum(axis=0).reshape(-1, 2, 3)
            summary.update({f"group/{name}": v for name, v in
                            violations_from_counts(union).items()})
        personal = adapted = None
        if rep.personal is not None:  # Ditto: each client's own model
            personal = (_spread(rep.personal[0], ids, k), _spread(rep.personal[1], ids, k))
            summary.update({f"personal/{name}": v for name, v in
                            client_summary(rep.personal[0], tested).items()})
        if rep.adapted is not None:  # after local adaptation (run.adapt_epochs)
            adapted = (_spread(rep.adapted[0], ids, k), _spread(rep.adapted[1], ids, k))
            summary.update({f"adapted/{name}": v for name, v in
                            client_summary(rep.adapted[0], tested).items()})
        if self.regression:
            summary.update({f"loss/{name}": v for name, v in loss_summary(loss).items()})
        self.writer.append_eval(rnd + 1, _spread(acc, ids, k), _spread(loss, ids, k), summary,
                                personal, adapted)
        if self.regression:
            log.info("round %d/%d: mean loss %.5g, std %.3g, worst5 %.5g, best5 %.5g",
                     rnd + 1, self.plan.rounds, summary["loss/mean"], summary["loss/std"],
                     summary["loss/worst5"], summary["loss/best5"])
            if not math.isfinite(summary["loss/mean"]):
                log.warning("round %d: non-finite loss", rnd + 1)
            return time.perf_counter() - t0, summary
        log.info("round %d/%d: mean acc %.4f, std %.2f pp, worst5 %.4f, best5 %.4f",
                 rnd + 1, self.plan.rounds, summary["mean"], 100 * summary["std"],
                 summary["worst5"], summary["best5"])
        if not math.isfinite(summary["mean"]):
            log.warning("round %d: non-finite accuracy", rnd + 1)
        return time.perf_counter() - t0, summary
