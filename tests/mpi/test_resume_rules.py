"""Kill-and-resume equality on real MPI ranks for a rule whose state is dual weights: AFL (the
Lagrange multipliers lambda over the clients and their running average). A job on real
Fashion-MNIST under mpiexec -n 3 is SIGKILLed (every process of it) once a mid-run checkpoint
exists, resumed with ``--resume``, and compared with the uninterrupted run (from the shared MPI
world, tests/world.py): np.array_equal on the model and on every /eval and /rounds column except
the machine's measurements.

The other stateful rules beside FedFV are not killed here: tests/inprocess/test_rule_state.py
proves, for every rule, that it resumes bit-exactly from its ``state_dict()`` after the
checkpoint's HDF5 round trip (FedFa's momentum and participation counts, FedMDFG's loss averages
and last round's updates, FedLF's history; UGA and FedMeta keep none). What a real-rank kill
adds on top is the run around the rule (rank 0 checkpointing what the workers' updates and
losses built, the keyed draws, the model), which is the same code for every rule holding the
same kind of state. So one real kill per kind of state suffices, and each other kind has its
own: FedFV's history of updates in tests/mpi/test_resume.py (the kind of FedLF's history,
FedMDFG's last updates and FedFa's momentum), Ditto's per-client personal models in
tests/mpi/test_ditto.py, FedBuff's and FedAsync's buffers in
tests/inprocess/test_async_rules.py, the state's blocks on shard ranks in
tests/inprocess/test_sharded_server.py."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.helpers import kill_tree, small_fmnist_job, write_fmnist_job
from tests.inprocess.test_resume import ENV, assert_same, command, run
from tests.world import world_run

pytestmark = pytest.mark.mpi  # starts mpiexec: one at a time (tests/conftest.py)

JOB = small_fmnist_job("rules", seed=7, rounds=8, eval_every=2, checkpoint_every=1,
                       partition='partition = "shards"', algorithm="fedavg")

RULES = {"afl": ["server.sampling=all"]}


def sets(name: str) -> list[str]:
    return [x for s in [f"server.algorithm={name}", *RULES[name]] for x in ("--set", s)]


#: the uninterrupted runs, from the shared world
REFERENCE = {name: world_run(f"rules-{name}-ref", [
    "run", "{dir}/resume-rules.toml", "--out", f"{{dir}}/rules-{name}-ref.h5", "--no-progress",
    *sets(name)], files={"resume-rules.toml": JOB}, for_mpi=True) for name in RULES}


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
@pytest.mark.parametrize("name", list(RULES))
def test_sigkill_mid_run_then_resume_is_exact(name, job, world, tmp_path):
    ref = world.file(REFERENCE[name])
    out = tmp_path / "killed.h5"
    killed = kill_after_checkpoint(command(3, "run", str(job), "--out", str(out), *sets(name)),
                                   tmp_path / "killed.h5.ckpt", 3)
    assert killed, "the job finished before it could be killed"
    run(3, "run", str(job), "--out", str(out), "--resume", *sets(name))
    assert_same(out, ref)
