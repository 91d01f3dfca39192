"""How many torch (OpenMP) and BLAS threads each rank uses.

torch starts one thread per core it sees; under ``mpiexec -n 3`` on 2 cores every rank then
runs 2 threads on the same 2 cores, and they take turns (the main job: 3-4x the time; the
million-client job: 49 s a round against 27 s with one thread a rank; docs/BENCHMARKS.md
"Threads per rank under plain mpiexec"). So each rank takes its share of the cores it may use,
once, at set-up:

* ``run.threads`` > 0: that many (the job's own choice);
* else ``OMP_NUM_THREADS`` in the environment (the user's choice; the SLURM templates set it);
* else (auto) the cores this process may use — its CPU affinity, the cgroup's CPU quota,
  ``SLURM_CPUS_ON_NODE`` / ``SLURM_CPUS_PER_TASK`` under SLURM — divided among the ranks that
  share them, at least 1.

Floating-point sums split over threads round differently, so a run is bit-identical only on
the same thread count (docs/explanation/concepts.md, "Reproducibility"); the count is stored in
the results file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpifl.runtime.installs import rank_ranges

#: cgroup v2 mounts the hierarchy here; v1 puts the CPU controller under cpu/ (or cpu,cpuacct/)
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Cores:
    """The CPUs this process may use, as the OS and the batch system say.

    Attributes:
        affinity: CPUs in this process's affinity mask (``os.sched_getaffinity``).
        quota: the cgroup's CPU quota in CPUs (quota / period; None: no quota), shared by every
            rank in the cgroup (this node's ranks).
        slurm_on_node: ``SLURM_CPUS_ON_NODE``, the job's CPUs on this node (None: not set).
        slurm_per_task: ``SLURM_CPUS_PER_TASK``, CPUs each task asked for (None: not set).
    """

    affinity: int
    quota: float | None = None
    slurm_on_node: int | None = None
    slurm_per_task: int | None = None


@dataclass(frozen=True)
class Threads:
    """The thread count of one rank and why (one phrase, for the log)."""

    count: int
    why: str


def decide_threads(requested: int, omp_env: str | None, cores: Cores, ranks_on_node: int,
                   ranks_sharing: int) -> Threads:
    """Threads for one rank.

    Args:
        requested: ``run.threads`` (0: decide).
        omp_env: ``OMP_NUM_THREADS`` as set in the environment (None: not set); its first
            positive integer counts ("4" or OpenMP's nested "4,2"), anything else is ignored.
        cores: the CPUs this process may use.
        ranks_on_node: ranks on this node (sharing the cgroup quota and SLURM's node CPUs).
        ranks_sharing: ranks on this node whose affinity masks overlap this one's, this one
            included (all of them when the launcher binds nothing; 1 when each rank is bound
            to its own cores).

    Returns:
        At least 1 thread; in auto mode never more than this rank's share of any limit.
    """
    if requested > 0:
        return Threads(requested, f"run.threads = {requested}")
    omp = (omp_env or "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return Threads(int(omp), f"OMP_NUM_THREADS={omp} in the environment")
    on_node, sharing = max(1, ranks_on_node), max(1, ranks_sharing)
    here = f"{_ranks(on_node)} on this node"
    shares = [(cores.affinity // sharing,
               f"{cores.affinity} CPUs in the affinity mask / {_ranks(sharing)} sharing them")]
    if cores.quota is not None:
        shares.append((math.floor(cores.quota) // on_node,
                       f"cgroup CPU quota {cores.quota:g} / {here}"))
    if cores.slurm_on_node is not None:
        shares.append((cores.slurm_on_node // on_node,
                       f"SLURM_CPUS_ON_NODE={cores.slurm_on_node} / {here}"))
    if cores.slurm_per_task is not None:
        shares.append((cores.slurm_per_task, f"SLURM_CPUS_PER_TASK={cores.slurm_per_task}"))
    count, why = min(shares, key=lambda s: s[0])
    return Threads(max(1, count), f"auto: {why}")


def threads_line(chosen: list[tuple[int, str]]) -> str:
    """Rank 0's log line from every rank's ``(threads, why)``, rank r at index r."""
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, choice in enumerate(chosen):
        groups.setdefault((choice[0], choice[1]), []).append(rank)
    if len(groups) == 1:
        (count, why), = groups
        return f"threads: {count} {'a rank ' if len(chosen) > 1 else ''}({why})"
    return "threads a rank: " + "; ".join(
        f"{count} on rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} ({why})"
        for (count, why), ranks in groups.items())


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def usable_cores(environ: Mapping[str, str] = os.environ) -> Cores:
    """This process's :class:`Cores`, read from the OS and the environment."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    return Cores(affinity, cgroup_quota(), _positive(environ.get("SLURM_CPUS_ON_NODE")),
                 _positive(environ.get("SLURM_CPUS_PER_TASK")))


def cgroup_quota() -> float | None:
    """The smallest CPU quota (CPUs) on this process's cgroup path, v2 or v1; None: no quota
    (or no cgroup file system)."""
    quotas = []
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: cpu.max "quota period" or "max period" on every level
            for folder in _ancestors(_CGROUP, path):
                quotas.append(_ratio(*(_read(folder / "cpu.max").split() + ["", ""])[:2]))
        elif "cpu" in controllers.split(","):  # v1
            for folder in _ancestors(_CGROUP / controllers, path):
                quotas.append(_ratio(_read(folder / "cpu.cfs_quota_us"),
                                     _read(folder / "cpu.cfs_period_us")))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/path`` and each folder above it up to ``root`` (a limit anywhere above applies)."""
    parts = [p for p in path.strip().split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = float(quota), float(period)
    except ValueError:  # "max", missing file
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _positive(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() and int(text) > 0 else None


def node_ranks(comm: Any) -> tuple[int, int]:
    """``(ranks on this node, ranks on this node whose CPU affinity overlaps this rank's)``.
    Collective over ``comm`` (None: one process, ``(1, 1)``)."""
    if comm is None:
        return 1, 1
    mine = _affinity_mask()
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.Get_rank())
    try:
        masks = node.allgather(mine)
        return node.Get_size(), sum(1 for m in masks if m & mine)
    finally:
        node.Free()


def _affinity_mask() -> int:
    """This process's CPUs as a bit mask (every CPU when the OS does not say)."""
    cpus: set[int] | range
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = range(os.cpu_count() or 1)
    return sum(1 << c for c in cpus)


def apply_threads(count: int) -> None:
    """Set torch's intra-op and inter-op threads and the BLAS libraries' (numpy's OpenBLAS:
    :func:`mpifl.aggregators.gram.gram`) to ``count``, for the rest of the process. Torch's
    inter-op pool can be sized only before its first use: then it stays as it was."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(count)
    except RuntimeError:  # already used or set once in this process (a second run in-process)
        pass
    threadpool_limits(limits=count, user_api="blas")
