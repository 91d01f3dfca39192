"""Names of runs: a sweep's run ids and ``mpifl run``'s default results path, by one rule.

A run is named by the values it sets: ``server.algorithm`` by its value, any other key by its
last part and value (``{"server.algorithm": "fedfv", "fedfv.alpha": 0.1, "run.seed": 0}`` ->
``fedfv_alpha0.1_seed0``), characters outside ``[A-Za-z0-9._+-]`` replaced by ``-``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath
from collections.abc import Sequence
from typing import Any

from mpifl.core.errors import ConfigError
from mpifl.experiment.config import parse_override


def plain_name(name: str) -> bool:
    """Whether ``name`` is one path component: it then cannot lead outside the folder it names
    something in (no separator, ``..``, or absolute path)."""
    return bool(name) and not any(c in name for c in "/\\\0") and name not in (".", "..") \
        and not PurePath(name).is_absolute()


def run_id(params: dict[str, Any]) -> str:
    """The run's file name stem from the values it sets (the module docstring's rule)."""
    parts = []
    for key, v in params.items():
        text = "-".join(map(str, v)) if isinstance(v, list) else str(v)
        parts.append(text if key == "server.algorithm" else key.split(".")[-1] + text)
    rid = re.sub(r"[^A-Za-z0-9._+-]+", "-", "_".join(parts))
    return rid if plain_name(rid) else "run"


def default_out(name: str, overrides: Sequence[str] = ()) -> Path:
    """The default results path: ``runs/<run.name>.h5``, or ``runs/<run.name>_<id>.h5`` where
    ``<id>`` is :func:`run_id` of the ``--set`` overrides (``run.name`` itself left out), so the
    same job run with another algorithm or seed does not collide.

    Raises:
        ConfigError: ``run.name`` is not a plain name (it would write outside ``runs/``).
    """
    if not plain_name(name):
        raise ConfigError(f"run.name = {name!r}: not a plain file name (no '/', '..' or absolute "
                          "path), so it cannot name runs/<run.name>.h5; pass --out PATH instead")
    params = {}
    for text in overrides:
        (section, key), value = parse_override(text)
        params[f"{section}.{key}"] = value
    params.pop("run.name", None)
    return Path("runs") / (f"{name}_{run_id(params)}.h5" if params else f"{name}.h5")
