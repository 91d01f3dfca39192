"""The per-round columns a trainer and the server exchange besides updates and losses; both ends
of the MPI protocol (runtime) and the trainers (clients) use it, so it lives below both."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Columns"]


@dataclass(frozen=True)
class Columns:
    """What a trainer exchanges with the server per round besides updates and losses.

    Both ends of the MPI protocol derive it from the config (rank 0 without building a
    trainer, through ``columns_for``), so no sizes travel at run time.

    Attributes:
        inputs: length of the float64 vector broadcast to every client with a TRAIN request
            (mFairFL's multipliers, (A,)); 0 for none.
        state: float32 width of the per-client state row the server sends with each selected
            client (Ditto's personal model, d); 0 for none.
        stats: ``(name, width)`` of the float32 per-client result columns, in order (e.g.
            ``("train_accuracy", 1)``); they reach the aggregator as ``RoundUpdates.stats[name]``,
            (m,) when the width is 1, else (m, width).
    """

    inputs: int = 0
    state: int = 0
    stats: tuple[tuple[str, int], ...] = ()

    @property
    def stats_width(self) -> int:
        """Float32 values per client in the gathered statistics row."""
        return sum(width for _, width in self.stats)
