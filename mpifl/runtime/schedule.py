"""When rank 0 writes a checkpoint: after the rounds and minutes the plan asks for, and, for the
default schedule, no more often than keeps checkpoints to a small share of the run's time.

The default (``run.checkpoint_every`` not set) bounds the work a killed run loses by both
measures at once: a checkpoint is due ``checkpoint_minutes`` after the previous one, or after
:func:`default_every` rounds (2% of the run), whichever comes first. A rounds-due checkpoint
waits, though, until the time since the previous one is ``(1 - share) / share`` times what the
previous one cost, so checkpoints take at most ``share`` of the run's time even when rounds are
much cheaper than a checkpoint (the main job: 0.2 s rounds, 75 ms checkpoints). An explicit
``checkpoint_every = N`` is kept exactly: every N-th round, whatever it costs.
"""

from __future__ import annotations

import math
import time
from typing import Callable

__all__ = ["CheckpointSchedule", "default_every", "DEFAULT_SHARE", "DEFAULT_ROUNDS_FRACTION"]

#: The default schedule's rounds between checkpoints, as a fraction of ``run.rounds``.
DEFAULT_ROUNDS_FRACTION = 0.02
#: The most share of the run's wall time the default schedule spends writing checkpoints.
DEFAULT_SHARE = 0.04


def default_every(rounds: int) -> int:
    """Rounds between checkpoints when ``run.checkpoint_every`` is not set: 2% of ``rounds``
    (at least 1), so a killed run loses at most that share of its rounds."""
    return max(1, math.ceil(DEFAULT_ROUNDS_FRACTION * rounds))


class CheckpointSchedule:
    """Decides, after each round, whether a checkpoint is due.

    Args:
        rounds: ``run.rounds``; the last round always checkpoints.
        every: rounds between checkpoints (0: none by rounds).
        minutes: wall-clock minutes between checkpoints (0: none by time).
        share: with ``> 0`` (the default schedule), a rounds-due checkpoint waits until the time
            since the previous one is ``(1 - share) / share`` times that one's cost, and ``every``
            counts rounds since the previous checkpoint; 0: every ``every``-th round exactly.
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(self, rounds: int, every: int, minutes: float, share: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rounds, self.every, self.minutes, self.share = rounds, every, minutes, share
        self.clock = clock
        self.last_time, self.last_round, self.cost = clock(), 0, 0.0

    def start(self, rounds_done: int) -> None:
        """The run (re)starts after ``rounds_done`` rounds: count from here."""
        self.last_time, self.last_round = self.clock(), rounds_done

    def due(self, rounds_done: int, stopping: bool = False) -> bool:
        """Whether to checkpoint now, after ``rounds_done`` rounds (a stop request and the last
        round always do)."""
        if stopping or rounds_done == self.rounds:
            return True
        elapsed = self.clock() - self.last_time
        if self.minutes and elapsed >= 60.0 * self.minutes:
            return True
        if not self.every:
            return False
        if not self.share:
            return rounds_done % self.every == 0
        held = elapsed < self.cost * (1.0 - self.share) / self.share
        return rounds_done - self.last_round >= self.every and not held

    def written(self, rounds_done: int, cost_s: float) -> None:
        """A checkpoint after ``rounds_done`` rounds took ``cost_s`` seconds."""
        self.last_time, self.last_round, self.cost = self.clock(), rounds_done, cost_s
