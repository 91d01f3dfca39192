"""One mpifl on every rank: which install and interpreter each rank runs, checked at set-up.

``mpiexec`` starts whatever ``python`` or ``mpifl`` its own ``PATH`` finds first, and a wrapper
may change that PATH (pyenv's shims put the base interpreter's ``bin`` first, so in a virtual
environment made with ``--system-site-packages`` the ranks ran the base install). Ranks that
import mpifl from different places compute with different code; so every rank reports its
install right after ``MPI_Init`` and a mismatch ends the run before anything is loaded.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

from mpifl.core.version import __version__

#: mpifl's package folder (this file is mpifl/runtime/installs.py)
PACKAGE = Path(__file__).resolve().parents[1]


def this_install() -> tuple[str, str, str, str]:
    """``(mpifl's package folder, mpifl's version, sys.executable, Python's version)`` of this
    process; the interpreter's path as started (a virtual environment's ``python`` is a link
    to its base interpreter, and telling them apart is the point)."""
    return str(PACKAGE), __version__, sys.executable, platform.python_version()


def describe(install: tuple[str, ...]) -> str:
    path, version, python, python_version = install
    return f"{path} (python {python} {python_version}, mpifl {version})"


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def mismatch(installs: list[tuple[str, str, str, str]]) -> str | None:
    """The one-line error when the ranks (``installs[r]`` is rank r's :func:`this_install`) do
    not all run the same install and interpreter; None when they do."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, install in enumerate(installs):
        groups.setdefault(tuple(install), []).append(rank)
    if len(groups) == 1:
        return None
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} {describe(install)}"
             for install, ranks in groups.items()]
    return (f"ranks run different mpifl installs: {'; '.join(parts)}; start every rank with "
            f"the same interpreter and environment, e.g. mpiexec -n {len(installs)} "
            '"$(command -v python)" -m mpifl ... (docs/guides/running.md "Which mpifl each '
            'rank runs")')


def venv_warning(install: tuple[str, str, str, str],
                 environ: Mapping[str, str] = os.environ) -> str | None:
    """A warning when a virtual environment is active (``VIRTUAL_ENV``) but this process runs
    another interpreter: the launcher's PATH found another ``python`` first."""
    venv = environ.get("VIRTUAL_ENV")
    if not venv or Path(sys.prefix).resolve() == Path(venv).resolve():
        return None
    return (f"the active virtual environment is {venv} (VIRTUAL_ENV), but the ranks run "
            f"{install[2]} with mpifl from {install[0]}: the launcher found another python "
            f'first; if {venv} was meant, start them with "{venv}/bin/python" -m mpifl')
