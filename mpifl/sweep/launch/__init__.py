"""Launching a sweep: pick a launcher (local or SLURM), start the runs that are not done, keep the
index up to date.

Running the same sweep again skips complete runs, leaves queued ones alone and resumes the
others from their newest checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from mpifl.core.errors import ConfigError
from mpifl.sweep.launch.base import Launcher
from mpifl.sweep.launch.local import LocalLauncher
from mpifl.sweep.launch.slurm import SlurmLauncher, live_states
from mpifl.sweep.plan import (RUNS, Point, RunState, count_statuses, grid_points, select,
                              states, write_index)
from mpifl.sweep.spec import Sweep
from mpifl.sweep.status import check_unchanged, refresh

__all__ = ["LAUNCHERS", "Launcher", "LocalLauncher", "SlurmLauncher", "choose", "run_sweep",
           "survey"]

log = logging.getLogger(__name__)

#: Every launcher, by its ``--executor`` name.
LAUNCHERS: dict[str, type[Launcher]] = {c.name: c for c in (LocalLauncher, SlurmLauncher)}

#: The run statuses that a launch starts (or resumes).
TO_START = ("new", "unfinished", "failed")


def choose(executor: str) -> type[Launcher]:
    """The launcher named ``executor``, checked to be able to run here; ``"auto"``: the one
    that fits this machine best (SLURM where sbatch is on PATH and a controller answers, else
    local), logged in one line with the reason.

    Raises:
        MpiflError: the launcher named cannot run here (``--executor slurm`` without sbatch
            or without a controller that answers): one line.
    """
    if executor != "auto":
        LAUNCHERS[executor].require()
        return LAUNCHERS[executor]
    fits = {c: c.fit() for c in LAUNCHERS.values()}
    best = max(fits, key=lambda c: fits[c][0])
    # why: the launchers that could not run here (those that would have been preferred), else
    # the winner's own reason
    why = "; ".join(f[1] for f in fits.values() if f[0] == 0) or fits[best][1]
    log.info("executor: %s (%s)", best.name, why)
    return best


def survey(sweep: Sweep, folder: Path, points: list[Point]) -> dict[str, RunState]:
    """Every point's state now: its config (or why it is invalid) and its status from disk
    and from SLURM's queue."""
    runs = states(sweep, folder, points)
    refresh(folder, runs, live_states(runs))
    return runs


def run_sweep(sweep: Sweep, folder: Path, *, executor: str = "local", wait: bool = False,
              only: Sequence[str] = (), timeout_s: float | None = None) -> dict[str, RunState]:
    """Start (or resume) every unfinished run of ``sweep``; write ``folder/index.json``.

    Complete runs are skipped, runs whose job is still queued or running are left alone, the
    others start or resume from their newest checkpoint. A blocking launcher (local) returns
    when the runs are done; the others only with ``wait``.

    Raises:
        ConfigError: an invalid run among those selected (its id and the reason), or a started
            run whose config has changed.
        MpiflError: SLURM refused the jobs or is not there.
    """
    points = select(grid_points(sweep), list(only))
    if not points:
        raise ConfigError("sweep: no run matches --only")
    folder.mkdir(parents=True, exist_ok=True)
    runs = survey(sweep, folder, points)
    check_unchanged(folder, runs)
    _no_invalid(runs)
    todo = [r for r in runs.values() if r.status in TO_START]
    log.info("sweep %s: %d runs (%s); starting %d", sweep.name, len(runs),
             count_statuses(r.status for r in runs.values()), len(todo))
    launcher = choose(executor)(sweep, folder)
    write_index(folder, sweep, runs)  # before a long local launch: what is about to run
    if todo:  # mpifl run --resume continues a run, or starts one in a folder that exists
        (folder / RUNS).mkdir(exist_ok=True)
    launcher.launch(todo)
    write_index(folder, sweep, runs)  # the job ids, before a wait that may be interrupted
    if wait:
        launcher.wait(runs, timeout_s=timeout_s)
    refresh(folder, runs, live_states(runs))
    write_index(folder, sweep, runs)
    return runs


def _no_invalid(runs: dict[str, RunState]) -> None:
    bad = [r for r in runs.values() if r.status == "invalid"]
    if bad:
        raise ConfigError(f"sweep: {len(bad)} of {len(runs)} runs are invalid; first {bad[0].id}: "
                          f"{bad[0].error} (see --dry-run; select runs with --only KEY=VALUE)")
