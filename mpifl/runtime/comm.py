"""MPI transport: the round protocol on flat numpy buffers (no pickle on the hot path).

Every request from rank 0 starts with a ``Bcast`` of a small float64 header
``[command, round, lr, m, flag]``, then, depending on the command:

* ``TRAIN``: ``Bcast`` of the selected client ids (m,) int64, of the global parameters (d,)
  float32 and, when the trainer takes them (:class:`mpifl.clients.Columns`), of the round inputs
  (A,) float64 (mFairFL's multipliers); ``Scatterv`` of per-client state rows (m, s) float32
  (Ditto's personal models) when the trainer keeps such state. Each worker trains its contiguous
  block of the ids (:func:`split_by_samples`, computed identically on every rank, so no
  assignment message is needed); ``Gatherv`` of the updates (m, d) float32, the pre-training
  losses (m,) float32 and the statistics rows (m, S) float32 into rank 0, already in id order;
  ``Gather`` of each rank's training seconds and peak resident memory.
* ``LOSSES``: ``Bcast`` of client ids and of candidate parameters; ``Gatherv`` of those
  clients' mean training losses (m,) float32 — an evaluation-only request (FedMDFG's line
  search), same blocks as TRAIN.
* ``EVAL``: ``Bcast`` of the parameters; each worker evaluates its static share of all K clients;
  ``Gatherv`` of accuracies and losses (K,) float64 and, on data with a sensitive attribute,
  of per-client group counts (K, G*2*3) float64. With bit :data:`PERSONAL` of ``flag``,
  ``Scatterv`` of per-client parameters (K, d) float32 follows and their accuracies and losses
  (Ditto's personal models) are gathered too. With bit :data:`ADAPTED` (``run.adapt_epochs``),
  each worker also trains its clients locally from the parameters (minibatch order keyed by
  the header's round, the header's lr) and the adapted accuracies and losses (K,) float64 are
  gathered last; round and lr are 0 in an EVAL header without it. With bit :data:`LOCAL`
  (local BatchNorm), ``Scatterv`` of every client's local coordinates (K, s) float32 (s =
  the trainer's state width) comes before the evaluation, and each client is evaluated with
  its own.
* ``CHECKPOINT`` (sharded server only): the shard ranks write their blocks of the rule's state
  into the checkpoint of the round carried in the header (:mod:`mpifl.runtime.sharding`);
  ``Gather`` of every rank's status (0 = written).
* ``STOP``: workers leave their loop and exit with the status carried in the header.

**Sharded server** (``server.shards = P > 1``, ranks 0 .. P-1 are the shards): a TRAIN's
updates travel as P ``Gatherv`` calls, the j-th to shard rank j with every worker's column block j
(``(m_r, hi_j - lo_j)``, packed contiguous), so no rank receives the whole (m, d) matrix;
losses, statistics rows and rank statistics still reach rank 0 as above. The shards then run
the aggregation among themselves (:class:`mpifl.runtime.sharding.ShardServer`).

A rank that waits for another's long phase (workers while rank 0 aggregates, rank 0 while the
workers train or evaluate) does not busy-poll: the header travels by ``Ibcast`` and results are
announced by an ``Ibarrier``, both completed by :func:`wait_idle`, which sleeps between tests.
MPICH's blocking calls spin, and when ranks share cores (3 ranks on a 2-core machine) the
spinning ranks take CPU time from the one doing the work.

Only upper-case (buffer) mpi4py calls are used in rounds. mpi4py is imported lazily so that
one-process runs work without an MPI library.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from mpifl.core.errors import PeerLost
from mpifl.core.wire import Columns

STOP, TRAIN, EVAL, LOSSES, CHECKPOINT = 0, 1, 2, 3, 4
HEADER_LEN = 5
#: Bits of an EVAL header's flag: per-client parameters follow (Ditto); evaluate after local
#: adaptation too (run.adapt_epochs); per-client local coordinates follow (local BatchNorm).
PERSONAL, ADAPTED, LOCAL = 1, 2, 4


def _request(method):
    """Rank 0's request methods: ``busy`` while a request's collectives are under way, so that
    after a failure rank 0 knows whether the workers are waiting for the next header (then a
    STOP releases them cleanly) or are inside a collective (then only MPI_Abort ends them)."""
    import functools

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        self.busy = True
        out = method(self, *args, **kwargs)
        self.busy = False  # left True when the request raised
        return out

    return wrapped


#: seconds between a failing rank's message and its MPI_Abort (see MPITransport.abort)
ABORT_GRACE_S = 0.5


def wait_idle(request, max_sleep: float = 2e-4, timeout: float = 0.0, waiting_for: str = "") -> None:
    """Complete an MPI request without holding a core while it is pending.

    Tests the request, sleeping between tests with a pause that doubles from 1 us up to
    ``max_sleep`` seconds: at most about ``max_sleep`` of added latency, negligible against a
    phase long enough to be worth not spinning through. (The main job on 3 ranks of the 2-core
    VM: 0.21 s a round with MPICH's spinning waits, 0.13 s with these; docs/BENCHMARKS.md.)

    Raises:
        PeerLost: ``timeout`` > 0 seconds passed first (a rank that hangs or whose node is
            lost would otherwise keep every other rank waiting forever).
    """
    pause, start = 1e-6, time.monotonic()
    while not request.Test():
        if timeout and time.monotonic() - start > timeout:
            raise PeerLost(f"no answer from {waiting_for} within run.peer_timeout_s = {timeout:g} s "
                           "(a rank hangs or its node is lost)")
        time.sleep(pause)
        pause = min(2 * pause, max_sleep)


def world(init_timeout_s: float = 0.0):
    """The MPI world communicator, or None when mpi4py is not installed.

    Args:
        init_timeout_s: seconds this rank may spend in MPI_Init (the first import of
            ``mpi4py.MPI``; every rank waits there for all the others), 0 = forever. A rank
            still in it then prints one line (``mpifl: error: rank r: MPI_Init did not finish
            ...``) and is ended with SIGKILL, so the launcher ends every rank and a SLURM job's
            next launch can follow. Seen under ``srun --mpi=pmi2`` when the PMI exchange breaks
            (slurm/README.md).
    """
    try:
        import mpi4py  # noqa: F401  (installed? MPI_Init comes with mpi4py.MPI)
    except ImportError:
        return None
    watchdog = (_init_watchdog(init_timeout_s)
                if init_timeout_s > 0 and "mpi4py.MPI" not in sys.modules else None)
    try:
        from mpi4py import MPI
    finally:
        if watchdog is not None:
            watchdog.stdin.close()  # the watchdog reads end-of-file and leaves
            watchdog.wait()
    return MPI.COMM_WORLD


#: The init watchdog, a separate small process: nothing in this one can run while it is inside
#: MPI_Init (the import holds the interpreter). It waits for its standard input to close (MPI_Init
#: returned, or this process died) for at most the timeout; then it prints one line and ends
#: this process.
_WATCHDOG = """
import os, select, signal, sys
pid, timeout, rank = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], timeout)[0]:
    sys.stderr.write(f"mpifl: error: rank {rank}: MPI_Init did not finish within "
                     f"run.init_timeout_s = {timeout:g} s (a rank did not start or stopped before "
                     "it, or the launcher's PMI exchange broke); ending this rank\\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
"""


def _init_watchdog(timeout_s: float):
    import subprocess

    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), f"{timeout_s:g}",
                             str(launched_rank())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)


def launched_rank() -> int:
    """This process's rank from the launcher's environment, before MPI_Init (0 without one)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def launched_size() -> int:
    """The number of ranks the launcher started (mpiexec, srun), from its environment, before
    MPI_Init; 1 when started without one."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def local_rank(rank: int) -> int:
    """This process's rank on its node (for picking a GPU), from the launcher's environment."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return rank


def split_by_samples(num_samples: np.ndarray, parts: int) -> np.ndarray:
    """Cut a sequence of clients into ``parts`` contiguous blocks of about equal sample counts.

    Args:
        num_samples: (m,) int, samples per client (training cost is about proportional).
        parts: number of worker ranks.

    Returns:
        (parts + 1,) int64 bounds: block r is ``[bounds[r], bounds[r+1])``. Contiguous blocks keep
        the gathered updates in client-id order with no reordering copy.
    """
    cum = np.cumsum(np.asarray(num_samples, dtype=np.float64))
    total = cum[-1] if cum.size else 0.0
    targets = total * np.arange(1, parts) / parts
    inner = np.searchsorted(cum, targets, side="left") + 1 if cum.size else np.zeros(parts - 1)
    bounds = np.concatenate([[0], np.minimum(inner, len(cum)), [len(cum)]]).astype(np.int64)
    return np.maximum.accumulate(bounds)


def rank_counts(bounds: np.ndarray) -> np.ndarray:
    """(workers + 1,) int64 rows per rank from the workers' block bounds of
    :func:`split_by_samples`: rank 0 holds none, rank r block r - 1 (the counts of a
    Gatherv or Scatterv over the whole communicator)."""
    return np.concatenate([[0], np.diff(bounds)]).astype(np.int64)


def bcast_text(comm, text: str | None) -> str:
    """Setup: send a text (e.g. the config JSON) from rank 0 to every rank, as raw bytes."""
    from mpi4py import MPI

    root = comm.Get_rank() == 0
    n = np.array([len(text.encode()) if root else 0], dtype=np.int64)
    comm.Bcast([n, MPI.INT64_T], root=0)
    buf = np.frombuffer(text.encode(), np.uint8).copy() if root else np.empty(int(n[0]), np.uint8)
    comm.Bcast([buf, MPI.BYTE], root=0)
    return buf.tobytes().decode()


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class TrainRequest:
    """What a worker receives for one request."""

    command: int
    round: int
    lr: float
    client_ids: np.ndarray  # (m,) int64, all selected clients (empty for EVAL)
    w: np.ndarray  # (d,) float32 global (or candidate) parameters
    inputs: np.ndarray | None = None  # (A,) float64 round inputs (TRAIN)
    state: np.ndarray | None = None  # (m_r, s) float32 state rows of this rank's block (TRAIN)
    personal: np.ndarray | None = None  # (K_r, d) float32 per-client parameters (EVAL)
    local: np.ndarray | None = None  # (K_r, s) float32 per-client local coordinates (EVAL)
    adapt: bool = False  # EVAL: evaluate after local adaptation too (round, lr as above)


@dataclass
class TrainReply:
    """What rank 0 collects for one TRAIN request (arrays in client-id order)."""

    updates: np.ndarray  # (m, d) float32, a view of a reused buffer
    losses: np.ndarray  # (m,) float32
    stats: np.ndarray | None  # (m, S) float32 statistics rows, None when S = 0
    seconds: np.ndarray  # (size,) float64 training seconds per rank (rank 0: 0)
    peak_rss: np.ndarray  # (size,) float64 peak resident bytes per rank
    bytes_moved: int
    time_broadcast: float  # seconds


@dataclass
class EvalReply:
    """What rank 0 collects for one EVAL request (per client, (K,) each)."""

    accuracy: np.ndarray
    loss: np.ndarray
    counts: np.ndarray | None = None  # (K, width) float64 group counts
    personal_accuracy: np.ndarray | None = None
    personal_loss: np.ndarray | None = None
    adapted_accuracy: np.ndarray | None = None  # after local adaptation (run.adapt_epochs)
    adapted_loss: np.ndarray | None = None
    bytes_moved: int = 0
    #: (size,) float64 every rank's peak resident bytes (getrusage) after the evaluation
    peak_rss: np.ndarray | None = None


class MPITransport:
    """Both ends of the round protocol over ``comm`` (rank 0 = server, ranks >= 1 = workers).

    Args:
        comm: an mpi4py intracommunicator of size >= 2.
        d: number of model parameters.
        columns: the trainer's per-round extras (the same on every rank, from the config).
        peer_timeout: seconds a rank waits for the others at the protocol's two waits (the
            workers' results, rank 0's next request) before :class:`PeerLost`; 0 = forever.
        shard_bounds: (P + 1,) coordinate block bounds of a sharded server (P > 1; shard j is
            rank j), or None: rank 0 gathers the whole updates.
    """

    def __init__(self, comm, d: int, columns: Columns = Columns(), peer_timeout: float = 0.0,
                 shard_bounds: np.ndarray | None = None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.workers = self.size - 1
        self.d = d
        self.columns = columns
        self._header = np.zeros(HEADER_LEN, dtype=np.float64)
        self._w = np.empty(d, dtype=np.float32)
        self._inputs = np.zeros(columns.inputs, dtype=np.float64)
        self._updates = np.empty((0, d), dtype=np.float32)  # grown on demand, reused
        self.busy = False  # rank 0: inside a request (see _request)
        self.peer_timeout = float(peer_timeout)
        self.shard_bounds = shard_bounds

    # -- helpers ---------------------------------------------------------------------------
    def _bcast_header(self, command: int = 0, rnd: int = 0, lr: float = 0.0, m: int = 0,
                      flag: int = 0):
        if self.rank == 0:
            self._header[:] = (command, rnd, lr, m, flag)
        # workers may wait here through a whole aggregation: sleep instead of spinning
        wait_idle(self.comm.Ibcast([self._header, self.MPI.DOUBLE], root=0),
                  timeout=self.peer_timeout, waiting_for="rank 0" if self.rank else "a worker rank")
        c, r, lr_, m_, f = self._header
        return int(c), int(r), float(lr_), int(m_), int(f)

    def _results_ready(self) -> None:
        """Rank 0 and the workers meet here once every worker has its results, so that rank 0
        sleeps through the workers' training or evaluation instead of spinning in a Gatherv."""
        wait_idle(self.comm.Ibarrier(), timeout=self.peer_timeout,
                  waiting_for="rank 0" if self.rank else "a worker rank")

    def _collective(self, name: str, *args, root: int = 0) -> None:
        """Run the blocking collective ``name`` (Bcast, Gatherv, Scatterv, Gather); with a peer
        timeout, its nonblocking form completed under that timeout instead, so that a rank
        that hangs mid-collective cannot hold the others forever."""
        if not self.peer_timeout:
            getattr(self.comm, name)(*args, root=root)
            return
        # spin (no sleep): large transfers progress only while the request is tested
        wait_idle(getattr(self.comm, "I" + name.lower())(*args, root=root), max_sleep=0.0,
                  timeout=self.peer_timeout, waiting_for="another rank")

    def _gatherv(self, local: np.ndarray, counts: np.ndarray, out: np.ndarray | None, mpitype):
        """Gather contiguous blocks (rank 0 sends nothing) into ``out`` on rank 0."""
        if self.rank == 0:
            displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
            self._collective("Gatherv", [local, 0, mpitype], [out, counts, displs, mpitype])
        else:
            self._collective("Gatherv", [local, mpitype], None)

    def _scatterv(self, rows: np.ndarray | None, counts: np.ndarray | None, width: int,
                  mine: int) -> np.ndarray | None:
        """Send contiguous row blocks of ``rows`` (n, width) float32 from rank 0; a worker
        receives its ``mine`` rows."""
        if self.rank == 0:
            displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
            self._collective("Scatterv", [np.ascontiguousarray(rows, np.float32), counts, displs,
                                          self.MPI.FLOAT], [np.empty(0, np.float32), self.MPI.FLOAT])
            return None
        out = np.empty((mine, width), dtype=np.float32)
        self._collective("Scatterv", None, [out, self.MPI.FLOAT])
        return out

    def _updates_buffer(self, m: int) -> np.ndarray:
        if self._updates.shape[0] < m:
            self._updates = np.empty((m, self.d), dtype=np.float32)
        return self._updates[:m]

    def _bcast_ids_w(self, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        self._collective("Bcast", [ids, self.MPI.INT64_T])
        if self.rank == 0:
            self._w[:] = w
        self._collective("Bcast", [self._w, self.MPI.FLOAT])
        return ids

    # -- server side -----------------------------------------------------------------------
    @_request
    def request_train(self, rnd: int, lr: float, client_ids: np.ndarray, w: np.ndarray,
                      bounds: np.ndarray, inputs: np.ndarray | None = None,
                      state: np.ndarray | None = None) -> TrainReply:
        """Rank 0: send a TRAIN request and collect the results.

        Args:
            client_ids: (m,) int64 selected clients, ascending. w: (d,) float32.
            bounds: (workers + 1,) block bounds from :func:`split_by_samples`.
            inputs: (columns.inputs,) float64 round inputs (required when columns.inputs > 0).
            state: (m, columns.state) float32 state rows (required when columns.state > 0).
        """
        m, cols = len(client_ids), self.columns
        t0 = time.perf_counter()
        self._bcast_header(TRAIN, rnd, lr, m)
        ids = self._bcast_ids_w(client_ids, w)
        sent = self.workers * (self._header.nbytes + ids.nbytes + self._w.nbytes)
        blocks = rank_counts(bounds)
        if cols.inputs:
            self._inputs[:] = inputs
            self._collective("Bcast", [self._inputs, self.MPI.DOUBLE])
            sent += self.workers * self._inputs.nbytes
        if cols.state:
            self._scatterv(state, blocks * cols.state, cols.state, 0)
            sent += m * cols.state * 4
        t_bcast = time.perf_counter() - t0
        self._results_ready()
        if self.shard_bounds is None:
            updates = self._updates_buffer(m)
            self._gatherv(np.empty(0, np.float32), blocks * self.d, updates, self.MPI.FLOAT)
        else:  # this rank's column block only (shard 0)
            updates = self._gather_shards(np.empty((0, self.d), np.float32), blocks)
        losses = np.empty(m, dtype=np.float32)
        self._gatherv(np.empty(0, np.float32), blocks, losses, self.MPI.FLOAT)
        stats = None
        if cols.stats_width:
            stats = np.empty((m, cols.stats_width), dtype=np.float32)
            self._gatherv(np.empty(0, np.float32), blocks * cols.stats_width, stats, self.MPI.FLOAT)
        ranks = self._gather_rank_stats(0.0)
        received = m * self.d * 4 + losses.nbytes + (stats.nbytes if stats is not None else 0)
        return TrainReply(updates, losses, stats, ranks[:, 0], ranks[:, 1], sent + received,
                          t_bcast)

    @_request
    def request_losses(self, client_ids: np.ndarray, w: np.ndarray, bounds: np.ndarray
                       ) -> tuple[np.ndarray, int]:
        """Rank 0: the clients' mean training losses at ``w`` (evaluation only, no training).

        Returns:
            ``(losses (m,) float32 in client-id order, bytes_moved)``.
        """
        m = len(client_ids)
        self._bcast_header(LOSSES, 0, 0.0, m)
        ids = self._bcast_ids_w(client_ids, w)
        losses = np.empty(m, dtype=np.float32)
        blocks = rank_counts(bounds)
        self._results_ready()
        self._gatherv(np.empty(0, np.float32), blocks, losses, self.MPI.FLOAT)
        return losses, self.workers * (self._header.nbytes + ids.nbytes + self._w.nbytes) + losses.nbytes

    @_request
    def request_eval(self, w: np.ndarray, counts: np.ndarray, width: int = 0,
                     personal: np.ndarray | None = None,
                     adapt: tuple[int, float] | None = None,
                     local: np.ndarray | None = None) -> EvalReply:
        """Rank 0: evaluate all K clients on the workers.

        Args:
            counts: (size,) clients per rank (rank 0 has none), from :func:`split_by_samples`.
            width: extra float64 statistics per client (group counts), 0 for none.
            personal: (K, d) float32 per-client parameters to evaluate as well, or None.
            adapt: ``(round, lr)``: evaluate after local adaptation too (minibatch order keyed
                by round), or None.
            local: (K, s) float32 every client's local coordinates (s = ``columns.state``),
                or None.
        """
        k = int(counts.sum())
        flag = ((PERSONAL if personal is not None else 0) | (ADAPTED if adapt is not None else 0)
                | (LOCAL if local is not None else 0))
        rnd, lr = adapt if adapt is not None else (0, 0.0)
        self._bcast_header(EVAL, rnd, lr, flag=flag)
        self._w[:] = w
        self._collective("Bcast", [self._w, self.MPI.FLOAT])
        sent = self.workers * (self._header.nbytes + self._w.nbytes)
        if personal is not None:
            self._scatterv(personal, counts * self.d, self.d, 0)
            sent += personal.nbytes
        if local is not None:
            local = np.ascontiguousarray(local, dtype=np.float32)
            self._scatterv(local, counts * self.columns.state, self.columns.state, 0)
            sent += local.nbytes
        self._results_ready()
        reply = EvalReply(self._gather_f64(counts), self._gather_f64(counts))
        if width:
            reply.counts = self._gather_f64(counts, width)
        if personal is not None:
            reply.personal_accuracy = self._gather_f64(counts)
            reply.personal_loss = self._gather_f64(counts)
        if adapt is not None:
            reply.adapted_accuracy = self._gather_f64(counts)
            reply.adapted_loss = self._gather_f64(counts)
        extra = 2 * ((personal is not None) + (adapt is not None))
        reply.bytes_moved = sent + 8 * k * (2 + width + extra)
        reply.peak_rss = self._gather_rank_stats(0.0)[:, 1]
        return reply

    def stop(self, code: int = 0) -> None:
        """Rank 0: release the workers; they exit with status ``code``."""
        self._bcast_header(STOP, code)

    def _gather_f64(self, counts: np.ndarray, width: int = 1) -> np.ndarray:
        k = int(counts.sum())
        out = np.empty((k, width) if width > 1 else k, dtype=np.float64)
        self._gatherv(np.empty(0, np.float64), counts * width, out, self.MPI.DOUBLE)
        return out

    # -- worker side -----------------------------------------------------------------------
    def receive(self, bounds_of=None) -> TrainRequest:
        """Worker: wait for the next request from rank 0.

        Args:
            bounds_of: ``bounds_of(command, client_ids) -> int``, the number of rows in this
                rank's block of a TRAIN (selected clients) or EVAL (all clients) request; needed
                to receive state rows or per-client parameters.
        """
        command, rnd, lr, m, flag = self._bcast_header()
        ids = np.empty(m, dtype=np.int64)
        req = TrainRequest(command, rnd, lr, ids, self._w)
        if command in (TRAIN, LOSSES):
            self._bcast_ids_w(ids, None)
        elif command == EVAL:
            self._collective("Bcast", [self._w, self.MPI.FLOAT])
        if command == TRAIN and self.columns.inputs:
            self._collective("Bcast", [self._inputs, self.MPI.DOUBLE])
            req.inputs = self._inputs
        if command == TRAIN and self.columns.state:
            req.state = self._scatterv(None, None, self.columns.state, bounds_of(command, ids))
        if command == EVAL and flag & PERSONAL:
            req.personal = self._scatterv(None, None, self.d, bounds_of(command, ids))
        if command == EVAL and flag & LOCAL:
            req.local = self._scatterv(None, None, self.columns.state, bounds_of(command, ids))
        req.adapt = command == EVAL and bool(flag & ADAPTED)
        return req

    def send_updates(self, updates: np.ndarray, losses: np.ndarray, stats: np.ndarray | None,
                     seconds: float, blocks: np.ndarray | None = None) -> np.ndarray | None:
        """Worker: contribute this rank's block of updates (m_r, d), losses (m_r,) and
        statistics rows (m_r, S).

        Args:
            blocks: (size,) selected clients per rank (:func:`rank_counts`; used on a sharded
                server only).

        Returns:
            On a shard rank of a sharded server, its column block of every selected client's
            update (m, hi - lo) float32; else None.
        """
        self._results_ready()
        mine = None
        if self.shard_bounds is None:
            self._gatherv(np.ascontiguousarray(updates, dtype=np.float32), None, None,
                          self.MPI.FLOAT)
        else:
            mine = self._gather_shards(updates, blocks)
        self._gatherv(np.ascontiguousarray(losses, dtype=np.float32), None, None, self.MPI.FLOAT)
        if self.columns.stats_width:
            self._gatherv(np.ascontiguousarray(stats, dtype=np.float32), None, None, self.MPI.FLOAT)
        self._gather_rank_stats(seconds)
        return mine

    def _gather_shards(self, updates: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        """Sharded server: one Gatherv per shard j (root: rank j) of every rank's column block
        j of its (m_r, d) updates; returns this rank's gathered (m, hi - lo) block when it is a
        shard, else None."""
        mine, m = None, int(blocks.sum())
        displs = np.concatenate([[0], np.cumsum(blocks[:-1])]).astype(np.int64)
        for j, (lo, hi) in enumerate(zip(self.shard_bounds[:-1], self.shard_bounds[1:])):
            width = int(hi - lo)
            part = np.ascontiguousarray(updates[:, lo:hi], dtype=np.float32)
            if self.rank == j:
                mine = np.empty((m, width), dtype=np.float32)
                recv = [mine, blocks * width, displs * width, self.MPI.FLOAT]
            else:
                recv = None
            self._collective("Gatherv", [part, self.MPI.FLOAT], recv, root=j)
        return mine

    @_request
    def request_checkpoint(self, rounds_done: int, write) -> np.ndarray:
        """Rank 0 (sharded server): every shard rank writes its blocks of the rule's state for
        the checkpoint after ``rounds_done`` rounds, rank 0 by calling ``write() -> status``
        meanwhile; (size,) float64 status per rank, 0 = ok."""
        self._bcast_header(CHECKPOINT, rounds_done)
        return self._gather_status(write())

    def send_status(self, status: float) -> None:
        """Worker: answer a CHECKPOINT request (0 = written or nothing to write)."""
        self._gather_status(status)

    def _gather_status(self, status: float) -> np.ndarray | None:
        send = np.array([status], dtype=np.float64)
        recv = np.empty(self.size, dtype=np.float64) if self.rank == 0 else None
        self._collective("Gather", [send, self.MPI.DOUBLE],
                         [recv, self.MPI.DOUBLE] if recv is not None else None)
        return recv

    def send_losses(self, losses: np.ndarray) -> None:
        """Worker: contribute this rank's block of losses (m_r,) for a LOSSES request."""
        self._results_ready()
        self._gatherv(np.ascontiguousarray(losses, dtype=np.float32), None, None, self.MPI.FLOAT)

    def send_eval(self, accuracy: np.ndarray, loss: np.ndarray, stats: np.ndarray | None,
                  personal: tuple[np.ndarray, np.ndarray] | None = None,
                  adapted: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Worker: contribute this rank's share of accuracies, losses, (if any) statistics,
        (for a personal evaluation) the personal accuracies and losses and (for an adapted
        one) the adapted accuracies and losses, each (K_r,) float64."""
        self._results_ready()
        arrays = ([accuracy, loss] + ([stats] if stats is not None else []) + list(personal or ())
                  + list(adapted or ()))
        for a in arrays:
            self._gatherv(np.ascontiguousarray(a, np.float64), None, None, self.MPI.DOUBLE)
        self._gather_rank_stats(0.0)  # peak memory after the evaluation

    def _gather_rank_stats(self, seconds: float) -> np.ndarray | None:
        """(size, 2) float64 on rank 0: every rank's [seconds, peak resident bytes]."""
        send = np.array([seconds, peak_rss_bytes()], dtype=np.float64)
        recv = np.empty((self.size, 2), dtype=np.float64) if self.rank == 0 else None
        self._collective("Gather", [send, self.MPI.DOUBLE],
                         [recv, self.MPI.DOUBLE] if recv is not None else None)
        return recv

    def abort(self, code: int) -> None:
        """End every rank of the job now (a rank failed; never leave the others hanging).

        Waits ``ABORT_GRACE_S`` first: mpiexec tears the job down on the first abort and drops
        output it has not forwarded yet, so the failing rank's one-line message (printed just
        before) would be lost when two ranks give up at the same moment.
        """
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)
