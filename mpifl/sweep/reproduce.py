"""``mpifl reproduce``: run the reproduction suites (``jobs/repro/*.toml``, ordinary sweep
files) through the sweep machinery, then write docs/REPRODUCTIONS.md from their results.

Each suite runs in its own sweep folder ``<out>/<suite>``: a repeated command resumes
unfinished runs and skips finished ones, SLURM (``--executor slurm``) spreads them over nodes,
and ``--report-only`` rewrites the document from whatever has finished.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

from mpifl.core.errors import ConfigError, OutputError
from mpifl.report.reproductions import (load_figures, measure, render, suite_header,
                                        suite_seconds)
from mpifl.store.results import Damaged
from mpifl.sweep.launch import choose, run_sweep
from mpifl.sweep.spec import load_sweep

FIGURES = "figures.toml"


def suite_files(folder: Path, names: list[str]) -> dict[str, Path]:
    """``{suite: path}`` of ``folder``'s sweep files (all but the figures file), or of the
    ``names`` given.

    Raises:
        ConfigError: no such folder, or a name with no file (the known ones listed).
    """
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder of reproduction suites")
    known = {p.stem: p for p in sorted(folder.glob("*.toml")) if p.name != FIGURES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown suite {unknown[0]!r}; known: {', '.join(known)}")
    return {n: known[n] for n in names} if names else known


def run_suites(suites: dict[str, Path], out: Path, executor: str, only: list[str]) -> list[str]:
    """Run (or resume) every suite; the names of those with runs that did not complete.

    Raises:
        ConfigError: an invalid suite file or run (before any run of that suite starts).
    """
    launcher = choose(executor)
    failed = []
    for name, path in suites.items():
        runs = run_sweep(load_sweep(path), out / name, executor=launcher.name,
                         wait=not launcher.blocks, only=only)
        if any(r.status != "complete" for r in runs.values()):
            failed.append(name)
    return failed


def write_doc(folder: Path, out: Path, doc: Path, suites: dict[str, Path],
              last: int) -> tuple[str, list[Damaged]]:
    """Write ``doc`` (atomically: a temporary file renamed over it) from the results under
    ``out``; return the summary line and the results files that could not be read (listed in
    the document, left out of its figures; the caller ends with them: exit status 2).

    Raises:
        ConfigError: a bad figures file, or one naming a suite that has no file.
        OutputError: ``doc``'s folder does not exist or is not writable.
    """
    every = suite_files(folder, [])
    rows = load_figures(folder / FIGURES)
    for r in rows:  # all rows, not only the chosen suites': a typo must not hide a row
        if r.suite not in every:
            raise ConfigError(f"{folder / FIGURES}: suite {r.suite!r} has no file in {folder}")
    rows = [r for r in rows if r.suite in suites]
    measured = [measure(r, out / r.suite, last) for r in rows]
    damaged = [d for m in measured for d in m.damaged]
    times = {n: (suite_header(p), suite_seconds(out / n, damaged)) for n, p in suites.items()
             if any(r.suite == n for r in rows)}
    damaged = list({d.path: d for d in damaged}.values())  # each file once, first seen first
    text = render(rows, measured, command=_command(), machine=_machine(), suites=times,
                  last=last, damaged=damaged)
    if not doc.parent.is_dir():
        raise OutputError(f"{doc}: folder {doc.parent} does not exist")
    tmp = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n")
        os.replace(tmp, doc)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{doc}: cannot write: {exc.strerror}") from None
    return next(line for line in text.splitlines() if line.startswith("Summary:")), damaged


def _command() -> str:
    return "mpifl " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "mpifl reproduce"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({os.cpu_count()} cores, {cpu}, Python {platform.python_version()})"
