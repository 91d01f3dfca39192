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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from mpifl.core.errors import OutputError
from mpifl.store.results import DamagedResults, read_many
from mpifl.store.sweep_index import INDEX, read_index

#: ``xarray.concat`` fill values of variables that are not floats (padding of shorter runs).
_FILL = {"selected": -1, "aggregated": False}


def load(source: str | Path | Iterable[str | Path]):
    """Read runs into one ``xarray.Dataset`` (layout in the module docstring).

    Args:
        source: a results file (``.h5``), a sweep folder (holding ``index.json``; runs without
            a results file yet are left out), or a list of results files.

    Returns:
        ``xarray.Dataset`` with dims ``run``, ``round``, ``eval_round``, ``client``, ``slot``
        and ``label``; accuracies float64 fractions, counts int64.

    Raises:
        DamagedResults: results files that cannot be read (damaged, truncated, empty, not
            HDF5, foreign or missing), every one named with its reason.
        OutputError: a path that is neither a results file nor a sweep folder, or no run to
            load.
    """
    import xarray as xr

    runs = _sources(source)
    if not runs:
        raise OutputError(f"{source}: no results to load")
    good, damaged = read_many(path for _, path, _ in runs)
    if damaged:  # every file is needed: name all that cannot be read, in one line
        raise DamagedResults(damaged)
    results = [(rid, res, params) for (rid, _, params), res in zip(runs, good)]
    # a key swept for some runs only (uga.eta_g in a grid with FedAvg) is a coordinate of all
    varying = sorted(set(_varying_keys([r["config"] for _, r, _ in results]))
                     .union(*(params for _, _, params in results)))
    parts = [_run_dataset(rid, res, params, varying) for rid, res, params in results]
    ds = xr.concat(parts, dim="run", join="outer", fill_value=_fill_values(parts),
                   combine_attrs="drop_conflicts", coords="different", compat="equals")
    ds.attrs.update(units="accuracies, std, cf, dp/eo/ap: fractions in [0, 1]; fair_angle: "
                          "radians; time_*: seconds; peak_rss_*: MiB", schema="docs/RESULTS.md")
    return ds


def tables(ds) -> dict[str, Any]:
    """The Dataset as three long-form pandas DataFrames, one row per observation.

    Returns:
        ``{"rounds": one row per (run, round), "evals": per (run, eval_round) — the summaries,
        "clients": per (run, eval_round, client) — accuracy and loss}``, each with the run's
        coordinates (algorithm, seed, swept keys) as columns and padded rows dropped.
    """
    run_coords = [c for c in ds.coords if ds[c].dims == ("run",)]
    out = {}
    for name, dims in (("rounds", ("run", "round")), ("evals", ("run", "eval_round")),
                       ("clients", ("run", "eval_round", "client"))):
        names = [v for v in ds.data_vars if ds[v].dims == dims]
        frame = ds[names].to_dataframe().reset_index()
        frame = frame.drop(columns=[c for c in frame.columns
                                    if c not in (*dims, *names, *run_coords)])
        key = {"rounds": "lr", "evals": "mean", "clients": "accuracy"}[name]
        out[name] = frame.dropna(subset=[key]).reset_index(drop=True)
    return out


def _sources(source) -> list[tuple[str, Path, dict[str, Any]]]:
    """(run id, results path, swept params) of each run to load."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            if not (path / INDEX).exists():
                raise OutputError(f"{path}: not a sweep folder (no {INDEX}) and not a results file")
            index = read_index(path)["runs"]
            return [(rid, path / run["results"], run["params"]) for rid, run in index.items()
                    if (path / run["results"]).is_file()]
        return [(path.stem, path, {})]
    paths = [Path(p) for p in source]
    stems = [p.stem for p in paths]
    ids = stems if len(set(stems)) == len(stems) else [str(p) for p in paths]
    return [(rid, p, {}) for rid, p in zip(ids, paths)]


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return out


def _varying_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Config keys (``section.key``) whose values differ between the runs (the swept keys)."""
    flats = [_flat(c) for c in configs]
    keys = sorted(set().union(*flats))
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1
            and k not in ("run.name", "run.seed", "server.algorithm")]


def _run_dataset(rid: str, res: dict[str, Any], params: dict[str, Any], varying: list[str]):
    import xarray as xr

    rounds, ev, config = res["rounds"], res["eval"], res["config"]
    flat = _flat(config)
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
        dims = {1: ("round",), 2: ("round", "layer" if name == "conflicts_layer" else "slot")}
        data[name] = (("run", *dims[values.ndim]), values[None])
    for name, values in ev.items():
        if name == "round":
            continue
        clean = name.replace("/", "_").replace("client_", "")
        dims = ("eval_round",) if values.ndim == 1 else ("eval_round", "client")
        data[clean] = (("run", *dims), values[None])
    for name, values in res.get("clients", {}).items():
        dims = ("client",) if values.ndim == 1 else ("client", "label")
        data[name] = (("run", *dims), values[None])
    ds = xr.Dataset(data, coords=coords)
    return ds.assign_coords({d: np.arange(ds.sizes[d]) for d in ("client", "slot", "label", "layer")
                             if d in ds.dims})


def _fill_values(parts) -> dict[str, Any]:
    names = set().union(*(p.data_vars for p in parts))
    return {n: _FILL.get(n, np.nan) for n in names}
