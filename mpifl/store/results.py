"""HDF5 results files: one per run, written by rank 0 only.

Layout (also in docs/RESULTS.md)::

    /                        attrs: schema_version, mpifl_version, config (JSON), world_size,
                                    status ("running" | "complete"), algorithm, num_clients
    /rounds/<column>         (R,)   one row per completed round (see ROUND_COLUMNS)
    /rounds/conflicts_layer  (R, L) per-layer conflict counts (LAYER_COLUMNS)
    /rounds/selected         (R, m) int64, the clients selected in each round, ascending
                                    (-1: not recorded, rounds run before schema 2)
    /rounds/aggregated       (R, m) bool, whether that client's update was aggregated (False:
                                    dropped out or rejected)
    /clients/num_train, num_test   (K,)   int64, each client's training / test samples
    /clients/label_counts    (K, C) int64, each client's training samples per label
    /clients/local_state     (K, s) float32, each client's local BatchNorm coordinates at the
                                    end of the run (model.batchnorm "local" or "local_stats";
                                    attrs names, column_start, column_stop, offset: which
                                    parameter each column block is and where it sits in w)
    /system/rounds/<column>  (R,)   a run on simulated time ([system] enabled): sim_time,
                                    selected, finished, late (SYSTEM_COLUMNS)
    /system/clients/<column> (K,)   tier, participations, finished, late, busy_s
    /eval/round              (E,)   int, rounds completed at that evaluation
    /eval/client_accuracy    (E, K) float64, fraction in [0, 1], on each client's local test split
    /eval/client_loss        (E, K) float64, mean of [model] loss (cross-entropy by default)
    /eval/<summary>          (E,)   mean, weighted_mean, std, worst5, best5, cf (fractions of 1),
                                    fair_angle (radians)
    /eval/group/{dp,eo,ap}   (E,)   group-fairness violations on the union of the clients' test
                                    data (only for binary tasks with a sensitive attribute)
    /eval/personal_accuracy, personal_loss   (E, K)  each client's personal model (Ditto only)
    /eval/personal/<summary> (E,)   the summaries of the personal accuracies (Ditto only)
    /eval/adapted/client_accuracy, client_loss   (E, K)  after local adaptation: each client's
                                    global model trained run.adapt_epochs local epochs (only
                                    with run.adapt_epochs > 0; absent = off)
    /eval/adapted/<summary>  (E,)   the summaries of the adapted accuracies
    /eval/loss/{mean,std,worst5,best5}  (E,)  summaries of the client losses (regression
                                    losses only, where client_accuracy and its summaries are NaN)
    /model/global            (d,)   float32, final global parameters (and float buffers such as
                                    BatchNorm's running statistics), model_state order
    /model/layer_names, layer_start, layer_stop   (L,) the layer map (module -> slice of /model/global)

Every accuracy (and its std) is a fraction in [0, 1]; percentage points appear only in printed
reports. Schema 1 (before 2026-11-24) had no /rounds/selected, /rounds/aggregated or /clients and
stored std in percentage points: :func:`read_results` converts it, so readers see one unit.
docs/RESULTS.md is the full reference.

The file is rewritten atomically (temporary file, SHA-256 seal, rename) after every evaluation,
checkpoint and at least every FLUSH_SECONDS, so a run that dies or hits a full disk keeps its
evaluations and the file is never half-written.
Nothing is pickled: the config is a JSON text attribute and everything else is a plain dataset.

Storage (docs/RESULTS.md, "Storage"): every dataset of at least :data:`COMPRESS_MIN_BYTES` (the
per-client arrays of a large population, /rounds/selected of many clients per round) is chunked
(:func:`chunk_shape`: one evaluation row is whole chunks, a client's column one chunk per
evaluation) and compressed with HDF5's built-in deflate (gzip, level :data:`GZIP_LEVEL`), with
the shuffle filter except for accuracies (fractions k/n: plain deflate is 3x smaller on them).
Smaller datasets stay contiguous, as in every file before. Names, shapes and dtypes are the same
either way: any HDF5 reader (h5py, h5dump, R, MATLAB) reads both. The compressed chunks of
evaluation rows and /clients are kept (:class:`ChunkCache`), so each rewrite compresses only
what is new.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from mpifl.core.version import __version__
from mpifl.core.errors import OutputError
from mpifl.core.locking import clean_stale_temporaries
from mpifl.metrics.summary import LOSS_SUMMARY_KEYS, SUMMARY_KEYS
from mpifl.store.sealed import open_verified, reason, write_atomic

SCHEMA_VERSION = 2
#: Versions :func:`read_results` reads (older ones are converted to the current units).
READABLE_VERSIONS = (1, 2)

#: The results file is rewritten at least this often (and after every evaluation, checkpoint
#: and at the end): a run that dies loses at most this many seconds of /rounds rows.
FLUSH_SECONDS = 1.0

#: /eval summaries on data with a sensitive attribute: violations on the union of test data.
GROUP_KEYS = ("group/dp", "group/eo", "group/ap")
#: /eval summaries of personal models (rules with ``personal_params``, e.g. Ditto).
PERSONAL_KEYS = tuple(f"personal/{k}" for k in SUMMARY_KEYS)
#: /eval summaries after local adaptation (``run.adapt_epochs`` > 0).
ADAPTED_KEYS = tuple(f"adapted/{k}" for k in SUMMARY_KEYS)
#: /eval summaries of the clients' test losses (regression tasks, ``[model] loss = "mse"``).
LOSS_KEYS = tuple(f"loss/{k}" for k in LOSS_SUMMARY_KEYS)

#: /rounds columns: name -> (dtype, unit/description), written once per round.
ROUND_COLUMNS: dict[str, tuple[str, str]] = {
    "round": ("i8", "round index t (0-based)"),
    "num_clients": ("i8", "clients whose updates were aggregated"),
    "train_loss": ("f8", "mean training loss of the aggregated clients: of the global model "
                         "before training for rules that need it (needs.losses), else the mean "
                         "minibatch loss of the first local epoch"),
    "lr": ("f8", "client learning rate lr_t"),
    "conflicts_model": ("i8", "MC: selected clients with u_k . s < 0"),
    "dropped": ("i8", "selected clients that dropped out (client.dropout)"),
    "rejected": ("i8", "updates excluded: NaN/Inf or norm above server.max_update_norm"),
    "bytes_moved": ("i8", "bytes sent over MPI this round (0 in one process)"),
    "time_broadcast": ("f8", "seconds"),
    "time_train": ("f8", "seconds, slowest rank's local training"),
    "time_gather": ("f8", "seconds, waiting for updates beyond the slowest training"),
    "time_aggregate": ("f8", "seconds"),
    "time_eval": ("f8", "seconds (0 when the round has no evaluation)"),
    "time_checkpoint": ("f8", "seconds writing the checkpoint after this round (0: none; also 0 "
                              "in the checkpoint's own copy of its last row)"),
    "peak_rss_server_mb": ("f8", "MiB, peak resident memory of rank 0 so far (the OS's "
                                 "maximum RSS, getrusage; after the round's evaluation too)"),
    "peak_rss_worker_mb": ("f8", "MiB, largest peak resident memory of a worker rank so far "
                                 "(the OS's maximum RSS, after the round's evaluation too; "
                                 "rank 0 in one process)"),
}

#: /rounds columns that are measurements of the machine (times, memory), not results: they
#: differ between an interrupted-and-resumed run and an uninterrupted one.
MEASURED_COLUMNS = tuple(k for k in ROUND_COLUMNS if k.startswith(("time_", "peak_rss_")))

#: /rounds columns added after schema 1 was first written: zeros when an older checkpoint lacks
#: them, so its runs still resume.
_LATER_COLUMNS = ("time_checkpoint", "peak_rss_server_mb", "peak_rss_worker_mb")

#: /rounds columns with one value per model layer: (R, L).
LAYER_COLUMNS: dict[str, tuple[str, str]] = {
    "conflicts_layer": ("i8", "LC: per layer, selected clients with u_k,l . s_l < 0"),
}

#: /rounds columns with one value per selected client: (R, m), since schema 2. Rows that a
#: checkpoint from schema 1 lacks are filled with -1 (selected) and False (aggregated).
SELECTION_COLUMNS: dict[str, tuple[str, str, int]] = {
    "selected": ("i8", "client ids selected this round, ascending (-1: not recorded)", -1),
    "aggregated": ("bool", "the selected client's update was aggregated (not dropped, not "
                           "rejected)", False),
}

#: /system datasets of a run on simulated time (``[system] enabled``; absent otherwise): per
#: round and per client, what the virtual clock (:mod:`mpifl.runtime.clock`) recorded.
SYSTEM_COLUMNS: dict[str, str] = {
    "rounds/sim_time": "simulated seconds since the run began, at the end of the round",
    "rounds/selected": "clients selected (available at the round's start)",
    "rounds/finished": "selected clients that finished in time and were aggregated",
    "rounds/late": "selected clients past the deadline, beyond the first m, or gone offline",
    "rounds/staleness": "asynchronous rules: mean staleness (server steps) of the updates "
                        "aggregated at the step (NaN: none)",
    "clients/tier": "device tier index per client (names: attribute tier_names)",
    "clients/participations": "rounds in which the client was selected",
    "clients/finished": "rounds in which its update arrived in time",
    "clients/late": "rounds in which it was selected but its update was not aggregated",
    "clients/busy_s": "simulated seconds it spent on rounds (downloading, training, uploading)",
}

#: /clients datasets: per-client facts of the federated data, written once.
CLIENT_COLUMNS: dict[str, str] = {
    "num_train": "(K,) training samples",
    "num_test": "(K,) test samples",
    "label_counts": "(K, C) training samples per label",
}


#: Datasets of at least this many bytes are chunked and compressed; smaller ones stay
#: contiguous (a chunk index and a filter would cost more than they save).
COMPRESS_MIN_BYTES = 1 << 16
#: Elements per chunk (256 KiB of float64): at K = 1e6, 31 chunks per evaluation row.
CHUNK_ELEMENTS = 1 << 15
#: Deflate level: 1 is within 4% of level 4's size (docs/BENCHMARKS.md), and faster.
GZIP_LEVEL = 1


def chunk_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """HDF5 chunk shape of a 1-D or 2-D dataset: about :data:`CHUNK_ELEMENTS` elements, whole
    rows when a row is shorter (``(E, K)`` -> ``(1, 32768)`` at K >= 32768; ``(K, C)`` ->
    ``(32768 // C, C)``), so one row (an evaluation) or one column (a client) is read without
    the rest."""
    if len(shape) == 1:
        return (max(1, min(shape[0], CHUNK_ELEMENTS)),)
    cols = max(1, min(shape[1], CHUNK_ELEMENTS))
    return (max(1, min(shape[0], CHUNK_ELEMENTS // cols)), cols)


def _shuffled(name: str) -> bool:
    """Shuffle filter for ``name``: yes but for accuracies, whose values are a few fractions
    k/n that plain deflate finds repeated (measured in docs/BENCHMARKS.md)."""
    return not name.endswith("accuracy")


def _encode(block: np.ndarray, chunks: tuple[int, ...], shuffle: bool) -> bytes:
    """One chunk as HDF5's shuffle + deflate filters store it: padded to the full chunk shape
    (edge chunks), bytes transposed by the shuffle filter, then zlib (deflate's format)."""
    if block.shape != chunks:
        full = np.zeros(chunks, dtype=block.dtype)
        full[tuple(slice(0, n) for n in block.shape)] = block
        block = full
    raw: np.ndarray = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    size = block.dtype.itemsize
    if shuffle and size > 1:
        raw = raw.reshape(-1, size).T
    return zlib.compress(np.ascontiguousarray(raw).tobytes(), GZIP_LEVEL)


class ChunkCache:
    """Compressed chunks of arrays that do not change once written (evaluation rows, /clients),
    so that a rewrite of the file compresses only what is new.

    Entries are keyed by name and hold the array they were made from: an entry is used only for
    that very array object (a replaced row is compressed again). Size: the compressed bytes,
    about 0.2 (accuracies) to 0.9 (losses) of the rows' own.
    """

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[np.ndarray, list[bytes]]] = {}

    def get(self, key: Any, source: np.ndarray, make: Callable[[], list[bytes]]) -> list[bytes]:
        hit = self._entries.get(key)
        if hit is not None and hit[0] is source:
            return hit[1]
        blobs = make()
        self._entries[key] = (source, blobs)
        return blobs


class LocalState(NamedTuple):
    """The clients' local coordinates of w (FedBN's BatchNorm rows) as the results file keeps
    them: ``/clients/local_state``.

    Attributes:
        rows: (K, s) float32, client k's values of the s local coordinates.
        entries: one ``(name, first column, end column, offset in w)`` per model entry the
            columns hold (``"bn1.running_mean"``, ...), in column order.
    """

    rows: np.ndarray
    entries: list[tuple[str, int, int, int]]

    @classmethod
    def of(cls, rows: Any, index: np.ndarray, layout: Any) -> "LocalState":
        """From the (K, s) rows, their (s,) ascending positions in w and the model's
        :class:`~mpifl.core.layout.ParamLayout` (``names``, ``offsets``, ``numels``).

        Raises:
            ValueError: positions that are not whole entries of the layout.
        """
        index = np.asarray(index, dtype=np.int64)
        entries = []
        for name, off, n in zip(layout.names, layout.offsets, layout.numels):
            col = int(np.searchsorted(index, off))
            if col < len(index) and index[col] == off:
                if not np.array_equal(index[col:col + n], np.arange(off, off + n)):
                    raise ValueError(f"local coordinates hold part of {name} only")
                entries.append((name, col, col + n, int(off)))
        if sum(b - a for _, a, b, _ in entries) != len(index):
            raise ValueError("local coordinates that are not whole model entries")
        return cls(np.asarray(rows, dtype=np.float32), entries)

    @staticmethod
    def column_names(entries: list[tuple[str, int, int, int]]) -> list[str]:
        """One label per column: ``"bn1.running_mean[0]"``, ``"bn1.running_mean[1]"``, ..."""
        return [f"{name}[{i}]" for name, a, b, _ in entries for i in range(b - a)]


def _chunk_offsets(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(0, n, c) for n, c in zip(shape, chunks)))


def create_dataset(g: h5py.Group, name: str, data: np.ndarray, *, cache: ChunkCache | None = None,
                   rows: list[np.ndarray] | None = None) -> h5py.Dataset:
    """``g[name] = data``, chunked and deflate-compressed when it holds at least
    :data:`COMPRESS_MIN_BYTES` (shape, dtype and values as given; see the module docstring).

    Args:
        data: a 1-D or 2-D array (or ``rows``' stack).
        cache: compressed chunks kept between rewrites, keyed by ``name`` (and row): reused
            while the same array objects are written again.
        rows: when given, ``data`` is ``np.stack(rows)`` and rows are cached one by one (only
            when a chunk is one row: K >= CHUNK_ELEMENTS; not at all otherwise). A cached row
            must not be changed in place (history rows never are).

    Returns:
        The dataset. Chunks are written with ``write_direct_chunk`` from :func:`_encode`:
        exactly what HDF5's deflate (and shuffle) filters would store, read back by any reader.
    """
    data = np.ascontiguousarray(data)
    if (data.nbytes < COMPRESS_MIN_BYTES or data.ndim not in (1, 2)
            or data.dtype.kind not in "biuf"):
        return g.create_dataset(name, data=data)
    chunks, shuffle = chunk_shape(data.shape), _shuffled(name)
    d = g.create_dataset(name, shape=data.shape, dtype=data.dtype, chunks=chunks,
                         compression="gzip", compression_opts=GZIP_LEVEL, shuffle=shuffle)
    by_row = rows is not None and data.ndim == 2 and chunks[0] == 1

    def encode(array: np.ndarray, offsets: Iterable[tuple[int, ...]]) -> list[bytes]:
        return [_encode(array[tuple(slice(o, o + c) for o, c in zip(off, chunks))], chunks,
                        shuffle) for off in offsets]

    if by_row and rows is not None:
        cols = list(range(0, data.shape[1], chunks[1]))
        for i, row in enumerate(rows):
            def make_row(i: int = i) -> list[bytes]:
                return encode(data[i:i + 1], [(0, c) for c in cols])
            blobs = cache.get((name, i), row, make_row) if cache is not None else make_row()
            for c, blob in zip(cols, blobs):
                d.id.write_direct_chunk((i, c), blob)
        return d
    offsets = list(_chunk_offsets(data.shape, chunks))

    def make() -> list[bytes]:
        return encode(data, offsets)

    # a stack of rows is a new array at every write: caching it would only hold memory
    blobs = cache.get(name, data, make) if cache is not None and rows is None else make()
    for off, blob in zip(offsets, blobs):
        d.id.write_direct_chunk(off, blob)
    return d


def _padded(rows: list[Any], dtype: str, fill: Any) -> np.ndarray:
    """(R, m) from R rows of (m,) values, None rows (not recorded) filled with ``fill``."""
    width = max((len(r) for r in rows if r is not None), default=0)
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, :len(r)] = r
    return out


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


class MetricHistory:
    """Every /rounds row and /eval entry so far, in memory (rank 0), for checkpoints and resume.

    Size O(R + E K) numbers: tiny next to the model history an aggregator keeps.
    """

    def __init__(self, num_clients: int, num_layers: int, group_metrics: bool = False,
                 personal_metrics: bool = False, adapted_metrics: bool = False,
                 loss_metrics: bool = False) -> None:
        self.num_clients, self.num_layers = num_clients, num_layers
        self.personal_metrics, self.adapted_metrics = personal_metrics, adapted_metrics
        self.loss_metrics = loss_metrics
        self.summary_keys = (SUMMARY_KEYS + (GROUP_KEYS if group_metrics else ())
                             + (PERSONAL_KEYS if personal_metrics else ())
                             + (ADAPTED_KEYS if adapted_metrics else ())
                             + (LOSS_KEYS if loss_metrics else ()))
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
        if self.personal_metrics:
            assert personal is not None  # a history with personal metrics is given them
            self.personal_accuracy.append(np.asarray(personal[0], dtype=np.float64))
            self.personal_loss.append(np.asarray(personal[1], dtype=np.float64))
        if self.adapted_metrics:
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
            create_dataset(g, f"rounds/{name}", _padded(self.rounds[name], dtype, fill))
        create_dataset(g, "eval/round", np.asarray(self.eval_round, dtype="i8"))
        for name, rows in self._per_client():
            data = np.asarray(rows, dtype="f8").reshape(len(rows), self.num_clients)
            create_dataset(g, f"eval/{name}", data, cache=self.chunks, rows=rows)
        for name in self.summary_keys:
            create_dataset(g, f"eval/{name}", np.asarray(self.summary[name], dtype="f8"))

    def _per_client(self) -> list[tuple[str, list[np.ndarray]]]:
        out = [("client_accuracy", self.accuracy), ("client_loss", self.loss)]
        if self.personal_metrics:
            out += [("personal_accuracy", self.personal_accuracy),
                    ("personal_loss", self.personal_loss)]
        if self.adapted_metrics:
            out += [("adapted/client_accuracy", self.adapted_accuracy),
                    ("adapted/client_loss", self.adapted_loss)]
        return out

    @classmethod
    def from_group(cls, g: h5py.Group, version: int = SCHEMA_VERSION) -> "MetricHistory":
        """Inverse of :meth:`to_group` (raises KeyError if a column is missing); a history
        written under schema ``version`` 1 has its std converted to a fraction."""
        h = cls(g["eval/client_accuracy"].shape[1], g["rounds/conflicts_layer"].shape[1],
                group_metrics="eval/group" in g, personal_metrics="eval/personal_accuracy" in g,
                adapted_metrics="eval/adapted" in g, loss_metrics="eval/loss" in g)
        num_rounds = len(g["rounds/round"])
        for name in h.rounds:
            if f"rounds/{name}" not in g and name in (*_LATER_COLUMNS, *SELECTION_COLUMNS):
                h.rounds[name] = [None if name in SELECTION_COLUMNS else 0.0] * num_rounds
                continue
            h.rounds[name] = list(g[f"rounds/{name}"][()])
        h.eval_round = g["eval/round"][()].tolist()
        h.accuracy = list(g["eval/client_accuracy"][()])
        h.loss = list(g["eval/client_loss"][()])
        if h.personal_metrics:
            h.personal_accuracy = list(g["eval/personal_accuracy"][()])
            h.personal_loss = list(g["eval/personal_loss"][()])
        if h.adapted_metrics:
            h.adapted_accuracy = list(g["eval/adapted/client_accuracy"][()])
            h.adapted_loss = list(g["eval/adapted/client_loss"][()])
        for name in h.summary_keys:
            h.summary[name] = g[f"eval/{name}"][()].tolist()
            if version == 1 and name in ("std", "personal/std"):  # was percentage points
                h.summary[name] = [v / 100.0 for v in h.summary[name]]
        return h


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
        world_size: MPI ranks of the run.
        num_clients: K, the width of the per-client evaluation arrays.
        adapted_metrics: the run evaluates after local adaptation (``run.adapt_epochs`` > 0):
            /eval/adapted/... is written.
        history: rows to write first (a resumed run rewrites its results from its checkpoint);
            kept up to date with every later append, for the next checkpoint.
        clients: the /clients datasets (CLIENT_COLUMNS: ``num_train``, ``num_test`` (K,) and
            ``label_counts`` (K, C), int64), or None to leave /clients out.

    Raises:
        OutputError: the file cannot be written (the previous file, if any, is untouched).
    """

    def __init__(self, path: Path, config_json: str, *, world_size: int, num_clients: int,
                 num_layers: int, algorithm: str, group_metrics: bool = False,
                 personal_metrics: bool = False, history: MetricHistory | None = None,
                 clients: dict[str, np.ndarray] | None = None, adapted_metrics: bool = False,
                 loss_metrics: bool = False):
        self.path = Path(path)
        clean_stale_temporaries(self.path.parent, f".{self.path.name}.tmp-")
        self.attrs = {"schema_version": SCHEMA_VERSION, "mpifl_version": __version__,
                      "config": config_json, "world_size": world_size,
                      "num_clients": num_clients, "algorithm": algorithm, "status": "running"}
        self.history = MetricHistory(num_clients, num_layers, group_metrics, personal_metrics,
                                     adapted_metrics, loss_metrics)
        self.clients = {k: np.asarray(v, dtype=np.int64) for k, v in (clients or {}).items()}
        self._model: tuple[np.ndarray, list[tuple[str, int, int]]] | None = None
        self._local: LocalState | None = None
        #: a run on simulated time: () -> {SYSTEM_COLUMNS name: array}, and the tier names
        self.system: tuple[Callable[[], dict[str, np.ndarray]], list[str]] | None = None
        self._written, self._cost = 0.0, 0.0  # monotonic time of the last write, its seconds
        self._pending = self._eval_pending = False
        old = history or MetricHistory(num_clients, num_layers, group_metrics, personal_metrics,
                                       adapted_metrics, loss_metrics)
        for i in range(len(old.rounds["round"])):
            self.append_round({name: col[i] for name, col in old.rounds.items()}, flush=False)
        for i, rnd in enumerate(old.eval_round):
            personal = ((old.personal_accuracy[i], old.personal_loss[i])
                        if personal_metrics else None)
            adapted = ((old.adapted_accuracy[i], old.adapted_loss[i])
                       if adapted_metrics else None)
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
            _write_local(f, self._local)
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


def _write_local(f: h5py.File, local: LocalState) -> None:
    """``/clients/local_state`` (K, s) float32, chunked and compressed when large, with the
    entries of its columns as attributes."""
    d = create_dataset(f, "clients/local_state", local.rows)
    d.attrs["unit"] = ("each client's local coordinates of w (model.batchnorm), at the end; "
                       "columns column_start[i]:column_stop[i] are entry names[i], "
                       "w[offset[i]:offset[i] + (column_stop[i] - column_start[i])] globally")
    d.attrs["names"] = np.array([n for n, _, _, _ in local.entries], dtype="S")
    for i, key in enumerate(("column_start", "column_stop", "offset"), start=1):
        d.attrs[key] = np.array([e[i] for e in local.entries], dtype=np.int64)


def _read_local(f: h5py.File) -> list[tuple[str, int, int, int]]:
    """The entries of ``/clients/local_state``'s columns (empty when the file has none)."""
    if "clients/local_state" not in f:
        return []
    a = f["clients/local_state"].attrs
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in a["names"]]
    return [(n, int(s), int(e), int(o)) for n, s, e, o in
            zip(names, a["column_start"], a["column_stop"], a["offset"])]


#: /eval datasets that are fractions in [0, 1] (NaN allowed: no test data, or a diverged run).
_FRACTIONS = ("client_accuracy", "personal_accuracy", "adapted/client_accuracy", "mean",
              "weighted_mean", "std", "worst5", "best5", "cf", "group/dp", "group/eo",
              "group/ap") + tuple(
    f"{sub}/{k}" for sub in ("personal", "adapted")
    for k in ("mean", "weighted_mean", "std", "worst5", "best5", "cf"))


def check_values(path: Path, rounds: dict[str, np.ndarray], ev: dict[str, np.ndarray],
                 attrs: dict[str, Any] | None = None) -> None:
    """Refuse values no run can produce (a damaged file that slipped through, e.g. an older
    file without a checksum): fractions outside [0, 1], negative counts or times, rounds out of
    order.

    Raises:
        OutputError: naming the dataset and the first bad value.
    """
    attrs = attrs or {}

    def bad(name: str, values: np.ndarray, ok: np.ndarray) -> None:
        if not np.all(ok):
            first = np.asarray(values)[~ok].ravel()[0]
            raise OutputError(f"{path}: damaged results file: {name} holds an impossible value "
                              f"({first!r})")

    for name in _FRACTIONS:
        if name in ev:
            v = np.asarray(ev[name], dtype=np.float64)
            bad(f"/eval/{name}", v, np.isnan(v) | ((v >= 0) & (v <= 1)))
    for name in ("client_loss", "personal_loss", "adapted/client_loss"):
        if name in ev:
            v = np.asarray(ev[name], dtype=np.float64)
            bad(f"/eval/{name}", v, np.isnan(v) | (v >= 0))
    if "fair_angle" in ev:
        v = np.asarray(ev["fair_angle"], dtype=np.float64)
        bad("/eval/fair_angle", v, np.isnan(v) | ((v >= 0) & (v <= np.pi + 1e-9)))
    if "round" in rounds:
        r = np.asarray(rounds["round"])
        bad("/rounds/round", r, r == np.arange(len(r)))
    for name, (dtype, _) in {**ROUND_COLUMNS, **LAYER_COLUMNS}.items():
        if name in rounds and name not in ("round", "train_loss"):
            v = np.asarray(rounds[name], dtype=np.float64)
            bad(f"/rounds/{name}", v, np.isfinite(v) & (v >= 0) if dtype == "i8" or name == "lr"
                else np.isnan(v) | (v >= 0))
    if "selected" in rounds and "num_clients" in attrs:
        v = np.asarray(rounds["selected"])
        bad("/rounds/selected", v, (v >= -1) & (v < attrs["num_clients"]))
    if "round" in ev:
        r = np.asarray(ev["round"])
        n = len(rounds.get("round", ())) if "round" in rounds else None
        ok = (r >= 1) & np.concatenate([[True], np.diff(r) > 0])
        if n is not None:
            ok &= r <= n
        bad("/eval/round", r, ok)


class LazyArray:
    """A per-client dataset of a results file kept open by :func:`read_results` (``lazy=True``):
    nothing is read until it is indexed, and an index reads only the chunks it touches.

    Attributes:
        shape, dtype, ndim, nbytes, chunks: the dataset's (``chunks`` None: contiguous, a file
            written before compression or a small one).
        path: the results file; name: the dataset's path in it (``eval/client_accuracy``).
    """

    def __init__(self, path: Path, name: str, dataset: h5py.Dataset, handle: "_OpenFile"):
        self.path, self.name, self._handle = path, name, handle
        self.shape, self.dtype, self.chunks = dataset.shape, dataset.dtype, dataset.chunks
        self.ndim = len(self.shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __getitem__(self, key: Any) -> np.ndarray:
        """h5py's indexing (ints, slices, one increasing list) of the dataset, as numpy.

        Raises:
            OutputError: the file was closed, or HDF5 cannot read the chunk (a damaged file
                that has no checksum).
        """
        f = self._handle.file
        if f is None:
            raise OutputError(f"{self.path}: closed (the loaded results were closed; load "
                              "them again)")
        try:
            out: np.ndarray = f[self.name][key]
            return out
        except (TypeError, IndexError, ValueError):
            raise
        except Exception as exc:  # noqa: BLE001 -- HDF5's errors on a damaged chunk
            first = (str(exc).splitlines() or [""])[0]
            raise OutputError(f"{self.path}: cannot read /{self.name} ({type(exc).__name__}: "
                              f"{first})") from None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[()]
        return out if dtype is None else out.astype(dtype, copy=False)

    def __len__(self) -> int:
        return int(self.shape[0])

    def __repr__(self) -> str:
        return f"LazyArray({self.path}:/{self.name}, shape={self.shape}, dtype={self.dtype})"


class _OpenFile:
    """The open file object and HDF5 file behind a run's :class:`LazyArray` s."""

    def __init__(self, fileobj: Any, f: h5py.File) -> None:
        self.fileobj, self.file = fileobj, f

    def close(self) -> None:
        f, self.file = self.file, None
        if f is not None:
            try:
                f.close()
            finally:
                self.fileobj.close()


#: Rows of a per-client array checked at once when an unsealed file is opened lazily.
_CHECK_BLOCK = 1 << 22


def _lazy(group: str, dataset: h5py.Dataset) -> bool:
    """Per-client arrays, read lazily with ``lazy=True``: /eval's (E, K), every /clients one."""
    return group == "clients" or (group == "eval" and dataset.ndim == 2)


def read_results(path: str | Path, lazy: bool = False) -> dict[str, Any]:
    """Read a results file into plain numpy arrays (for ``mpifl report`` and analysis).

    The file's SHA-256 is verified before HDF5 reads it (files written before checksums were
    added are still read), and impossible values are refused (:func:`check_values`).

    Args:
        lazy: per-client arrays (/eval's (E, K) ones, /clients) come back as
            :class:`LazyArray` s over the file, which stays open (until ``result["close"]()``
            or garbage collection) and is read only where they are indexed; everything else is
            read as with ``lazy=False``. The seal is verified all the same (it streams the file
            through SHA-256, in constant memory); the value checks of the lazy arrays, which
            would read them whole, are left out for sealed files (the seal proves they are the
            bytes mpifl wrote) and done a block of rows at a time for unsealed (older) ones.

    Returns:
        ``{"path", "attrs", "config", "rounds": {col: (R,) or (R, L) or (R, m)},
        "eval": {name: array}, "clients": {name: array}, "system": {SYSTEM_COLUMNS name:
        array, "tier_names": [str]}}`` (``clients`` empty before schema 2, ``system`` empty for
        a run not on simulated time),
        accuracies and their std as fractions whatever the file's schema version; with
        ``lazy``, also ``"close"``: a callable that closes the file.

    Raises:
        OutputError: the file is missing, not HDF5, damaged, or not an mpifl results file of a
            known schema version.
    """
    path = Path(path)
    if not path.is_file():
        raise OutputError(f"{path}: no such results file")
    fileobj, sealed = open_verified(path, "results file")
    handle: _OpenFile | None = None
    lazies: dict[str, LazyArray] = {}
    try:
        handle = _OpenFile(fileobj, h5py.File(fileobj, "r"))
        f = handle.file
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        if "schema_version" not in attrs or "rounds" not in f or "eval" not in f:
            raise OutputError(f"{path}: not an mpifl results file")
        if attrs["schema_version"] not in READABLE_VERSIONS:
            raise OutputError(
                f"{path}: schema version {attrs['schema_version']} is not supported "
                f"(this mpifl reads {', '.join(map(str, READABLE_VERSIONS))})"
            )

        def get(group: str, name: str) -> Any:
            d = f[f"{group}/{name}"]
            if lazy and _lazy(group, d):
                lazies[f"{group}/{name}"] = LazyArray(path, f"{group}/{name}", d, handle)
                return lazies[f"{group}/{name}"]
            return d[()]

        rounds = {k: get("rounds", k) for k in f["rounds"]}
        ev = {k: get("eval", k) for k in f["eval"] if isinstance(f["eval"][k], h5py.Dataset)}
        for sub in ("group", "personal", "adapted", "loss"):
            ev.update({f"{sub}/{k}": get("eval", f"{sub}/{k}") for k in f["eval"].get(sub, {})})
        clients = {k: get("clients", k) for k in f.get("clients", {})}
        system = _read_system(f)
        local_entries = _read_local(f)
        if lazy and not sealed:
            _check_lazy(path, {k: v for k, v in ev.items() if isinstance(v, LazyArray)})
    except BaseException as exc:
        if handle is not None:
            handle.close()
        else:
            fileobj.close()
        if isinstance(exc, (OutputError, KeyboardInterrupt, SystemExit)):
            raise
        # h5py raises OSError, KeyError, RuntimeError, ... on damage
        first = (str(exc).splitlines() or [""])[0]
        raise OutputError(f"{path}: cannot read as HDF5 ({type(exc).__name__}: {first})") from None
    if not lazies:
        handle.close()
    try:
        if not isinstance(attrs.get("config", "{}"), str):
            raise OutputError(f"{path}: damaged results file (config is not text)")
        try:
            config = json.loads(attrs.get("config", "{}"))
        except ValueError:
            raise OutputError(f"{path}: stored config is not valid JSON") from None
        if attrs["schema_version"] == 1:  # std was stored in percentage points
            for name in ("std", "personal/std"):
                if name in ev:
                    ev[name] = ev[name] / 100.0
        check_values(path, rounds, {k: v for k, v in ev.items()
                                    if not isinstance(v, LazyArray)}, attrs)
    except BaseException:
        handle.close()
        raise
    out = {"path": str(path), "attrs": attrs, "config": config, "rounds": rounds, "eval": ev,
           "clients": clients, "local_entries": local_entries, "system": system}
    if lazy:
        out["close"] = handle.close
    return out


def _read_system(f: h5py.File) -> dict[str, Any]:
    """/system of a run on simulated time ({SYSTEM_COLUMNS name: array, "tier_names": [str]}),
    empty for a run without it."""
    if "system" not in f:
        return {}
    g = f["system"]
    out: dict[str, Any] = {f"{part}/{k}": g[part][k][()] for part in ("rounds", "clients")
                           for k in g.get(part, {})}
    out["tier_names"] = [n.decode() if isinstance(n, bytes) else str(n)
                         for n in g.attrs.get("tier_names", [])]
    return out


def _check_lazy(path: Path, arrays: dict[str, LazyArray]) -> None:
    """:func:`check_values` of (E, K) arrays a block of rows at a time (constant memory)."""
    for name, a in arrays.items():
        step = max(1, _CHECK_BLOCK // max(1, a.shape[1]))
        for lo in range(0, a.shape[0], step):
            check_values(path, {}, {name: a[lo:lo + step]})


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    return v


# -- reading many results files: the one route every summary and reader takes ------------------


class Damaged(NamedTuple):
    """A results file that cannot be read: its path (as given) and why, in a few words."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


class DamagedResults(OutputError):
    """Results files that cannot be read (damaged, truncated, empty, foreign, missing), all named
    in one line: ``N damaged results file(s): PATH (reason); PATH (reason)``."""

    def __init__(self, damaged: list[Damaged]) -> None:
        self.damaged = list(damaged)
        super().__init__(f"{len(self.damaged)} damaged results file(s): "
                         + "; ".join(map(str, self.damaged)))


def damage_reason(path: str | Path, exc: OutputError) -> str:
    """Why ``path`` could not be read, from :func:`read_results`'s error, without the path."""
    text = " ".join(str(exc).split())
    text = text.removeprefix(f"{path}: ")
    try:
        if Path(path).is_file() and Path(path).stat().st_size == 0:
            return "empty: 0 bytes"
    except OSError:
        pass
    text = text.removeprefix("unreadable results file: ").removeprefix("damaged results file: ")
    if text.startswith("damaged results file (") and text.endswith(")"):
        return text[len("damaged results file ("):-1]  # "checksum mismatch"
    inner = text.removeprefix("cannot read as HDF5 (").removesuffix(")")
    if inner.startswith(("not an HDF5", "truncated")):  # "truncated: 10 of 20 bytes ..."
        return inner
    return text


def read_many(paths: Iterable[str | Path],
              lazy: bool = False) -> tuple[list[dict[str, Any]], list[Damaged]]:
    """Read every results file of ``paths`` with :func:`read_results` (``lazy`` passed on).

    Returns:
        ``(good, damaged)``: the results of the files that read (in order; each has its
        ``"path"``), and a :class:`Damaged` (path, reason) for every other one — damaged,
        truncated, empty, not HDF5, foreign or missing. Summaries show ``good`` and name every
        entry of ``damaged`` (then exit 2: :class:`DamagedResults`); readers that need every
        file raise ``DamagedResults(damaged)``.
    """
    good, damaged = [], []
    for path in paths:
        try:
            good.append(read_results(path, lazy=lazy))
        except OutputError as exc:
            damaged.append(Damaged(Path(path), damage_reason(path, exc)))
    return good, damaged
