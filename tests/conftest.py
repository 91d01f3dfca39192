"""Test tiers: a test that starts a job launcher carries the marker of its tier.

``make check`` runs the in-process tests on every core (pytest-xdist) and ``make test`` adds
the tests marked ``mpi`` (they start ``mpiexec``) and ``slurm`` (they use the one-node SLURM
cluster) one at a time, since their ranks already take every core. The markers are enforced,
not trusted: while an unmarked test runs (set-up and fixtures included), starting ``mpiexec``,
``mpirun``, ``srun``, ``sbatch`` or ``salloc`` fails it with a line naming the marker it needs.
"""

from __future__ import annotations

import os
import subprocess

import pytest

#: launcher -> the marker of the tier a test that starts it belongs to
LAUNCHERS = {"mpiexec": "mpi", "mpirun": "mpi", "mpiexec.hydra": "mpi", "srun": "slurm",
             "sbatch": "slurm", "salloc": "slurm", "local-cluster.sh": "slurm"}
TIERS = ("mpi", "slurm")


def _launcher(args) -> str | None:
    """The launcher ``args`` starts (a Popen argument list or command string), or None."""
    words = args.split() if isinstance(args, (str, bytes)) else list(args)
    for word in words[:2]:  # the program, or the script a shell runs
        name = os.path.basename(os.fsdecode(word))
        if name in LAUNCHERS:
            return name
    return None


class _Guard:
    """Replaces ``subprocess.Popen.__init__`` while an unmarked test runs."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.original = subprocess.Popen.__init__

    def __enter__(self):
        original, nodeid = self.original, self.nodeid

        def init(popen, args, *rest, **kwargs):
            name = _launcher(args)
            if name is not None:
                if os.environ.get("MPIFL_TIER_LOG"):  # to list the tests to mark
                    with open(os.environ["MPIFL_TIER_LOG"], "a") as log:
                        log.write(f"{nodeid} {LAUNCHERS[name]}\n")
                pytest.fail(f"{nodeid} starts {name}: mark it @pytest.mark.{LAUNCHERS[name]} "
                            "(tests/conftest.py: tests that start launchers run one at a time)",
                            pytrace=False)
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = init
        return self

    def __exit__(self, *exc):
        subprocess.Popen.__init__ = self.original


def _guarded(item) -> bool:
    return not any(item.get_closest_marker(tier) for tier in TIERS)


def _phase(item):
    """One guarded phase of ``item`` (a hook wrapper's body)."""
    if _guarded(item):
        with _Guard(item.nodeid):
            yield
    else:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _phase(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _phase(item)
