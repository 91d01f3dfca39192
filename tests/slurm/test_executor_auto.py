"""``mpifl sweep`` without ``--executor`` (``auto``) when a SLURM controller answers: a
one-node cluster of this module's own (slurm/local-cluster.sh, own folder and ports), to which
the sweep goes. It needs the real cluster (slurmctld, slurmd, munge; root) and runs one at a
time. The cases without a controller are tests/inprocess/test_executor_auto.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import h5py
import pytest

from tests.helpers import free_port_pair
from tests.inprocess.test_executor_auto import env_with, mpifl, write_sweep
from tests.inprocess.test_executor_auto import slurm_commands  # noqa: F401 (autouse fixture)
from tests.slurm.test_slurm import ONE_NODE_FABRIC, SCRIPT


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory):
    """The environment of a private one-node SLURM cluster (own folder and ports), up for this
    module; os.environ is left alone."""
    if os.geteuid() != 0:
        pytest.fail("the SLURM cluster of tests/slurm/test_executor_auto.py needs root")
    missing = [t for t in ("slurmctld", "slurmd", "munged", "srun") if not shutil.which(t)]
    if missing:
        pytest.fail(f"missing {missing}: make slurm-deps (apt-get install slurmctld slurmd munge)")
    folder = tmp_path_factory.mktemp("slurm-auto")
    env = env_with(str(folder / "etc" / "slurm.conf"), MPIFL_SLURM_DIR=str(folder),
                   MPIFL_SLURM_PORT=str(free_port_pair()), **ONE_NODE_FABRIC)

    def sh(*args, check=True):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                              env=env, timeout=120)
        assert proc.returncode == 0 or not check, proc.stdout[-2000:] + proc.stderr[-3000:]

    try:
        sh("up")
        yield env
    finally:
        sh("down", check=False)


@pytest.mark.slurm
def test_auto_submits_to_slurm_when_the_controller_answers(cluster_env, tmp_path):
    path, out = write_sweep(tmp_path / "files"), tmp_path / "out"
    submitted = mpifl(cluster_env, "sweep", path, "--out", out, timeout=120)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-3000:]
    assert ("executor: slurm (sbatch found and the SLURM controller answers: scontrol ping: "
            "Slurmctld(primary) at ") in submitted.stderr, submitted.stderr[-3000:]
    job = json.loads((out / "index.json").read_text())["runs"]["fedavg_seed0"]["job_id"]
    assert job, "submitted to SLURM: a job id"
    done = mpifl(cluster_env, "sweep", path, "--out", out, "--wait", timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "executor: slurm (" in done.stderr
    run = json.loads((out / "index.json").read_text())["runs"]["fedavg_seed0"]
    assert run["status"] == "complete" and run["job_id"] == job, run
    log = (out / run["log"]).read_text()
    assert "srun --mpi=pmi2 --ntasks=2" in log, log[-3000:]
    with h5py.File(out / run["results"]) as f:
        assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 2
    again = mpifl(cluster_env, "sweep", path, "--out", out, "--executor", "slurm", timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]  # the controller answers: no refusal
    assert "executor:" not in again.stderr and "1 runs (1 complete); starting 0" in again.stderr
