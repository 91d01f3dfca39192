"""Progress lines for batch jobs: under ``mpiexec`` or ``srun`` stderr is a pipe into a log
file and the progress bar does not show, so the server also logs, every
``run.progress_every_s`` seconds, one line a user can ``tail -f``. After a round (and after
every evaluation)::

    progress: round 37/100 (37%), 0.42 s/round, ETA 0:01:26 (with 6 evaluations, 0:00:10 each), peak memory 0.81 GB/rank, mean acc 0.7512, worst5 0.3011

and inside a phase longer than the interval (training, gathering, aggregation, evaluation,
checkpoint, writing results), from a heartbeat thread, so a long phase is never silent::

    progress: round 2/2, evaluation: 310,000/1,000,000 clients (31%), 52 s in, phase ETA 0:01:54, run ETA 0:02:10

The run ETA counts the evaluations still due apart from the rounds: seconds a round are
measured without the evaluations, and each kind of evaluation (every client, or
``run.eval_clients`` of them) by its own measured time, or, before one of that kind has run, by
the seconds a client of the others (:meth:`ProgressLog.run_eta`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from mpifl.runtime.plan import RoundPlan

log = logging.getLogger("mpifl.server")

__all__ = ["ProgressLog", "Phase", "BAR_FORMAT"]

#: The tqdm bar without tqdm's own remaining time (a per-iteration rate that mixes rounds
#: with evaluations); the postfix carries the phase and :meth:`ProgressLog.run_eta` instead.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
#: Phases of a round before its evaluation (the rest come after its training).
ROUND_PHASES = ("training", "gathering", "aggregation")
#: Longest pause of the heartbeat thread between looks (seconds).
BEAT_S = 1.0


@dataclass
class Phase:
    """What rank 0 is doing now: ``name`` in round ``round`` (1-based: training of round r, the
    evaluation after r rounds), since ``t0``; ``done`` of ``total`` ``unit`` (total 0: not
    counted); ``full``: an evaluation of every client (else a sampled one)."""

    name: str
    round: int
    t0: float
    total: int = 0
    done: int = 0
    unit: str = "clients"
    full: bool = True


class ProgressLog:
    """Decides when to log a progress line, writes it, and estimates the time left.

    Args:
        total: ``run.rounds``. start: the first round of this process (after a resume, the
            rounds already done; the rates count this process's work only).
        every_s: seconds between lines (0: none, not even at evaluations).
        clock: monotonic seconds (a parameter for tests).
        plan: the :class:`mpifl.runtime.plan.RoundPlan` (which evaluations are still due),
            or None: the ETA counts rounds only.
        num_clients: K (what a full evaluation tests).
        bar: a tqdm bar whose postfix shows the phase and the run ETA, or None.
    """

    def __init__(self, total: int, start: int, every_s: float,
                 clock: Callable[[], float] = time.monotonic, plan: RoundPlan | None = None,
                 num_clients: int = 0, bar: Any = None) -> None:  # bar: tqdm's (untyped)
        self.total, self.start, self.every_s, self.clock = total, start, float(every_s), clock
        self.plan, self.num_clients, self.bar = plan, num_clients, bar
        self.t0 = self.last = self.round_t0 = clock()
        self.done = start  # rounds completed
        self.metrics = ""
        self.phase: Phase | None = None
        self.eval_s = 0.0  # seconds in this process's evaluations (not the rounds')
        self.evals = {True: [0.0, 0], False: [0.0, 0]}  # full?: [seconds, count] completed
        self.eval_clients = 0  # clients of the completed evaluations (seconds a client)
        self.phase_s: dict[str, list[float]] = {}  # name: [seconds, count] completed
        self.lock = threading.RLock()

    # ---- what rank 0 does ---------------------------------------------------------------

    def round_begins(self, rnd: int) -> None:
        """Round ``rnd`` (0-based) starts."""
        with self.lock:
            self.round_t0 = self.clock()

    def begin(self, name: str, rnd: int, total: int = 0, unit: str = "clients",
              full: bool = True) -> None:
        """Phase ``name`` of round ``rnd`` (1-based) starts (ending the one before)."""
        with self.lock:
            self.end()
            self.phase = Phase(name, rnd, self.clock(), int(total), 0, unit, full)

    def advance(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        """The phase has done ``done`` of its ``total`` (clients, loss requests, ...)."""
        with self.lock:
            if self.phase is not None:
                self.phase.done = int(done)
                self.phase.total = self.phase.total if total is None else int(total)
                self.phase.unit = unit or self.phase.unit

    def end(self, complete: bool = True) -> None:
        """The phase ends; a complete one's time estimates the next of its kind."""
        with self.lock:
            ph, self.phase = self.phase, None
            if ph is None:
                return
            seconds = self.clock() - ph.t0
            if ph.name == "evaluation":
                self.eval_s += seconds
                if complete:
                    self.evals[ph.full][0] += seconds
                    self.evals[ph.full][1] += 1
                    self.eval_clients += ph.total
            elif complete:
                acc = self.phase_s.setdefault(ph.name, [0.0, 0])
                acc[0] += seconds
                acc[1] += 1

    def round_done(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> bool:
        """After round ``rnd`` (0-based): log a line if the interval passed or it evaluated.
        ``row`` is the round's /rounds row (peak memory), ``summary`` its evaluation or None.
        Returns whether a line was logged."""
        with self.lock:
            self.end()
            self.done = rnd + 1
            if summary is not None:
                self.metrics = _metrics(summary)
            now = self.clock()
            self.round_t0 = now
            self._show(now)
            if not self.every_s or (summary is None and now - self.last < self.every_s):
                return False
            self.last = now
            per_round = self.per_round(now)
            eta, evals = self.run_eta(now)
            peak = max(row.get("peak_rss_server_mb", 0.0), row.get("peak_rss_worker_mb", 0.0))
            log.info("progress: round %d/%d (%.0f%%), %.3g s/round, ETA %s%s, peak memory "
                     "%.2f GB/rank%s", self.done, self.total, 100 * self.done / self.total,
                     per_round, _clock(eta), evals, peak / 1024,
                     f", {self.metrics}" if self.metrics else "")
            return True

    # ---- lines inside a phase -----------------------------------------------------------

    def tick(self) -> bool:
        """Log the phase's line if the interval passed since the last line and since the round
        began (rounds shorter than the interval get only :meth:`round_done`'s lines); refresh
        the bar. Returns whether it logged."""
        with self.lock:
            now, ph = self.clock(), self.phase
            self._show(now)
            if ph is None or not self.every_s:
                return False
            if now - max(self.last, self.round_t0) < self.every_s:
                return False
            self.last = now
            log.info("progress: %s", self.phase_line(now))
            return True

    def phase_line(self, now: float) -> str:
        """``round 2/2, evaluation: 310,000/1,000,000 clients (31%), 52 s in, phase ETA
        0:01:54, run ETA 0:02:10`` (the parts not known yet left out)."""
        ph = self.phase
        assert ph is not None  # a line is made only while a phase runs
        text = f"round {ph.round}/{self.total}, {ph.name}"
        if ph.total:
            text += f": {ph.done:,}/{ph.total:,} {ph.unit} ({100 * ph.done / ph.total:.0f}%)"
        elif ph.done:
            text += f": {ph.done:,} {ph.unit}"
        text += f", {_seconds(now - ph.t0)} in"
        left = self.phase_eta(now)
        if left is not None:
            text += f", phase ETA {_clock(left)}"
        eta, evals = self.run_eta(now)
        if eta is not None:
            text += f", run ETA {_clock(eta)}{evals}"
        return text

    @contextmanager
    def running(self) -> Iterator[ProgressLog]:
        """A heartbeat thread calls :meth:`tick` inside the block, so a phase that is one
        long call (an aggregation, a checkpoint write, a worker's training) still gets its
        lines: it only reads what the main thread sets, and only logs."""
        if not self.every_s and (self.bar is None or self.bar.disable):
            yield self
            return
        stop = threading.Event()
        pause = min(BEAT_S, max(0.05, self.every_s / 4 if self.every_s else BEAT_S))
        thread = threading.Thread(target=self._beat, args=(stop, pause), daemon=True,
                                  name="mpifl-progress")
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def _beat(self, stop: threading.Event, pause: float) -> None:
        while not stop.wait(pause):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 -- a progress line must never end a run
                log.debug("progress line failed", exc_info=True)

    # ---- estimates ----------------------------------------------------------------------

    def per_round(self, now: float) -> float:
        """Seconds a round of this process, its evaluations left out (0 before one ended)."""
        rounds = self.done - self.start
        ended = now if self.phase is None else self.round_t0
        return max(0.0, ended - self.t0 - self.eval_s) / rounds if rounds > 0 else 0.0

    def eval_cost(self, full: bool, now: float | None = None) -> float | None:
        """Seconds an evaluation of this kind takes: the mean of those run; else the one
        running, if of this kind, projected from its count; else the seconds a client of the
        evaluations run (or of the one running) times this kind's clients; None if no
        evaluation has been timed yet."""
        seconds, count = self.evals[full]
        if count:
            return seconds / count
        ph = self.phase
        # the evaluation running now, once a client of it is done
        running = (ph if now is not None and ph is not None and ph.name == "evaluation"
                   and ph.done > 0 else None)
        if running is not None and now is not None and running.full == full:
            return (now - running.t0) * running.total / running.done
        clients = self.num_clients if full else getattr(self.plan, "eval_clients", 0)
        if self.eval_clients:
            return clients * (self.evals[True][0] + self.evals[False][0]) / self.eval_clients
        if running is None or now is None:
            return None
        return clients * (now - running.t0) / running.done

    def phase_eta(self, now: float) -> float | None:
        """Seconds left in the current phase: by its count when it has one, else by the mean
        of its kind so far; None when neither is known."""
        ph = self.phase
        if ph is None:
            return None
        elapsed = now - ph.t0
        if ph.total and ph.done:
            return elapsed * (ph.total - ph.done) / ph.done
        if ph.name == "evaluation":
            cost = self.eval_cost(ph.full, now)
        else:
            seconds, count = self.phase_s.get(ph.name, (0.0, 0))
            cost = seconds / count if count else None
        return None if cost is None else max(0.0, cost - elapsed)

    def run_eta(self, now: float) -> tuple[float | None, str]:
        """Seconds left in the run, and the evaluations it counts as text (``" (with 2 full
        evaluations, 0:08:00 each)"``, or ``" + 1 full evaluation not timed yet"``).

        The rounds left (the current one's rest included) at :meth:`per_round`, plus the
        current phase's rest when it is an evaluation, plus every evaluation still due at
        :meth:`eval_cost` of its kind. None before the first round of this process ended.
        """
        if self.done == self.start:
            return None, ""
        per_round, ph = self.per_round(now), self.phase
        left, after = per_round * (self.total - self.done), self.done
        if ph is not None and ph.name in ROUND_PHASES:  # the round under way: its rest
            left -= min(per_round, now - self.round_t0)
        elif ph is not None:  # after round ph.round's training: it is not left
            left -= per_round * max(0, ph.round - self.done)
            after = ph.round
            if ph.name == "evaluation":
                rest = self.phase_eta(now)
                left += rest or 0.0
        due = self.plan.evaluations(after) if self.plan is not None else (0, 0)
        timed, untimed = [], []
        for full, count in zip((True, False), due):
            if not count:
                continue
            assert self.plan is not None  # without a plan no evaluation is due
            cost = self.eval_cost(full, now)
            kind = ("full " if full else "sampled ") if self.plan.eval_clients else ""
            what = f"{count} {kind}evaluation{'s' * (count > 1)}"
            if cost is None:
                untimed.append(what)
            else:
                left += count * cost
                timed.append(f"{what}, {_clock(cost)} each")
        text = f" (with {' and '.join(timed)})" if timed else ""
        if untimed:
            text += f" + {' and '.join(untimed)} not timed yet"
        return max(0.0, left), text

    def _show(self, now: float) -> None:
        """The bar's postfix: the phase and the run ETA (tqdm's own ETA is left out)."""
        if self.bar is None or self.bar.disable:
            return
        ph, (eta, _) = self.phase, self.run_eta(now)
        parts = []
        if ph is not None:
            parts.append(ph.name + (f" {100 * ph.done / ph.total:.0f}%" if ph.total else ""))
        if eta is not None:
            parts.append(f"ETA {_clock(eta)}")
        if self.metrics:
            parts.append(self.metrics)
        self.bar.set_postfix_str(", ".join(parts))


def _clock(seconds: float | None) -> str:
    return "?" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else _clock(seconds)


def _metrics(summary: dict[str, float]) -> str:
    if "loss/mean" in summary:
        return f"mean loss {summary['loss/mean']:.5g}, worst5 loss {summary['loss/worst5']:.5g}"
    return f"mean acc {summary['mean']:.4f}, worst5 {summary['worst5']:.4f}"
