"""The SLURM launcher: a sweep's runs as one submitit job array, and the squeue queries that
tell which of its jobs are still queued or running.

Every point is one job of ``ranks`` tasks that starts ``srun --mpi=pmi2 python -m mpifl run
BASE --out DIR/runs/ID.h5 --resume --set ...``; at most ``array_parallelism`` of the array run at
once. The jobs ask for ``--signal=USR1@signal_delay_s`` and are requeueable (see
:mod:`mpifl.sweep.job`).
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import subprocess
import time

from mpifl.core.errors import MpiflError
from mpifl.sweep.job import MpiRun
from mpifl.sweep.launch.base import Launcher
from mpifl.sweep.plan import RunState, count_statuses

log = logging.getLogger(__name__)

#: How long ``scontrol ping`` may take before the controller counts as not answering.
PING_TIMEOUT_S = 10.0

_VERDICT = re.compile(r"\b(is|are) (UP|DOWN)\b")

# squeue states of a job that is over (anything else is still queued, running or requeueing)
_OVER = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


class SlurmLauncher(Launcher):
    """Submits to SLURM; preferred by ``--executor auto`` where sbatch is on PATH and a
    SLURM controller answers."""

    name = "slurm"
    requeues = True

    @classmethod
    def fit(cls) -> tuple[int, str]:
        if shutil.which("sbatch") is None:
            return 0, "sbatch not found (no SLURM here)"
        up, answer = controller()
        if up:
            return 2, f"sbatch found and the SLURM controller answers: {answer}"
        note = "" if "SLURM_CONF" in answer else f" ({_conf_note()})"
        return 0, f"sbatch found but no SLURM controller answers: {answer}{note}"

    @classmethod
    def require(cls) -> None:
        """Check that sbatch is here and a controller answers, before anything is written.

        Raises:
            MpiflError: not so (one line: what was found, and what to do).
        """
        score, why = cls.fit()
        if score == 0:
            raise MpiflError(f"--executor slurm: {why}; start SLURM (on this machine: "
                             "slurm/local-cluster.sh up) or use --executor local")

    def prefix(self) -> list[str]:
        return ["srun", f"--mpi={self.sweep.slurm.srun_mpi}", f"--ntasks={self.sweep.ranks}",
                "--kill-on-bad-exit=1"]

    def _start(self, runs: list[RunState], jobs: list[MpiRun]) -> None:
        """Submit the jobs as one array; each run is then queued with its job id.

        Raises:
            MpiflError: no sbatch here, or sbatch refused the jobs (its message, one line).
        """
        ex = self.executor()
        try:
            submitted = ex.submit_array(jobs)
        except Exception as exc:  # noqa: BLE001 -- submitit: CalledProcessError and others
            detail = getattr(exc, "stderr", None) or getattr(exc, "output", None) or exc
            text = detail.decode() if isinstance(detail, bytes) else str(detail)
            raise MpiflError(f"sbatch failed: {' '.join(text.split())[:300]}") from None
        for r, job in zip(runs, submitted):
            r.job_id, r.status, r.error = job.job_id, "queued", None
            r.log = os.path.relpath(job.paths.stdout, self.folder)

    def executor(self):
        """A submitit SlurmExecutor for the sweep's jobs: ``ranks`` tasks (each one MPI rank,
        started by the job's own ``srun``), ``threads`` CPUs per task, USR1 before the time
        limit, requeueable (also after a lost node), at most ``array_parallelism`` array jobs at
        once. ``additional = {no_kill = true}`` keeps a job that lost a node running on the
        others, where :class:`MpiRun` launches again on fewer ranks.

        Raises:
            MpiflError: no SLURM commands on this machine.
        """
        import submitit

        if shutil.which("sbatch") is None:
            raise MpiflError("--executor slurm: sbatch not found (no SLURM here; try --executor "
                             "local, or slurm/local-cluster.sh up)")
        s, sweep = self.sweep.slurm, self.sweep
        ex = submitit.SlurmExecutor(folder=self.folder / "logs", max_num_timeout=1000)
        params = {"job_name": f"mpifl-{sweep.name}", "nodes": s.nodes,
                  "ntasks_per_node": sweep.ranks // s.nodes, "cpus_per_task": sweep.threads,
                  "time": s.time_min, "use_srun": False,
                  "array_parallelism": s.array_parallelism,
                  "signal_delay_s": s.signal_delay_s, "stderr_to_stdout": True,
                  "additional_parameters": {"signal": f"USR1@{s.signal_delay_s}",
                                            "requeue": True, **s.additional}}
        for key in ("partition", "account", "qos", "constraint", "gpus_per_node", "setup"):
            if getattr(s, key) is not None:
                params[key] = getattr(s, key)
        if s.mem_gb is not None:
            params["mem"] = f"{int(s.mem_gb)}GB"
        ex.update_parameters(**params)
        return ex

    def wait(self, runs: dict[str, RunState], timeout_s: float | None = None,
             poll_s: float = 2.0) -> None:
        """Block until none of the runs' jobs is queued, running or requeueing.

        Raises:
            MpiflError: ``timeout_s`` passed first.
        """
        start, last = time.monotonic(), 0.0
        ids = [r.job_id for r in runs.values() if r.job_id]
        while live := _states_retrying(ids):
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise MpiflError(f"sweep: still {len(live)} job(s) in SLURM after "
                                 f"{timeout_s:.0f} s")
            if time.monotonic() - last > 60:
                log.info("waiting for %d job(s): %s", len(live), count_statuses(live.values()))
                last = time.monotonic()
            time.sleep(poll_s)


def controller(timeout_s: float = PING_TIMEOUT_S) -> tuple[bool, str]:
    """Whether a SLURM controller answers, and what said so: ``scontrol ping`` (read from its
    output, as SLURM exits 1 when only a backup controller is down), at most ``timeout_s``.

    scontrol finds the controller in ``$SLURM_CONF`` (else its built-in slurm.conf path, else a
    DNS SRV record); a ``$SLURM_CONF`` that is no file is told at once (scontrol would retry
    reading it for a minute).
    """
    conf = os.environ.get("SLURM_CONF")
    if conf == "":
        return False, "SLURM_CONF is set but empty"
    if conf is not None and not os.path.isfile(conf):
        return False, f"SLURM_CONF={conf} is not a file"
    if shutil.which("scontrol") is None:
        return False, "scontrol not found on PATH, so nothing can ask the controller"
    try:
        proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True,
                              timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"scontrol ping: no answer within {timeout_s:g} s"
    except OSError as exc:
        return False, f"scontrol ping: {exc}"
    # "Slurmctld(primary) at HOST is UP", one line per controller (primary, backups)
    said = [line.strip() for line in proc.stdout.splitlines() if _VERDICT.search(line)]
    up = proc.returncode == 0 or any((v := _VERDICT.search(line)) is not None and v[2] == "UP"
                                          for line in said)
    if not said:  # no verdict: scontrol's own last error ("fatal: Could not establish ...")
        errors = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        said = [errors[-1].removeprefix("scontrol: ")] if errors else [
            f"exit status {proc.returncode}"]
    return up, "scontrol ping: " + ", ".join(said)


def _conf_note() -> str:
    """Which slurm.conf names the controller, for a message."""
    conf = os.environ.get("SLURM_CONF")
    return f"SLURM_CONF={conf}" if conf else "SLURM_CONF unset: SLURM's default slurm.conf"


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """``job id -> squeue state`` for those of ``job_ids`` that are not over yet (queued,
    running, completing, requeueing). ``{}`` on a machine without SLURM.

    Raises:
        MpiflError: squeue is there but fails (controller down): the sweep cannot tell which
            jobs are still queued, and would otherwise submit them twice.
    """
    if not job_ids or shutil.which("squeue") is None:
        return {}
    user = pwd.getpwuid(os.getuid()).pw_name
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-u", user, "-o", "%i|%T"],
                              capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpiflError(f"squeue failed: {exc}") from None
    if proc.returncode != 0:
        raise MpiflError(f"squeue failed: {' '.join(proc.stderr.split())[:200]} "
                         "(is the SLURM controller up? SLURM_CONF?)")
    states = dict(line.split("|", 1) for line in proc.stdout.split() if "|" in line)
    wanted = set(job_ids)
    return {j: s for j, s in states.items() if j in wanted and s not in _OVER}


def live_states(runs: dict[str, RunState]) -> dict[str, str]:
    """The live SLURM states of the runs' recorded jobs (for :func:`mpifl.sweep.status.refresh`)."""
    return slurm_states([r.job_id for r in runs.values() if r.job_id])


def _states_retrying(ids: list[str], tries: int = 5) -> dict[str, str]:
    """:func:`slurm_states`, trying again for a while when squeue fails (a busy controller)."""
    for attempt in range(tries):
        try:
            return slurm_states(ids)
        except MpiflError:
            if attempt == tries - 1:
                raise
            time.sleep(10)
    return {}
