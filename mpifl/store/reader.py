"""Reading and validating an existing results file: :func:`read_results` (``mpifl report``,
:func:`mpifl.report.load`, analysis) and :func:`read_many` (every summary of many runs).

The file's SHA-256 seal is verified before HDF5 reads it (:mod:`mpifl.store.sealed`) and values
no run can produce are refused (:func:`check_values`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from mpifl.core.errors import OutputError
from mpifl.store.encoding import plain, read_local
from mpifl.store.schema import FRACTIONS, LAYER_COLUMNS, READABLE_VERSIONS, ROUND_COLUMNS
from mpifl.store.sealed import open_verified


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

    for name in FRACTIONS:
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
        attrs = {k: plain(v) for k, v in f.attrs.items()}
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
        local_entries = read_local(f)
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
