"""The round protocol's waits and hangs on real ranks, each under its own mpiexec: a worker
waiting through rank 0's long phase sleeps instead of spinning, and a rank that stops inside a
collective ends the whole job within the peer timeout (MPI_Abort). Real ranks, because what is
measured is each launched process's CPU time and the job's end on every rank."""

from __future__ import annotations

import pytest

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
