"""One launched MPI world for the runs whose files the tests only read.

Starting ``mpiexec -n 3 python -m mpifl`` costs seconds of Python and torch start-up on every
rank before the run does anything, and many tests only read a finished run's files (an
end-to-end run of each rule, the reference run of a kill-and-resume test). A test module
declares such runs once, at import::

    FEDFV = world_run("e2e-fedfv", ["run", str(MAIN), "--out", "{dir}/e2e-fedfv.h5"], ranks=3)

and a test reads them through the session fixture ``world`` (``tests/conftest.py``)::

    def test_it(world):
        with h5py.File(world.file(FEDFV), "r") as f: ...

The first test that asks starts **one** world (``tests/ranks/world.py``) that performs every
declared run that the session's selected tests need, each on a sub-communicator of the ranks it
asks for, through the command line's entry point (``mpifl.cli.main``); every other test, on any
pytest-xdist worker, waits for it behind a file lock and reads the same files. The world is two
launches at once (:data:`STREAMS`), each with its share of the runs in their declared order (a
run and the runs that use its output in the same one), so that no core idles while a run has
one rank. Adding a run
adds a run to that world, not a launch. ``{dir}`` in a run's argv is the world's folder; files
a run needs (job files) are written there first.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ranks" / "world.py"
#: seconds the whole world may take (its runs are small; this bounds a hang)
WORLD_TIMEOUT_S = 1800
#: the name of the thread that starts the world
THREAD = "mpifl-world"
#: the environment of every world run (one thread a rank unless a run sets its own)
ENV = {"OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class WorldRun:
    """One run of the world: ``mpifl ARGV`` on ``ranks`` ranks, declared by ``module``."""

    name: str
    argv: tuple[str, ...]
    ranks: int
    module: str
    files: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    for_mpi: bool = False

    def spec(self) -> dict:
        return {"name": self.name, "argv": list(self.argv), "ranks": self.ranks,
                "env": {**ENV, **dict(self.env)}}


_RUNS: dict[str, WorldRun] = {}


def _declaring_module() -> str:
    """The test module being imported that declares a run (through a helper of another
    module, too): the innermost module-level frame of a ``tests`` module on the stack; else
    (a run declared in a function) the module of :func:`world_run`'s caller."""
    frames = inspect.stack(0)[2:]  # no source lines: only names are read
    for info in frames:
        name = info.frame.f_globals.get("__name__", "")
        if info.function == "<module>" and name.startswith("tests."):
            return name
    return frames[0].frame.f_globals["__name__"]


def world_run(name: str, argv: list[str], *, ranks: int = 3, files: dict[str, str] | None = None,
              env: dict[str, str] | None = None, for_mpi: bool = False) -> WorldRun:
    """Declare the run ``name`` (``mpifl ARGV`` on ``ranks`` ranks) of the shared world.

    Args:
        name: unique in the suite; also names the run's output files.
        argv: the words after ``mpifl``; ``{dir}`` stands for the world's folder.
        ranks: 1 to 4.
        files: {file name: text} written into the world's folder before it starts.
        env: environment variables of this run only.
        for_mpi: read by tests marked ``mpi`` or ``slurm`` (the reference of a kill-and-resume
            test), so started in the real-rank tier's world rather than the in-process tier's.
    """
    caller = _declaring_module()
    run = WorldRun(name, tuple(argv), ranks, caller, tuple(sorted((files or {}).items())),
                   tuple(sorted((env or {}).items())), for_mpi)
    if name in _RUNS and _RUNS[name] != run:
        raise ValueError(f"world run {name!r} declared twice, differently")
    if not 1 <= ranks <= 4:
        raise ValueError(f"world run {name!r}: ranks = {ranks}, expected 1 to 4")
    _RUNS[name] = run
    return run


@dataclass
class World:
    """The world: each run's files in ``folder``, read as soon as that run has ended (its
    ``.status`` file), while the world's later runs go on."""

    folder: Path
    runs: dict[str, WorldRun] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return self.folder / name

    def _ended(self, run: WorldRun) -> Path:
        """The run's status file, once the run has ended or the world has (then it may be
        missing)."""
        if run.name not in self.runs:
            pytest.fail(f"world run {run.name!r} was not started: its module's tests were "
                        "not selected (tests/world.py)", pytrace=False)
        status, done = self.folder / f"{run.name}.status", self.folder / "world.log"
        deadline = time.monotonic() + WORLD_TIMEOUT_S
        while not status.exists() and not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return status

    def output(self, run: WorldRun) -> str:
        """Everything the run's ranks printed (rank 0 first)."""
        self._ended(run)
        parts = sorted(self.folder.glob(f"{run.name}.out.*"), key=lambda p: int(p.suffix[1:]))
        return "".join(p.read_text(errors="replace") for p in parts)

    def status(self, run: WorldRun) -> int:
        """The run's exit status; fails the test when the run never ended."""
        status = self._ended(run)
        if not status.exists():
            log = (self.folder / "world.log").read_text(errors="replace")[-3000:] \
                if (self.folder / "world.log").exists() else "(the world did not end)"
            pytest.fail(f"world run {run.name!r} did not end (the world stopped before it):\n"
                        f"{log}\n{self.output(run)[-3000:]}", pytrace=False)
        return int(status.read_text())

    def file(self, run: WorldRun, name: str | None = None) -> Path:
        """The run's results file (``{dir}/<name>.h5``, or ``name``), after asserting that the
        run exited 0."""
        status = self.status(run)
        assert status == 0, f"world run {run.name} exited {status}:\n{self.output(run)[-3000:]}"
        return self.folder / (name or f"{run.name}.h5")


def needed(items) -> dict[str, WorldRun]:
    """The declared runs of the modules whose selected tests use the ``world`` fixture (those
    declared ``for_mpi`` where such a test is marked ``mpi`` or ``slurm``, the others where one
    is not), in
    the order they were declared (a resume follows its run)."""
    wanted = {(item.module.__name__, any(item.get_closest_marker(m) for m in ("mpi", "slurm")))
              for item in items if "world" in getattr(item, "fixturenames", ())
              and getattr(item, "module", None) is not None}
    return {n: r for n, r in _RUNS.items() if (r.module, r.for_mpi) in wanted}


#: how many launches share the world's runs (they run at once; each keeps its runs' order)
STREAMS = 2


def _streams(runs: dict[str, WorldRun], count: int = STREAMS) -> list[list[WorldRun]]:
    """The runs split into ``count`` lists that can run at the same time: runs that name the
    same output under ``{dir}`` (a run and its resume, a report of it) stay in one list, in
    their declared order; the groups go to the list with the least work so far (runs x ranks).
    One launch alone leaves a core idle whenever its run has one rank, or while the tests that
    read the world wait for it."""
    inputs = {name for r in runs.values() for name, _ in r.files}
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for r in runs.values():
        for arg in r.argv:
            if "{dir}/" in arg:
                top = arg.split("{dir}/", 1)[1].split("/")[0]
                out = top.removesuffix(".ckpt").removesuffix(".h5")
                if top not in inputs:
                    parent[root(r.name)] = root("out:" + out)
    groups: dict[str, list[WorldRun]] = {}
    for r in runs.values():
        groups.setdefault(root(r.name), []).append(r)
    streams: list[list[WorldRun]] = [[] for _ in range(count)]
    work = [0] * count
    for group in groups.values():
        i = work.index(min(work))
        streams[i] += group
        work[i] += sum(r.ranks for r in group)
    return [s for s in streams if s]


def _launch(runs: dict[str, WorldRun], folder: Path) -> None:
    for run in runs.values():
        for name, text in run.files:
            (folder / name).write_text(text.replace("{dir}", str(folder)))
    start, lines = time.monotonic(), ["the world failed to launch\n"]
    try:
        with ThreadPoolExecutor(STREAMS, thread_name_prefix=THREAD) as pool:  # mpiexec allowed
            lines = list(pool.map(lambda x: _launch_stream(x[1], folder, x[0]),
                                  enumerate(_streams(runs))))
    finally:  # the world has ended (the tests waiting on a run then stop waiting)
        (folder / "world.log").write_text(
            "".join(lines) + f"\nworld of {len(lines)} launches, {len(runs)} runs: done in "
            f"{time.monotonic() - start:.1f} s\n")


def _launch_stream(runs: list[WorldRun], folder: Path, index: int) -> str:
    """One launch of ``runs`` in order; its log's text."""
    from tests.helpers import mpiexec

    specs = [{**r.spec(), "argv": [a.replace("{dir}", str(folder)) for a in r.argv]}
             for r in runs]
    manifest = folder / f"manifest-{index}.json"
    manifest.write_text(json.dumps(specs, indent=1))
    size = max(r.ranks for r in runs)
    start = time.monotonic()
    log = folder / f"world-{index}.log"
    with open(log, "w") as out:
        proc = subprocess.run([mpiexec(), "-n", str(size), sys.executable, str(SCRIPT),
                               str(manifest)], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **ENV}, timeout=WORLD_TIMEOUT_S, cwd=folder)
    return (log.read_text(errors="replace")
            + f"\nlaunch {index}: {size} ranks, {len(runs)} runs: exit {proc.returncode} in "
            f"{time.monotonic() - start:.1f} s\n")


def _folder(runs: dict[str, WorldRun], shared: Path) -> Path:
    """The world's folder in ``shared``: one per set of runs (their specs and files)."""
    key = hashlib.sha256(json.dumps([r.spec() for r in runs.values()]).encode()
                         + repr([r.files for r in runs.values()]).encode()).hexdigest()[:12]
    return shared / f"world-{key}"


def _build(runs: dict[str, WorldRun], shared: Path) -> World:
    folder = _folder(runs, shared)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "world.log").exists():
            folder.mkdir(parents=True, exist_ok=True)
            _launch(runs, folder)
    return World(folder, runs)


_STARTED: Future | None = None


def start(items, shared: Path) -> Future:
    """The world for ``items`` (their modules' declared runs), started once per folder
    ``shared`` and set of runs: the first caller of the session launches it in a background
    thread; another pytest-xdist worker's thread waits for it behind a file lock and reads the
    same files. The future's result is the :class:`World`."""
    global _STARTED
    if _STARTED is None:
        runs = needed(items)
        _STARTED = ThreadPoolExecutor(1, thread_name_prefix=THREAD).submit(
            _build, runs, shared) if runs else _done(World(shared, {}))
    return _STARTED


def now(items, shared: Path) -> World:
    """The world for ``items`` (:func:`start`), at once: a test reads a run when that run has
    ended, not when the whole world has. Fails when the world could not start."""
    future = start(items, shared)
    if future.done() and future.exception() is not None:
        raise future.exception()  # type: ignore[misc]
    runs = needed(items)
    return World(_folder(runs, shared), runs) if runs else future.result()


def _done(world: World) -> Future:
    future: Future = Future()
    future.set_result(world)
    return future


def launching() -> bool:
    """Whether this thread is the one starting the world (``tests/conftest.py`` lets its
    mpiexec through while an unmarked test runs)."""
    return threading.current_thread().name.startswith(THREAD)
