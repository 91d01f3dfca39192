"""``mpifl run JOB --seeds 3`` (seeds 0, 1, 2) or ``--seeds 0-4``: the same experiment over
several seeds, as a local sweep.

The sweep file is written into the output folder (``DIR/seeds.toml``: the job, its ``--set``
overrides, one grid axis ``run.seed``), so the runs are ordinary sweep runs: resumed when the
command is repeated, extended with more seeds, and reported with ``mpifl report DIR``. The
folder's report and ``mpifl.load(DIR)`` summarise the seeds that ``seeds.toml`` lists now, the
last ``--seeds`` asked for (:func:`mpifl.store.sweep_index.listed_runs`); runs of other seeds
left in the folder by an earlier call are named in one note line.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomli_w

from mpifl.core.errors import ConfigError
from mpifl.experiment.config import load_config, parse_override
from mpifl.experiment.naming import default_out
from mpifl.store.results import DamagedResults
from mpifl.store.sweep_index import SEEDS_FILE
from mpifl.sweep.launch import run_sweep
from mpifl.sweep.plan import RunState
from mpifl.sweep.report import report_sweep
from mpifl.sweep.spec import load_sweep
from mpifl.sweep.status import damaged_runs

SWEEP_FILE = SEEDS_FILE


def parse_seeds(text: str) -> list[int]:
    """The seeds of ``--seeds``: a count or a list, never both.

    ``"3"`` (one integer, no comma) -> [0, 1, 2]: three seeds, as Flower's and FLGo's
    ``num_seeds``; ``"0-4"`` -> [0, 1, 2, 3, 4]; ``"0,2,5"`` -> [0, 2, 5]; ranges and lists mix
    (``0-2,7``); one given seed is a list of one, with its comma: ``"5,"`` -> [5].

    Raises:
        ConfigError: anything else, a count of 0, a descending range, or a repeated seed.
    """
    form = ("expected a number of seeds (3: seeds 0, 1, 2), a range (0-4) or a list (0,2,5; "
            "one seed: 5, with the comma)")
    if re.fullmatch(r"\s*\d+\s*", text):
        if int(text) < 1:
            raise ConfigError(f"--seeds {text.strip()}: at least 1 seed; {form}")
        return list(range(int(text)))
    parts = text.split(",")
    if len(parts) > 1 and not parts[-1].strip():
        parts = parts[:-1]  # "5,": the list of the one seed 5
    seeds: list[int] = []
    for part in parts:
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"--seeds {text!r}: {form}")
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
