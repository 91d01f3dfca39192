"""The srun shape of a launch after a lost node (mpifl/sweep/allocation.py): pure functions of
the job's environment and node count. The real path — a node killed, the job going on with the
others — is tests/slurm/test_multinode.py."""

from __future__ import annotations

import pytest

from mpifl.sweep.allocation import reshaped, srun_shape

STARTED = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "6"}


def test_all_nodes_left_or_unknown_keeps_the_launch():
    assert srun_shape(3, STARTED) == []
    assert srun_shape(None, STARTED) == []
    assert srun_shape(2, {}) == []  # not a SLURM job


def test_a_lost_node_keeps_the_ranks_per_node_on_the_rest():
    assert srun_shape(2, STARTED) == ["--nodes=2", "--ntasks=4", "--overlap"]
    # no SLURM_NTASKS_PER_NODE (sbatch -n 6 -N 3): the tasks per node the job started with
    no_per_node = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "6"}
    assert srun_shape(1, no_per_node) == ["--nodes=1", "--ntasks=2", "--overlap"]
    # SLURM_NNODES when SLURM_JOB_NUM_NODES is missing
    assert srun_shape(1, {"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4"}) == [
        "--nodes=1", "--ntasks=4", "--overlap"]


def test_reshaped_replaces_the_counts_and_keeps_the_rest():
    argv = ["srun", "--mpi=pmi2", "--ntasks=6", "--nodes=3", "python", "-m", "mpifl", "run", "x"]
    shape = ["--nodes=2", "--ntasks=4", "--overlap"]
    assert reshaped(argv, shape) == ["srun", *shape, "--mpi=pmi2", "python", "-m", "mpifl", "run",
                                     "x"]
    assert reshaped(argv, []) is argv
    with pytest.raises(ValueError, match="only an srun launch"):
        reshaped(["mpiexec", "-n", "6"], shape)
