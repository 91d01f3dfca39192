"""A bounded MPI_Init that says which ranks never reached it.

Every rank waits in ``MPI_Init`` until all have entered it, and nothing can be exchanged over
MPI before it returns. So a rank that hangs or fails before it leaves the others waiting, and
the waiting ranks cannot ask each other who is missing. These answer that on a node:

* **Arrival marks.** A rank entering MPI_Init listens on an abstract Unix socket (Linux; no
  file) named after the launcher's agent on this node — the ``hydra_pmi_proxy``, ``slurmstepd``
  or ``prted`` process that started the node's ranks — and its rank; it closes it once
  MPI_Init returns. Any process on the node can test whether rank r has arrived.
* **The watchdog**, a small process each rank starts before MPI_Init (nothing in the rank
  itself runs while MPI_Init holds the interpreter). After ``run.init_timeout_s`` it claims the
  node's report (one more abstract name: the first watchdog to fire prints, the others stay
  quiet), tests the marks and prints one line: the ranks that did not arrive when every rank
  runs on this node; else those that arrived here. Then it ends its rank with SIGKILL and the
  launcher ends the rest; it holds the claim until the node's other ranks are gone, so a
  watchdog that fires later stays quiet too.
* **The exchange bound.** When every rank of the job runs on this node, the watchdog also sees
  the moment the last one arrives: from then on MPI_Init is only the launcher's PMI exchange,
  which takes well under a second, so one that has not finished :data:`EXCHANGE_S` later has
  broken (seen under ``srun --mpi=pmi2``, slurm/README.md) and the watchdog fires then, not at
  ``run.init_timeout_s``: a SLURM job's next launch starts minutes sooner.
* **SIGTERM while in MPI_Init.** A rank's own handler cannot run while MPI_Init holds the
  interpreter, so a rank stuck there would outlive the job's end until the launcher's SIGKILL
  (SLURM: ``KillWait`` later, 30 s or more). The watchdog gets the same SIGTERM (SLURM signals
  every process of the step), gives MPI_Init :data:`TERM_GRACE_S` to return (a rank that gets
  out acts on the signal itself: checkpoint, status 3) and ends it otherwise.

Without a known agent (a wrapper script between the launcher and Python, another OS) the line
says only that this rank waited.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from mpifl.runtime.installs import rank_ranges

#: process names of the launchers' per-node agents (MPICH, SLURM, Open MPI / PRRTE)
AGENTS = ("hydra_pmi_proxy", "slurmstepd", "prted", "orted", "prterun", "mpirun", "mpiexec")
#: seconds MPI_Init may take after the last rank of a one-node job arrived: its PMI exchange
#: alone, under a second even on a loaded 2-core machine, so this only bounds a broken one
EXCHANGE_S = 30.0
#: seconds between the watchdog's looks at the arrival marks
LOOK_S = 1.0
#: seconds a rank may stay in MPI_Init after a SIGTERM to the watchdog
TERM_GRACE_S = 5.0


class _Terminated(Exception):
    """SIGTERM reached the watchdog."""


def _on_term(_signum: int, _frame: object) -> None:
    raise _Terminated


def launcher_agent(pid: int | None = None) -> int | None:
    """The pid of the nearest ancestor of ``pid`` (this process) that is a launcher's agent,
    or None (no /proc, or none found)."""
    pid = os.getpid() if pid is None else pid
    for _ in range(64):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent <= 1:
            return None
        try:
            name = Path(f"/proc/{parent}/comm").read_text().strip()
        except OSError:
            return None
        if name in AGENTS:
            return parent
        pid = parent
    return None


def _address(agent: int, what: str) -> str:
    return f"\0mpifl-init-{agent}-{what}"


def mark_arrival(agent: int | None, rank: int) -> socket.socket | None:
    """Rank ``rank`` has reached MPI_Init: listen on its mark until the returned socket is
    closed (None: no agent, or the OS has no abstract sockets)."""
    if agent is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_address(agent, str(rank)))
        sock.listen(64)
    except OSError:
        sock.close()
        return None
    return sock


def arrived(agent: int, size: int) -> list[int]:
    """The ranks of ``size`` whose arrival mark is up on this node."""
    found = []
    for rank in range(size):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(_address(agent, str(rank)))
                found.append(rank)
            except OSError:
                pass
    return found


def message(rank: int, size: int, timeout_s: float, here: list[int] | None,
            node_size: int | None, exchange_s: float | None = None) -> str:
    """The watchdog's line (without ``mpifl: error:``).

    Args:
        rank: the rank whose watchdog fired; size: ranks in the job.
        here: the ranks whose arrival mark is up on this node (None: marks unavailable).
        node_size: ranks the launcher started on this node (None: not known).
        exchange_s: the exchange bound, when that is the one that passed (None: the timeout).
    """
    bound = f"run.init_timeout_s = {timeout_s:g} s"
    if exchange_s is not None:
        bound = f"{exchange_s:g} s of the last rank's arrival"
    tail = ("; ending the job (start it again; a larger run.init_timeout_s helps when ranks "
            "start slowly)")
    if here is not None and node_size == size:
        missing = sorted(set(range(size)) - set(here))
        if missing:
            return (f"rank(s) {rank_ranges(missing)} did not reach MPI_Init within {bound}, "
                    f"while rank(s) {rank_ranges(here)} waited there for them (hung or failed "
                    "before it: their own output may say why)" + tail)
        return (f"MPI_Init did not finish within {bound} although every rank "
                f"({rank_ranges(here)}) reached it: the launcher's PMI exchange broke "
                '(slurm/README.md "MPI_Init under srun")' + tail)
    others = rank_ranges([r for r in range(size) if r != rank]) or "none"
    where = ""
    if here is not None:
        count = f" of {node_size}" if node_size else ""
        where = f"; on this node rank(s) {rank_ranges(here)} arrived{count}"
    return (f"rank {rank} waited {bound} in MPI_Init for the other ranks ({others}){where}: "
            "one of them did not reach MPI_Init (hung or failed before it: its own output may "
            "say why) or the launcher's PMI exchange broke" + tail)


def launched_node_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """Ranks the launcher started on this node, from its environment (None: not known)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
    if environ.get("SLURM_STEP_NUM_NODES") == "1" and tasks.isdigit():
        return int(tasks)
    return None


def start(timeout_s: float, rank: int, size: int, agent: int | None
          ) -> subprocess.Popen[bytes]:
    """Start the watchdog of this process (it waits for its standard input to close: close it
    when MPI_Init returned)."""
    return subprocess.Popen(
        [sys.executable, "-m", "mpifl.runtime.init_watch", str(os.getpid()), f"{timeout_s:g}",
         str(rank), str(size), "" if agent is None else str(agent)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def _watch(pid: int, timeout_s: float, rank: int, size: int, agent: int | None,
           exchange_s: float = EXCHANGE_S) -> None:
    """The watchdog: end process ``pid`` if its MPI_Init takes more than ``timeout_s``, or more
    than ``exchange_s`` after every rank of a one-node job arrived."""
    signal.signal(signal.SIGTERM, _on_term)
    try:
        bound = _wait_for_init(timeout_s, size, agent, exchange_s)
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not select.select([sys.stdin], [], [], TERM_GRACE_S)[0]:
            os.kill(pid, signal.SIGKILL)  # still in MPI_Init: it cannot act on the signal
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here it ends the rank anyway
    if bound is None:
        return  # MPI_Init returned (stdin closed), or the rank died
    report = mark_arrival(agent, -1) if agent is not None else None  # -1: the node's report
    if agent is None or report is not None:  # the first watchdog of the node to fire speaks
        here = arrived(agent, size) if agent is not None else None
        line = message(rank, size, timeout_s, here, launched_node_size(),
                       exchange_s if bound == "exchange" else None)
        sys.stderr.write(f"mpifl: error: {line}\n")
        sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
    if report is not None and agent is not None:  # a report implies an agent
        _hold(report, agent, size)


def _wait_for_init(timeout_s: float, size: int, agent: int | None, exchange_s: float
                   ) -> str | None:
    """Wait until standard input closes (MPI_Init returned: None) or a bound passes: "init"
    (``timeout_s``) or "exchange" (``exchange_s`` after every rank's mark was up)."""
    start = time.monotonic()
    one_node = agent is not None and launched_node_size() == size
    all_since = None  # when every rank's mark was first seen up
    while True:
        now = time.monotonic()
        left = timeout_s - (now - start)
        if left <= 0:
            return "init"
        if all_since is not None and exchange_s - (now - all_since) <= 0:
            return "exchange"
        if all_since is not None:
            left = min(left, exchange_s - (now - all_since))
        look = min(left, LOOK_S) if one_node and all_since is None else left
        if select.select([sys.stdin], [], [], look)[0]:
            return None
        if one_node and all_since is None and agent is not None \
                and len(arrived(agent, size)) == size:
            all_since = time.monotonic()


def _hold(report: socket.socket, agent: int, size: int, grace_s: float = 2.0,
          bound_s: float = 30.0) -> None:
    """Keep the node's report claimed until the node's other ranks are gone (and ``grace_s``
    more, for a watchdog that fired as its rank died), at most ``bound_s``: a claim that ended
    with this process would let a later-firing watchdog print the line a second time."""
    deadline = time.monotonic() + bound_s
    while arrived(agent, size) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(grace_s)
    report.close()


if __name__ == "__main__":
    _pid, _timeout, _rank, _size, _agent = sys.argv[1:6]
    _watch(int(_pid), float(_timeout), int(_rank), int(_size), int(_agent) if _agent else None)
