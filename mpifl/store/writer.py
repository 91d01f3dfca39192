"""Writing a run's results file (rank 0): :class:`ResultsWriter`.

The whole file is rewritten at every flush -- to a temporary file beside it, sealed with its
SHA-256 and renamed over the previous one (:mod:`mpifl.store.sealed`) -- rather than appended to
in place (HDF5's resizable datasets): an in-place append that a kill or a full disk interrupts
leaves a file HDF5 may not open, and the seal covers the whole file, so it could not be
updated without reading every byte again. The rewrite keeps both guarantees: a reader sees
the previous complete file or the new one, never a half-written row.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from mpifl.core.errors import OutputError
from mpifl.core.locking import clean_stale_temporaries
from mpifl.core.version import __version__
from mpifl.store.encoding import LocalState, create_dataset, write_local
from mpifl.store.history import MetricHistory, MetricSet
from mpifl.store.schema import (CLIENT_COLUMNS, LAYER_COLUMNS, ROUND_COLUMNS, SCHEMA_VERSION,
                                SELECTION_COLUMNS, SYSTEM_COLUMNS)
from mpifl.store.sealed import reason, write_atomic

#: The results file is rewritten at least this often (and after every evaluation, checkpoint
#: and at the end): a run that dies loses at most this many seconds of /rounds rows.
FLUSH_SECONDS = 1.0


def preflight(path: Path) -> None:
    """Check before any work that ``path`` can be written: fail now, not after 100 rounds.

    Raises:
        OutputError: the folder cannot be created or written, or ``path`` is a folder.
    """
    if path.is_dir():
        raise OutputError(f"--out {path}: is a directory, expected a .h5 file path")
    probe = path.parent / f".{path.name}.preflight-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, b"ok")  # unbuffered: a full disk fails here, not at a later close
        finally:
            os.close(fd)
    except OSError as exc:
        raise OutputError(f"--out {path}: cannot write there ({reason(exc)})") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass


class ResultsWriter:
    """Writer of one run's results file (rank 0).

    The rows live in memory (:class:`MetricHistory`, also what checkpoints store) and every
    append rewrites the whole file: to a temporary file beside it, sealed with its SHA-256
    (:mod:`mpifl.store.sealed`) and renamed over the previous one. A failed write (a full disk)
    or a kill at any instant therefore leaves the previous complete file, never a damaged one,
    and a reader never sees a half-written row.

    Args:
        path: the .h5 file to create (replaced if it exists; the CLI asks first).
        config_json: the validated config as JSON text.
        metrics: which metrics the run records (K, L and the optional groups of columns).
        world_size: MPI ranks of the run.
        algorithm: the rule's name (an attribute of the file).
        history: rows to write first (a resumed run rewrites its results from its checkpoint);
            kept up to date with every later append, for the next checkpoint.
        clients: the /clients datasets (CLIENT_COLUMNS: ``num_train``, ``num_test`` (K,) and
            ``label_counts`` (K, C), int64), or None to leave /clients out.

    Raises:
        OutputError: the file cannot be written (the previous file, if any, is untouched).
    """

    def __init__(self, path: Path, config_json: str, metrics: MetricSet, *, world_size: int,
                 algorithm: str, history: MetricHistory | None = None,
                 clients: dict[str, np.ndarray] | None = None):
        self.path = Path(path)
        clean_stale_temporaries(self.path.parent, f".{self.path.name}.tmp-")
        self.attrs = {"schema_version": SCHEMA_VERSION, "mpifl_version": __version__,
                      "config": config_json, "world_size": world_size,
                      "num_clients": metrics.num_clients, "algorithm": algorithm,
                      "status": "running"}
        self.history = MetricHistory(metrics)
        self.clients = {k: np.asarray(v, dtype=np.int64) for k, v in (clients or {}).items()}
        self._model: tuple[np.ndarray, list[tuple[str, int, int]]] | None = None
        self._local: LocalState | None = None
        #: a run on simulated time: () -> {SYSTEM_COLUMNS name: array}, and the tier names
        self.system: tuple[Callable[[], dict[str, np.ndarray]], list[str]] | None = None
        self._written, self._cost = 0.0, 0.0  # monotonic time of the last write, its seconds
        self._pending = self._eval_pending = False
        old = history or MetricHistory(metrics)
        for i in range(len(old.rounds["round"])):
            self.append_round({name: col[i] for name, col in old.rounds.items()}, flush=False)
        for i, rnd in enumerate(old.eval_round):
            personal = ((old.personal_accuracy[i], old.personal_loss[i])
                        if metrics.personal else None)
            adapted = ((old.adapted_accuracy[i], old.adapted_loss[i])
                       if metrics.adapted else None)
            self.append_eval(rnd, old.accuracy[i], old.loss[i],
                             {name: old.summary[name][i] for name in old.summary_keys}, personal,
                             adapted, flush=False)
        self.flush()

    def _fill(self, f: h5py.File) -> None:
        for key, value in self.attrs.items():
            f.attrs[key] = value
        self.history.to_group(f)
        for name, (_, unit) in {**ROUND_COLUMNS, **LAYER_COLUMNS}.items():
            f["rounds"][name].attrs["unit"] = unit
        ev = f["eval"]
        ev["client_accuracy"].attrs["unit"] = "fraction in [0, 1]"
        if "adapted" in ev:
            ev["adapted/client_accuracy"].attrs["unit"] = (
                "fraction in [0, 1], after run.adapt_epochs local epochs from the global model")
        ev["std"].attrs["unit"] = "fraction (population std of the clients' accuracies)"
        for name, (_, unit, _) in SELECTION_COLUMNS.items():
            f["rounds"][name].attrs["unit"] = unit
        for name, data in self.clients.items():
            create_dataset(f, f"clients/{name}", data, cache=self.history.chunks
                           ).attrs["unit"] = CLIENT_COLUMNS[name]
        ev["fair_angle"].attrs["unit"] = "radians"
        ev["cf"].attrs["unit"] = "fraction: max_k |acc_k - mean acc|"
        if self._local is not None:
            write_local(f, self._local)
        if self.system is not None:
            tables, names = self.system
            for name, data in tables().items():
                create_dataset(f, f"system/{name}", data).attrs["unit"] = SYSTEM_COLUMNS[name]
            f["system"].attrs["tier_names"] = np.array(names, dtype="S")
        if self._model is not None:
            w, layers = self._model
            g = f.create_group("model")
            g.create_dataset("global", data=np.asarray(w, dtype=np.float32))
            g.create_dataset("layer_names", data=np.array([n for n, _, _ in layers], dtype="S"))
            g.create_dataset("layer_start", data=np.array([s for _, s, _ in layers], dtype="i8"))
            g.create_dataset("layer_stop", data=np.array([e for _, _, e in layers], dtype="i8"))

    def flush(self) -> None:
        """Replace the file with the current state (atomically; see the class docstring)."""
        t0 = time.monotonic()
        write_atomic(self.path, self._fill, "results file")
        self._written = time.monotonic()
        self._cost = self._written - t0
        self._pending = False

    def try_flush(self) -> None:
        """After a failure elsewhere: write what is pending if the disk lets us, else keep the
        previous file (never raises an OutputError)."""
        if self._pending:
            try:
                self.flush()
            except OutputError:
                pass

    def append_round(self, row: dict[str, float | int], flush: bool = True) -> None:
        """Append one /rounds row; every column of ROUND_COLUMNS and LAYER_COLUMNS must be present.

        The file is rewritten when the round had an evaluation, or when :data:`FLUSH_SECONDS`
        (at least 20 times the last write's duration) have passed since the last write: the
        rewrite then costs a few percent of the run at most. Checkpoints and the end always
        write (:meth:`set_last_round`, :meth:`finish`)."""
        self.history.add_round(row)
        self._pending = True
        due = time.monotonic() - self._written >= max(FLUSH_SECONDS, 20 * self._cost)
        if flush and (self._eval_pending or due):
            self._eval_pending = False
            self.flush()

    def set_last_round(self, name: str, value: float) -> None:
        """Overwrite one column of the last /rounds row (a time known only after the row was
        written, e.g. the checkpoint's)."""
        self.history.rounds[name][-1] = value
        self.flush()

    def append_eval(self, round_done: int, accuracy: np.ndarray, loss: np.ndarray,
                    summary: dict[str, float], personal: tuple[np.ndarray, np.ndarray] | None = None,
                    adapted: tuple[np.ndarray, np.ndarray] | None = None,
                    flush: bool = True) -> None:
        """Append one evaluation: (K,) accuracies and losses and their summary; ``personal``
        (accuracy (K,), loss (K,)) of the personal models and ``adapted`` (the same after local
        adaptation) when the run has them."""
        self.history.add_eval(round_done, accuracy, loss, summary, personal, adapted)
        self._pending = True
        if flush:
            self._eval_pending = True  # written with the round's row (append_round)

    def finish(self, w: np.ndarray, layers: list[tuple[str, int, int]],
               local: LocalState | None = None) -> None:
        """Write the final global model (float32) and layer map, and the clients' local
        coordinates (``local``: ``/clients/local_state``, FedBN's rows) when the run keeps
        some; mark the run complete.

        Call after the final checkpoint: if this write fails, the run resumes from it.
        """
        self._model = (np.asarray(w, dtype=np.float32), list(layers))
        self._local = local
        self.attrs["status"] = "complete"
        try:
            self.flush()
        except OutputError:
            self._model, self._local, self.attrs["status"] = None, None, "running"
            raise

    def close(self) -> None:
        """Nothing stays open between writes; kept for callers that close explicitly."""
