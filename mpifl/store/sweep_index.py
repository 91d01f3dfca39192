"""A sweep folder's ``index.json``: which runs it holds, their results files and swept values.

``mpifl sweep`` writes it (:func:`mpifl.sweep.plan.write_index`); readers of results (``mpifl
report``, :func:`mpifl.load`) read it here, below the sweep layer, through :func:`listed_runs`.

The index keeps every run ever launched into the folder. In a ``mpifl run --seeds`` folder the
runs that count are those of the seeds its ``seeds.toml`` lists now (the last ``--seeds``): after
``--seeds 4`` then ``--seeds 3`` the folder holds seed 3's run too, which the folder's summaries
leave out and name in one note line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, cast

from mpifl.core.errors import OutputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

INDEX = "index.json"
#: The sweep file ``mpifl run --seeds`` writes into its folder (:mod:`mpifl.sweep.seeds`).
SEEDS_FILE = "seeds.toml"


def read_index(folder: Path) -> dict[str, Any]:
    """``DIR/index.json`` as a dict (``{"runs": {}}`` when there is none yet).

    Raises:
        OutputError: the file exists but is not valid JSON, or not an index (a JSON object
            whose "runs" maps run ids to objects with their "results" and "params").
    """
    path = folder / INDEX
    if not path.exists():
        return {"runs": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: cannot read the sweep index ({exc})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("results"), str)
            and isinstance(r.get("params"), dict) for r in runs.values()):
        raise OutputError(f"{path}: not a sweep index (expected an object with \"runs\": "
                          "{id: {\"results\": ..., \"params\": ...}}); move it away or use "
                          "another --out folder")
    return cast(dict[str, Any], data)


def listed_runs(folder: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The runs of a sweep folder that its summaries show, and a note on the others.

    Every run of the index, except in a ``--seeds`` folder (one with ``seeds.toml``): there
    only the runs of the algorithm and seeds that ``seeds.toml`` lists.

    Returns:
        ``({run id: index entry}, note)``: note is None, or one line naming the runs left out,
        e.g. ``note: 1 other run in this folder (seed 3) is not in seeds.toml's seeds [0, 1, 2];
        mpifl report DIR/runs/*.h5 shows all``.

    Raises:
        OutputError: a malformed index (:func:`read_index`) or ``seeds.toml``.
    """
    runs = read_index(folder)["runs"]
    wanted = _seeds_wanted(folder)
    if wanted is None:
        return runs, None
    algorithms, seeds = wanted
    kept = {rid: r for rid, r in runs.items() if r["params"].get("run.seed") in seeds
            and (not algorithms or r["params"].get("server.algorithm") in algorithms)}
    others = [r["params"] for rid, r in runs.items() if rid not in kept]
    if not others:
        return kept, None
    same = not algorithms or all(p.get("server.algorithm") in algorithms for p in others)
    if same:
        what = (f"seed{'s' * (len(others) > 1)} "
                + ", ".join(str(p.get("run.seed")) for p in others))
    else:
        what = ", ".join(f"{p.get('server.algorithm')} seed {p.get('run.seed')}" for p in others)
    asked = f"seeds {seeds}" if same else f"runs ({', '.join(algorithms)}, seeds {seeds})"
    verb = "is" if len(others) == 1 else "are"
    note = (f"note: {len(others)} other run{'s' * (len(others) > 1)} in this folder ({what}) "
            f"{verb} not in {SEEDS_FILE}'s {asked}; mpifl report {folder}/runs/*.h5 shows all")
    return kept, note


def _seeds_wanted(folder: Path) -> tuple[list[str], list[int]] | None:
    """``(algorithms, seeds)`` that ``folder/seeds.toml`` lists, or None without the file."""
    path = folder / SEEDS_FILE
    if not path.is_file():
        return None
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: cannot read it ({exc}); run mpifl run --seeds again to "
                          "rewrite it") from None
    seeds = spec.get("grid", {}).get("run.seed")
    algorithms = spec.get("algorithms", {})
    if not isinstance(seeds, list) or not isinstance(algorithms, dict):
        raise OutputError(f"{path}: not a --seeds sweep file (no [grid] \"run.seed\" list); "
                          "run mpifl run --seeds again to rewrite it")
    return list(algorithms), seeds
