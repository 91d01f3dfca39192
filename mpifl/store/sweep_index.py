"""A sweep folder's ``index.json``: which runs it holds, their results files and swept values.

``mpifl sweep`` writes it (:func:`mpifl.sweep.plan.write_index`); readers of results (``mpifl
report``, :func:`mpifl.load`) read it here, below the sweep layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpifl.core.errors import OutputError

INDEX = "index.json"


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
    return data
