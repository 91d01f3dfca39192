"""One run as a job: :class:`MpiRun`, what submitit pickles and runs in the batch script.

Preemption and time limits: SLURM jobs ask for ``--signal=USR1@signal_delay_s`` and are
requeueable. mpifl's ranks checkpoint at the end of the round on SIGUSR1/SIGTERM and exit with
status 3; the job then requeues itself (``scontrol requeue``) unless SLURM is already requeueing
or cancelling it, and the requeued job resumes from the checkpoint.

Queued jobs pickled by older versions name ``mpifl.sweep.MpiRun``: the package re-exports it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from mpifl.core.errors import EXIT_BAD_INPUT
from mpifl.runtime.signals import EXIT_CHECKPOINTED
from mpifl.sweep.allocation import allocated_nodes, job_state, reshaped, srun_shape
from mpifl.sweep.netmod import srun_env


@dataclass
class MpiRun:
    """The job of one sweep point: launch ``mpifl run --resume`` on all ranks, requeue on stop.

    Called by submitit in the job (one process, not under srun). ``argv`` is the full launch
    command (``srun --mpi=pmi2 ...`` or ``mpiexec -n N ...``). SIGTERM, SIGUSR1 and SIGUSR2
    received by this process are passed on to the ranks as SIGUSR1 (srun would turn a SIGTERM
    into killing the step); the ranks checkpoint and exit with status 3.

    A launch that fails otherwise (status not 0, 2 or 3; e.g. 4, a rank that stopped answering,
    or a failed MPI_Init) is tried again, up to ``launches`` times in all, while the job is
    still running: ``--resume`` continues where it stopped.
    In a job submitted with ``--no-kill`` (``[slurm] additional = {no_kill = true}``) a lost
    node leaves the job running on the others, and the next launch starts as many ranks per
    node on the nodes that remain (:func:`srun_shape`), fewer ranks in all.

    Returns:
        ``{"id", "status": "complete" | "checkpointed", "results"}``.

    Raises:
        RuntimeError: ``mpifl run`` failed (status other than 0 and 3); see the job's log.
    """

    id: str
    argv: list[str]
    results: str
    env: dict[str, str]
    slurm: bool

    launches: int = 3
    retry_wait_s: float = 5.0

    def __call__(self) -> dict[str, str]:
        for attempt in range(1, self.launches + 1):
            argv = _fit_to_allocation(self.argv) if self.slurm else self.argv
            _say(f"{self.id}: {shlex.join(argv)}")
            env = {**os.environ, **self.env}
            rc = _run_forwarding(argv, {**env, **srun_env(env)} if self.slurm else env)
            if rc in (0, EXIT_BAD_INPUT, EXIT_CHECKPOINTED) or attempt == self.launches \
                    or not _may_retry():
                break
            _say(f"{self.id}: launch {attempt} failed with status {rc}; trying again (--resume)")
            time.sleep(self.retry_wait_s)
        if rc == 0:
            return {"id": self.id, "status": "complete", "results": self.results}
        if rc != EXIT_CHECKPOINTED:
            raise RuntimeError(f"{self.id}: mpifl run exited with status {rc}")
        if self.slurm:
            _requeue_self(self.id)
        return {"id": self.id, "status": "checkpointed", "results": self.results}


def thread_env(threads: int) -> dict[str, str]:
    """The environment of every rank: ``threads`` torch/BLAS threads, unbuffered output (so
    the job's log shows each line as it happens)."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


def _fit_to_allocation(argv: list[str]) -> list[str]:
    """``argv`` (``srun ...``) with its node and task counts fitted to the job's nodes now."""
    job = os.environ.get("SLURM_JOB_ID")
    shape = srun_shape(allocated_nodes(job)) if job and argv[:1] == ["srun"] else []
    if shape:
        _say(f"the job has {shape[0].split('=')[1]} of its "
             f"{os.environ.get('SLURM_JOB_NUM_NODES')} nodes (a node was lost): launching "
             f"{shape[1].split('=')[1]} ranks on them")
    return reshaped(argv, shape)


def _may_retry() -> bool:
    """Whether to launch again after a failure: not when SLURM is ending this job. (MPICH's
    wheel under ``srun --mpi=pmi2`` has been seen to fail in MPI_Init now and then, with
    "UCX ERROR failed to unpack address"; a new launch works and resumes the run.)"""
    job = os.environ.get("SLURM_JOB_ID")
    return job is None or job_state(job) in (None, "RUNNING")


def _run_forwarding(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv``, passing SIGTERM/SIGUSR1/SIGUSR2 on to it as SIGUSR1 (checkpoint and stop)."""
    proc = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        _say(f"got {signal.Signals(signum).name}: asking the ranks to checkpoint")
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _requeue_self(run_id: str) -> None:
    """Requeue this SLURM job unless SLURM is already ending it (requeue, cancel, preemption),
    then leave without a result: the requeued job resumes from the checkpoint."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        return
    state = job_state(job)
    if state in (None, "RUNNING"):
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              check=False)
        _say(f"{run_id}: checkpointed; scontrol requeue {job}: "
             + ("ok" if done.returncode == 0 else done.stderr.strip()))
    else:
        _say(f"{run_id}: checkpointed; job {job} is {state}: SLURM requeues or ends it")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no submitit result: the job is not over


def _say(text: str) -> None:
    """A line in the job's log (submitit's process has no logging set up)."""
    print(f"[mpifl sweep {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
