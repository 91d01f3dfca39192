"""Every rank of one launched world runs the experiments of a manifest, one after another,
each on a sub-communicator of the ranks it asks for (``tests/world.py`` starts it).

    mpiexec -n W python tests/ranks/world.py MANIFEST.json

The manifest is a list of ``{"name", "ranks", "argv", "env"}``. Run ``name`` is
``mpifl.cli.main(argv)`` on ranks 0 .. ranks-1 inside :func:`mpifl.runtime.comm.communicator`:
the command line's own entry point, on a communicator of that size, so the run is the one
``mpiexec -n ranks python -m mpifl ARGV`` makes, without starting Python and torch again. The
other ranks wait without spinning. Each rank's stdout and stderr of run ``name`` go to
``name.out.<rank>`` beside the manifest; rank 0 writes the exit status to ``name.status`` last,
so a status file means the run ended.

Each run starts from what a fresh process has (:func:`_isolated`): what an earlier run's
plugins registered (rules, models, losses, data sets, their config tables), imported and put
on ``sys.path`` is taken away again, and torch's thread count is put back, so no run sees
another's plugins and every rank of a run has the same registries.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def _output_to(path: Path):
    """File descriptors 1 and 2 (what the run and its logging print) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


@contextmanager
def _environment(extra: dict[str, str]):
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _module_state() -> list[dict]:
    """The dicts that registering a plugin changes: every :class:`mpifl.core.registry.Registry`
    of mpifl's imported modules, and the data sets' file layouts."""
    from mpifl.core.registry import Registry
    from mpifl.data import roots

    found = {id(roots.LAYOUTS): roots.LAYOUTS, id(roots.SOURCES): roots.SOURCES}
    for name, module in list(sys.modules.items()):
        if name == "mpifl" or name.startswith("mpifl."):
            for value in list(vars(module).values()):
                if isinstance(value, Registry):
                    found[id(value._entries)] = value._entries
    return list(found.values())


def _fresh(module) -> bool:
    """Whether a module imported during a run is a plugin's (not mpifl's, not installed)."""
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    mpifl_dir = os.path.dirname(os.path.realpath(sys.modules["mpifl"].__file__))
    return not path.startswith(mpifl_dir + os.sep) and not any(
        path.startswith(p + os.sep) for p in installed)


@contextmanager
def _isolated():
    """What the run registers, imports from its plugins and adds to ``sys.path`` is undone
    after it; torch's thread count is restored."""
    import torch

    # mpifl's own modules (and their registries) are shared by every run: imported before
    # the snapshot, so that what a run's plugins add to them is seen and undone
    import mpifl.cli  # noqa: F401
    import mpifl.experiment.run  # noqa: F401

    states = [(d, dict(d)) for d in _module_state()]
    modules, path, threads = set(sys.modules), list(sys.path), torch.get_num_threads()
    try:
        yield
    finally:
        for d, before in states:
            d.clear()
            d.update(before)
        for name in set(sys.modules) - modules:
            if _fresh(sys.modules[name]):
                del sys.modules[name]
        sys.path[:] = path
        torch.set_num_threads(threads)


def _run_one(run: dict, sub, folder: Path) -> int:
    from mpifl.cli import main
    from mpifl.runtime.comm import communicator

    with _output_to(folder / f"{run['name']}.out.{sub.Get_rank()}"):
        try:
            with _isolated(), communicator(sub), _environment(run.get("env", {})):
                return int(main(list(run["argv"])))
        except SystemExit as exc:  # argparse's refusals
            return exc.code if isinstance(exc.code, int) else 2
        except Exception:  # noqa: BLE001 -- the test reading the run shows it
            traceback.print_exc()
            return 1


def main(manifest: Path) -> None:
    from mpi4py import MPI

    from mpifl.runtime.comm import wait_idle

    world = MPI.COMM_WORLD
    rank, folder = world.Get_rank(), manifest.parent
    for run in json.loads(manifest.read_text()):
        sub = world.Split(0 if rank < run["ranks"] else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            status = _run_one(run, sub, folder)
            statuses = sub.gather(status, root=0)
            if rank == 0:
                worst = max(statuses, key=abs)
                done = folder / f"{run['name']}.status"  # whole or absent: tests wait on it
                done.with_suffix(".tmp").write_text(f"{worst}\n")
                done.with_suffix(".tmp").replace(done)
            sub.Free()
        wait_idle(world.Ibarrier(), max_sleep=0.01)  # idle ranks leave the cores to the run


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]))
