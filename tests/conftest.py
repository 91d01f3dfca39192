"""Test tiers: a test that starts a job launcher carries the marker of its tier, and lies in
its tier's folder.

``make check`` runs the in-process tests on every core (pytest-xdist) and ``make test`` adds
the tests marked ``mpi`` (they start ``mpiexec``) and ``slurm`` (they use the one-node SLURM
cluster) one at a time, since their ranks already take every core. The markers are enforced,
not trusted: while an unmarked test runs (set-up and fixtures included), starting ``mpiexec``,
``mpirun``, ``srun``, ``sbatch`` or ``salloc`` fails it with a line naming the marker it needs.

The folders follow the tiers: tests/inprocess/ (in the pytest process, ``slow`` and
``world`` ones included), tests/mpi/, tests/slurm/ and tests/gpu/ (``pytest -m gpu``). A test
under tests/mpi/, tests/slurm/ or tests/gpu/ gets that folder's marker where it lacks it, and a
test marked ``mpi`` or ``slurm`` anywhere but there (in tests/inprocess/, say) fails collection
with one line, so the folder and the marker cannot disagree.
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
#: folder of tests/ -> the marker each of its tests carries (added where it lacks it)
FOLDER_MARKERS = {"mpi": "mpi", "slurm": "slurm", "gpu": "gpu"}
#: the folders where a test marked mpi or slurm may lie (tests/gpu/ holds both kinds)
LAUNCHING_FOLDERS = ("mpi", "slurm", "gpu")
TESTS = Path(__file__).resolve().parent


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


def _folder(path) -> str | None:
    """The folder of tests/ that holds the test file ``path`` (``inprocess``, ``mpi``,
    ``slurm``, ``gpu``), or None (tests/ itself, or outside it)."""
    try:
        parts = Path(path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


def _place(item) -> str | None:
    """Give ``item`` the marker of its folder where it lacks it; the one line saying that a
    test marked mpi or slurm lies outside tests/mpi/, tests/slurm/ and tests/gpu/, or None."""
    folder = _folder(item.path)
    marker = FOLDER_MARKERS.get(folder)
    if marker is not None and item.get_closest_marker(marker) is None:
        item.add_marker(marker)
    tier = next((t for t in TIERS if item.get_closest_marker(t)), None)
    if tier is None or folder in LAUNCHING_FOLDERS:
        return None
    where = ("lies in tests/inprocess/ (the in-process tier)" if folder == "inprocess"
             else "lies outside tests/mpi/, tests/slurm/ and tests/gpu/")
    return (f"{item.nodeid} is marked {tier} but {where}: move it to tests/{tier}/ "
            "(tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before ``-m`` selects: a test that reads the shared world carries the marker ``world``,
    a test under tests/mpi/, tests/slurm/ or tests/gpu/ that folder's marker, and a test marked
    mpi or slurm in any other folder is a collection error of one line (and is not run)."""
    misplaced = set()
    for item in items:
        if "world" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.world)
        line = _place(item)
        if line is not None:
            misplaced.add(item.nodeid)
            config.hook.pytest_collectreport(
                report=pytest.CollectReport(item.nodeid, "failed", line, []))
    if misplaced:
        items[:] = [item for item in items if item.nodeid not in misplaced]
    # the files that read the world last: pytest-xdist hands out files in this order, so its
    # workers run every other file while the world's ranks make the runs, instead of waiting
    readers = {item.path for item in items if "world" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path in readers)  # stable: each file's order is kept


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
    """The shared MPI world's runs (tests/world.py): launched once for the session's selected
    tests, by whichever pytest-xdist worker gets there first; each run read once it has ended."""
    return shared_world.now(request.session.items, _shared_folder(request.config))
