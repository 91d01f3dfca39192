"""The rows of a run's results in memory (rank 0): what the results file and checkpoints store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from mpifl.metrics.summary import SUMMARY_KEYS
from mpifl.store.encoding import ChunkCache, create_dataset, padded
from mpifl.store.schema import (ADAPTED_KEYS, GROUP_KEYS, LATER_COLUMNS, LAYER_COLUMNS,
                                LOSS_KEYS, PERSONAL_KEYS, ROUND_COLUMNS, SCHEMA_VERSION,
                                SELECTION_COLUMNS)


@dataclass(frozen=True)
class MetricSet:
    """Which metrics a run records, fixed at its start: the shape of its results file.

    Attributes:
        num_clients: K, the width of the per-client evaluation arrays.
        num_layers: L, the width of the per-layer round columns.
        group: group fairness metrics (a binary task with a sensitive attribute: demographic
            parity and equal opportunity gaps; /eval/group).
        personal: the personal models' accuracies and losses (Ditto; /eval/personal_*).
        adapted: the clients after local adaptation (``run.adapt_epochs`` > 0; /eval/adapted).
        loss: a regression loss: the test loss is summarised, no accuracy (/eval/loss).
    """

    num_clients: int
    num_layers: int
    group: bool = False
    personal: bool = False
    adapted: bool = False
    loss: bool = False


class MetricHistory:
    """Every /rounds row and /eval entry so far, in memory (rank 0), for checkpoints and resume.

    Size O(R + E K) numbers: tiny next to the model history an aggregator keeps.
    """

    def __init__(self, metrics: MetricSet) -> None:
        self.metrics = metrics
        self.num_clients, self.num_layers = metrics.num_clients, metrics.num_layers
        self.summary_keys = (SUMMARY_KEYS + (GROUP_KEYS if metrics.group else ())
                             + (PERSONAL_KEYS if metrics.personal else ())
                             + (ADAPTED_KEYS if metrics.adapted else ())
                             + (LOSS_KEYS if metrics.loss else ()))
        self.rounds: dict[str, list[Any]] = {
            name: [] for name in {**ROUND_COLUMNS, **LAYER_COLUMNS, **SELECTION_COLUMNS}}
        self.eval_round: list[int] = []
        self.accuracy: list[np.ndarray] = []
        self.loss: list[np.ndarray] = []
        self.personal_accuracy: list[np.ndarray] = []
        self.personal_loss: list[np.ndarray] = []
        self.adapted_accuracy: list[np.ndarray] = []
        self.adapted_loss: list[np.ndarray] = []
        self.summary: dict[str, list[float]] = {name: [] for name in self.summary_keys}
        #: compressed chunks of the evaluation rows already written (large K only)
        self.chunks = ChunkCache()

    def add_round(self, row: dict[str, Any]) -> None:
        """Append one round's row: every ROUND_COLUMNS and LAYER_COLUMNS key; the
        SELECTION_COLUMNS keys ((m,) arrays) may be missing (then not recorded)."""
        for name in self.rounds:
            self.rounds[name].append(row.get(name) if name in SELECTION_COLUMNS else row[name])

    def add_eval(self, round_done: int, accuracy: np.ndarray, loss: np.ndarray,
                 summary: dict[str, float], personal: tuple[np.ndarray, np.ndarray] | None = None,
                 adapted: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """One evaluation: (K,) float64 accuracies and losses, the summaries (every
        ``summary_keys``), and the (accuracy (K,), loss (K,)) pairs of the personal models and
        after adaptation when the history has them."""
        self.eval_round.append(int(round_done))
        self.accuracy.append(np.asarray(accuracy, dtype=np.float64))
        self.loss.append(np.asarray(loss, dtype=np.float64))
        if self.metrics.personal:
            assert personal is not None  # a history with personal metrics is given them
            self.personal_accuracy.append(np.asarray(personal[0], dtype=np.float64))
            self.personal_loss.append(np.asarray(personal[1], dtype=np.float64))
        if self.metrics.adapted:
            assert adapted is not None  # likewise after adaptation
            self.adapted_accuracy.append(np.asarray(adapted[0], dtype=np.float64))
            self.adapted_loss.append(np.asarray(adapted[1], dtype=np.float64))
        for name in self.summary_keys:
            self.summary[name].append(float(summary[name]))

    def to_group(self, g: h5py.Group) -> None:
        """Store as plain datasets under ``g`` (``rounds/<col>``, ``eval/<name>``); large ones
        chunked and compressed (:func:`create_dataset`), the evaluation rows' compressed chunks
        kept in :attr:`chunks` for the next write."""
        for name, (dtype, _) in ROUND_COLUMNS.items():
            create_dataset(g, f"rounds/{name}", np.asarray(self.rounds[name], dtype=dtype))
        for name, (dtype, _) in LAYER_COLUMNS.items():
            layer_rows = np.asarray(self.rounds[name], dtype=dtype).reshape(-1, self.num_layers)
            create_dataset(g, f"rounds/{name}", layer_rows)
        for name, (dtype, _, fill) in SELECTION_COLUMNS.items():
            create_dataset(g, f"rounds/{name}", padded(self.rounds[name], dtype, fill))
        create_dataset(g, "eval/round", np.asarray(self.eval_round, dtype="i8"))
        for name, rows in self._per_client():
            data = np.asarray(rows, dtype="f8").reshape(len(rows), self.num_clients)
            create_dataset(g, f"eval/{name}", data, cache=self.chunks, rows=rows)
        for name in self.summary_keys:
            create_dataset(g, f"eval/{name}", np.asarray(self.summary[name], dtype="f8"))

    def _per_client(self) -> list[tuple[str, list[np.ndarray]]]:
        out = [("client_accuracy", self.accuracy), ("client_loss", self.loss)]
        if self.metrics.personal:
            out += [("personal_accuracy", self.personal_accuracy),
                    ("personal_loss", self.personal_loss)]
        if self.metrics.adapted:
            out += [("adapted/client_accuracy", self.adapted_accuracy),
                    ("adapted/client_loss", self.adapted_loss)]
        return out

    @classmethod
    def from_group(cls, g: h5py.Group, version: int = SCHEMA_VERSION) -> "MetricHistory":
        """Inverse of :meth:`to_group` (raises KeyError if a column is missing); a history
        written under schema ``version`` 1 has its std converted to a fraction."""
        h = cls(MetricSet(g["eval/client_accuracy"].shape[1], g["rounds/conflicts_layer"].shape[1],
                          group="eval/group" in g, personal="eval/personal_accuracy" in g,
                          adapted="eval/adapted" in g, loss="eval/loss" in g))
        num_rounds = len(g["rounds/round"])
        for name in h.rounds:
            if f"rounds/{name}" not in g and name in (*LATER_COLUMNS, *SELECTION_COLUMNS):
                h.rounds[name] = [None if name in SELECTION_COLUMNS else 0.0] * num_rounds
                continue
            h.rounds[name] = list(g[f"rounds/{name}"][()])
        h.eval_round = g["eval/round"][()].tolist()
        h.accuracy = list(g["eval/client_accuracy"][()])
        h.loss = list(g["eval/client_loss"][()])
        if h.metrics.personal:
            h.personal_accuracy = list(g["eval/personal_accuracy"][()])
            h.personal_loss = list(g["eval/personal_loss"][()])
        if h.metrics.adapted:
            h.adapted_accuracy = list(g["eval/adapted/client_accuracy"][()])
            h.adapted_loss = list(g["eval/adapted/client_loss"][()])
        for name in h.summary_keys:
            h.summary[name] = g[f"eval/{name}"][()].tolist()
            if version == 1 and name in ("std", "personal/std"):  # was percentage points
                h.summary[name] = [v / 100.0 for v in h.summary[name]]
        return h
