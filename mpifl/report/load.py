"""Results as an ``xarray.Dataset`` and pandas tables: :func:`mpifl.load` (docs/RESULTS.md).

One Dataset holds any number of runs — results files, or the runs of a sweep folder — aligned on
their rounds and clients:

====================  =========================  ==============================================
dimension             coordinate values          what is along it
====================  =========================  ==============================================
``run``               run ids (file stem, or the  one results file each; non-index coordinates
                      sweep's run id)             ``algorithm``, ``seed``, ``status`` and every
                                                  config key whose value differs between runs
``round``             0 .. R-1                   training rounds (/rounds columns)
``eval_round``        rounds completed           evaluations (/eval)
``client``            0 .. K-1                   clients
``slot``              0 .. m-1                   position among a round's selected clients
``label``             0 .. C-1                   labels (``label_counts``)
====================  =========================  ==============================================

Runs of different lengths are padded (NaN; -1 for ``selected``, False for ``aggregated``).
Accuracies, their ``std`` and the fairness violations are fractions in [0, 1] whatever the
file's schema version (percentage points appear only in printed reports).

**Lazy loading** (``lazy=True``, and by default when a run's per-client arrays hold at least
:data:`LAZY_MIN_BYTES`): the per-client variables (``accuracy``, ``loss``, the personal and
adapted ones, ``num_train``, ``num_test``, ``label_counts``) are not read. They are dask
arrays when dask is installed (``pip install 'mpifl[dask]'``; chunks of
:data:`DASK_CLIENT_CHUNK` clients, one evaluation and one run), otherwise xarray's lazily
indexed arrays; either way an index reads only the HDF5 chunks it touches (an evaluation row,
a client's column) through :class:`_Stacked`. The results files stay open until
``ds.close()`` (or ``with mpifl.load(...) as ds:``). The rounds table and the summaries are
read as before.
"""

from __future__ import annotations

import itertools
import json
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Union

import numpy as np

from mpifl.core.errors import OutputError
from mpifl.metrics.summary import SUMMARY_KEYS
from mpifl.store.results import (CHUNK_ELEMENTS, DamagedResults, LazyArray, LocalState,
                                 read_many)
from mpifl.store.sweep_index import INDEX, listed_runs

if TYPE_CHECKING:
    import xarray as xr

#: One axis of an outer index: a slice with step 1, or integer positions.
AxisIndex = Union[slice, np.ndarray]
#: A run's lazy variables: name -> (dims without run, the array, {dim: coordinate values}).
Lazies = dict[str, tuple[tuple[str, ...], LazyArray, dict[str, np.ndarray]]]

#: ``xarray.concat`` fill values of variables that are not floats (padding of shorter runs).
_FILL = {"selected": -1, "aggregated": False}

#: ``lazy="auto"`` loads lazily when one run's per-client arrays hold at least this many bytes
#: (below it, reading them costs less than a second and a few tens of MiB).
LAZY_MIN_BYTES = 1 << 25
#: Clients per dask chunk of a lazy per-client variable: 8 HDF5 chunks (2 MiB of float64).
DASK_CLIENT_CHUNK = 8 * CHUNK_ELEMENTS
#: A lazy read holds at most about this many elements of one run's array at once.
_READ_BUDGET = 1 << 23
#: Contiguous runs of indices read one by one up to this many; more: their bounding range.
_MAX_RUNS = 32


def load(source: str | Path | Iterable[str | Path], lazy: bool | str = "auto") -> xr.Dataset:
    """Read runs into one ``xarray.Dataset`` (layout in the module docstring).

    Args:
        source: a results file (``.h5``), a sweep folder (holding ``index.json``; runs without
            a results file yet are left out, and in a ``--seeds`` folder the seeds its
            ``seeds.toml`` does not list), or a list of results files.
        lazy: ``True``: the per-client variables stay in the files and are read where they are
            indexed (dask arrays with dask installed, else xarray's lazily indexed arrays);
            ``False``: everything is read into memory; ``"auto"``: lazy when one run's
            per-client arrays hold at least :data:`LAZY_MIN_BYTES` (32 MiB: K = 200,000
            clients and 10 evaluations), else read.

    Returns:
        ``xarray.Dataset`` with dims ``run``, ``round``, ``eval_round``, ``client``, ``slot``
        and ``label`` (and ``local`` with FedBN's ``local_state``); accuracies float64
        fractions, counts int64 (float64 where runs of different K or C are padded with NaN);
        a regression run's summaries ``loss_mean``, ``loss_std``, ``loss_worst5`` (the highest
        5% of the client losses), ``loss_best5`` float64 in the loss's units, and no accuracy
        variables. Lazy: close it (``ds.close()``, or use it in a ``with`` block) to close the
        files.

    Raises:
        DamagedResults: results files that cannot be read (damaged, truncated, empty, not
            HDF5 or foreign), every one named with its reason.
        OutputError: a path that does not exist ("no such file"), a folder that is not a
            sweep folder, no run to load, or a ``lazy`` that is not True, False or "auto".
    """
    import xarray as xr

    if lazy not in (True, False, "auto"):
        raise OutputError(f"lazy={lazy!r}: expected True, False or 'auto'")
    runs, note = _sources(source)
    if not runs:
        raise OutputError(f"{source}: no results to load")
    if note:
        warnings.warn(note, UserWarning, stacklevel=2)
    good, damaged = read_many((path for _, path, _ in runs), lazy=lazy is not False)
    if damaged:  # every file is needed: name all that cannot be read, in one line
        for res in good:
            res.get("close", lambda: None)()
        raise DamagedResults(damaged)
    if lazy == "auto" and max(map(_per_client_bytes, good)) < LAZY_MIN_BYTES:
        for res in good:
            res["close"]()
        good, damaged = read_many(path for _, path, _ in runs)  # small: read as always
        if damaged:
            raise DamagedResults(damaged)
    for res in good:
        _drop_regression_accuracy(res)
    results = [(rid, res, params) for (rid, _, params), res in zip(runs, good)]
    # a key swept for some runs only (uga.eta_g in a grid with FedAvg) is a coordinate of all
    varying = sorted(set(_varying_keys([r["config"] for _, r, _ in results]))
                     .union(*(params for _, _, params in results)))
    try:
        lazies = [_take_lazy(res) for _, res, _ in results]
        parts = [_run_dataset(rid, res, params, varying) for rid, res, params in results]
        ds = xr.concat(parts, dim="run", join="outer", fill_value=_fill_values(parts),
                       combine_attrs="drop_conflicts", coords="different", compat="equals")
        if any(lazies):
            ds = _add_lazy(ds, lazies)
    except BaseException:
        for res in good:
            res.get("close", lambda: None)()
        raise
    if "close" in good[0]:
        closers = [res["close"] for res in good]

        def close_all() -> None:
            for close in closers:
                close()

        ds.set_close(close_all)
    ds.attrs.update(units="accuracies, std, cf, dp/eo/ap: fractions in [0, 1]; fair_angle: "
                          "radians; time_*: seconds; peak_rss_*: MiB; loss, loss_*: the [model] "
                          "loss's units", schema="docs/RESULTS.md")
    if note:
        ds.attrs["note"] = note
    return ds


def load_noted(source: str | Path | Iterable[str | Path], lazy: bool | str = "auto"
               ) -> xr.Dataset:
    """:func:`load` for the command line: a ``--seeds`` folder's note on the runs it leaves out
    goes to standard error as one plain line instead of a ``UserWarning``."""
    import sys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ds = load(source, lazy=lazy)
    if ds.attrs.get("note"):
        print(ds.attrs["note"], file=sys.stderr)
    return ds


def _drop_regression_accuracy(res: dict[str, Any]) -> None:
    """A regression run (its file has ``/eval/loss/mean``) has no accuracy: drop the per-client
    accuracy and its summaries, NaN by construction, so that only the loss summaries remain."""
    ev = res["eval"]
    if "loss/mean" not in ev:
        return
    for name in ("client_accuracy", *SUMMARY_KEYS):
        ev.pop(name, None)


def _per_client_bytes(res: dict[str, Any]) -> int:
    """Bytes of a run's per-client arrays (what a lazy load leaves in the file)."""
    return sum(v.nbytes for group in ("eval", "clients") for v in res[group].values()
               if isinstance(v, LazyArray))


def _take_lazy(res: dict[str, Any]) -> Lazies:
    """Remove a run's lazy arrays from ``res``; put in their place the coordinates their
    dimensions need. Returns {variable name: (dims without run, LazyArray, {dim: coordinate
    values})}."""
    out: Lazies = {}
    ev_round = np.asarray(res["eval"]["round"])
    for group in ("eval", "clients"):
        for name in [k for k, v in res[group].items() if isinstance(v, LazyArray)]:
            a = res[group].pop(name)
            dims: tuple[str, ...]
            if group == "eval":
                dims = ("eval_round", "client")
                out[name.replace("/", "_").replace("client_", "")] = (
                    dims, a, {"eval_round": ev_round, "client": np.arange(a.shape[1])})
            else:
                dims = _client_dims(name, a.ndim)
                coords = {d: np.arange(n) for d, n in zip(dims, a.shape)}
                if name == "local_state":
                    coords["local"] = np.array(LocalState.column_names(res["local_entries"]))
                out[name] = (dims, a, coords)
    sizes: dict[str, int] = {}
    for dims, a, _ in out.values():
        for d, n in zip(dims, a.shape):
            if d not in ("eval_round", "local"):
                sizes[d] = max(sizes.get(d, 0), n)
    res["_dims"] = sizes  # client / label coordinates of the run, for alignment
    return out


def _add_lazy(ds: xr.Dataset, lazies: list[Lazies]) -> xr.Dataset:
    """``ds`` with each run's lazy arrays added as lazy (run, ...) variables aligned on ds's
    eval_round, client and label coordinates (positions a run lacks: padding)."""
    import xarray as xr

    names = list(dict.fromkeys(n for lz in lazies for n in lz))
    for name in names:
        dims = next(lz[name][0] for lz in lazies if name in lz)
        sources: list[LazyArray | None] = []
        maps: list[list[np.ndarray | None] | None] = []
        for lz in lazies:
            if name not in lz:
                sources.append(None)
                maps.append(None)
                continue
            _, a, coords = lz[name]
            sources.append(a)
            maps.append([_positions(np.asarray(coords[d]), np.asarray(ds[d].values))
                         for d in dims])
        shape = (ds.sizes["run"], *(ds.sizes[d] for d in dims))
        stack = _Stacked(sources, maps, shape, name)
        ds[name] = xr.Variable(("run", *dims), _lazy_data(stack, dims))
    return ds


def _positions(own: np.ndarray, union: np.ndarray) -> np.ndarray | None:
    """For each value of ``union``, its index in ``own`` (unique values; -1: absent); None
    when they are the same values (the usual case: no map is kept)."""
    import pandas as pd

    if own.shape == union.shape and np.array_equal(own, union):
        return None
    return pd.Index(own).get_indexer(union).astype(np.intp)


def _lazy_data(stack: _Stacked, dims: tuple[str, ...]) -> Any:
    """The stack as a dask array (dask installed) or an xarray lazily indexed array."""
    try:
        import dask.array as da
    except ImportError:
        from xarray.backends import BackendArray
        from xarray.core import indexing

        class _Backend(BackendArray):
            def __init__(self, s: _Stacked) -> None:
                self.s, self.shape, self.dtype = s, s.shape, s.dtype

            def __getitem__(self, key: Any) -> np.ndarray:
                return indexing.explicit_indexing_adapter(
                    key, self.shape, indexing.IndexingSupport.OUTER, self.s.__getitem__)

        return indexing.LazilyIndexedArray(_Backend(stack))
    chunks = (1, *(1 if d == "eval_round" else DASK_CLIENT_CHUNK if d == "client" else -1
                   for d in dims))
    return da.from_array(  # type: ignore[no-untyped-call]  # dask leaves it unannotated
        stack, chunks=chunks, name=f"mpifl-{stack.name}-{uuid.uuid4().hex}", lock=True,
        meta=np.empty((0,) * len(stack.shape), dtype=stack.dtype))


class _Stacked:
    """One per-client variable of every run, as a (run, ...) array read on indexing.

    Run r's values come from ``sources[r]`` (a :class:`LazyArray`, or None: the run lacks the
    variable), and ``maps[r][axis]`` gives, for each position along that axis of the aligned
    dataset (eval_round, client, label), the run's own index (-1: padding, NaN or the
    variable's fill). Indexing takes ints, slices and integer or boolean arrays per axis
    (outer indexing, as xarray and dask ask) and reads only the chunks it needs.
    """

    def __init__(self, sources: list[LazyArray | None],
                 maps: list[list[np.ndarray | None] | None], shape: tuple[int, ...],
                 name: str) -> None:
        self.sources, self.maps, self.shape, self.name = sources, maps, shape, name
        self.ndim = len(shape)
        dtype = np.result_type(*(s.dtype for s in sources if s is not None))
        padded = any(s is None or mp is None or any(m is not None and (m < 0).any() for m in mp)
                     for s, mp in zip(sources, maps))
        self.fill = _FILL.get(name, np.nan)
        if padded and dtype.kind in "iub" and isinstance(self.fill, float):
            dtype = np.dtype(np.float64)  # as xarray.concat pads integers with NaN
        elif not padded and dtype.kind != "f":
            self.fill = 0  # never shown: nothing is padded
        self.dtype = dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (self.ndim - len(key))
        sel: list[AxisIndex] = []
        squeeze: list[int] = []
        for axis, (k, n) in enumerate(zip(key, self.shape)):
            if isinstance(k, (int, np.integer)):
                i = int(np.arange(n)[k])  # IndexError out of range, as numpy
                sel.append(slice(i, i + 1))
                squeeze.append(axis)
            elif isinstance(k, slice) and k.indices(n)[2] == 1:
                lo, hi, _ = k.indices(n)
                sel.append(slice(lo, max(lo, hi)))
            else:
                sel.append(np.arange(n)[k].astype(np.intp).reshape(-1))
        out = np.full([_length(s) for s in sel], self.fill, dtype=self.dtype)
        for at, r in enumerate(np.arange(self.shape[0])[sel[0]]):
            src, maps = self.sources[r], self.maps[r]
            if src is None or maps is None:
                continue
            local: list[AxisIndex] = []
            dest: list[AxisIndex] = []
            for s, m in zip(sel[1:], maps):
                if m is None:  # the run's own positions: the selection as it is
                    local.append(s)
                    dest.append(slice(0, _length(s)))
                    continue
                want = m[s]
                keep = np.flatnonzero(want >= 0)
                local.append(want[keep])
                dest.append(keep)
            if any(_length(x) == 0 for x in local):
                continue
            out[at][_outer(dest)] = _read_outer(src, local)
        return out[tuple(0 if axis in squeeze else slice(None) for axis in range(self.ndim))]


def _length(s: AxisIndex) -> int:
    return s.stop - s.start if isinstance(s, slice) else len(s)


def _outer(index: list[AxisIndex]) -> tuple[Any, ...]:
    """A numpy index taking the outer product of per-axis slices and integer arrays."""
    if sum(not isinstance(i, slice) for i in index) <= 1:
        return tuple(index)
    return np.ix_(*(np.arange(i.start, i.stop) if isinstance(i, slice) else i for i in index))


def _read_outer(src: Any, index: list[AxisIndex]) -> np.ndarray:
    """``src`` at the outer product of ``index`` (per axis: a slice with step 1, or integer
    positions in any order) for a 1-D or 2-D h5py-like ``src``, reading by slices only: a
    slice as it is; positions as the contiguous runs of their sorted unique values (their
    bounding range when there are more than :data:`_MAX_RUNS`), along the first axis in blocks
    of rows that keep a bounding read under :data:`_READ_BUDGET` elements."""
    if all(isinstance(i, slice) for i in index):
        return src[tuple(index)]
    # per axis: [(lo, hi, take, dest)]
    pieces: list[list[tuple[int, int, AxisIndex, AxisIndex]]] = []
    finals: list[AxisIndex] = []
    sizes: list[int] = []
    for i in index:
        if isinstance(i, slice):
            pieces.append([(i.start, i.stop, slice(0, i.stop - i.start),
                            slice(0, i.stop - i.start))])
            finals.append(slice(0, i.stop - i.start))
            sizes.append(i.stop - i.start)
            continue
        u, inv = np.unique(i, return_inverse=True)
        cuts = np.flatnonzero(np.diff(u) != 1) + 1
        groups = np.split(np.arange(len(u)), cuts) if len(cuts) < _MAX_RUNS else [
            np.arange(len(u))]
        pieces.append([(int(u[g[0]]), int(u[g[-1]]) + 1, u[g] - u[g[0]], g) for g in groups])
        finals.append(inv.reshape(-1))
        sizes.append(len(u))
    width = max((hi - lo for lo, hi, _, _ in pieces[1]), default=1) if len(pieces) > 1 else 1
    rows_per = max(1, _READ_BUDGET // max(1, width))
    first: list[tuple[int, int, AxisIndex, AxisIndex]] = []
    for lo, hi, take, dest in pieces[0]:  # long row ranges in blocks: a read stays in budget
        at = np.arange(lo, hi)[take] if not isinstance(take, slice) else None
        for a in range(lo, hi, rows_per):
            b = min(hi, a + rows_per)
            if at is None:
                assert isinstance(dest, slice)  # a slice's piece: take and dest are slices
                first.append((a, b, slice(0, b - a), slice(dest.start + a - lo,
                                                           dest.start + b - lo)))
            elif (inside := (at >= a) & (at < b)).any():
                assert isinstance(dest, np.ndarray)  # positions' pieces: index arrays
                first.append((a, b, at[inside] - a, dest[inside]))
    pieces[0] = first
    out = np.empty(sizes, dtype=src.dtype)
    for combo in itertools.product(*pieces):
        part = src[tuple(slice(lo, hi) for lo, hi, _, _ in combo)]
        out[_outer([d for _, _, _, d in combo])] = part[_outer([t for _, _, t, _ in combo])]
    return out[_outer(finals)] if any(not isinstance(f, slice) for f in finals) else out


def tables(ds: xr.Dataset) -> dict[str, Any]:
    """The Dataset as three long-form pandas DataFrames, one row per observation.

    Returns:
        ``{"rounds": one row per (run, round), "evals": per (run, eval_round) — the summaries,
        "clients": per (run, eval_round, client) — accuracy and loss}``, each with the run's
        coordinates (algorithm, seed, swept keys) as columns and padded rows dropped (rows
        without ``lr``; evaluations without ``mean`` nor ``loss_mean``; clients without
        ``accuracy`` nor ``loss``).
    """
    run_coords = [c for c in ds.coords if ds[c].dims == ("run",)]
    out = {}
    for name, dims in (("rounds", ("run", "round")), ("evals", ("run", "eval_round")),
                       ("clients", ("run", "eval_round", "client"))):
        names = [v for v in ds.data_vars if ds[v].dims == dims]
        frame = ds[names].to_dataframe().reset_index()
        frame = frame.drop(columns=[c for c in frame.columns
                                    if c not in (*dims, *names, *run_coords)])
        keys = {"rounds": ["lr"], "evals": ["mean", "loss_mean"],
                "clients": ["accuracy", "loss"]}[name]
        present = [k for k in keys if k in frame.columns]  # regression runs: no accuracy
        out[name] = frame.dropna(subset=present, how="all").reset_index(drop=True)
    return out


def _sources(source: str | Path | Iterable[str | Path]
             ) -> tuple[list[tuple[str, Path, dict[str, Any]]], str | None]:
    """(run id, results path, swept params) of each run to load, and the note of a ``--seeds``
    folder on the runs it leaves out (:func:`listed_runs`; else None).

    Raises:
        OutputError: a path that does not exist, or a folder that is not a sweep folder.
    """
    paths = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise OutputError(f"no such file: {', '.join(missing)} (mpifl.load takes results files "
                          "(.h5) or a sweep folder)")
    if isinstance(source, (str, Path)) and paths[0].is_dir():
        path = paths[0]
        if not (path / INDEX).exists():
            raise OutputError(f"{path}: not a sweep folder (no {INDEX}) and not a results file")
        index, note = listed_runs(path)
        return [(rid, path / run["results"], run["params"]) for rid, run in index.items()
                if (path / run["results"]).is_file()], note
    stems = [p.stem for p in paths]
    ids = stems if len(set(stems)) == len(stems) else [str(p) for p in paths]
    return [(rid, p, {}) for rid, p in zip(ids, paths)], None


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A stored config (nested dict) as ``{"section.key": value}``, lists as JSON text."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return out


def _varying_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Config keys (``section.key``) whose values differ between the runs (the swept keys)."""
    flats = [flat_config(c) for c in configs]
    keys = sorted(set().union(*flats))
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1
            and k not in ("run.name", "run.seed", "server.algorithm")]


def _run_dataset(rid: str, res: dict[str, Any], params: dict[str, Any], varying: list[str]
                 ) -> xr.Dataset:
    import xarray as xr

    rounds, ev, config = res["rounds"], res["eval"], res["config"]
    flat = flat_config(config)
    coords = {"run": [rid], "round": rounds["round"], "eval_round": ev["round"],
              "algorithm": ("run", [res["attrs"].get("algorithm", flat.get("server.algorithm"))]),
              "seed": ("run", [flat.get("run.seed", -1)]),
              "status": ("run", [res["attrs"].get("status", "?")])}
    for key in varying:
        coords[key] = ("run", [params.get(key, flat.get(key))])
    data = {}
    for name, values in rounds.items():
        if name == "round":
            continue
        by_ndim = {1: ("round",), 2: ("round", "layer" if name == "conflicts_layer" else "slot")}
        data[name] = (("run", *by_ndim[values.ndim]), values[None])
    for name, values in ev.items():
        if name == "round":
            continue
        clean = name.replace("/", "_").replace("client_", "")
        dims = ("eval_round",) if values.ndim == 1 else ("eval_round", "client")
        data[clean] = (("run", *dims), values[None])
    for name, values in res.get("clients", {}).items():
        data[name] = (("run", *_client_dims(name, values.ndim)), values[None])
    system = res.get("system", {})
    for name, values in system.items():  # simulated time: sim_time (round), tier (client), ...
        if name == "tier_names":
            continue
        part, column = name.split("/")
        key = column if part == "clients" or column == "sim_time" else f"sim_{column}"
        data[key] = (("run", "round" if part == "rounds" else "client"), values[None])
    if system.get("tier_names"):
        coords["tier_name"] = ("tier_index", system["tier_names"])
    for d, n in res.get("_dims", {}).items():  # the lazy arrays' dimensions (added later)
        coords[d] = np.arange(n)
    if res.get("local_entries"):  # FedBN's rows: columns named by entry and element
        coords["local"] = LocalState.column_names(res["local_entries"])
        coords["local_param"] = ("local", [n for n, a, b, _ in res["local_entries"]
                                           for _ in range(b - a)])
    ds = xr.Dataset(data, coords=coords)
    return ds.assign_coords({d: np.arange(ds.sizes[d]) for d in ("client", "slot", "label", "layer")
                             if d in ds.dims})


def _client_dims(name: str, ndim: int) -> tuple[str, ...]:
    """The dims of a /clients dataset (without ``run``)."""
    if name == "local_state":
        return ("client", "local")
    return ("client",) if ndim == 1 else ("client", "label")


def _fill_values(parts: list[xr.Dataset]) -> dict[str, Any]:
    names = {str(n) for p in parts for n in p.data_vars}
    return {n: _FILL.get(n, np.nan) for n in names}
