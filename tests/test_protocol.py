"""The round protocol's extras on real ranks: evaluation-only LOSSES requests (FedMDFG's line
search), per-client statistics rows (FedFa's training accuracy), and the phase columns every
run records (checkpoint time, peak memory). One process and 3 ranks of the shared MPI world
(tests/world.py) must agree; the waits and hangs run under their own mpiexec."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from mpifl.aggregators import available
from tests.helpers import small_fmnist_job
from tests.world import world_run

JOB = small_fmnist_job("protocol", seed=5, rounds=4, eval_every=2, checkpoint_every=2,
                       partition='partition = "dirichlet"\ndirichlet_alpha = 0.5',
                       algorithm="fedmdfg")

RULES = [r for r in ("fedmdfg", "fedfa") if r in available()]
#: each rule on 1 and on 3 ranks
RUNS = {(rule, n): world_run(f"protocol-{rule}-n{n}", [
    "run", "{dir}/protocol.toml", "--out", f"{{dir}}/protocol-{rule}-n{n}.h5", "--no-progress",
    "--set", f"server.algorithm={rule}"], ranks=n, files={"protocol.toml": JOB})
    for rule in RULES for n in (1, 3)}


@pytest.fixture(scope="module", params=RULES)
def runs(request, world):
    return request.param, {n: world.file(RUNS[request.param, n]) for n in (1, 3)}


def read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in ("eval/client_accuracy", "model/global", "rounds/train_loss",
                                      "rounds/bytes_moved", "rounds/time_checkpoint",
                                      "rounds/peak_rss_server_mb", "rounds/peak_rss_worker_mb")}


def test_one_and_three_ranks_agree(runs):
    _, out = runs
    one, three = read(out[1]), read(out[3])
    np.testing.assert_array_equal(three["eval/client_accuracy"], one["eval/client_accuracy"])
    np.testing.assert_allclose(three["model/global"], one["model/global"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(three["rounds/train_loss"], one["rounds/train_loss"], rtol=1e-6)


def test_phase_columns_are_recorded(runs):
    name, out = runs
    r = read(out[3])
    d = len(r["model/global"])
    # checkpoints after rounds 2 and 4 (checkpoint_every = 2): timed; other rounds: none
    assert np.all(r["rounds/time_checkpoint"][[1, 3]] > 0)
    assert np.all(r["rounds/time_checkpoint"][[0, 2]] == 0)
    # each rank's peak since its process began (a world rank's earlier runs included): a floor
    assert np.all(r["rounds/peak_rss_server_mb"] > 50) and np.all(r["rounds/peak_rss_worker_mb"] > 50)
    # every round: w to 2 workers, 4 updates back (float32); FedMDFG's line search sends at
    # least one candidate w to both workers on top (a LOSSES request)
    floor = (2 + 4) * d * 4
    assert np.all(r["rounds/bytes_moved"] >= (floor + 2 * d * 4 if name == "fedmdfg" else floor))


IDLE = """
import resource, sys, time
import numpy as np
from mpifl.runtime.comm import world
from mpifl.runtime.protocol import MPITransport

comm = world()
t = MPITransport(comm, d=4)
if comm.Get_rank() == 0:
    time.sleep(1.5)                      # a long phase on rank 0 (an aggregation, say)
    t.stop.request(0)
else:
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    assert t.receive().command == 0      # STOP, after rank 0's phase
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"waited {time.perf_counter() - start:.2f} s on {cpu:.3f} s of CPU", flush=True)
"""


@pytest.mark.mpi
def test_a_waiting_rank_does_not_spin(tmp_path):
    """A worker waiting through rank 0's long phase sleeps (wait_idle) instead of busy-polling
    in a blocking Bcast, which would take CPU time from rank 0 when ranks share cores."""
    import re
    import subprocess
    import sys

    from tests.helpers import mpiexec

    script = tmp_path / "idle.py"
    script.write_text(IDLE)
    out = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    waited, cpu = map(float, re.search(r"waited ([\d.]+) s on ([\d.]+) s", out.stdout).groups())
    assert waited > 1.0, out.stdout
    assert cpu < 0.25 * waited, f"the waiting rank used {cpu:.2f} s of CPU in {waited:.2f} s"


HANG = """
import os, signal, sys
import numpy as np
from mpifl.core.errors import PeerLost
from mpifl.runtime.comm import world
from mpifl.runtime.protocol import MPITransport

comm = world()
rank, d = comm.Get_rank(), 100_000
t = MPITransport(comm, d=d, peer_timeout=2.0)


def hang_before(method):
    # this rank stops (SIGSTOP: alive, silent) just before the collective ``method``
    real = getattr(t.wire, method)

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args, **kwargs)

    setattr(t.wire, method, stopped)


if sys.argv[1] == "rank 0" and rank == 0:
    hang_before("bcast_ids_w")          # the workers are then inside the model's broadcast
elif sys.argv[1] == "worker" and rank == 2:
    hang_before("gatherv")              # rank 0 and rank 1 are then inside the gather
try:
    if rank == 0:
        t.losses.request(np.arange(4), np.zeros(d, np.float32), np.array([0, 2, 4]))
    else:
        t.receive()
        t.losses.reply(np.zeros(2, np.float32))
    print(f"rank {rank}: done", flush=True)
except PeerLost as exc:
    print(f"rank {rank}: {exc}", flush=True)
    t.abort(2)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("who", ["rank 0", "worker"])
def test_a_rank_hanging_inside_a_collective_ends_the_job(who, tmp_path):
    """With a peer timeout, a rank that stops between two collectives of a request (so the
    others are already inside a broadcast or a gather, not at the protocol's waits) still ends
    the job: the waiting ranks raise PeerLost within the timeout and MPI_Abort takes the stopped
    rank down too."""
    import subprocess
    import sys
    import time

    from tests.helpers import mpiexec

    script = tmp_path / "hang.py"
    script.write_text(HANG)
    start = time.monotonic()
    out = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(script), who],
                         capture_output=True, text=True, timeout=90)
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout
    assert "no answer from another rank within run.peer_timeout_s = 2 s" in out.stdout, \
        out.stdout + out.stderr[-2000:]
    assert took < 60, f"the job took {took:.0f} s to end"
    # the killed ranks may outlive mpiexec by a few milliseconds (being torn down)
    deadline = time.monotonic() + 10
    while (left := subprocess.run(["pgrep", "-f", str(script)], capture_output=True,
                                  text=True).stdout.strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == "", f"ranks left behind: {left}"
