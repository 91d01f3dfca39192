"""SLURM for real: a one-node cluster on this machine (slurm/local-cluster.sh), MPICH's wheel
under ``srun --mpi=pmi2``, jobs/sweep-smoke.toml submitted through submitit, and preemption:
a requeued sweep job and an array-template job stopped as at a time limit both finish with
results identical to the uninterrupted runs.

Needs root and Debian's slurmctld, slurmd and munge (``make slurm-deps``; CI installs them):
without them these tests fail, they never skip. The node's 2 CPUs run one 2-rank job at a
time: about 2.5 minutes on these machines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.helpers import free_port_pair

pytestmark = pytest.mark.slurm  # starts the SLURM cluster: one at a time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "local-cluster.sh"
SMOKE = ROOT / "jobs" / "sweep-smoke.toml"
RUNS = ["fedavg_seed0", "fedavg_seed1", "fedfv_alpha0.1_tau1_seed0", "fedfv_alpha0.1_tau1_seed1"]
ROUNDS = 20  # run.rounds of the smoke sweep
#: libfabric (the netmod srun's ranks use, mpifl/sweep/netmod.py) on the loopback device: its
#: "sockets" provider otherwise takes the newest interface as its NIC, which can be the bridge
#: of tests/slurm/test_multinode.py's nodes, running beside this cluster on another pytest
#: worker; a rank's sends then fail ("OFI call tsenddata failed (default nic=mpiflbr0)") or
#: MPI_Init hangs when that test takes its bridge down (slurm/README.md, "MPI_Init under srun")
ONE_NODE_FABRIC = {"FI_SOCKETS_IFACE": "lo", "FI_TCP_IFACE": "lo"}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "MPIFL_PYTHON": sys.executable}


def sh(*cmd, timeout: float = 120, check: bool = True, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env(),
                          timeout=timeout, cwd=cwd, **kw)
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


def mpifl(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "mpifl", *args, timeout=timeout)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A private one-node SLURM cluster (own folder and ports) for this test session."""
    if os.geteuid() != 0:
        pytest.fail("tests/slurm/test_slurm.py starts SLURM daemons and must run as root")
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch", "srun") if not shutil.which(t)]
    if missing:
        pytest.fail(f"missing {missing}: make slurm-deps (apt-get install slurmctld slurmd munge)")
    folder = tmp_path_factory.mktemp("slurm")
    saved = {k: os.environ.get(k) for k in ("MPIFL_SLURM_DIR", "MPIFL_SLURM_PORT", "SLURM_CONF",
                                            *ONE_NODE_FABRIC)}
    os.environ.update(MPIFL_SLURM_DIR=str(folder), MPIFL_SLURM_PORT=str(free_port_pair()),
                      SLURM_CONF=str(folder / "etc" / "slurm.conf"), **ONE_NODE_FABRIC)
    try:
        sh("bash", SCRIPT, "up")
        yield folder
    finally:
        sh("bash", SCRIPT, "down", check=False)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_local_cluster_is_idempotent_and_runs_mpich_under_srun(cluster):
    again = sh("bash", SCRIPT, "up")
    assert "already up" in again.stderr
    status = sh("bash", SCRIPT, "status").stdout
    assert re.search(r"slurmctld: running .*\n.*slurmd: running", status), status
    for _ in range(3):  # MPICH's UCX has been seen to fail MPI_Init now and then under load
        proc = sh("srun", "--mpi=pmi2", "-n", "2", sys.executable, "-c",
                  "from mpi4py import MPI; c = MPI.COMM_WORLD; print(c.Get_rank(), c.Get_size())",
                  timeout=120, check=False)
        if proc.returncode == 0:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r for r in proc.stdout.split("\n") if r) == ["0 2", "1 2"]


@pytest.fixture(scope="module")
def smoke(cluster, tmp_path_factory):
    """jobs/sweep-smoke.toml submitted through submitit to the cluster and waited for."""
    out = tmp_path_factory.mktemp("smoke")
    start = time.monotonic()
    proc = mpifl("sweep", SMOKE, "--executor", "slurm", "--out", out, "--wait", timeout=420)
    print(f"smoke sweep: {time.monotonic() - start:.0f} s")
    return out, proc


def test_smoke_sweep_through_submitit_gives_four_finished_runs(smoke):
    out, proc = smoke
    index = json.loads((out / "index.json").read_text())
    assert sorted(index["runs"]) == RUNS
    arrays = {run["job_id"].split("_")[0] for run in index["runs"].values()}
    assert len(arrays) == 1, "one job array for the sweep"
    for rid, run in index["runs"].items():
        assert run["status"] == "complete", (rid, run)
        with h5py.File(out / run["results"]) as f:
            assert f.attrs["status"] == "complete"
            assert f.attrs["world_size"] == 2  # srun started 2 MPI ranks
            assert f["rounds/round"].shape == (ROUNDS,)
        log = (out / run["log"]).read_text()
        assert "srun --mpi=pmi2 --ntasks=2" in log and "Job completed successfully" in log
        assert (out / "logs" / f"{run['job_id']}_submitted.pkl").exists()  # submitit's
    assert proc.stdout.count("complete") == 4
    sbatch = next((out / "logs").glob("*_submission.sh")).read_text()
    for line in ("--signal=USR1@60", "--requeue", "--ntasks-per-node=2", "--array=0-3%4"):
        assert line in sbatch, sbatch


TINY = """
[run]
rounds = 4
eval_every = 2
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 6
[model]
name = "logreg"
[server]
algorithm = "fedfv"
clients_per_round = 3
"""


def test_one_run_template(cluster, tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    sh("sbatch", "--wait", "--output", tmp_path / "run.out", ROOT / "slurm" / "mpifl-run.sbatch",
       tmp_path / "tiny.toml", tmp_path / "tiny.h5", "--set", "run.seed=3", timeout=180)
    log = (tmp_path / "run.out").read_text()
    assert "results written to" in log, log[-3000:]
    with h5py.File(tmp_path / "tiny.h5") as f:
        assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 2
        assert json.loads(f.attrs["config"])["run"]["seed"] == 3


def test_a_set_up_failure_on_one_rank_is_not_requeued(cluster, tmp_path):
    """A plugin that raises on rank 1 only ends the run-template job with rank 1's
    line and status 2, once: no retry, no requeue (only status 3 is requeued)."""
    from tests.inprocess.test_setup_agreement import JOB, PLUGIN

    (tmp_path / "setup_faults.py").write_text(PLUGIN)
    (tmp_path / "job.toml").write_text(JOB + f'path = ["{tmp_path}"]\n')
    proc = sh("sbatch", "--wait", "--output", tmp_path / "run.out",
              "--export", "ALL,MPIFL_FAULT=import:raise:1", ROOT / "slurm" / "mpifl-run.sbatch",
              tmp_path / "job.toml", tmp_path / "run.h5", timeout=180, check=False)
    log = (tmp_path / "run.out").read_text()
    assert proc.returncode != 0, log[-3000:]
    assert ("mpifl: error: rank 1: plugins.modules: cannot import 'setup_faults': RuntimeError: "
            "import fails on rank 1 only") in log, log[-3000:]
    assert "requeueing" not in log and "trying again" not in log, log[-3000:]
    assert log.count("mpifl job ") == 1, log[-3000:]  # one start: never requeued
    assert not (tmp_path / "run.h5").exists()


def wait_for_round(ckpt_folder: Path, results: Path, rounds: int, timeout: float = 180) -> int:
    """Poll until a checkpoint after >= ``rounds`` rounds exists; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [int(m.group(1)) for p in (ckpt_folder.glob("round-*.h5") if ckpt_folder.exists() else [])
                if (m := re.match(r"round-(\d+)\.h5$", p.name))]
        if done and max(done) >= rounds:
            assert max(done) < ROUNDS, "the run finished before it could be interrupted"
            return max(done)
        time.sleep(0.1)
    pytest.fail(f"no checkpoint after {rounds} rounds in {ckpt_folder} within {timeout:.0f} s")


def assert_same_results(a: Path, b: Path) -> None:
    with h5py.File(a) as fa, h5py.File(b) as fb:
        assert fa.attrs["status"] == fb.attrs["status"] == "complete"
        for key in ("eval/client_accuracy", "model/global", "eval/round", "rounds/train_loss"):
            assert np.array_equal(fa[key][()], fb[key][()]), key


INTERRUPTIONS = {
    # SLURM ends the job (SIGTERM to every rank) and puts it back in the queue itself
    "scontrol requeue": (["scontrol", "requeue"], ": SLURM requeues or ends it"),
    # only the ranks get SIGTERM; the job requeues itself after they checkpointed (exit 3)
    "SIGTERM to the ranks": (["scancel", "--signal=TERM"], "checkpointed; scontrol requeue {job}: ok"),
}


@pytest.mark.parametrize("how", sorted(INTERRUPTIONS))
def test_interrupted_sweep_job_resumes_to_identical_results(smoke, tmp_path, how):
    ref, _ = smoke
    command, trace = INTERRUPTIONS[how]
    rid, out = "fedfv_alpha0.1_tau1_seed0", tmp_path / "requeue"
    only = ["--only", "server.algorithm=fedfv", "--only", "run.seed=0"]
    mpifl("sweep", SMOKE, "--executor", "slurm", "--out", out, *only)
    job = json.loads((out / "index.json").read_text())["runs"][rid]["job_id"]
    results = out / "runs" / f"{rid}.h5"
    wait_for_round(results.with_name(results.name + ".ckpt"), results, 5)
    sh(*command, job)
    done = mpifl("sweep", SMOKE, "--executor", "slurm", "--out", out, *only, "--wait", timeout=300)
    assert f"{rid}  complete" in done.stdout
    run = json.loads((out / "index.json").read_text())["runs"][rid]
    assert run["job_id"] == job, "the same job, requeued (not a new submission)"
    log = (out / run["log"]).read_text()
    assert trace.format(job=job) in log, log[-3000:]
    # requeued = the same job id started twice (slurmstepd's "DUE TO JOB REQUEUE" line is only
    # written when the batch step is still running at the requeue, a race)
    assert log.count(f"Starting with JobEnvironment(job_id={job},") == 2, log[-3000:]
    # SLURM's SIGTERM to the ranks and the job's forwarded SIGUSR1 race: either starts the stop
    assert re.search(r"stop requested \((SIGTERM|SIGUSR1)\)", log), log[-3000:]
    assert re.search(r"resuming after round \d+", log), log[-3000:]
    assert_same_results(results, ref / "runs" / f"{rid}.h5")


def test_array_template_checkpoints_and_requeues_at_the_time_limit(smoke, tmp_path):
    ref, _ = smoke
    rid, out = "fedavg_seed1", tmp_path / "array"
    listing = mpifl("sweep", SMOKE, "--out", out, "--print-args", "--only", "server.algorithm=fedavg",
                    "--only", "run.seed=1").stdout
    (tmp_path / "runs.txt").write_text(listing)
    job = sh("sbatch", "--parsable", "--array=0-0", "--output", tmp_path / "array-%A_%a.out",
             ROOT / "slurm" / "mpifl-array.sbatch", tmp_path / "runs.txt").stdout.strip()
    results = out / "runs" / f"{rid}.h5"
    wait_for_round(results.with_name(results.name + ".ckpt"), results, 5)
    # what --signal=B:USR1@120 does before the time limit: SIGUSR1 to the batch script
    sh("scancel", "--batch", "--signal=USR1", f"{job}_0")
    deadline = time.monotonic() + 300
    while sh("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip():
        assert time.monotonic() < deadline, "array job still in the queue after 300 s"
        time.sleep(1)
    log = (tmp_path / f"array-{job}_0.out").read_text()
    assert "stop requested (SIGUSR1)" in log and "requeueing" in log, log[-3000:]
    assert "restart 1" in log and re.search(r"resuming after round \d+", log), log[-3000:]
    assert_same_results(results, ref / "runs" / f"{rid}.h5")
