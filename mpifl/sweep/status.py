"""Each run's status, read from disk: its results file, its checkpoints and its job's log.

Live SLURM job states are an argument (``job id -> squeue state``), not a query made here, so
that the same rules decide for every launcher and for ``--dry-run``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mpifl.core.errors import ConfigError, OutputError
from mpifl.store.results import Damaged, read_many
from mpifl.sweep.plan import RunState

#: The status of a run whose results file cannot be read (:func:`refresh`); a launch does not
#: start it again over the file, and every command that lists runs names it and exits 2.
DAMAGED = "damaged"
DAMAGED_PREFIX = "damaged results file: "


def refresh(folder: Path, runs: dict[str, RunState], live: dict[str, str]) -> None:
    """Update each run's status: complete (results say so), queued/running (a live job in
    ``live``), damaged (its results file cannot be read: the reason in ``error``), unfinished
    (results or checkpoints on disk), failed (its log has an error), new (nothing yet)."""
    for r in runs.values():
        if r.status == "invalid":
            continue
        if r.error and r.error.startswith(DAMAGED_PREFIX):
            r.error = None  # an earlier survey's finding: looked at again below
        state = live.get(r.job_id or "")
        path = folder / r.results
        res, damage = read_run(path)
        if (res is not None and res["attrs"].get("status") == "complete"
                and _rounds_done(res, r.config)):
            r.status, r.error = "complete", None
        elif state is not None:
            r.status = "running" if state in ("RUNNING", "COMPLETING") else "queued"
        elif damage is not None:  # never started again over it: named, left for the user
            r.status, r.error = DAMAGED, DAMAGED_PREFIX + damage.reason
        else:
            r.error = log_error(folder, r.log) if r.log else r.error
            started = path.exists() or path.with_name(path.name + ".ckpt").exists()
            r.status = "failed" if r.error else "unfinished" if started else "new"


def damaged_runs(folder: Path, runs: dict[str, RunState]) -> list[Damaged]:
    """The runs that :func:`refresh` found damaged: their results path and the reason."""
    return [Damaged(folder / r.results, r.error.removeprefix(DAMAGED_PREFIX))
            for r in runs.values() if r.status == DAMAGED and r.error]


def log_error(folder: Path, log_path: str) -> str | None:
    """The most telling error line of a job's log: mpifl's own one-line error, else the last
    Python exception (other than "mpifl run exited with status N"), else that one."""
    lines = []
    for path in (folder / log_path, folder / log_path.replace("_log.out", "_log.err")):
        try:
            lines += path.read_text(errors="replace").splitlines()[-300:]
        except OSError:
            continue
    found = [m.group(1).strip() for line in lines
             if (m := re.search(r"(mpifl: error: .*|\b[A-Z]\w*Error: .*)", line))]
    for good in (lambda e: e.startswith("mpifl: error: "),
                 lambda e: "mpifl run exited with status" not in e, lambda e: True):
        picked = [e for e in found if good(e)]
        if picked:
            return picked[-1]
    return None


def read_run(path: Path) -> tuple[dict | None, Damaged | None]:
    """A sweep run's results file, verified (:func:`mpifl.store.results.read_many`):
    ``(results, None)``, ``(None, Damaged)`` when it cannot be read, or ``(None, None)`` when
    there is none yet (files are replaced atomically, so a running job's is never half
    written)."""
    if not path.exists():
        return None, None
    good, damaged = read_many([path])
    return (good[0], None) if good else (None, damaged[0])


def _rounds_done(res: dict, config: dict | None) -> bool:
    """A complete results file ran as many rounds as the sweep now asks for."""
    if config is None:
        return True
    return res["config"].get("run", {}).get("rounds") == config["run"]["rounds"]


def check_unchanged(folder: Path, runs: dict[str, RunState]) -> None:
    """Refuse to resume a started run with another config: its results would mix the two.

    Raises:
        ConfigError: a started run whose config has changed since (the differences).
    """
    from mpifl.experiment.config import config_diff, config_from_json

    for r in runs.values():
        if r.status in ("new", "invalid") or r.config is None:
            continue
        stored = _stored_config(folder / r.results)
        if stored is None:
            continue
        diffs = config_diff(config_from_json(stored), config_from_json(json.dumps(r.config)))
        if diffs:
            raise ConfigError(f"run {r.id}: its config changed since it was started "
                              f"({'; '.join(diffs)}); use another --out folder")


def _stored_config(path: Path) -> str | None:
    from mpifl.store import checkpoint
    from mpifl.store.results import read_results

    try:
        if path.exists():
            return json.dumps(read_results(path)["config"])
        ckpt = checkpoint.load_latest(checkpoint.folder_for(path))
    except OutputError:
        return None  # damaged: mpifl run --resume reports it
    return ckpt.config_json if ckpt is not None else None
