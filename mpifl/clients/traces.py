"""Device and availability traces: mpifl's two CSV formats, and a converter from FedScale's.

Both files are CSV (comma-separated, UTF-8) with the header line shown, one record a line; blank
lines are skipped. Times are simulated seconds, bandwidths Mbit/s (10^6 bit/s).

**Device trace** (``[system] device_trace``), one row per client::

    client,tier,seconds_per_sample,down_mbps,up_mbps,latency_s
    0,fast,0.004,48.5,19.0,0.02

* ``client``: ids 0..N-1, each exactly once, in any order. A run with K clients uses clients
  0..K-1 and refuses a file with N < K rows.
* ``tier``: the name of one of ``[system] tiers`` (used for reporting and for each tier's
  ``available_fraction`` under ``availability = "periodic"``).
* ``seconds_per_sample`` (> 0): local compute time per training sample per epoch;
  ``down_mbps``, ``up_mbps`` (> 0): bandwidths; ``latency_s`` (>= 0): per transfer.

**Availability trace** (``[system] availability_trace``), on-intervals::

    client,start_s,end_s
    0,0,3600
    0,7200,10800.5

* A client is available at time t when ``start_s <= t < end_s`` for one of its rows (half-open).
  Rows of one client may come in any order and may overlap or touch (they are merged).
* Times are absolute and do not wrap: after a client's last ``end_s`` it is never available
  again, and a client with no rows is never available.
* Rows for clients >= K are ignored (a run may use fewer clients than the trace holds).

**FedScale** (Lai et al., "FedScale: Benchmarking Model and System Performance of Federated
Learning at Scale", ICML 2022; files ``benchmark/dataset/data/device_info/client_device_capacity``
and ``client_behave_trace`` of github.com/SymbioticLab/FedScale, described in that folder's
README.md) publishes two pickled dicts keyed by client id:

* ``client_device_capacity``: ``{id: {"computation": ms, "communication": kbit/s}}``, where
  ``computation`` is the device's *inference* latency per sample (AI Benchmark, Ignatov et al.,
  2019) and ``communication`` its bandwidth (MobiPerf measurements). FedScale's simulator
  (``fedscale/cloud/internal/client_metadata.py``, ``get_completion_time``) charges
  ``3 * computation / 1000`` seconds per training sample (backward ~ 2x forward) and the same
  bandwidth up and down, with no latency; :func:`convert_fedscale` writes exactly that.
* ``client_behave_trace``: ``{id: {"active": [s, ...], "inactive": [s, ...], "finish_time": s,
  ...}}``: the client is on from ``active[i]`` to ``inactive[i]``, and FedScale repeats the
  trace every ``finish_time`` seconds (``ClientMetadata.is_active``: time mod finish_time).
  mpifl's intervals do not wrap, so the converter unrolls ``horizon_s`` seconds of it (one
  ``finish_time`` by default).

FedScale maps its simulated client n to the n-th trace entry cyclically; the converter does the
same: output client i gets the i-th entry (ids sorted) modulo the number of entries, so
``num_clients`` may exceed the file's size. The files are read with a restricted unpickler that
builds no objects but dicts, lists, tuples, strings and numbers (numpy scalars included):
anything else is refused with a :class:`~mpifl.core.errors.DataError`.
"""

from __future__ import annotations

import csv
import io
import math
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt

from mpifl.core.errors import DataError

__all__ = ["DEVICE_HEADER", "AVAILABILITY_HEADER", "FEDSCALE_TIERS", "FEDSCALE_TRAIN_FACTOR",
           "DeviceTrace", "Intervals", "read_device_trace", "read_availability_trace",
           "merge_intervals", "write_device_trace", "write_availability_trace",
           "load_plain_pickle", "fedscale_devices", "fedscale_availability", "convert_fedscale"]

DEVICE_HEADER = ("client", "tier", "seconds_per_sample", "down_mbps", "up_mbps", "latency_s")
AVAILABILITY_HEADER = ("client", "start_s", "end_s")
#: Tier names the converter writes: terciles of compute time, fastest first (the default tiers).
FEDSCALE_TIERS = ("fast", "medium", "slow")
#: FedScale's factor from inference to training time per sample (client_metadata.py).
FEDSCALE_TRAIN_FACTOR = 3.0


class DeviceTrace:
    """Per-client devices, each a (K,) array: ``tier`` int64 (index into the tier names),
    ``seconds_per_sample``, ``down_mbps``, ``up_mbps``, ``latency_s`` float64."""

    def __init__(self, tier: npt.NDArray[np.int64], seconds_per_sample: npt.NDArray[np.float64],
                 down_mbps: npt.NDArray[np.float64], up_mbps: npt.NDArray[np.float64],
                 latency_s: npt.NDArray[np.float64]) -> None:
        self.tier = tier
        self.seconds_per_sample = seconds_per_sample
        self.down_mbps = down_mbps
        self.up_mbps = up_mbps
        self.latency_s = latency_s


class DeviceArrays(Protocol):
    """What :func:`write_device_trace` reads: a :class:`DeviceTrace`'s five (K,) arrays, as a
    :class:`DeviceTrace` or a :class:`~mpifl.clients.system.SystemModel` holds them."""

    tier: npt.NDArray[np.int64]
    seconds_per_sample: npt.NDArray[np.float64]
    down_mbps: npt.NDArray[np.float64]
    up_mbps: npt.NDArray[np.float64]
    latency_s: npt.NDArray[np.float64]


class Intervals:
    """Merged on-intervals in CSR form: client c's are ``start[indptr[c]:indptr[c+1]]`` (and
    ``end``), sorted, disjoint and not touching; ``owner`` (n,) int64 is each one's client.
    All float64 seconds, half-open ``[start, end)``."""

    def __init__(self, owner: np.ndarray, start: np.ndarray, end: np.ndarray,
                 num_clients: int) -> None:
        self.owner, self.start, self.end = owner, start, end
        self.indptr = np.searchsorted(owner, np.arange(num_clients + 1)).astype(np.int64)

    def contains(self, t: float) -> np.ndarray:
        """(n,) bool: which intervals contain time ``t``."""
        return (self.start <= t) & (t < self.end)


# ---------------------------------------------------------------- reading mpifl's own formats

def _rows(path: str | Path, header: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """Yields (line number, fields) of a CSV after checking its header; DataError if unreadable."""
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the trace ({exc.strerror})") from None
    with f:
        reader = csv.reader(f)
        try:
            first = next(reader, None)
            if first is None or tuple(c.strip() for c in first) != header:
                raise DataError(f"{path}:1: header must be '{','.join(header)}' "
                                f"(got {','.join(first or [])!r})")
            for fields in reader:
                if fields and any(c.strip() for c in fields):
                    if len(fields) != len(header):
                        raise DataError(f"{path}:{reader.line_num}: {len(fields)} fields, "
                                        f"expected {len(header)} ({','.join(header)})")
                    yield reader.line_num, fields
        except (csv.Error, UnicodeDecodeError) as exc:
            raise DataError(f"{path}:{reader.line_num}: not a CSV line ({exc})") from None


def _int(path: str | Path, line: int, name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise DataError(f"{path}:{line}: {name} {text.strip()!r} is not an integer") from None
    if value < 0:
        raise DataError(f"{path}:{line}: {name} {value} is negative")
    return value


def _float(path: str | Path, line: int, name: str, text: str, *, positive: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{path}:{line}: {name} {text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise DataError(f"{path}:{line}: {name} must be finite and {need} (got {text.strip()})")
    return value


def read_device_trace(path: str | Path, num_clients: int, tier_names: list[str]) -> DeviceTrace:
    """Reads a device trace (module docstring) for clients 0..num_clients-1.

    A valid file is parsed by numpy's C reader (~1 s per 10^6 rows); any doubt sends it to the
    line-by-line reader, which names the offending line.

    Returns:
        :class:`DeviceTrace` of (num_clients,) arrays; ``tier`` indexes ``tier_names``.

    Raises:
        DataError: one line naming the file, the line and the problem (bad header, field,
            unknown tier, duplicate or missing client, fewer rows than ``num_clients``).
    """
    fast = _fast_device(path, num_clients, tier_names)
    return fast if fast is not None else _slow_device(path, num_clients, tier_names)


def _loadtxt(path: str | Path, usecols: int | tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    with warnings.catch_warnings():  # "line contained no data": blank lines are allowed
        warnings.simplefilter("ignore", UserWarning)
        return np.loadtxt(path, delimiter=",", skiprows=1, usecols=usecols, dtype=dtype,
                          ndmin=1, comments=None, encoding="utf-8")


def _header_ok(path: str | Path, header: tuple[str, ...]) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return tuple(c.strip() for c in f.readline().split(",")) == header
    except (OSError, UnicodeDecodeError):
        return False


def _fast_device(path: str | Path, num_clients: int, tier_names: list[str]) -> DeviceTrace | None:
    """The trace if the file is plainly valid, else None (then the slow reader explains)."""
    if not _header_ok(path, DEVICE_HEADER):
        return None
    try:
        ids = _loadtxt(path, 0, np.int64)
        names = _loadtxt(path, 1, str)
        vals = _loadtxt(path, (2, 3, 4, 5), np.float64).reshape(-1, 4)
    except (ValueError, OSError):
        return None
    n = len(ids)
    if n < num_clients or not np.array_equal(np.sort(ids), np.arange(n)):
        return None
    if not (np.isin(names, tier_names).all() and np.isfinite(vals).all()
            and (vals[:, :3] > 0).all() and (vals[:, 3] >= 0).all()):
        return None
    order = np.argsort(ids)[:num_clients]
    lookup = {name: i for i, name in enumerate(tier_names)}
    tier = np.array([lookup[x] for x in np.unique(names)], dtype=np.int64)[
        np.unique(names, return_inverse=True)[1]]
    return DeviceTrace(tier[order], *(np.ascontiguousarray(vals[order, j]) for j in range(4)))


def _slow_device(path: str | Path, num_clients: int, tier_names: list[str]) -> DeviceTrace:
    tiers = {name: i for i, name in enumerate(tier_names)}
    ids: list[int] = []
    tier: list[int] = []
    values: list[list[float]] = []
    lines: dict[int, int] = {}
    for line, f in _rows(path, DEVICE_HEADER):
        k = _int(path, line, "client", f[0])
        if k in lines:
            raise DataError(f"{path}:{line}: client {k} again (first on line {lines[k]})")
        lines[k] = line
        name = f[1].strip()
        if name not in tiers:
            raise DataError(f"{path}:{line}: tier {name!r} is not one of [system] tiers "
                            f"({', '.join(tier_names)})")
        ids.append(k)
        tier.append(tiers[name])
        values.append([_float(path, line, n, x, positive=n != "latency_s")
                       for n, x in zip(DEVICE_HEADER[2:], f[2:])])
    if len(ids) < num_clients:
        raise DataError(f"{path}: {len(ids)} clients, but the run has {num_clients}: give one "
                        "row per client or lower the number of clients")
    if ids and max(ids) != len(ids) - 1:  # ids are distinct, so 0..N-1 all present iff max == N - 1
        missing = int(np.setdiff1d(np.arange(len(ids)), ids)[0])
        raise DataError(f"{path}: client {missing} has no row (ids must be 0..{len(ids) - 1})")
    order = np.argsort(np.asarray(ids, dtype=np.int64))[:num_clients]
    table = np.asarray(values, dtype=np.float64).reshape(-1, 4)[order]
    return DeviceTrace(np.asarray(tier, dtype=np.int64)[order], *(table[:, j].copy()
                                                                  for j in range(4)))


def read_availability_trace(path: str | Path, num_clients: int) -> Intervals:
    """Reads an availability trace (module docstring) for clients 0..num_clients-1.

    Returns:
        :class:`Intervals`, merged (overlapping or touching rows of a client become one).

    Raises:
        DataError: one line naming the file, the line and the problem.
    """
    fast = _fast_intervals(path, num_clients)
    return fast if fast is not None else _slow_intervals(path, num_clients)


def _fast_intervals(path: str | Path, num_clients: int) -> Intervals | None:
    if not _header_ok(path, AVAILABILITY_HEADER):
        return None
    try:
        owner = _loadtxt(path, 0, np.int64)
        times = _loadtxt(path, (1, 2), np.float64).reshape(-1, 2)
    except (ValueError, OSError):
        return None
    start, end = times[:, 0], times[:, 1]
    if not (np.isfinite(times).all() and (owner >= 0).all() and (start >= 0).all()
            and (end > start).all()):
        return None
    keep = owner < num_clients
    return merge_intervals(owner[keep], start[keep], end[keep], num_clients)


def _slow_intervals(path: str | Path, num_clients: int) -> Intervals:
    owner: list[int] = []
    start: list[float] = []
    end: list[float] = []
    for line, f in _rows(path, AVAILABILITY_HEADER):
        k = _int(path, line, "client", f[0])
        s = _float(path, line, "start_s", f[1])
        e = _float(path, line, "end_s", f[2])
        if e <= s:
            raise DataError(f"{path}:{line}: end_s {f[2].strip()} must be after "
                            f"start_s {f[1].strip()}")
        if k < num_clients:
            owner.append(k)
            start.append(s)
            end.append(e)
    return merge_intervals(np.asarray(owner, dtype=np.int64), np.asarray(start, np.float64),
                           np.asarray(end, np.float64), num_clients)


def merge_intervals(owner: np.ndarray, start: np.ndarray, end: np.ndarray,
                    num_clients: int) -> Intervals:
    """Sorts (owner, start) and merges each client's overlapping or touching intervals."""
    order = np.lexsort((start, owner))
    owner, start, end = owner[order], start[order], end[order]
    n = len(owner)
    if n == 0:
        return Intervals(owner, start, end, num_clients)
    # running max of end within each client: encode (owner, rank of end) in one int64 so one
    # global maximum.accumulate never carries a value across clients (owners are sorted)
    end_order = np.argsort(end, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[end_order] = np.arange(n)
    reach = end[end_order][np.maximum.accumulate(owner * (n + 1) + rank) % (n + 1)]
    first = np.ones(n, dtype=bool)
    first[1:] = (owner[1:] != owner[:-1]) | (start[1:] > reach[:-1])
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, n - 1)
    return Intervals(owner[heads], start[heads], reach[tails], num_clients)


# ---------------------------------------------------------------- writing

def write_device_trace(path: str | Path, tier_names: list[str], trace: DeviceArrays) -> None:
    """Writes ``trace`` (client i = row i) in the device-trace format; floats round-trip.
    ``trace``: a :class:`DeviceTrace` or anything with its five (K,) arrays (a SystemModel)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(",".join(DEVICE_HEADER) + "\n")
        cols = (trace.seconds_per_sample, trace.down_mbps, trace.up_mbps, trace.latency_s)
        for k, (t, *vals) in enumerate(zip(trace.tier.tolist(), *(c.tolist() for c in cols))):
            f.write(f"{k},{tier_names[t]},{','.join(map(repr, vals))}\n")


def write_availability_trace(path: str | Path, owner: npt.ArrayLike, start: npt.ArrayLike,
                             end: npt.ArrayLike) -> None:
    """Writes on-intervals ``[start[i], end[i])`` of client ``owner[i]``; floats round-trip."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(",".join(AVAILABILITY_HEADER) + "\n")
        for k, s, e in zip(np.asarray(owner).tolist(), np.asarray(start, float).tolist(),
                           np.asarray(end, float).tolist()):
            f.write(f"{k},{s!r},{e!r}\n")


# ---------------------------------------------------------------- FedScale

#: Classes a trace pickle may name: numpy's scalar reconstruction only (a numpy float or int
#: stored in place of a Python one); it builds a number from a dtype and raw bytes. The same
#: pair is on PyTorch's ``weights_only`` allow-list.
_ALLOWED = {("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar")}


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, str, bytes, numbers, bools and None; refuses any class
    (an arbitrary class or callable in a pickle can run code when loaded)."""

    def __init__(self, file: IO[bytes], path: str | Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:  # pickle.Unpickler's own signature
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise DataError(f"{self.path}: the pickle needs {module}.{name}; only plain dicts, "
                        "lists and numbers are read (trace files are never unpickled as-is)")


def load_plain_pickle(path: str | Path) -> object:
    """The plain-data content of a pickle file, read with :class:`_PlainUnpickler`.

    Raises:
        DataError: unreadable, damaged, or naming a class (one line).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return _PlainUnpickler(io.BytesIO(data), path).load()
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any damage: truncated, bad opcode, ...
        raise DataError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc})") from None


def _entries(path: str | Path, data: object,
             num_clients: int | None) -> tuple[list[object], list[object]]:
    """(output client -> FedScale key, values) cyclically over the sorted keys."""
    if not isinstance(data, dict) or not data:
        raise DataError(f"{path}: expected a non-empty dict keyed by client id, "
                        f"got {type(data).__name__}")
    try:
        keys = sorted(data)
    except TypeError:
        raise DataError(f"{path}: client ids of mixed types cannot be ordered") from None
    n = len(keys) if num_clients is None else num_clients
    chosen = [keys[i % len(keys)] for i in range(n)]
    return chosen, [data[k] for k in chosen]


# A field and its values are unchecked pickle content, hence Any: _number's float() checks each.
def _field(path: str | Path, key: object, entry: object, name: str) -> Any:
    if not isinstance(entry, dict) or name not in entry:
        raise DataError(f"{path}: client {key!r} has no {name!r} (FedScale format: "
                        "a dict per client)")
    return entry[name]


def _number(path: str | Path, key: object, name: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{path}: client {key!r}: {name} {value!r} is not a number") from None
    if not math.isfinite(x):
        raise DataError(f"{path}: client {key!r}: {name} {value!r} is not finite")
    return x


def fedscale_devices(path: str | Path, num_clients: int | None = None) -> DeviceTrace:
    """Device trace from FedScale's ``client_device_capacity`` (module docstring).

    Tiers: terciles of ``seconds_per_sample`` over the converted clients, ``fast`` up to the
    1/3 quantile, ``medium`` up to the 2/3 quantile, ``slow`` above (indices into
    :data:`FEDSCALE_TIERS`).
    """
    keys, entries = _entries(path, load_plain_pickle(path), num_clients)
    comp = np.empty(len(keys))
    comm = np.empty(len(keys))
    for i, (key, e) in enumerate(zip(keys, entries)):
        comp[i] = _number(path, key, "computation", _field(path, key, e, "computation"))
        comm[i] = _number(path, key, "communication", _field(path, key, e, "communication"))
        if comp[i] <= 0 or comm[i] <= 0:
            raise DataError(f"{path}: client {key!r}: computation and communication must be "
                            f"> 0 (got {comp[i]}, {comm[i]})")
    sps = FEDSCALE_TRAIN_FACTOR * comp / 1000.0
    tier = np.searchsorted(np.quantile(sps, [1 / 3, 2 / 3]), sps, side="left").astype(np.int64)
    mbps = comm / 1000.0
    return DeviceTrace(tier, sps, mbps, mbps.copy(), np.zeros(len(keys)))


def fedscale_availability(path: str | Path, num_clients: int | None = None,
                          horizon_s: float | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, start, end) on-intervals from FedScale's ``client_behave_trace``, unrolled over
    ``[0, horizon_s)`` with period ``finish_time`` (default horizon: each client's own
    ``finish_time``, i.e. one period). Empty intervals (inactive == active) are dropped."""
    keys, entries = _entries(path, load_plain_pickle(path), num_clients)
    owner: list[int] = []
    start: list[float] = []
    end: list[float] = []
    for i, (key, e) in enumerate(zip(keys, entries)):
        on = [_number(path, key, "active", v) for v in _field(path, key, e, "active")]
        off = [_number(path, key, "inactive", v) for v in _field(path, key, e, "inactive")]
        period = _number(path, key, "finish_time", _field(path, key, e, "finish_time"))
        if len(on) != len(off) or period <= 0 or any(b < a for a, b in zip(on, off)):
            raise DataError(f"{path}: client {key!r}: needs as many 'active' as 'inactive' "
                            "times, each inactive >= its active, and finish_time > 0")
        horizon = period if horizon_s is None else horizon_s
        for r in range(max(1, math.ceil(horizon / period))):
            for a, b in zip(on, off):
                if b > a and a + r * period < horizon:
                    owner.append(i)
                    start.append(a + r * period)
                    end.append(b + r * period)
    return (np.asarray(owner, dtype=np.int64), np.asarray(start, np.float64),
            np.asarray(end, np.float64))


def convert_fedscale(device_file: str | Path | None, availability_file: str | Path | None,
                     out_dir: str | Path, num_clients: int | None = None, *,
                     horizon_s: float | None = None) -> dict[str, Path]:
    """Converts FedScale's device and availability pickles to mpifl's two CSV traces.

    Args:
        device_file: ``client_device_capacity`` (or None to skip), written to
            ``out_dir/devices.csv`` with tiers ``fast``/``medium``/``slow`` (terciles of compute).
        availability_file: ``client_behave_trace`` (or None), written to
            ``out_dir/availability.csv``.
        num_clients: clients to write (default: as many as the file has entries); more than the
            file holds reuse its entries cyclically, as FedScale does.
        horizon_s: seconds of FedScale's periodic behaviour trace to unroll (default: one
            ``finish_time``).

    Returns:
        ``{"device_trace": path, "availability_trace": path}`` for the files written.

    Raises:
        DataError: a file that is unreadable, not in FedScale's format, or needs a class.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if device_file is not None:
        written["device_trace"] = out / "devices.csv"
        write_device_trace(written["device_trace"], list(FEDSCALE_TIERS),
                           fedscale_devices(device_file, num_clients))
    if availability_file is not None:
        written["availability_trace"] = out / "availability.csv"
        write_availability_trace(written["availability_trace"],
                                 *fedscale_availability(availability_file, num_clients,
                                                        horizon_s))
    return written
