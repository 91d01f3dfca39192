"""The shared MPI world's parts that need no ranks: a communicator put in place of the world
(mpifl.runtime.comm.communicator), which declared runs a session starts (tests/world.py), and
the tier guard letting only the world's own thread start mpiexec (tests/conftest.py). The
world itself is proven by what its runs are compared with: tests/mpi/test_recorded_runs.py (the
old code's bits) and the 1-rank against 3-rank comparisons of tests/inprocess/test_resume.py.
Its communicators on real ranks: tests/mpi/test_world.py."""

from __future__ import annotations

import subprocess
import threading
from types import SimpleNamespace

import pytest

from mpifl.runtime import comm
from tests import world as shared_world
from tests.conftest import _Guard


class _Comm:
    """What :func:`mpifl.runtime.comm.communicator` reads of a communicator."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 -- mpi4py's name
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size


def test_a_communicator_stands_for_the_world_inside_its_block_only(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    outer, inner = _Comm(1, 3), _Comm(0, 2)
    with comm.communicator(outer):
        assert comm.world() is outer and comm.substituted()
        assert (comm.launched_rank(), comm.launched_size()) == (1, 3)
        with comm.communicator(inner):
            assert comm.world() is inner and comm.launched_size() == 2
        assert comm.world() is outer
    assert not comm.substituted()
    assert (comm.launched_rank(), comm.launched_size()) == (3, 4)  # the launcher's again


def test_the_budget_counts_the_communicators_ranks(monkeypatch):
    from mpifl.experiment.budget import world_size

    monkeypatch.setenv("PMI_SIZE", "4")
    assert world_size() == 4
    with comm.communicator(_Comm(0, 2)):
        assert world_size() == 2


def _item(module: str, uses_world: bool, marker: str | None = None):
    return SimpleNamespace(module=SimpleNamespace(__name__=module),
                           fixturenames=["world"] if uses_world else [],
                           get_closest_marker=lambda name: name if name == marker else None)


def test_a_session_starts_the_runs_its_selected_tests_read(monkeypatch):
    monkeypatch.setattr(shared_world, "_RUNS", {})
    a = shared_world.world_run("a", ["run"])
    shared_world.world_run("b", ["run"], for_mpi=True)
    c = shared_world.world_run("c", ["resume"], ranks=2)
    other = shared_world.world_run("other", ["run"])
    other = shared_world.WorldRun(**{**other.__dict__, "module": "elsewhere"})
    shared_world._RUNS["other"] = other
    here = __name__
    assert list(shared_world.needed([_item(here, True)])) == ["a", "c"]  # in declaration order
    assert list(shared_world.needed([_item(here, True, "mpi")])) == ["b"]
    assert list(shared_world.needed([_item(here, True, "slurm"), _item(here, False)])) == ["b"]
    assert shared_world.needed([_item(here, False)]) == {}
    assert list(shared_world.needed([_item("elsewhere", True)])) == ["other"]
    with pytest.raises(ValueError, match="declared twice"):
        shared_world.world_run("a", ["run", "x"])
    with pytest.raises(ValueError, match="1 to 4"):
        shared_world.world_run("d", ["run"], ranks=5)
    assert (a.module, c.ranks) == (here, 2)


def test_only_the_worlds_own_thread_may_start_mpiexec_from_an_unmarked_test():
    started = []

    def launch():
        try:
            with _Guard("tests/test_x.py::test_y"):
                subprocess.run(["mpiexec", "--version"], capture_output=True)
            started.append(True)
        except pytest.fail.Exception:
            started.append(False)

    for name in (shared_world.THREAD + "_0", "another"):
        thread = threading.Thread(target=launch, name=name)
        thread.start()
        thread.join()
    assert started == [True, False]


def test_a_run_is_read_once_it_has_ended_not_when_the_whole_world_has(tmp_path):
    """``world.status`` waits for that run's status file only; once the world has ended
    (world.log) a run without one fails the test instead of waiting."""
    done = shared_world.WorldRun("done", ("run",), 1, "m")
    late = shared_world.WorldRun("late", ("run",), 1, "m")
    world = shared_world.World(tmp_path, {"done": done, "late": late})

    def end_the_run():
        (tmp_path / "done.status").write_text("0\n")

    timer = threading.Timer(0.2, end_the_run)
    timer.start()
    assert world.status(done) == 0  # the rest of the world is still going (no world.log)
    timer.join()
    (tmp_path / "world.log").write_text("world of 2 launches: done\n")
    with pytest.raises(pytest.fail.Exception, match="world run 'late' did not end"):
        world.status(late)


def test_the_world_is_split_so_that_a_run_and_its_resume_share_a_launch():
    """Two launches at once; a run, its resume and a report of it (the same output under
    {dir}) in one, in their declared order; input files shared by many runs tie nothing."""
    runs = {r.name: r for r in [
        shared_world.WorldRun("a", ("run", "{dir}/job.toml", "--out", "{dir}/a.h5"), 3, "m",
                              files=(("job.toml", ""),)),
        shared_world.WorldRun("b", ("run", "{dir}/job.toml", "--out", "{dir}/b.h5"), 1, "m",
                              files=(("job.toml", ""),)),
        shared_world.WorldRun("a-resumed", ("resume", "{dir}/a.h5"), 3, "m"),
        shared_world.WorldRun("c", ("run", "{dir}/job.toml", "--out", "{dir}/c.h5"), 1, "m"),
        shared_world.WorldRun("a-report", ("report", "{dir}/a.h5.ckpt"), 1, "m"),
    ]}
    streams = shared_world._streams(runs)
    assert len(streams) == 2 and sorted(r.name for s in streams for r in s) == sorted(runs)
    (with_a,) = [[r.name for r in s] for s in streams if runs["a"] in s]
    assert [n for n in with_a if n.startswith("a")] == ["a", "a-resumed", "a-report"]
    assert {"b", "c"} - set(with_a)  # the other launch got work
