"""Kill-and-resume equality for the stateful rules beside FedFV (tests/test_resume.py): AFL
(lambda and its running average), FedFa (momentum and participation counts), FedMDFG (loss
averages, last round's updates), FedLF (history), UGA and FedMeta. A job on real Fashion-MNIST
under mpiexec -n 3 is SIGKILLed (every process of it) once a mid-run checkpoint exists, resumed
with ``--resume``, and compared with an uninterrupted run: np.array_equal on the model and on
every /eval and /rounds column except the machine's measurements."""

from __future__ import annotations

import subprocess
import time

import pytest

from mpifl.aggregators import available
from tests.helpers import kill_tree, small_fmnist_job, write_fmnist_job
from tests.test_resume import ENV, assert_same, command, run

pytestmark = pytest.mark.mpi  # starts mpiexec: one at a time (tests/conftest.py)

JOB = small_fmnist_job("rules", seed=7, rounds=8, eval_every=2, checkpoint_every=1,
                       partition='partition = "shards"', algorithm="fedavg")

RULES = {"afl": ["server.sampling=all"], "fedfa": [], "fedmdfg": [], "fedlf": [],
         "uga": ["client.epochs=2", "client.batch_size=20"], "fedmeta": ["fedmeta.meta_size=50"]}


def sets(name: str) -> list[str]:
    return [x for s in [f"server.algorithm={name}", *RULES[name]] for x in ("--set", s)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return write_fmnist_job(tmp_path_factory, "rules.toml", JOB)


def kill_after_checkpoint(cmd: list[str], folder, rounds_done: int) -> bool:
    """Start ``cmd``; SIGKILL the whole job once the checkpoint after ``rounds_done`` rounds
    exists. False when the job ended before that."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = folder / f"round-{rounds_done:06d}.h5"
    while proc.poll() is None and not target.exists():
        time.sleep(0.02)
    if proc.poll() is not None:
        return False
    kill_tree(proc.pid)
    proc.wait()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RULES if n in available()])
def test_sigkill_mid_run_then_resume_is_exact(name, job, tmp_path):
    ref = tmp_path / "ref.h5"
    run(3, "run", str(job), "--out", str(ref), *sets(name))
    out = tmp_path / "killed.h5"
    killed = kill_after_checkpoint(command(3, "run", str(job), "--out", str(out), *sets(name)),
                                   tmp_path / "killed.h5.ckpt", 3)
    assert killed, "the job finished before it could be killed"
    run(3, "run", str(job), "--out", str(out), "--resume", *sets(name))
    assert_same(out, ref)
