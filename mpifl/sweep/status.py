"""Each run's status, read from disk: its results file, its checkpoints and its job's log.

Live SLURM job states are an argument (``job id -> squeue state``), not a query made here, so
that the same rules decide for every launcher and for ``--dry-run``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mpifl.core.errors import ConfigError, OutputError
from mpifl.sweep.plan import RunState


def refresh(folder: Path, runs: dict[str, RunState], live: dict[str, str]) -> None:
    """Update each run's status: complete (results say so), queued/running (a live job in
    ``live``), unfinished (results or checkpoints on disk), failed (its log has an error), new
    (nothing yet)."""
    for r in runs.values():
        if r.status == "invalid":
            continue
        state = live.get(r.job_id or "")
        path = folder / r.results
        if results_status(path) == "complete" and _rounds_done(path, r.config):
            r.status, r.error = "complete", None
        elif state is not None:
            r.status = "running" if state in ("RUNNING", "COMPLETING") else "queued"
        else:
            r.error = log_error(folder, r.log) if r.log else r.error
            started = path.exists() or path.with_name(path.name + ".ckpt").exists()
            r.status = "failed" if r.error else "unfinished" if started else "new"


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


def results_status(path: Path) -> str | None:
    """The ``status`` attribute of a results file; None when it cannot be read (missing, or
    being written by a running job)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            status = f.attrs.get("status")
    except OSError:
        return None
    return status.decode() if isinstance(status, bytes) else status


def _rounds_done(path: Path, config: dict | None) -> bool:
    """A complete results file ran as many rounds as the sweep now asks for."""
    from mpifl.store.results import read_results

    if config is None:
        return True
    stored = read_results(path)["config"]
    return stored.get("run", {}).get("rounds") == config["run"]["rounds"]


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
