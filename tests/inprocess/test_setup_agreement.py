"""Set-up is one agreed phase (docs/ARCHITECTURE.md, "Set-up, agreed on every rank"): a
failure on one rank during set-up — an exception in a plugin's import or in a data set's loader, a
rank stopped with SIGSTOP, a signal to the job — ends every rank within seconds with that rank's one
line and one status (2; 130 for SIGINT; 3 for SIGTERM/SIGUSR1), never a hang and never the 3 that
mpiexec's OR of 2 and 1 used to give. Real ranks (mpiexec -n 3), a real plugin module, real signals;
the same job without a fault runs on 3 ranks of the shared MPI world (tests/world.py). The tests
that start mpiexec themselves are in tests/mpi/test_setup_agreement.py.
"""

from __future__ import annotations

from tests.world import world_run

#: A plugin whose behaviour on one rank is chosen by the environment: MPIFL_FAULT is
#: "<where>:<what>:<rank>" (where: import, data; what: raise, stop, wait).
PLUGIN = '''
import os, signal, time
import numpy as np
from mpifl.plugin import DataPool, register_dataset

where, what, rank = (os.environ.get("MPIFL_FAULT", "none:none:-1").split(":") + ["", ""])[:3]
me = os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "0"))


def fault(now):
    if where != now or me != rank:
        return
    if what == "raise":
        raise RuntimeError(f"{now} fails on rank {me} only")
    if what == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if what == "wait":  # tell the test we are here, then take a while
        open(os.environ["MPIFL_READY"], "w").close()
        time.sleep(float(os.environ.get("MPIFL_WAIT_S", "4")))


fault("import")


@register_dataset("tiny")
def tiny(*, seed, data_root=None):
    fault("data")
    rng = np.random.default_rng(seed)
    return DataPool(rng.normal(size=(400, 8)).astype(np.float32),
                    rng.integers(0, 4, 400).astype(np.int64), num_classes=4)
'''

JOB = """
[run]
name = "agree"
rounds = 3
eval_every = 3
setup_timeout_s = 6
[data]
dataset = "tiny"
partition = "iid"
num_clients = 6
[model]
name = "mlp"
hidden = [8]
[client]
epochs = 1
batch_size = 0
[server]
algorithm = "fedavg"
clients_per_round = 3
[plugins]
modules = ["setup_faults"]
"""


#: the job with no fault, beside its plugin as in ``job`` (tests/mpi/test_setup_agreement.py)
UNCHANGED = world_run("setup-agreement-ok", [
    "run", "{dir}/setup-agreement.toml", "--out", "{dir}/setup-agreement-ok.h5", "--no-progress"],
    files={"setup_faults.py": PLUGIN, "setup-agreement.toml": JOB},
    env={"MPIFL_FAULT": "none:none:-1"})


def mpifl_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "Segmentation" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("mpifl: ")]


def test_the_unchanged_job_runs(world):
    assert world.file(UNCHANGED).is_file()


def test_a_decided_status_is_not_turned_into_143_by_the_launchers_sigterm(tmp_path):
    """Once ``mpifl run`` has its exit status (agreed by every rank), SIGTERM is ignored for the
    rest of the exit: srun --kill-on-bad-exit sends it to the ranks still finishing when another
    rank has exited 2 or 3 first, and Python's finalisation puts back the default handler for
    any signal it handled (CPython's ``_PySignal_Fini`` leaves only SIG_IGN alone), so such a
    rank ended 143 and the job template retried a bad input."""
    import subprocess
    import sys

    script = ("import signal, sys; from mpifl.__main__ import entry; status = entry(); "
              "print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, status)")
    proc = subprocess.run([sys.executable, "-c", script, "run", str(tmp_path / "missing.toml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["True", "2"], proc.stderr[-2000:]
    assert len(mpifl_lines(proc.stderr)) == 1, proc.stderr  # the bad input's one line
