"""``mpifl sweep`` without ``--executor`` (``auto``) the way a user meets it: Debian's real
``sbatch`` and ``scontrol`` on PATH, and either no SLURM controller (a slurm.conf whose
controller is not running, or no slurm.conf at all) or a running one-node cluster
(slurm/local-cluster.sh).

No controller: the sweep runs here, and its log says why in one line; ``--executor slurm``
stops with exit status 2 and one line, before anything is written. A controller that answers:
the sweep goes to SLURM. Needs Debian's slurmctld, slurmd and munge (``make slurm-deps``) and,
for the cluster, root: without them these tests fail, they never skip.

Every command gets its own ``SLURM_CONF`` (or none), so a cluster that tests/slurm/test_slurm.py
started in this session (its fixture exports ``SLURM_CONF``) does not leak into the
"no controller" cases. The test with a running cluster is in tests/slurm/test_executor_auto.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from tests.helpers import free_port_pair, mpiexec

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONF = Path("/etc/slurm/slurm.conf")  # Debian's slurm-client default

BASE = """
[run]
name = "tiny"
rounds = 4
eval_every = 2
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 6
[model]
name = "logreg"
[client]
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 3
"""

SWEEP = """
[sweep]
name = "tiny"
base = "base.toml"
ranks = 2
[grid]
"run.seed" = [0]
[algorithms.fedavg]
[slurm]
time_min = 10
[local]
mpiexec = "{mpiexec}"
"""


@pytest.fixture(scope="module", autouse=True)
def slurm_commands():
    missing = [t for t in ("sbatch", "scontrol") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing {missing}: make slurm-deps (apt-get install slurmctld slurmd munge)")


def write_sweep(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.toml").write_text(BASE)
    path = folder / "sweep.toml"
    path.write_text(SWEEP.replace("{mpiexec}", mpiexec()))
    return path


def env_with(conf: str | None, **extra: str) -> dict[str, str]:
    """This process's environment with ``SLURM_CONF=conf`` (``None``: unset). No
    OMP_NUM_THREADS: GNU nproc obeys it, and local-cluster.sh sizes its node with nproc."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "OMP_NUM_THREADS")}
    env.update(PYTHONUNBUFFERED="1", MPIFL_PYTHON=sys.executable, **extra)
    if conf is not None:
        env["SLURM_CONF"] = conf
    return env


def mpifl(env: dict[str, str], *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpifl", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def down_conf(folder: Path) -> Path:
    """A slurm.conf like local-cluster.sh's whose controller (on a free port) is not running."""
    port = free_port_pair()
    host = socket.gethostname().split(".")[0]
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(f"""ClusterName=nocontroller
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={port}
SlurmdPort={port + 1}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket.2
SlurmUser=root
NodeName={host} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


#: No controller: how SLURM_CONF is set, and what scontrol ping's answer must say.
NO_CONTROLLER = {
    "controller down": ("down", " is DOWN (SLURM_CONF="),
    # the case: sbatch installed, no slurm.conf at all (scontrol tries DNS SRV, fails)
    "no slurm.conf": (None, "scontrol ping: fatal: Could not establish a configuration source"),
    "SLURM_CONF names no file": ("missing", "is not a file"),
}


def no_controller_env(case: str, tmp_path: Path) -> dict[str, str]:
    how, _ = NO_CONTROLLER[case]
    if how is None:
        if DEFAULT_CONF.exists():
            pytest.skip(f"{DEFAULT_CONF} exists: this machine has a SLURM config of its own")
        return env_with(None)
    if how == "missing":
        return env_with(str(tmp_path / "nowhere" / "slurm.conf"))
    return env_with(str(down_conf(tmp_path / "slurm")))


def test_ping_of_a_stopped_controller_is_quick(tmp_path, monkeypatch):
    from mpifl.sweep.launch.slurm import controller

    monkeypatch.setenv("SLURM_CONF", str(down_conf(tmp_path)))
    start = time.monotonic()
    up, answer = controller()
    assert not up and answer.endswith(" is DOWN"), answer
    assert time.monotonic() - start < 3.0  # connection refused: no 10 s timeout


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(NO_CONTROLLER))
def test_auto_runs_here_without_a_controller_and_says_why(tmp_path, case):
    env = no_controller_env(case, tmp_path)
    out = tmp_path / "out"
    start = time.monotonic()
    proc = mpifl(env, "sweep", write_sweep(tmp_path / "files"), "--out", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "executor:" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "executor: local (sbatch found but no SLURM controller answers: " in lines[0], lines
    assert NO_CONTROLLER[case][1] in lines[0], lines
    assert "sbatch: error" not in proc.stderr and "resolve_ctls" not in proc.stderr
    run = json.loads((out / "index.json").read_text())["runs"]["fedavg_seed0"]
    assert run["status"] == "complete" and run["job_id"] is None, run
    with h5py.File(out / run["results"]) as f:
        assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 2  # mpiexec -n 2
    assert "fedavg_seed0  complete" in proc.stdout
    print(f"{case}: local sweep in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("case", sorted(NO_CONTROLLER))
def test_explicit_slurm_without_a_controller_is_one_line_and_exit_2(tmp_path, case):
    env = no_controller_env(case, tmp_path)
    out = tmp_path / "out"
    proc = mpifl(env, "sweep", write_sweep(tmp_path / "files"), "--executor", "slurm", "--out", out,
                 timeout=60)
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stdout[-2000:] + err[-3000:]
    assert "\n" not in err, err
    assert err.startswith("mpifl: error: --executor slurm: sbatch found but no SLURM controller "
                          "answers: "), err
    assert NO_CONTROLLER[case][1] in err and "or use --executor local" in err, err
    assert not out.exists()  # nothing written
