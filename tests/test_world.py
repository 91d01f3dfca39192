"""The shared MPI world's parts that need no ranks: a communicator put in place of the world
(mpifl.runtime.comm.communicator), which declared runs a session starts (tests/world.py), and
the tier guard letting only the world's own thread start mpiexec (tests/conftest.py). The
world itself is proven by what its runs are compared with: tests/test_recorded_runs.py (the
old code's bits) and the 1-rank against 3-rank comparisons of tests/test_resume.py."""

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


SPLIT_JOB = """
[run]
name = "split"
seed = 4
rounds = 3
eval_every = 3
[data]
dataset = "fashion_mnist"
partition = "shards"
num_clients = 8
[model]
name = "mlp"
hidden = [16]
[client]
batch_size = 0
[server]
algorithm = "fedfv"
clients_per_round = 4
"""
#: the same job on 2 ranks, as the shared world runs it through the command line
ON_TWO = shared_world.world_run("world-split-2", ["run", "{dir}/split.toml", "--out",
                                           "{dir}/world-split-2.h5", "--no-progress"],
                         ranks=2, files={"split.toml": SPLIT_JOB}, for_mpi=True)
SPLIT = """
import sys
from mpi4py import MPI
import mpifl
half = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank() // 2)
color = MPI.COMM_WORLD.Get_rank() // 2
mpifl.run(sys.argv[1], out=f"{sys.argv[2]}/half-{color}.h5", progress=False, comm=half)
"""


@pytest.mark.mpi
def test_mpifl_run_on_two_halves_of_a_world_gives_the_two_rank_run_twice(world, tmp_path):
    """4 ranks split into two communicators of 2, each running the same job at the same time
    through ``mpifl.run(comm=...)``: both results equal the 2-rank run of the command line."""
    import os
    import sys

    import h5py
    import numpy as np

    from tests.helpers import mpiexec
    from tests.test_resume import contents

    job = tmp_path / "split.toml"
    job.write_text(SPLIT_JOB)
    proc = subprocess.run([mpiexec(), "-n", "4", sys.executable, "-c", SPLIT, str(job),
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = contents(world.file(ON_TWO))
    for color in (0, 1):
        got = contents(tmp_path / f"half-{color}.h5")
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        with h5py.File(tmp_path / f"half-{color}.h5") as f:
            assert f.attrs["world_size"] == 2
