"""Several nodes on one machine (slurm/local-cluster.sh up --nodes 3: each node a network, UTS,
mount and IPC namespace with its own slurmd), and a hung rank detected by run.peer_timeout_s.

A run across three nodes gives the bits of the same run under mpiexec on one node (same world
size and threads); `down` leaves no namespace, link or daemon behind. A SIGSTOPped worker ends
the whole job within the timeout, the checkpoint stays good, and the resumed run finishes with
the uninterrupted run's results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.helpers import mpiexec, small_fmnist_job, write_fmnist_job
from tests.test_slurm import SCRIPT, free_port_pair

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd, timeout: float = 180, check: bool = True, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                "PYTHONUNBUFFERED": "1", **env})
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "job.toml", small_fmnist_job(
        "nodes", seed=2, rounds=6, eval_every=3, checkpoint_every=3,
        partition='partition = "shards"', algorithm="fedfv"))


@pytest.fixture(scope="module")
def one_node(job) -> Path:
    """The reference: the job on 3 ranks of this machine, under mpiexec."""
    out = job.parent / "one-node.h5"
    run(mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", "run", job, "--out", out, "--no-progress")
    return out


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if re.match(r"mpifl-n\d+\b", line)]


def test_three_nodes_run_like_one_and_leave_nothing_behind(job, one_node, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("namespaces and SLURM daemons need root")
    # short: slurmstepd's unix sockets live under the spool folder (108-byte path limit)
    folder = Path(tempfile.mkdtemp(prefix="mfl-", dir="/tmp"))
    env = dict(MPIFL_SLURM_DIR=str(folder), MPIFL_SLURM_PORT=str(free_port_pair()),
               SLURM_CONF=str(folder / "etc" / "slurm.conf"), MPIFL_PYTHON=sys.executable)
    try:
        up = run("bash", SCRIPT, "up", "--nodes", "3", **env)
        assert "up: 3 nodes" in up.stderr
        nodes = run("sinfo", "-h", "-N", "-o", "%N %t", **env).stdout.split("\n")
        assert sorted(n.split()[0] for n in nodes if n) == ["mpifl-n1", "mpifl-n2", "mpifl-n3"]
        out = tmp_path / "three-nodes.h5"
        run("sbatch", "--wait", "-N", "3", "--ntasks-per-node=1", "--output", tmp_path / "job.out",
            ROOT / "slurm" / "mpifl-run.sbatch", job, out, timeout=240, **env)
        log = (tmp_path / "job.out").read_text()
        assert "ranks on hosts: 0:mpifl-n1, 1:mpifl-n2, 2:mpifl-n3" in log, log[-3000:]
        with h5py.File(out) as a, h5py.File(one_node) as b:
            assert a.attrs["status"] == "complete" and a.attrs["world_size"] == 3
            for key in ("model/global", "eval/client_accuracy", "rounds/selected"):
                np.testing.assert_array_equal(a[key][()], b[key][()], err_msg=key)
    finally:
        run("bash", SCRIPT, "down", check=False, **env)
    assert our_namespaces() == []
    assert subprocess.run(["ip", "link", "show", "mpiflbr0"], capture_output=True).returncode != 0
    daemons = subprocess.run(["pgrep", "-af", str(folder)], capture_output=True, text=True).stdout
    assert daemons.strip() == "", daemons  # no slurmd, slurmctld or munged of this cluster
    shutil.rmtree(folder, ignore_errors=True)


def test_a_hung_worker_ends_the_job_within_the_timeout(job, one_node, tmp_path):
    out = tmp_path / "hung.h5"
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out),
           "--no-progress", "--set", "run.rounds=400", "--set", "run.peer_timeout_s=3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    ckpt = out.with_name(out.name + ".ckpt")
    deadline = time.monotonic() + 120
    while not list(ckpt.glob("round-00000[3-9].h5")) and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [int(p) for p in subprocess.run(["pgrep", "-f", f"^{sys.executable} -m mpifl run .*{out}"],
                                            capture_output=True, text=True).stdout.split()]
    assert len(ranks) == 3, ranks
    # one rank hangs (the newest process: usually a worker; rank 0 hanging is caught the same
    # way, by the workers waiting for its next request)
    os.kill(max(ranks), signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - stopped < 30
    lines = [line for line in err.splitlines() if line.startswith("mpifl: error:")]
    assert lines and "within run.peer_timeout_s = 3 s" in lines[0], err[-2000:]
    # the last checkpoint is good: resumed for 3 more rounds; the first 6 rounds are the
    # reference's (the same job with 6 rounds, uninterrupted)
    with h5py.File(max(ckpt.glob("round-*.h5"))) as f:
        done = int(f.attrs["round"])
    assert done >= 3
    run(mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", "resume", out, "--no-progress",
        "--rounds", str(done + 3), timeout=240)
    with h5py.File(out) as a, h5py.File(one_node) as b:
        assert a.attrs["status"] == "complete"
        np.testing.assert_array_equal(a["rounds/selected"][:6], b["rounds/selected"][()])
        np.testing.assert_array_equal(a["rounds/train_loss"][:6], b["rounds/train_loss"][()])
        assert json.loads(a.attrs["config"])["run"]["peer_timeout_s"] == 3
