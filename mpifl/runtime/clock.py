"""Simulated time for synchronous rounds: rank 0's virtual clock over the clients' devices
(:class:`mpifl.clients.system.SystemModel`).

A round at simulated time t:

1. **Who can be selected**: the clients available at t (``SystemModel.available``). When
   none is, the round starts at the next time one is (``SystemModel.next_available``: the
   server waits for clients to come on); when none ever is again (an availability trace that
   has ended), the run stops with a one-line :class:`~mpifl.core.errors.DataError`.
2. **Who is selected**: ``ceil(m (1 + over_commit))`` of them (``server.over_commit`` of the
   ``[system]`` table; ``sampling = "all"``: every available client), drawn as
   :func:`mpifl.runtime.server.select_clients` draws, keyed by (seed, round), so the same
   round selects the same clients on any number of ranks and after a resume.
3. **When each would finish**: its round time (download, local work, upload:
   ``SystemModel.round_seconds``); a client whose availability ends before that never
   finishes.
4. **Who is aggregated**: the first m to finish (ties by client id), of those within the
   deadline (``deadline_s``); a client that goes off before finishing never is. The others'
   updates are not computed at all: the simulation knows before training that they would
   arrive late, and training them would only cost the cluster time. Their work is still
   counted (``busy_s``).
5. **How long the round takes**: until the m-th finishes, or the deadline when fewer than m
   make it (with no deadline: until the last aggregated one finishes, or, when none finishes,
   until the last selected one leaves). The clock advances by that much.

A round that keeps nobody trains nothing and leaves the model as it was. That is never
silent: :meth:`Clock.advance` logs a warning (the 1st, 2nd, 4th, 8th, ... such round, with
the count so far; ``/system/rounds/finished`` is 0 for each), :meth:`Clock.check_trained`
refuses a whole run of them, and a run in which no client could ever finish (too slow for the
deadline, or never on long enough) is refused before its first round
(:meth:`mpifl.clients.system.SystemModel.check_rounds`).

Everything is a function of the seed, the round and the clock's state (the simulated time and
the per-client counters), which checkpoints carry, so a resumed run continues the same
simulated time bit for bit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mpifl.core.errors import ConfigError, DataError, MpiflError
from mpifl.core.rng import SAMPLING_TAG

if TYPE_CHECKING:  # annotations only
    from mpifl.clients.system import SystemModel

__all__ = ["Clock", "RoundTime", "check_trained", "system_tables"]

log = logging.getLogger("mpifl.server")

#: Most jumps to the next availability a round's start makes before giving up (each lands
#: where a client's interval starts, so one suffices but for float rounding of periodic phases).
_MAX_WAITS = 64


@dataclass(frozen=True)
class RoundTime:
    """One round on the clock.

    Attributes:
        selected: (n,) int64 clients selected (available at the round's start), ascending.
        kept: (k,) int64 those that finish in time and are aggregated (k <= m), ascending.
        start, seconds: the round's simulated start and duration (s).
        on_time: (n,) bool, which of ``selected`` are kept.
        busy: (n,) float64 simulated seconds each selected client worked.
        offline, too_slow: how many of ``selected`` went off before finishing, and how many
            would have finished only after the deadline.
    """

    selected: np.ndarray
    kept: np.ndarray
    start: float
    seconds: float
    on_time: np.ndarray
    busy: np.ndarray
    offline: int = 0
    too_slow: int = 0


class Clock:
    """Rank 0's simulated time and what each client did under it.

    Args:
        system: the clients' devices and availability.
        num_train: (K,) int64 training samples per client (a client's local work).
        epochs: local epochs a round.
        seed: the run's seed (keys selection with the round).
        deadline_s: a round's deadline in simulated seconds, or None for none.
        over_commit: selects ``ceil(m (1 + over_commit))`` clients and keeps the first m.
        work: (K,) int64 samples each client's round goes through (``client.max_local_steps``
            caps it: :func:`mpifl.clients.minibatches.trained_samples`); None: ``epochs``
            epochs over ``num_train``.

    Raises:
        ConfigError, DataError: no client could ever finish a round (too slow for
            ``deadline_s``, never on long enough, a non-finite round time, an availability
            trace without any of the K clients): :meth:`SystemModel.check_rounds`.
    """

    #: per-client counters: name -> dtype (checkpointed, written to /system/clients)
    COUNTERS = {"participations": np.int64, "finished": np.int64, "late": np.int64,
                "busy_s": np.float64}

    def __init__(self, system: SystemModel, num_train: np.ndarray, epochs: int, seed: int,
                 deadline_s: float | None = None, over_commit: float = 0.0,
                 work: np.ndarray | None = None) -> None:
        self.system, self.num_train = system, np.asarray(num_train, dtype=np.int64)
        self.epochs, self.seed = int(epochs), int(seed)
        self.deadline_s, self.over_commit = deadline_s, float(over_commit)
        # (samples, epochs) of a client's round: its data E times, or its capped steps' samples
        self._work = (self.num_train, self.epochs) if work is None else (
            np.asarray(work, dtype=np.int64), 1)
        system.check_rounds(*self._work, deadline_s)  # someone can finish
        k = len(self.num_train)
        self.now = 0.0
        self.counters = {name: np.zeros(k, dtype=dt) for name, dt in self.COUNTERS.items()}
        #: per round: (simulated end (s), selected, finished, late)
        self.rounds: list[tuple[float, int, int, int]] = []
        self._empty = 0  # rounds in ``rounds`` that kept nobody

    def round(self, rnd: int, m: int, sampling: str) -> RoundTime:
        """Select, time and keep round ``rnd``'s clients (steps 1-5 of the module's
        docstring); the clock moves only when the round is kept (:meth:`advance`), so a round
        a stop request drops runs again on resume from the same time."""
        start, available = self._wait(rnd, self.now)
        selected = self._select(rnd, m, sampling, available)
        seconds = self.system.round_seconds(selected, self._work[0][selected], self._work[1])
        left = self.system.available_until(selected, start) - start
        finish = np.where(seconds <= left, seconds, np.inf)  # leaves first: never finishes
        order = np.lexsort((selected, finish))  # by finish time, ties by client id
        want = len(selected) if sampling == "all" else m
        first = order[:want]
        limit = math.inf if self.deadline_s is None else self.deadline_s
        # finite first: with no deadline, inf <= inf would keep clients that never finish
        in_time = first[np.isfinite(finish[first]) & (finish[first] <= limit)]
        kept = np.sort(selected[in_time])
        duration = self._duration(finish[in_time], seconds, left, want, limit)
        if not math.isfinite(start + duration):
            kind, source = self._source()
            raise kind(f"{source}: round {rnd + 1} would end at simulated time "
                       f"{start:g} + {duration:g} s, past the largest float: times this "
                       "large cannot be simulated")
        on_time = np.zeros(len(selected), dtype=bool)
        on_time[in_time] = True
        busy = np.minimum(np.minimum(seconds, left), duration)
        offline = int(np.isinf(finish).sum())
        too_slow = int((np.isfinite(finish) & (finish > limit)).sum())
        return RoundTime(selected, kept, start, duration, on_time, busy, offline, too_slow)

    def _source(self) -> tuple[type[MpiflError], str]:
        """The error class and the name of what decides the clients' times: the availability
        trace, else the ``[system]`` table."""
        trace = self.system.params.availability_trace
        return (DataError, str(trace)) if trace is not None else (ConfigError, "system")

    def _wait(self, rnd: int, t: float) -> tuple[float, np.ndarray]:
        """(start, (K,) bool available): ``t`` and who is available then, or, when nobody is,
        the next time someone is (step 1 of the module's docstring).

        Raises:
            DataError: nobody is available at ``t`` or ever after (the trace has ended).
        """
        available = self.system.available(t)
        for _ in range(_MAX_WAITS):
            if available.any():
                return t, available
            later = self.system.next_available(t)
            if not math.isfinite(later):
                kind, source = self._source()
                raise kind(f"{source}: no client is available at simulated time {t:g} s or "
                           f"later, so round {rnd + 1} cannot run (the availability trace "
                           "ends before the run): give a longer trace or fewer rounds")
            t = later if later > t else float(np.nextafter(t, math.inf))
            available = self.system.available(t)
        raise MpiflError(f"round {rnd + 1}: no client became available after {_MAX_WAITS} "
                         f"waits from simulated time {self.now:g} s (bug: next_available "
                         "and available disagree)")

    def advance(self, rt: RoundTime) -> None:
        """Count round ``rt`` (its clients' participations, finishes, lateness and work) and
        move the clock to its end."""
        c = self.counters
        c["participations"][rt.selected] += 1
        c["finished"][rt.selected[rt.on_time]] += 1
        c["late"][rt.selected[~rt.on_time]] += 1
        c["busy_s"][rt.selected] += rt.busy
        self.now = rt.start + rt.seconds
        self.rounds.append((self.now, len(rt.selected), len(rt.kept),
                            len(rt.selected) - len(rt.kept)))
        if len(rt.kept):
            return
        self._empty += 1
        empty = self._empty
        if empty & (empty - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a long run stays readable
            why = (f"{rt.offline} went off before finishing" if rt.offline else "",
                   f"{rt.too_slow} needed more than the {self.deadline_s:g} s deadline"
                   if rt.too_slow else "")
            log.warning("round %d: none of the %d selected clients finished (%s); the model "
                        "does not move (%d such round(s) so far, logged at 1, 2, 4, 8, ...; "
                        "/system/rounds/finished is 0 for each)", len(self.rounds),
                        len(rt.selected), ", ".join(w for w in why if w), empty)

    def empty_rounds(self) -> int:
        """How many of the rounds counted so far kept no client (trained nothing)."""
        return self._empty

    def check_trained(self) -> None:
        """After the run's last round: :func:`check_trained` of the rounds counted."""
        limit = ("" if self.deadline_s is None
                 else f"within system.deadline_s = {self.deadline_s:g} s and ")
        check_trained(np.asarray(self.rounds, dtype=np.float64).reshape(-1, 4)[:, 2],
                      f" (no selected client finished {limit}before going off)")

    def _select(self, rnd: int, m: int, sampling: str, available: np.ndarray) -> np.ndarray:
        pool = np.flatnonzero(available)
        if sampling == "all" or len(pool) == 0:
            return pool.astype(np.int64)
        n = min(len(pool), math.ceil(m * (1.0 + self.over_commit)))
        p = None
        if sampling == "weighted":
            w = self.num_train[pool].astype(np.float64)
            p = w / w.sum()
        rng = np.random.default_rng([self.seed, rnd, SAMPLING_TAG])
        return np.sort(pool[rng.choice(len(pool), size=n, replace=False, p=p)]).astype(np.int64)

    @staticmethod
    def _duration(done: np.ndarray, seconds: np.ndarray, left: np.ndarray, want: int,
                  limit: float) -> float:
        """How long the server waits (step 5)."""
        if len(done) == want and len(done):
            return float(done.max())
        if math.isfinite(limit):
            return limit
        if len(done):
            return float(done.max())
        spent = np.minimum(seconds, left)  # nobody finishes: until the last one leaves
        return float(spent.max()) if len(spent) else 0.0

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, np.ndarray | np.generic]:
        """The clock as arrays (a checkpoint's ``server_state`` holds them)."""
        rows = np.asarray(self.rounds, dtype=np.float64).reshape(-1, 4)
        return {"now": np.float64(self.now), "rounds": rows, **self.counters}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`state_dict`.

        Raises:
            ValueError: a state of another number of clients, or without the clock's arrays.
        """
        missing = [k for k in ("now", "rounds", *self.COUNTERS) if k not in state]
        if missing:
            raise ValueError(f"the checkpoint has no simulated-time state ({', '.join(missing)})")
        for name, dtype in self.COUNTERS.items():
            value = np.asarray(state[name], dtype=dtype)
            if value.shape != self.counters[name].shape:
                raise ValueError(f"the checkpoint's clock counts {value.shape[0]} clients, the "
                                 f"run has {self.counters[name].shape[0]}")
            self.counters[name] = value.copy()
        self.now = float(state["now"])
        self.rounds = [tuple(r) for r in np.asarray(state["rounds"]).reshape(-1, 4).tolist()]
        self._empty = sum(1 for r in self.rounds if r[2] == 0)

    def tables(self) -> dict[str, np.ndarray]:
        """What the results file's /system group holds: per round the simulated end time (s)
        and the clients selected, finished and late; per client its tier and counters."""
        rows = np.asarray(self.rounds, dtype=np.float64).reshape(-1, 4)
        return system_tables(rows, np.asarray(self.system.tier, dtype=np.int64), self.counters)


def check_trained(finished: np.ndarray, why: str = "") -> None:
    """The end of a run on simulated time: a warning with the count when some rounds (server
    steps) aggregated no client, and an error when none aggregated any.

    Args:
        finished: (R,) clients each round aggregated (``/system/rounds/finished``).
        why: what an empty round means, for the messages (" (no selected client ...)"), or "".

    Raises:
        ConfigError: every one of the R >= 1 rounds aggregated no client: the model is the
            initial one, so the run is not reported complete.
    """
    rounds, empty = len(finished), int(np.sum(np.asarray(finished) == 0))
    if not empty:
        return
    if empty == rounds:
        raise ConfigError(f"system: none of the run's {rounds} round(s) trained a client{why}, "
                          "so the model is the initial one; /system/rounds of the results "
                          "shows each round: raise the deadline or over_commit, or give "
                          "longer availability")
    log.warning("%d of %d rounds trained no client%s; /system/rounds/finished is 0 for them",
                empty, rounds, why)


def system_tables(rows: np.ndarray, tier: np.ndarray, counters: dict[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
    """The results file's /system tables (SYSTEM_COLUMNS) of a run on simulated time, shared
    by :class:`Clock` and :class:`mpifl.runtime.asynchronous.AsyncServer`.

    Args:
        rows: (R, >= 4) float64 per round: simulated end time (s), clients selected, finished
            and late.
        tier: (K,) int64 each client's device tier.
        counters: per-client counters, name -> (K,) array.
    """
    return {"rounds/sim_time": rows[:, 0], "rounds/selected": rows[:, 1].astype(np.int64),
            "rounds/finished": rows[:, 2].astype(np.int64),
            "rounds/late": rows[:, 3].astype(np.int64), "clients/tier": tier,
            **{f"clients/{k}": v for k, v in counters.items()}}
