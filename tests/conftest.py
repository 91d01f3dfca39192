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
from pathlib import Path

import pytest

from tests import world as shared_world

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
            if name is not None and not shared_world.launching():
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



@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test that reads the shared world carries the marker ``world`` (before ``-m`` selects)."""
    for item in items:
        if "world" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.world)


def _shared_folder(config) -> Path:
    """A folder every pytest-xdist worker of this session sees (the base temp's parent there)."""
    base = config._tmp_path_factory.getbasetemp()  # pytest's own; tmp_path_factory's fixture
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def pytest_collection_finish(session):
    """Start the shared world (tests/world.py) in the background as soon as the tests are
    known, so its ranks work while the in-process tests run; ``world`` waits for it."""
    if shared_world.needed(session.items) and not session.config.option.collectonly:
        shared_world.start(session.items, _shared_folder(session.config))


@pytest.fixture(scope="session")
def world(request) -> shared_world.World:
    """The shared MPI world's finished runs (tests/world.py): launched once for the session's
    selected tests, by whichever pytest-xdist worker gets there first."""
    return shared_world.start(request.session.items, _shared_folder(request.config)).result()
