"""The shared MPI world's communicators on real ranks: 4 ranks started by mpiexec, split into
two communicators of 2, each run the same job at the same time through ``mpifl.run(comm=...)``,
and both results equal the 2-rank run of the command line in the real-rank tier's world
(tests/world.py). Real ranks, because what is proven is the split of a launched world."""

from __future__ import annotations

import subprocess

import pytest

from tests import world as shared_world

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
    from tests.inprocess.test_resume import contents

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
