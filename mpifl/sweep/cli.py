"""``mpifl sweep`` on the command line: its arguments, the preview (``--dry-run``,
``--print-args``) and the exit status."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from mpifl.store.results import DamagedResults
from mpifl.sweep.launch import TO_START, choose, run_sweep, survey
from mpifl.sweep.plan import INDEX, RunState, count_statuses, grid_points, select
from mpifl.sweep.spec import Sweep, load_sweep
from mpifl.sweep.status import damaged_runs


def add_sweep_parser(subparsers) -> None:
    """Add ``mpifl sweep`` to the ``mpifl`` command line."""
    s = subparsers.add_parser("sweep", help="submit a grid of runs (SLURM via submitit, or local)")
    s.add_argument("sweep", help="sweep file (TOML; see jobs/sweep-smoke.toml)")
    s.add_argument("--out", help="sweep folder (default runs/sweeps/<sweep.name>)")
    s.add_argument("--executor", choices=["auto", "slurm", "local"], default="auto",
                   help="slurm (sbatch via submitit), local (mpiexec here, in the foreground), "
                        "auto (default): slurm when sbatch is on PATH and a SLURM controller "
                        "answers (scontrol ping), else local; the choice is logged with why")
    s.add_argument("--wait", action="store_true", help="with slurm: wait until every job is over")
    s.add_argument("--only", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="run only the points with this value (repeatable)")
    s.add_argument("--dry-run", action="store_true",
                   help="list the runs and their status; submit nothing")
    s.add_argument("--print-args", action="store_true",
                   help="print the mpifl run arguments of each unfinished run, one per line "
                        "(the list file of slurm/mpifl-array.sbatch); submit nothing")
    s.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run ``mpifl sweep``: exit 0 when submitted (or all complete with --wait), 1 when a run
    ended without completing, 2 for a bad sweep file or a damaged results file (one line)."""
    sweep = load_sweep(args.sweep)
    folder = Path(args.out) if args.out else Path("runs") / "sweeps" / sweep.name
    if args.dry_run or args.print_args:
        return _preview(sweep, folder, args)
    launcher = choose(args.executor)
    runs = run_sweep(sweep, folder, executor=launcher.name, wait=args.wait, only=args.only)
    print(format_runs(runs))
    print(f"index: {folder / INDEX}")
    _fail_on_damage(folder, runs)
    if not launcher.blocks and not args.wait:
        return 0
    return 0 if all(r.status == "complete" for r in runs.values()) else 1


def _preview(sweep: Sweep, folder: Path, args: argparse.Namespace) -> int:
    """List the runs and their status, or (``--print-args``) the arguments of those a launch
    would start; nothing is written."""
    runs = survey(sweep, folder, select(grid_points(sweep), args.only))
    if args.print_args:
        for r in runs.values():
            if r.status in TO_START:
                sets = [x for o in r.overrides for x in ("--set", o)]
                print(shlex.join([str(sweep.base), "--out", str(folder / r.results), *sets]))
        _fail_on_damage(folder, runs)
        return 0
    print(format_runs(runs))
    print(f"{len(runs)} runs: {count_statuses(r.status for r in runs.values())}")
    _fail_on_damage(folder, runs)
    return 0


def _fail_on_damage(folder: Path, runs: dict[str, RunState]) -> None:
    """After the listing: runs whose results file cannot be read end the command with one
    line naming each (exit status 2); they are not started again over their files.

    Raises:
        DamagedResults: at least one run is damaged.
    """
    damaged = damaged_runs(folder, runs)
    if damaged:
        raise DamagedResults(damaged)


def format_runs(runs: dict[str, RunState]) -> str:
    """One line per run: id, status, job id, and the reason when invalid or failed."""
    width = max((len(r) for r in runs), default=2)
    lines = []
    for r in runs.values():
        note = f"  ({r.error})" if r.error and r.status != "complete" else ""
        lines.append(f"{r.id:<{width}}  {r.status:<10}  {r.job_id or '-':<10}{note}")
    return "\n".join(lines)
