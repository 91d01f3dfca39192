"""Each rank's threads fit the node: the cores this process may use divided among the ranks that
share them (mpifl.runtime.threads), unless the job (run.threads) or the user (OMP_NUM_THREADS)
chose. The pure rule with its inputs as numbers; then real runs, one process and 3 ranks, read
back from the results file (the threads each rank had once set) and rank 0's log line: from the
shared MPI world (tests/world.py), but for the 3 ranks of a plain ``mpiexec -n 3`` with no
OMP_NUM_THREADS at all, which need processes of their own. The tests that start mpiexec
themselves are in tests/mpi/test_threads.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import h5py
import pytest

from mpifl.runtime.threads import Cores, cgroup_quota, decide_threads, threads_line, usable_cores
from tests.helpers import small_fmnist_job
from tests.world import world_run

# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("cores,on_node,sharing,expected", [
    (Cores(2), 3, 3, 1),       # mpiexec -n 3 on 2 cores: one each, not 2 each
    (Cores(2), 1, 1, 2),       # one process: every core
    (Cores(2), 2, 2, 1),
    (Cores(64), 4, 4, 16),
    (Cores(64), 3, 3, 21),     # rounded down: never more than the share
    (Cores(1), 8, 8, 1),       # at least one
    (Cores(4), 4, 1, 4),       # each rank bound to its own 4 cores (srun --cpu-bind): all 4
    (Cores(64, quota=4.0), 2, 2, 2),    # a container's quota is shared by the node's ranks
    (Cores(64, quota=2.5), 1, 1, 2),    # part of a core is not a thread
    (Cores(64, slurm_on_node=16), 4, 4, 4),
    (Cores(16, slurm_per_task=2), 2, 2, 2),
    (Cores(16, slurm_per_task=8), 4, 4, 4),  # the mask is the tighter limit
])
def test_auto_is_the_smallest_share_of_the_cores(cores, on_node, sharing, expected):
    threads = decide_threads(0, None, cores, on_node, sharing)
    assert threads.count == expected
    assert threads.why.startswith("auto: ")


def test_the_limiting_share_is_named():
    assert decide_threads(0, None, Cores(2), 3, 3).why == (
        "auto: 2 CPUs in the affinity mask / 3 ranks sharing them")
    assert decide_threads(0, None, Cores(64, quota=4.0), 2, 2).why == (
        "auto: cgroup CPU quota 4 / 2 ranks on this node")
    assert decide_threads(0, None, Cores(16, slurm_per_task=2), 1, 1).why == (
        "auto: SLURM_CPUS_PER_TASK=2")


@pytest.mark.parametrize("omp,expected", [("3", 3), (" 2 ", 2), ("4,2", 4)])
def test_omp_num_threads_is_the_users_choice(omp, expected):
    threads = decide_threads(0, omp, Cores(64), 64, 64)
    assert threads.count == expected
    assert threads.why == f"OMP_NUM_THREADS={omp.split(',')[0].strip()} in the environment"


@pytest.mark.parametrize("omp", ["", "0", "-1", "many"])
def test_an_unusable_omp_num_threads_is_ignored(omp):
    assert decide_threads(0, omp, Cores(8), 2, 2).count == 4


def test_run_threads_wins_over_everything():
    threads = decide_threads(5, "1", Cores(2, quota=1.0, slurm_per_task=1), 3, 3)
    assert (threads.count, threads.why) == (5, "run.threads = 5")


def test_the_log_line_groups_ranks():
    assert threads_line([(1, "auto: x")] * 3) == "threads: 1 a rank (auto: x)"
    assert threads_line([(2, "auto: y")]) == "threads: 2 (auto: y)"
    assert threads_line([(1, "a"), (1, "a"), (4, "b"), (1, "a")]) == (
        "threads a rank: 1 on ranks 0-1, 3 (a); 4 on rank 2 (b)")


def test_this_process_cores_come_from_the_os():
    cores = usable_cores({})
    assert cores.affinity == len(os.sched_getaffinity(0))
    assert (cores.slurm_on_node, cores.slurm_per_task) == (None, None)
    slurm = usable_cores({"SLURM_CPUS_ON_NODE": "12", "SLURM_CPUS_PER_TASK": "3"})
    assert (slurm.slurm_on_node, slurm.slurm_per_task) == (12, 3)


# --------------------------------------------------------------------------- real runs


def expected_auto(ranks: int) -> int:
    """The direct oracle on this machine: its CPUs, within the cgroup quota, over the ranks."""
    share = len(os.sched_getaffinity(0)) // ranks
    quota = cgroup_quota()
    if quota is not None:
        share = min(share, math.floor(quota) // ranks)
    return max(1, share)


JOB = small_fmnist_job("cores", seed=1, rounds=1, eval_every=1, checkpoint_every=0,
                       partition='partition = "shards"', algorithm="fedavg")


def _world(name: str, ranks: int, omp: str, *extra: str):
    """A world run of the job with OMP_NUM_THREADS = ``omp`` ("": ignored, as if unset)."""
    return world_run(f"threads-{name}", ["run", "{dir}/threads.toml", "--out",
                                         f"{{dir}}/threads-{name}.h5", "--no-progress", *extra],
                     ranks=ranks, files={"threads.toml": JOB}, env={"OMP_NUM_THREADS": omp})


# A world rank keeps the threads its earlier runs set (1): a run due to set 1 would pass there
# even if it set nothing, so the auto share of 3 ranks on few cores runs in fresh processes
# (test_three_ranks_share_the_cores); each world run here sets another count (on 2 cores).
ONE = _world("one", 1, "")
OMP = _world("omp", 3, "2")
RUN_THREADS = _world("set", 1, "2", "--set", "run.threads=3")


def stored_threads(out: Path) -> list[int]:
    with h5py.File(out, "r") as f:
        return [int(t) for t in f.attrs["threads"]]


def line_of(log: str) -> str:
    lines = [line.split("mpifl: ", 1)[1] for line in log.splitlines()
             if line.startswith("[rank 0]") and "mpifl: threads" in line]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


def test_one_process_takes_every_core(world):
    log = world.output(ONE)
    assert stored_threads(world.file(ONE)) == [expected_auto(1)]
    assert line_of(log).startswith(f"threads: {expected_auto(1)} (auto: ")


def test_omp_num_threads_and_run_threads_are_honoured(world):
    assert stored_threads(world.file(OMP)) == [2, 2, 2]
    assert line_of(world.output(OMP)) == (
        "threads: 2 a rank (OMP_NUM_THREADS=2 in the environment)")
    assert stored_threads(world.file(RUN_THREADS)) == [3]
    assert line_of(world.output(RUN_THREADS)) == "threads: 3 (run.threads = 3)"
