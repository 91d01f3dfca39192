"""Several nodes on one machine (slurm/local-cluster.sh up --nodes 3: each node a network, UTS,
mount and IPC namespace with its own slurmd), and a hung rank detected by run.peer_timeout_s.

A run across three nodes gives the bits of the same run on 3 ranks of one node (same world
size and threads); `down` leaves no namespace, link or daemon behind. A node killed mid-run:
the batch node of a template job (requeued, resumed exactly on the 3 nodes left of 4), and a
node of a --no-kill sweep job (finished on the 2 nodes left, on 2 ranks). A SIGSTOPped worker
ends the whole job within the timeout (status 4), the checkpoint stays good, and the resumed run
finishes with the uninterrupted run's results; a rank held before MPI_Init ends the job after
run.init_timeout_s.
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
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.errors import EXIT_PEER_LOST
from tests.world import world_run
from tests.helpers import free_port_pair, mpiexec, small_fmnist_job, write_fmnist_job
from tests.slurm.test_slurm import ONE_NODE_FABRIC, SCRIPT

pytestmark = pytest.mark.slurm  # starts the SLURM cluster: one at a time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def host_environ() -> dict[str, str]:
    """This process's environment without the one-node cluster's loopback-only libfabric
    (tests/slurm/test_slurm.py sets it for the session): these nodes talk over their bridge."""
    return {k: v for k, v in os.environ.items() if k not in ONE_NODE_FABRIC}


def run(*cmd, timeout: float = 180, check: bool = True, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**host_environ(), "OMP_NUM_THREADS": "1",
                                                "PYTHONUNBUFFERED": "1", **env})
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


JOB = small_fmnist_job("nodes", seed=2, rounds=6, eval_every=3, checkpoint_every=3,
                       partition='partition = "shards"', algorithm="fedfv")
#: the lost-node runs: long enough that the node is lost mid-run (a round takes ~0.1 s)
LOST_ROUNDS = ["--set", "run.rounds=45", "--set", "run.peer_timeout_s=5"]
#: the references: the job on 3 ranks of this machine (the shared MPI world, tests/world.py)
ONE_NODE = world_run("nodes-one", ["run", "{dir}/nodes.toml", "--out", "{dir}/nodes-one.h5",
                                   "--no-progress"], files={"nodes.toml": JOB}, for_mpi=True)
LONG_ONE_NODE = world_run("nodes-long-one", ["run", "{dir}/nodes.toml", "--out",
                                             "{dir}/nodes-long-one.h5", "--no-progress",
                                             *LOST_ROUNDS], files={"nodes.toml": JOB},
                          for_mpi=True)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "job.toml", JOB)


@pytest.fixture(scope="module")
def one_node(world) -> Path:
    """The reference: the job on 3 ranks of this machine."""
    return world.file(ONE_NODE)


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if re.match(r"mpifl-n\d+\b", line)]


@contextmanager
def cluster(nodes: int = 3):
    """A local cluster of ``nodes`` namespace nodes, its environment; taken down after, and
    then nothing of it may be left: no namespace, link or daemon."""
    if os.geteuid() != 0:
        pytest.skip("namespaces and SLURM daemons need root")
    # short: slurmstepd's unix sockets live under the spool folder (108-byte path limit)
    folder = Path(tempfile.mkdtemp(prefix="mfl-", dir="/tmp"))
    # no MPIR_CVAR_CH4_NETMOD: the templates choose MPICH's netmod (mpifl/sweep/netmod.py)
    env = dict(MPIFL_SLURM_DIR=str(folder), MPIFL_SLURM_PORT=str(free_port_pair()),
               SLURM_CONF=str(folder / "etc" / "slurm.conf"), MPIFL_PYTHON=sys.executable)
    try:
        up = run("bash", SCRIPT, "up", "--nodes", str(nodes), **env)
        assert f"up: {nodes} nodes" in up.stderr
        yield env
    finally:
        run("bash", SCRIPT, "down", check=False, **env)
    assert our_namespaces() == []
    assert subprocess.run(["ip", "link", "show", "mpiflbr0"], capture_output=True).returncode != 0
    daemons = subprocess.run(["pgrep", "-af", str(folder)], capture_output=True, text=True).stdout
    assert daemons.strip() == "", daemons  # no slurmd, slurmctld or munged of this cluster
    shutil.rmtree(folder, ignore_errors=True)


def test_three_nodes_run_like_one_and_leave_nothing_behind(job, one_node, tmp_path):
    with cluster(3) as env:
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


@pytest.fixture(scope="module")
def long_one_node(world) -> Path:
    """The lost-node runs' reference: their job on 3 ranks of this machine, uninterrupted."""
    return world.file(LONG_ONE_NODE)


def lose_node(out: Path, env: dict[str, str], node: str | None = None) -> str:
    """Once the run ``out`` has a checkpoint, kill every process of ``node`` (default: the
    batch node of the one job in the queue): its slurmd, step daemons and ranks, as if the node
    had crashed. Returns the node's name."""
    ckpt = out.with_name(out.name + ".ckpt")
    deadline = time.monotonic() + 120
    while not list(ckpt.glob("round-*.h5")):
        assert time.monotonic() < deadline, f"no checkpoint of {out} within 120 s"
        time.sleep(0.05)
    node = node or run("squeue", "-h", "-o", "%B", **env).stdout.strip()
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout
    for pid in pids.split():
        os.kill(int(pid), signal.SIGKILL)
    return node


def ranks_on_hosts(log: str) -> list[list[str]]:
    """The hosts of every launch in a job log, rank by rank."""
    return [[h.split(":")[1] for h in line.split(", ")]
            for line in re.findall(r"ranks on hosts: (.*)", log)]


def test_a_lost_batch_node_and_the_requeued_template_job_resumes_exactly(job, long_one_node,
                                                                         tmp_path):
    """The default: the node that runs the batch script (and rank 0) dies; the job ends
    NODE_FAIL, --requeue starts it again on the three nodes left, and it resumes from its
    checkpoint to the uninterrupted run's bits (same world size)."""
    with cluster(4) as env:
        out, log = tmp_path / "lost.h5", tmp_path / "lost.out"
        job_id = run("sbatch", "--parsable", "-N", "3", "--ntasks-per-node=1", "--output", log,
                     ROOT / "slurm" / "mpifl-run.sbatch", job, out, *LOST_ROUNDS,
                     **env).stdout.strip()
        lost = lose_node(out, env)
        deadline = time.monotonic() + 240
        while run("squeue", "-h", "-j", job_id, check=False, **env).stdout.strip():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        text = log.read_text()
        assert f"mpifl job {job_id} (restart 1)" in text, text[-3000:]
        first, *_, last = ranks_on_hosts(text)
        assert first[0] == lost and len(last) == 3 and lost not in last, (first, last)
        assert re.search(r"resuming after round \d+", text), text[-3000:]
        with h5py.File(out) as a, h5py.File(long_one_node) as b:
            assert a.attrs["status"] == "complete" and a.attrs["world_size"] == 3
            for key in ("model/global", "rounds/selected", "rounds/round",
                        "eval/client_accuracy"):
                np.testing.assert_array_equal(a[key][()], b[key][()], err_msg=key)


def test_a_lost_node_and_the_no_kill_sweep_job_finishes_on_the_others(job, long_one_node,
                                                                       tmp_path):
    """``--no-kill`` (``[slurm] additional``): the third node dies, the job goes on on the two
    left, and its next launch resumes there on 2 ranks: the uninterrupted 3-rank run's rounds,
    clients and accuracies, the model to the precision of a change of world size."""
    sweep = tmp_path / "sweep-lost.toml"
    sweep.write_text(f"""
[sweep]
name = "lost"
base = "{job}"
ranks = 3
[set]
"run.rounds" = 45
"run.peer_timeout_s" = 5
[algorithms.fedfv]
[slurm]
nodes = 3
time_min = 10
additional = {{no_kill = true}}
""")
    with cluster(3) as env:
        folder = tmp_path / "sweep"
        proc = subprocess.Popen(
            [sys.executable, "-m", "mpifl", "sweep", str(sweep), "--executor", "slurm", "--out",
             str(folder), "--wait"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**host_environ(), **env, "OMP_NUM_THREADS": "1"})
        runs = folder / "runs"
        deadline = time.monotonic() + 120
        while not list(runs.glob("*.h5")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (out,) = [p for p in runs.glob("*.h5")]
        lose_node(out, env, "mpifl-n3")
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, text[-3000:]
        log = "".join(p.read_text() for p in sorted((folder / "logs").glob("*.out")))
        assert "Node failure on mpifl-n3" in log, log[-3000:]
        assert "nodes (a node was lost): launching 2 ranks on them" in log, log[-3000:]
        assert re.search(r"resuming after round \d+", log), log[-3000:]
        hosts = ranks_on_hosts(log)
        assert hosts[0] == ["mpifl-n1", "mpifl-n2", "mpifl-n3"], hosts
        assert hosts[-1] == ["mpifl-n1", "mpifl-n2"], hosts
        with h5py.File(out) as a, h5py.File(long_one_node) as b:
            assert a.attrs["status"] == "complete" and a.attrs["world_size"] == 2
            for key in ("rounds/selected", "rounds/round", "eval/client_accuracy"):
                np.testing.assert_array_equal(a[key][()], b[key][()], err_msg=key)
            np.testing.assert_allclose(a["model/global"][()], b["model/global"][()], atol=1e-5)
        status = json.loads((folder / "index.json").read_text())
        assert [r["status"] for r in status["runs"].values()] == ["complete"], status


def test_a_hung_worker_ends_the_job_within_the_timeout(job, one_node, tmp_path):
    out = tmp_path / "hung.h5"
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out),
           "--no-progress", "--set", "run.rounds=400", "--set", "run.peer_timeout_s=3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**host_environ(), "OMP_NUM_THREADS": "1"})
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
    assert proc.returncode == EXIT_PEER_LOST and time.monotonic() - stopped < 30, proc.returncode
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


def test_a_rank_held_before_mpi_init_ends_the_job_within_init_timeout(job, tmp_path):
    """run.init_timeout_s bounds MPI_Init: rank 1 is held before it (a plugin module that sleeps
    at import on rank 1, as a rank whose PMI exchange broke would hang), rank 0 waits there for
    it and, after the timeout, its watchdog names rank 1 in one line and ends rank 0 (SIGKILL);
    mpiexec ends rank 1.
    Nothing is written."""
    (tmp_path / "late_rank.py").write_text(
        "import os, time\nif os.environ.get('PMI_RANK') == '1':\n    time.sleep(120)\n")
    late = tmp_path / "late.toml"
    late.write_text(job.read_text()
                    + f'\n[plugins]\nmodules = ["late_rank"]\npath = ["{tmp_path}"]\n')
    out = tmp_path / "late.h5"
    started = time.monotonic()
    proc = run(mpiexec(), "-n", "2", sys.executable, "-m", "mpifl", "run", late, "--out", out,
               "--no-progress", "--set", "run.init_timeout_s=5", timeout=100, check=False)
    took = time.monotonic() - started
    assert proc.returncode != 0 and took < 60, (took, proc.stderr[-2000:])
    assert ("mpifl: error: rank(s) 1 did not reach MPI_Init within run.init_timeout_s = 5 s"
            in proc.stderr and "Traceback" not in proc.stderr), proc.stderr[-2000:]
    assert not out.exists() and not out.with_name(out.name + ".ckpt").exists()
    left = subprocess.run(["pgrep", "-f", str(late)], capture_output=True, text=True).stdout
    assert left.strip() == "", left
