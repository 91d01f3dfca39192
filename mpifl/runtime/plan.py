"""What the runtime is told about a run: frozen records that :mod:`mpifl.experiment.plan` fills
in once from the config and the rule's needs. The runtime reads these, never the config."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)  # 18 fields: built by name, never by position
class RoundPlan:
    """Rank 0's round loop (:class:`mpifl.runtime.server.Server`): who trains when, and when the
    run evaluates, checkpoints and reports.

    Attributes:
        name: the run's name (progress bar, log lines).
        seed: keys client selection and dropout (with the round; no RNG state is saved).
        rounds: R, rounds in all (a resumed run continues to R).
        clients_per_round: m (ignored by ``sampling = "all"``).
        sampling: ``uniform``, ``weighted`` or ``all``.
        lr, lr_decay: client learning rate of round r is ``lr * lr_decay ** r``.
        dropout: probability that a selected client drops out of a round.
        max_update_norm: updates with a larger or non-finite L2 norm are rejected (None: only
            non-finite ones).
        eval_every: evaluate after every ``eval_every`` rounds and after the last.
        checkpoint_every: rounds between checkpoints (0: only at the end and on a stop request).
        checkpoint_minutes: wall-clock minutes between checkpoints (0: by rounds only).
        checkpoint_share: > 0 for the default schedule (``run.checkpoint_every`` not set): the
            most share of the run's time spent writing checkpoints
            (:class:`mpifl.runtime.schedule.CheckpointSchedule`); 0: every N-th round exactly.
        progress_every_s: seconds between progress lines in the log (0: none).
        adapt: evaluation after local adaptation (``run.adapt_epochs > 0``).
        eval_clients: N > 0: each evaluation tests a random subset of N clients, keyed by
            (seed, round); 0: every client.
        full_eval_every: with ``eval_clients``, the evaluations after a multiple of this many
            rounds and after the last round test every client; 0: none does.
        eval_window_samples: samples of a lazy population drawn at once in a streamed
            evaluation (:func:`mpifl.runtime.backends.stream_blocks`); progress lines and a stop
            signal act between windows.
        rule: the rule's name, for naming it when it fails.
        config_json: the run's config as canonical JSON, stored in every checkpoint.
    """

    name: str
    seed: int
    rounds: int
    clients_per_round: int
    sampling: str
    lr: float
    lr_decay: float
    dropout: float
    max_update_norm: float | None
    eval_every: int
    checkpoint_every: int
    checkpoint_minutes: float
    progress_every_s: float
    adapt: bool
    rule: str
    config_json: str
    eval_clients: int = 0
    full_eval_every: int = 0
    checkpoint_share: float = 0.0
    eval_window_samples: int = 2**18

    def evaluates(self, rounds_done: int) -> bool:
        """Whether the run evaluates after ``rounds_done`` rounds (every ``eval_every`` and
        after the last)."""
        return rounds_done % self.eval_every == 0 or rounds_done == self.rounds

    def evaluations(self, after: int) -> tuple[int, int]:
        """``(full, sampled)``: how many evaluations still come after ``after`` rounds are
        done, i.e. after rounds ``after + 1 .. rounds`` (the progress lines' ETA)."""
        def multiples(k: int) -> int:  # of k in (after, rounds], and the last round if not one
            return max(0, self.rounds // k - after // k
                       + int(self.rounds % k != 0 and self.rounds > after))

        total = multiples(self.eval_every)
        if not self.eval_clients:
            return total, 0
        if not self.full_eval_every:
            return 0, total
        full = multiples(math.lcm(self.eval_every, self.full_eval_every))
        return full, total - full

    def tests_all(self, rounds_done: int) -> bool:
        """Whether the evaluation after ``rounds_done`` rounds tests every client."""
        if not self.eval_clients:
            return True
        every = self.full_eval_every
        return bool(every) and (rounds_done % every == 0 or rounds_done == self.rounds)

    def lr_at(self, rnd: int) -> float:
        """The client learning rate of round ``rnd`` (0-based)."""
        return self.lr * self.lr_decay ** rnd
