"""``mpifl run JOB --seeds 0-4``: the same experiment over several seeds, as a local sweep.

The sweep file is written into the output folder (``DIR/seeds.toml``: the job, its ``--set``
overrides, one grid axis ``run.seed``), so the runs are ordinary sweep runs: resumed when the
command is repeated, extended with more seeds, and reported with ``mpifl report DIR``.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomli_w

from mpifl.core.errors import ConfigError
from mpifl.experiment.config import load_config, parse_override
from mpifl.experiment.naming import default_out
from mpifl.store.results import DamagedResults
from mpifl.sweep.launch import run_sweep
from mpifl.sweep.plan import RunState
from mpifl.sweep.report import report_sweep
from mpifl.sweep.spec import load_sweep
from mpifl.sweep.status import damaged_runs

SWEEP_FILE = "seeds.toml"


def parse_seeds(text: str) -> list[int]:
    """``"0-4"`` -> [0, 1, 2, 3, 4]; ``"0,2,5"`` -> [0, 2, 5]; ranges and lists mix (``0-2,7``).

    Raises:
        ConfigError: anything else, a descending range, or a repeated seed.
    """
    seeds: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"--seeds {text!r}: expected seeds like 0-4 or 0,2,5")
        seeds += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


def default_folder(job: Path, overrides: list[str]) -> Path:
    """``runs/sweeps/<results stem of the job and its overrides>-seeds``."""
    cfg = load_config(job, overrides)
    return Path("runs") / "sweeps" / (default_out(cfg.run.name, overrides).stem + "-seeds")


def run_seeds(job: Path, overrides: list[str], seeds: list[int], folder: Path,
              ranks: int = 1) -> dict[str, RunState]:
    """Run ``job`` with ``overrides`` once per seed (``ranks`` MPI ranks each, one after the
    other, here), results under ``folder/runs/``.

    Raises:
        ConfigError: an invalid job or override (checked before anything is written), or a
            folder whose earlier ``seeds.toml`` ran another experiment.
        DamagedResults: a run's results file cannot be read (after the report of the others).
    """
    cfg = load_config(job, overrides)  # every problem of the job, before anything is written
    fixed = {}
    for text in overrides:
        (section, key), value = parse_override(text)
        if f"{section}.{key}" in ("run.seed", "server.algorithm"):
            continue  # the grid's and the algorithm table's
        fixed[f"{section}.{key}"] = value
    spec = {"sweep": {"name": folder.name, "base": str(Path(job).resolve()), "ranks": ranks},
            "set": fixed, "grid": {"run.seed": seeds},
            "algorithms": {cfg.server.algorithm: {}}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SWEEP_FILE
    path.write_text("# written by: mpifl run --seeds (rerun: mpifl sweep THIS_FILE --executor "
                    f"local --out {folder})\n" + tomli_w.dumps(spec))
    runs = run_sweep(load_sweep(path), folder, executor="local")
    damaged = damaged_runs(folder, runs)
    if damaged:  # not started again over its file: the report of the others, then one line
        report_sweep(folder, last=3)
        raise DamagedResults(damaged)
    return runs
