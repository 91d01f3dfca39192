"""A running SLURM job as ``scontrol`` shows it (its state, the nodes it still has) and the srun
shape that fits its ranks onto those nodes.

In a job submitted with ``--no-kill`` SLURM drops a lost node from the allocation and the job
keeps running, and the next launch must ask srun for the nodes that remain (an srun that asks
for the original count is refused). Without it (the default) the job ends NODE_FAIL and is
requeued, and these functions change nothing.
``python -m mpifl.sweep.allocation shape`` prints those srun options for the sbatch templates;
:class:`mpifl.sweep.job.MpiRun` calls :func:`srun_shape` itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
import subprocess
import sys


def srun_shape(nodes_now: int | None, env: Mapping[str, str] | None = None) -> list[str]:
    """srun options that fit the job's ranks onto the nodes it still has.

    A job submitted with ``--no-kill`` keeps running when one of its nodes is lost: SLURM
    drops the node from the allocation, and an srun that asks for the original node count is
    refused. The next launch then keeps the ranks per node and uses every node left, so the
    run resumes from its checkpoint on fewer ranks (results to the precision of a change of
    world size, docs/guides/resume.md).

    Args:
        nodes_now: the allocation's node count now (``NumNodes`` of ``scontrol show job``), or
            None when unknown.
        env: the job's environment (default ``os.environ``): ``SLURM_JOB_NUM_NODES`` (the
            nodes the job started with), ``SLURM_NTASKS_PER_NODE`` or ``SLURM_NTASKS``.

    Returns:
        ``[]`` when the job still has all its nodes (or this is not a SLURM job), else
        ``["--nodes=N", "--ntasks=N*K", "--overlap"]`` with K the ranks per node it started
        with.
    """
    env = os.environ if env is None else env
    started = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "0")) or 0)
    if not nodes_now or not started or nodes_now >= started:
        return []
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():
        k = int(per_node)
    else:  # sbatch -n without --ntasks-per-node: the tasks per node it started with
        k = max(1, int(env.get("SLURM_NTASKS", started)) // started)
    # --overlap: the step of the launch that lost the node is never completed by SLURM 22.05
    # (its lost node cannot report), holds its CPUs on the remaining nodes until the job ends,
    # and a new step that does not overlap it waits for them forever
    return [f"--nodes={nodes_now}", f"--ntasks={nodes_now * k}", "--overlap"]


def reshaped(argv: list[str], shape: list[str]) -> list[str]:
    """``argv`` (``srun ...``) with its node and task counts replaced by ``shape``
    (:func:`srun_shape`); ``argv`` itself when ``shape`` is empty.

    Raises:
        ValueError: ``shape`` given for a command that is not ``srun``.
    """
    if not shape:
        return argv
    if argv[:1] != ["srun"]:
        raise ValueError(f"only an srun launch can be fitted to the job's nodes, not {argv[:1]}")
    drop = ("--ntasks=", "--nodes=", "--overlap")
    return [argv[0], *shape, *(a for a in argv[1:] if not a.startswith(drop))]


def job_state(job_id: str) -> str | None:
    """JobState of one SLURM job (None when unknown): how the job learns whether SLURM itself
    is ending it."""
    return _job_field(job_id, "JobState")


def allocated_nodes(job_id: str) -> int | None:
    """NumNodes of a running SLURM job now (None when unknown); less than it started with
    after a node of a ``--no-kill`` job was lost."""
    nodes = _job_field(job_id, "NumNodes")
    return int(nodes) if nodes and nodes.isdigit() else None


def _job_field(job_id: str, key: str) -> str | None:
    """One ``key=value`` field of ``scontrol show job -o JOB`` (None when unknown)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else None


if __name__ == "__main__":  # the sbatch templates: `python -m mpifl.sweep.allocation shape`
    if sys.argv[1:] != ["shape"]:
        print("usage: python -m mpifl.sweep.allocation shape  (the srun options for this job's "
              "nodes now)", file=sys.stderr)
        sys.exit(2)
    job_id = os.environ.get("SLURM_JOB_ID")
    print(*srun_shape(allocated_nodes(job_id) if job_id else None))
