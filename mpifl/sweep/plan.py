"""The plan of a sweep: its grid points, their run ids and output paths, each run's status from
what is on disk, and the index ``DIR/index.json`` that records them.

Nothing here starts a job or asks SLURM: the live job states come in as an argument (see
:func:`mpifl.sweep.launch.slurm.slurm_states`), so one plan serves every launcher.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpifl.core.errors import ConfigError
from mpifl.experiment.config import parse_override, read_toml
from mpifl.store.sweep_index import INDEX, read_index  # noqa: F401  (re-exported)
from mpifl.experiment.naming import plain_name, run_id  # noqa: F401  (re-exported)
from mpifl.sweep.spec import Sweep

RUNS = "runs"  # the folder of the results files (and their checkpoints), in the sweep folder
_MISSING = object()


@dataclass(frozen=True)
class Point:
    """One run of a sweep.

    Attributes:
        id: file-name-safe run id built from the varied values, e.g. ``fedfv_alpha0.1_seed0``.
        params: the varied keys of this run (``"section.key" -> value``), algorithm first.
        overrides: every ``--set`` of the run: the sweep's fixed ones, then ``params``.
    """

    id: str
    params: dict[str, Any]
    overrides: tuple[str, ...]


def grid_points(sweep: Sweep) -> list[Point]:
    """Expand the grid: every algorithm's axes times the shared grid, in file order.

    Raises:
        ConfigError: two points would get the same run id.
    """
    algos: list[tuple[str | None, dict[str, list]]] = [*sweep.algorithms.items()] or [(None, {})]
    points = []
    for algo, axes in algos:
        head = {"server.algorithm": algo} if algo is not None else {}
        for values in _product({**axes, **sweep.grid}):
            params = {**head, **values}
            sets = {**sweep.fixed, **params}
            points.append(Point(run_id(params), params,
                                tuple(f"{k}={toml_value(v)}" for k, v in sets.items())))
    _check_unique(points)
    return points


def _product(axes: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def toml_value(v: Any) -> str:
    """A value as TOML text for ``--set`` (strings, numbers, booleans, lists of them)."""
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", v) and v not in (
            "true", "false", "inf", "nan"):
        return v  # a bare word is a string for --set
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return json.dumps(v)


def results_path(rid: str) -> str:
    """Where run ``rid`` writes, relative to the sweep folder."""
    return f"{RUNS}/{rid}.h5"


def _check_unique(points: list[Point]) -> None:
    seen: dict[str, Point] = {}
    for p in points:
        if p.id in seen:
            raise ConfigError(f"sweep file: runs {seen[p.id].params} and {p.params} get the same "
                              f"id '{p.id}'; make their values distinct")
        seen[p.id] = p


def select(points: list[Point], only: list[str]) -> list[Point]:
    """The points matching every ``--only section.key=value`` (several values of a key: any).

    Raises:
        ConfigError: a malformed filter, or a key that the sweep does not vary.
    """
    wanted: dict[str, list] = {}
    for text in only:
        (section, key), value = parse_override(text)
        wanted.setdefault(f"{section}.{key}", []).append(value)
    for key in wanted:
        if points and all(key not in p.params for p in points):
            raise ConfigError(f"--only {key}: the sweep does not vary this key")
    return [p for p in points if all(p.params.get(k, _MISSING) in vs for k, vs in wanted.items())]


@dataclass
class RunState:
    """What the index knows about one run (one entry of ``DIR/index.json``)."""

    id: str
    params: dict[str, Any]
    overrides: list[str]
    results: str  # relative to the sweep folder
    # new | queued | running | unfinished | failed | complete | invalid | damaged (the results
    # file fails its checksum or value checks: named by every reader, never re-run by itself)
    status: str = "new"
    config: dict | None = None
    job_id: str | None = None
    log: str | None = None
    error: str | None = None


def check(sweep: Sweep, point: Point) -> tuple[dict | None, str | None]:
    """Validate one run's config: ``(config as a dict, None)`` or ``(None, one-line reason)``.

    An algorithm that this mpifl does not implement is reported (not raised), so that sweeps
    naming future algorithms still expand.
    """
    from mpifl.aggregators import available
    from mpifl.experiment.config import load_config

    algo = point.params.get("server.algorithm") or _base_algorithm(sweep)
    try:  # loading imports the job's [plugins] first, so plugin rules are known below
        cfg = load_config(sweep.base, list(point.overrides))
        if cfg.server.shards > sweep.ranks:  # each shard is a rank of the run
            raise ConfigError(f"server.shards = {cfg.server.shards} needs at least "
                              f"{cfg.server.shards} ranks per run; the sweep gives "
                              f"{sweep.ranks} (sweep.ranks)")
        return json.loads(cfg.to_json()), None
    except ConfigError as exc:
        if algo not in available():
            return None, (f"algorithm '{algo}' is not implemented in this mpifl "
                          f"(known: {', '.join(available())})")
        return None, str(exc)


def _base_algorithm(sweep: Sweep) -> str:
    fixed = sweep.fixed.get("server.algorithm")
    if fixed is not None:
        return str(fixed)
    return str(read_toml(sweep.base).get("server", {}).get("algorithm", "fedavg"))


def states(sweep: Sweep, folder: Path, points: list[Point]) -> dict[str, RunState]:
    """Every point's state before its status is known: its config (or why it is invalid), and
    the job id, log and error the index kept from earlier launches."""
    old = read_index(folder)["runs"]
    runs = {}
    for p in points:
        prev = old.get(p.id, {})
        r = RunState(p.id, p.params, list(p.overrides), results_path(p.id),
                     job_id=prev.get("job_id"), log=prev.get("log"), error=prev.get("error"))
        r.config, reason = check(sweep, p)
        if reason:
            r.status, r.error = "invalid", reason
        runs[p.id] = r
    return runs


def write_index(folder: Path, sweep: Sweep, runs: dict[str, RunState]) -> None:
    """Write ``DIR/index.json`` atomically: sweep file, base, ranks and every run's state.
    Runs already in the index but not in ``runs`` (left out by ``--only``) are kept."""
    merged = {**read_index(folder)["runs"], **{rid: vars(r) for rid, r in runs.items()}}
    data = {"sweep": sweep.name, "sweep_file": str(sweep.path), "base": str(sweep.base),
            "ranks": sweep.ranks, "updated": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": merged}
    tmp = folder / f".{INDEX}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, folder / INDEX)


def count_statuses(statuses) -> str:
    """``"2 complete, 1 new"``: how many runs are in each status, for one log line."""
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
