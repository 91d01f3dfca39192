"""Rank 0's loop for asynchronous rules (``needs.asynchronous``: FedBuff, FedAsync) on simulated
time: clients train concurrently from the model version current when they started, and the
server aggregates whenever ``buffer_size`` of them have finished.

"Round" r of the run is server step r (one aggregation), so evaluation every ``eval_every``
steps, checkpoints, the /rounds rows, stop signals and progress are the synchronous
:class:`mpifl.runtime.server.Server`'s. Step r at simulated time ``now``:

1. **Start.** While fewer than C (``concurrency``) clients are in flight, C minus those start
   from the current model (version r), drawn among the clients available at ``now`` and not in
   flight as :func:`mpifl.runtime.server.select_clients` draws (``[seed, r, SAMPLING_TAG]``,
   uniform or weighted without replacement; ``sampling = "all"``: every such client); those
   that drop out (``client.dropout``, keyed by (seed, r)) do not start. Each would finish at
   ``now + SystemModel.round_seconds``; one whose availability ends first never finishes.
2. **Wait.** The in-flight clients' events in order of (time, client id): a finish joins the
   buffer, a departure is counted late and leaves the flight, until B (``buffer_size``)
   updates are buffered; ``now`` moves to the B-th finish. When everyone in flight finishes
   or leaves before B arrive, the step aggregates those that did (none: the model does not
   move) and ``now`` moves to the last event; when nobody is in flight or can start, ``now``
   moves to the next time a client becomes available.
3. **Train.** The buffered clients are trained only now, one ``clients.train`` call per start
   version v with the model of version v and the learning rate of round v, keyed by round v:
   a client's minibatches depend on (seed, v, client), never on the order the server runs
   things or the number of ranks.
4. **Aggregate** through the rule and the server optimizer, as every rule's step; the rule
   sees ``stats["staleness"]`` (r - v per update) and, with ``needs.current_updates``
   (FedAsync), the updates against the current model, ``(w - w_v) + u_k = w - w_k``.
   The model versions no longer referenced by an in-flight client are dropped.

Without a system model (``[system] enabled = false``) every client takes 1 simulated second and
is always available. With ``buffer_size = concurrency = m`` every step starts m clients at once
and aggregates all of them with staleness 0: the synchronous round of the same seed.

Everything is a function of the seed, the step and the state that checkpoints carry
(``server_state["async_*"]``: the simulated time, the in-flight clients, their model versions,
the per-client counters and the per-step table), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mpifl.aggregators import RoundInputs, RoundUpdates
from mpifl.clients.faults import accepted, dropped_out
from mpifl.clients.trainer import TrainingStopped
from mpifl.core.errors import ConfigError, MpiflError
from mpifl.core.rng import SAMPLING_TAG
from mpifl.metrics.summary import count_conflicts, count_layer_conflicts
from mpifl.clients.system import SystemModel
from mpifl.runtime.clock import check_trained, system_tables
from mpifl.runtime.plan import RoundPlan
from mpifl.runtime.server import Server, ServerSetup

__all__ = ["AsyncServer", "Flight"]

log = logging.getLogger("mpifl.server")

#: a buffer's training: ``(updates, losses, stats)`` in the order of its client ids
Trained = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]

_FLIGHT = ("ids", "version", "start", "finish", "until")


@dataclass
class Flight:
    """The clients in flight, one row each (all (n,)).

    Attributes:
        ids: int64 client ids. version: int64 the model version (server step) each started
            from. start: float64 simulated start time (s). finish: float64 when it would
            finish. until: float64 when its availability ends (``inf``: never).
    """

    ids: np.ndarray
    version: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    until: np.ndarray

    @classmethod
    def empty(cls) -> Flight:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), *(np.zeros(0) for _ in range(3)))

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: np.ndarray) -> Flight:
        return Flight(*(getattr(self, n)[rows] for n in _FLIGHT))

    def join(self, other: Flight) -> Flight:
        return Flight(*(np.concatenate([getattr(self, n), getattr(other, n)]) for n in _FLIGHT))

    @property
    def end(self) -> np.ndarray:
        """(n,) float64 each one's next event: its finish, or its departure when earlier."""
        return np.where(self.finish <= self.until, self.finish, self.until)

    @property
    def done(self) -> np.ndarray:
        """(n,) bool: it finishes (its availability lasts)."""
        return self.finish <= self.until


@dataclass
class Step:
    """What step r does, decided before training (committed only when the step is kept).

    Attributes:
        started: (s,) int64 clients started at the step's start (before dropout).
        dropped: (s,) bool which of them dropped out.
        buffered: the clients aggregated (a Flight of them, rows by (finish, id)).
        late: the clients that left before finishing during the step.
        flight: the clients still in flight after the step.
        now: the simulated time at the step's end.
    """

    started: np.ndarray
    dropped: np.ndarray
    buffered: Flight
    late: Flight
    flight: Flight
    now: float


class AsyncServer(Server):
    """The round loop of rank 0 for an asynchronous rule (module docstring).

    Args:
        plan, parts: :class:`mpifl.runtime.server.Server`'s (``parts.clock`` None).
        system: the clients' devices and availability (:class:`mpifl.clients.system.
            SystemModel`), or None: every client takes 1 simulated second, always available.
        epochs: local epochs a round (the system model's local work).
        work: (K,) int64 samples each client's round goes through, when capped
            (:class:`mpifl.runtime.clock.Clock`'s); None: ``epochs`` epochs over its data.

    Raises:
        ConfigError: a rule that is not asynchronous or lacks ``buffer_size``/``concurrency``,
            or a sharded server.
        ConfigError, DataError: no client could ever finish (:meth:`mpifl.clients.system.
            SystemModel.check_rounds`).
    """

    #: per-client counters: name -> dtype (checkpointed, written to /system/clients)
    COUNTERS = {"participations": np.int64, "finished": np.int64, "late": np.int64,
                "busy_s": np.float64}

    def __init__(self, plan: RoundPlan, parts: ServerSetup, *, system: SystemModel | None = None,
                 epochs: int = 1, work: np.ndarray | None = None) -> None:
        super().__init__(plan, parts)
        agg, name = self.aggregator, self.plan.rule
        if not agg.needs.asynchronous:
            raise ConfigError(f"server.algorithm: '{name}' is not an asynchronous rule")
        if self.shard is not None or self.clock is not None:
            raise ConfigError(f"server: '{name}' is asynchronous; it runs on one server "
                              "(server.shards = 1) with its own simulated time")
        try:
            # declared by the rule's needs (mpifl.aggregators.Needs.asynchronous), not the base
            self.buffer = int(getattr(agg, "buffer_size"))  # noqa: B009
            self.concurrency = int(getattr(agg, "concurrency"))  # noqa: B009
        except (AttributeError, TypeError, ValueError):
            raise ConfigError(f"server.algorithm: '{name}' is asynchronous but has no int "
                              "buffer_size and concurrency (mpifl.aggregators.Needs)") from None
        if not 1 <= self.buffer <= self.concurrency:
            raise ConfigError(f"{name}: need 1 <= buffer_size ({self.buffer}) <= concurrency "
                              f"({self.concurrency})")
        self.system, self.epochs = system, int(epochs)
        self._work = (self.fed.num_train, self.epochs) if work is None else (
            np.asarray(work, dtype=np.int64), 1)
        if system is not None:  # refuse before the first step a run in which nobody finishes
            system.check_rounds(*self._work)
        k = self.fed.num_clients
        self.now = 0.0
        self.flight = Flight.empty()
        self.versions: dict[int, torch.Tensor] = {}  # start version -> (d,) model
        self.counters = {n: np.zeros(k, dtype=dt) for n, dt in self.COUNTERS.items()}
        #: per step: (simulated end (s), started, finished, late, mean staleness)
        self.steps: list[tuple[float, int, int, int, float]] = []

    # ------------------------------------------------------------------ the clients' time

    def _available(self, t: float) -> np.ndarray:
        if self.system is None:
            return np.ones(self.fed.num_clients, dtype=bool)
        return np.asarray(self.system.available(t), dtype=bool)

    def _times(self, ids: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(finish, until): when ``ids`` started at ``t`` would finish, and leave."""
        if self.system is None:
            return np.full(len(ids), t + 1.0), np.full(len(ids), np.inf)
        seconds = self.system.round_seconds(ids, self._work[0][ids], self._work[1])
        return t + seconds, np.asarray(self.system.available_until(ids, t), dtype=np.float64)

    def _next_available(self, t: float) -> float:
        """The first time after ``t`` that a client becomes available (the system model's
        periodic phases or trace intervals); ``inf`` when none ever does."""
        return math.inf if self.system is None else float(self.system.next_available(t))

    def _start(self, rnd: int, now: float, busy: np.ndarray) -> np.ndarray:
        """The clients step ``rnd`` starts at ``now`` (ascending), as select_clients draws."""
        plan = self.plan
        pool = np.flatnonzero(self._available(now) & ~busy).astype(np.int64)
        if plan.sampling == "all" or len(pool) == 0:
            return pool
        n = min(len(pool), self.concurrency - int(busy.sum()))
        if n <= 0:
            return pool[:0]
        p = None
        if plan.sampling == "weighted":
            w = self.fed.num_train[pool].astype(np.float64)
            p = w / w.sum()
        rng = np.random.default_rng([plan.seed, rnd, SAMPLING_TAG])
        return np.sort(pool[rng.choice(len(pool), size=n, replace=False, p=p)]).astype(np.int64)

    def _plan_step(self, rnd: int) -> Step:
        """Steps 1-2 of the module's docstring, without changing the server's state."""
        plan, now, flight = self.plan, self.now, self.flight
        busy = np.zeros(self.fed.num_clients, dtype=bool)
        busy[flight.ids] = True
        started = (self._start(rnd, now, busy) if len(flight) < self.concurrency
                   else np.zeros(0, np.int64))
        dropped = dropped_out(plan.seed, rnd, started, plan.dropout)
        go = started[~dropped]
        finish, until = self._times(go, now)
        flight = flight.join(Flight(go, np.full(len(go), rnd, np.int64), np.full(len(go), now),
                                    finish, until))
        if len(flight) == 0:  # nobody in flight or available: wait for someone to come on
            later = self._next_available(now)
            if not math.isfinite(later):
                raise MpiflError(f"step {rnd}: no client is available at simulated time "
                                 f"{now:g} s or later (the availability trace ends); the run "
                                 "cannot go on")
            return Step(started, dropped, Flight.empty(), Flight.empty(), flight, later)
        end, done = flight.end, flight.done
        order = np.lexsort((flight.ids, end))
        finishes = np.flatnonzero(done[order])
        cut = (finishes[self.buffer - 1] + 1 if len(finishes) >= self.buffer
               else len(order))
        past, rest = order[:cut], order[cut:]
        return Step(started, dropped, flight.take(past[done[past]]),
                    flight.take(past[~done[past]]), flight.take(np.sort(rest)),
                    float(end[order[cut - 1]]))

    # ------------------------------------------------------------------ one step

    def _round(self, rnd: int, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """Server step ``rnd`` (module docstring): the parameters after it and its /rounds row;
        None when a stop request dropped it before anything of it was kept."""
        if self._stopping():
            return w, None
        w_start, st = w, self._plan_step(rnd)
        buf = st.buffered
        order = np.argsort(buf.ids, kind="stable")
        ids, versions = buf.ids[order], buf.version[order]
        row = {"round": rnd, "lr": self.plan.lr_at(rnd), "dropped": int(st.dropped.sum()),
               "rejected": 0, "num_clients": 0, "train_loss": float("nan"),
               "conflicts_model": 0, "conflicts_layer": np.zeros(len(self.layers), np.int64),
               "bytes_moved": 0, "time_broadcast": 0.0, "time_train": 0.0, "time_gather": 0.0,
               "time_aggregate": 0.0, "time_eval": 0.0, "time_checkpoint": 0.0,
               "peak_rss_server_mb": 0.0, "peak_rss_worker_mb": 0.0,
               "selected": ids, "aggregated": np.zeros(len(ids), dtype=bool)}
        if len(ids):
            res = self._train(rnd, w, ids, versions, row)
            if res is None:
                return w, None  # stopped at its training: nothing of the step is kept
            w = self._apply(rnd, w, ids, versions, res, row)
        self._commit(rnd, w_start, st, versions)
        return w, row

    def _model(self, version: int, rnd: int, w: torch.Tensor) -> torch.Tensor:
        return w if version == rnd else self.versions[version]

    def _train(self, rnd: int, w: torch.Tensor, ids: np.ndarray, versions: np.ndarray,
               row: dict[str, Any]) -> Trained | None:
        """Trains the buffered clients, one call per start version; ``(updates, losses,
        stats)`` in the order of ``ids``, or None when a stop request came meanwhile."""
        agg, lines = self.aggregator, self.lines
        inputs = agg.round_inputs() if isinstance(agg, RoundInputs) else None
        lines.begin("training", rnd + 1)
        parts = []
        for v in np.unique(versions):
            group = ids[versions == v]
            state = self.local.of(group).to(w.device) if self.local is not None else None
            try:
                res = self.clients.train(int(v), self.plan.lr_at(int(v)), group,
                                         self._model(int(v), rnd, w), inputs, state,
                                         phase=lambda name: lines.begin(name, rnd + 1))
            except TrainingStopped:  # abandoned between steps: nothing of the step is kept
                self._training_stopped()
                return None
            # the transport's reply is a view of a buffer the next call reuses: copy it
            res.updates, res.losses = res.updates.clone(), res.losses.clone()
            res.stats = {k: x.clone() for k, x in res.stats.items()}
            parts.append((group, res))
            if self._stopping():
                return None
            row["bytes_moved"] += res.bytes_moved
            for key in ("time_broadcast", "time_train", "time_gather"):
                row[key] += getattr(res, key)
            row["peak_rss_server_mb"] = max(row["peak_rss_server_mb"], res.peak_rss_server / 2**20)
            row["peak_rss_worker_mb"] = max(row["peak_rss_worker_mb"], res.peak_rss_worker / 2**20)
        where = np.argsort(np.concatenate([g for g, _ in parts]), kind="stable")
        pick = torch.from_numpy(where).to(parts[0][1].updates.device)
        cat: Callable[[Iterable[torch.Tensor]], torch.Tensor] = (  # noqa: E731
            lambda xs: torch.cat(list(xs))[pick])  # back to the order of ids
        updates = cat(r.updates for _, r in parts)
        losses = cat(r.losses for _, r in parts)
        stats = {k: cat(r.stats[k] for _, r in parts) for k in parts[0][1].stats}
        if self.aggregator.needs.current_updates:  # FedAsync: w - w_k = (w - w_v) + u_k
            for v in np.unique(versions):
                if v != rnd:
                    rows = torch.from_numpy(np.flatnonzero(versions == v)).to(updates.device)
                    drift = (w - self.versions[int(v)]).to(updates)
                    updates[rows] = updates[rows] + drift
        return updates, losses, stats

    def _apply(self, rnd: int, w: torch.Tensor, ids: np.ndarray, versions: np.ndarray,
               res: Trained, row: dict[str, Any]) -> torch.Tensor:
        """Aggregation of the trained buffer (as :meth:`Server._round` aggregates)."""
        updates, losses, stats = res
        self.lines.begin("aggregation", rnd + 1)
        row["train_loss"] = float(losses.double().mean())
        t0 = time.perf_counter()
        keep = accepted(updates, self.plan.max_update_norm)
        row["rejected"] = int((~keep).sum())
        if not bool(keep.any()):
            log.warning("step %d: every update was rejected; the model does not move", rnd)
            return w
        keep_np = keep.cpu().numpy()
        stats = {**stats, "staleness": torch.from_numpy(rnd - versions).to(updates.device)}
        if row["rejected"]:
            updates, losses = updates[keep], losses[keep]
            stats = {k: v[keep] for k, v in stats.items()}
        kept = ids[keep_np]
        row["aggregated"] = keep_np.copy()

        def loss_at(step: torch.Tensor) -> torch.Tensor:  # an evaluation-only request
            out, nbytes = self.clients.losses(kept, w - step.to(w))
            row["bytes_moved"] += nbytes
            return out.float()

        r = RoundUpdates(round=rnd, client_ids=kept, updates=updates, losses=losses,
                         num_samples=self.fed.num_train[kept], lr=self.plan.lr_at(rnd),
                         layers=self.layers, stats=stats, loss_at=loss_at)
        step = self._aggregate(r, w)
        if self.local is not None:
            self.local.store(kept, stats["local_state"])
        w = w - self._server_step(step)
        if self.meta is not None:
            w = self.meta.apply(w)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        row.update(num_clients=len(kept), conflicts_model=count_conflicts(updates, step),
                   conflicts_layer=count_layer_conflicts(updates, step, self.layers),
                   time_aggregate=time.perf_counter() - t0)
        return w

    def _commit(self, rnd: int, w_before: torch.Tensor, st: Step, versions: np.ndarray) -> None:
        """The step is kept: its clients counted, the clock and the flight moved on."""
        c = self.counters
        go = st.started[~st.dropped]
        c["participations"][go] += 1
        c["finished"][st.buffered.ids] += 1
        c["late"][st.late.ids] += 1
        c["busy_s"][st.buffered.ids] += st.buffered.finish - st.buffered.start
        c["busy_s"][st.late.ids] += st.late.until - st.late.start
        if rnd in set(st.flight.version.tolist()):  # started now, still training: keep w_rnd
            self.versions[rnd] = w_before.detach().clone()
        live = set(st.flight.version.tolist())
        self.versions = {v: x for v, x in self.versions.items() if v in live}
        self.flight, self.now = st.flight, st.now
        tau = float(np.mean(rnd - versions)) if len(versions) else float("nan")
        self.steps.append((self.now, len(go), len(st.buffered.ids), len(st.late.ids), tau))

    def _check_trained(self) -> None:
        """After the last step: :func:`mpifl.runtime.clock.check_trained` of the steps."""
        check_trained(np.asarray(self.steps, dtype=np.float64).reshape(-1, 5)[:, 2])

    # ------------------------------------------------------------------ state

    def _server_state(self) -> dict[str, np.ndarray | np.generic]:
        """Server's state plus ``async_*``: the simulated time, the flight, the model
        versions it references, the counters and the per-step table."""
        state = super()._server_state()
        keys = sorted(self.versions)
        d = self.layout.d
        models = (torch.stack([self.versions[v] for v in keys]).detach().cpu().numpy() if keys
                  else np.zeros((0, d), np.float32))
        rows = np.asarray(self.steps, dtype=np.float64).reshape(-1, 5)
        mine = {"now": np.float64(self.now), "steps": rows,
                "version_ids": np.asarray(keys, np.int64), "versions": models,
                **{f"flight_{n}": getattr(self.flight, n) for n in _FLIGHT},
                **{f"count_{n}": v for n, v in self.counters.items()}}
        state.update({f"async_{k}": v for k, v in mine.items()})
        return state

    def load_state_dict(self, server_state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`_server_state` wrote (its ``async_*`` arrays).

        Raises:
            ValueError: the state lacks them (a checkpoint of a synchronous run) or counts
                another number of clients.
        """
        s = {k[len("async_"):]: v for k, v in server_state.items() if k.startswith("async_")}
        need = ["now", "steps", "version_ids", "versions", *(f"flight_{n}" for n in _FLIGHT),
                *(f"count_{n}" for n in self.COUNTERS)]
        if missing := [k for k in need if k not in s]:
            raise ValueError(f"the checkpoint has no asynchronous server state "
                             f"({', '.join('async_' + k for k in missing)})")
        for n, dt in self.COUNTERS.items():
            value = np.asarray(s[f"count_{n}"], dtype=dt)
            if value.shape != self.counters[n].shape:
                raise ValueError(f"the checkpoint's asynchronous state counts {value.shape[0]} "
                                 f"clients, the run has {self.counters[n].shape[0]}")
            self.counters[n] = value.copy()
        self.now = float(s["now"])
        self.steps = [tuple(r) for r in np.asarray(s["steps"]).reshape(-1, 5).tolist()]
        self.flight = Flight(*(np.asarray(s[f"flight_{n}"], dtype=np.int64 if n in
                                          ("ids", "version") else np.float64) for n in _FLIGHT))
        models = np.asarray(s["versions"], dtype=np.float32)
        self.versions = {int(v): torch.from_numpy(models[i].copy()).to(self.device)
                         for i, v in enumerate(np.asarray(s["version_ids"]).tolist())}

    def tables(self) -> dict[str, np.ndarray]:
        """The results file's /system group, as :meth:`mpifl.runtime.clock.Clock.tables`: per
        step the simulated end time (s), clients started, aggregated and late (left before
        finishing) and the mean staleness of the aggregated updates; per client its tier and
        counters (participations = starts)."""
        rows = np.asarray(self.steps, dtype=np.float64).reshape(-1, 5)
        tier = (np.zeros(self.fed.num_clients, np.int64) if self.system is None
                else np.asarray(self.system.tier, dtype=np.int64))
        return {**system_tables(rows, tier, self.counters), "rounds/staleness": rows[:, 4]}

    @property
    def tier_names(self) -> list[str]:
        """The tiers' names (``["equal"]`` without a system model)."""
        return ["equal"] if self.system is None else list(self.system.tier_names)
