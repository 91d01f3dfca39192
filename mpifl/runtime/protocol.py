"""The round protocol on flat numpy buffers (no pickle on the hot path): one object per command,
holding both of its ends.

Every request from rank 0 starts with a ``Bcast`` of a small float64 header
``[command, round, lr, m, flag, window]``, then, depending on the command:

* ``TRAIN``: ``Bcast`` of the selected client ids (m,) int64, of the global parameters (d,)
  float32 and, when the trainer takes them (:class:`mpifl.clients.Columns`), of the round inputs
  (A,) float64 (mFairFL's multipliers); ``Scatterv`` of per-client state rows (m, s) float32
  (Ditto's personal models) when the trainer keeps such state. Each worker trains its contiguous
  block of the ids (:func:`mpifl.runtime.comm.split_by_samples`, computed identically on every rank, so no
  assignment message is needed); ``Gatherv`` of the updates (m, d) float32, the pre-training
  losses (m,) float32 and the statistics rows (m, S) float32 into rank 0, already in id order;
  ``Gather`` of each rank's training seconds and peak resident memory.
* ``LOSSES``: ``Bcast`` of client ids and of candidate parameters; ``Gatherv`` of those
  clients' mean training losses (m,) float32 — an evaluation-only request (FedMDFG's line
  search), same blocks as TRAIN.
* ``EVAL``: ``Bcast`` of the parameters; each worker evaluates its static share of all K clients
  (or, with a header m > 0, ``run.eval_clients``: ``Bcast`` of the m sampled client ids first,
  and each worker evaluates its block of them, blocks of about equal test samples);
  ``Gatherv`` of accuracies and losses (K,) float64 and, on data with a sensitive attribute,
  of per-client group counts (K, G*2*3) float64. With bit :data:`PERSONAL` of ``flag``,
  ``Scatterv`` of per-client parameters (K, d) float32 follows and their accuracies and losses
  (Ditto's personal models) are gathered too. With bit :data:`ADAPTED` (``run.adapt_epochs``),
  each worker also trains its clients locally from the parameters (minibatch order keyed by
  the header's round, the header's lr) and the adapted accuracies and losses (K,) float64 are
  gathered last; round and lr are 0 in an EVAL header without it. With bit :data:`LOCAL`
  (local BatchNorm), ``Scatterv`` of every client's local coordinates (K, s) float32 (s =
  the trainer's state width) comes before the evaluation, and each client is evaluated with
  its own. A lazy population's share goes through the trainer in windows of about the header's
  ``window`` samples (``run.eval_window_samples``), and beside the collectives runs a small
  point-to-point channel (:class:`EvalWatch`, :class:`EvalReport`): each worker sends rank 0
  ``[done, total, final]`` (its clients evaluated so far) at most every :data:`REPORT_S`
  between windows and once before its results, and rank 0, which polls them while it waits,
  sends each worker exactly one verdict: 1 as soon as the server asks to stop (a signal; the
  worker then stops at its next window and replies NaN for the clients it did not reach), else
  0 once every worker has its results. Exactly one verdict and one final message a worker and
  request, so nothing is left unmatched, and the gathers that follow are unchanged.
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
announced by an ``Ibarrier``, both completed by :func:`mpifl.runtime.comm.wait_idle`, which sleeps between tests.
MPICH's blocking calls spin, and when ranks share cores (3 ranks on a 2-core machine) the
spinning ranks take CPU time from the one doing the work.

Each command is a class below (:class:`Train`, :class:`Losses`, :class:`Eval`,
:class:`Checkpoint`, :class:`Stop`) with rank 0's end (``request``, answered by a named reply
record) beside the workers' ends (``receive``, the payload after the header; ``serve``, which
asks the worker's :class:`WorkerRank` for its part and sends it with ``reply``), so the order
of their collectives can be read, and changed, in one place. A worker's loop is
:meth:`MPITransport.serve_next` until STOP: it dispatches through the same objects rank 0 uses.
They share the buffers and collectives of one :class:`Wire`.
Only upper-case (buffer) mpi4py calls are used in rounds.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from mpifl.core.wire import Columns
from mpifl.runtime.comm import ABORT_GRACE_S, peak_rss_bytes, rank_counts, wait_idle

STOP, TRAIN, EVAL, LOSSES, CHECKPOINT = 0, 1, 2, 3, 4
HEADER_LEN = 6
#: Bits of an EVAL header's flag: per-client parameters follow (Ditto); evaluate after local
#: adaptation too (run.adapt_epochs); per-client local coordinates follow (local BatchNorm).
PERSONAL, ADAPTED, LOCAL = 1, 2, 4
#: Tags of an EVAL's point-to-point channel: a worker's progress, rank 0's verdict.
PROGRESS_TAG, VERDICT_TAG = 0x6D70, 0x6D71
#: Seconds between rank 0's looks at the progress messages (and the stop) while workers
#: evaluate; the least seconds between two progress messages of a worker.
POLL_S, REPORT_S = 0.05, 0.25

@dataclass
class Request:
    """What a worker receives for one request (any command)."""

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
    window: int = 0  # EVAL: samples of a lazy population's window (0: the default)


@dataclass
class TrainBlock:
    """A worker's results for one TRAIN request: its block of the selected clients, in
    client-id order."""

    updates: np.ndarray  # (m_r, d) float32
    losses: np.ndarray  # (m_r,) float32, the global model's loss before training
    stats: np.ndarray  # (m_r, S) float32 statistics rows (S = columns.stats_width, may be 0)
    seconds: float  # training seconds on this rank
    #: (size,) int64 selected clients per rank (rank_counts), which a sharded server's column
    #: gathers need
    per_rank: np.ndarray


@dataclass
class Evaluated:
    """One rank's evaluation of some clients, each array in the order of the clients: (n,)
    float64 accuracies and losses, (n, G*2*3) group counts or None, and the (accuracy, loss)
    pairs at the personal models and after local adaptation, or None."""

    accuracy: np.ndarray
    loss: np.ndarray
    counts: np.ndarray | None = None
    personal: tuple[np.ndarray, np.ndarray] | None = None
    adapted: tuple[np.ndarray, np.ndarray] | None = None
    #: False: stopped between windows (``on_progress``); the clients not reached are NaN
    complete: bool = True


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
class LossesReply:
    """What rank 0 collects for one LOSSES request."""

    losses: np.ndarray  # (m,) float32 mean training losses in client-id order
    bytes_moved: int


@dataclass
class EvalReply:
    """What rank 0 collects for one EVAL request (per client, (K,) each)."""

    accuracy: np.ndarray
    loss: np.ndarray
    counts: np.ndarray | None = None  # (K, width) float64 group counts
    #: (accuracy, loss) at each client's personal model (Ditto), or None
    personal: tuple[np.ndarray, np.ndarray] | None = None
    #: (accuracy, loss) after local adaptation (run.adapt_epochs), or None
    adapted: tuple[np.ndarray, np.ndarray] | None = None
    bytes_moved: int = 0
    #: (size,) float64 every rank's peak resident bytes (getrusage) after the evaluation
    peak_rss: np.ndarray | None = None
    #: stopped before every client was evaluated (a stop request): drop it, the arrays hold NaN
    stopped: bool = False


class Wire:
    """The buffers and collectives every command uses, over ``comm`` (rank 0 = server, ranks
    >= 1 = workers).

    Args:
        comm: an mpi4py intracommunicator of size >= 2.
        d: number of model parameters.
        columns: the trainer's per-round extras (the same on every rank, from the plan).
        peer_timeout: seconds a rank waits for the others at the protocol's two waits (the
            workers' results, rank 0's next request) before :class:`PeerLost`; 0 = forever.
        shard_bounds: (P + 1,) coordinate block bounds of a sharded server (P > 1; shard j is
            rank j), or None: rank 0 gathers the whole updates.
    """

    def __init__(self, comm: Any, d: int, columns: Columns = Columns(), peer_timeout: float = 0.0,
                 shard_bounds: np.ndarray | None = None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.workers = self.size - 1
        self.d = d
        self.columns = columns
        self.header = np.zeros(HEADER_LEN, dtype=np.float64)
        self.w = np.empty(d, dtype=np.float32)
        self.inputs = np.zeros(columns.inputs, dtype=np.float64)
        self._updates = np.empty((0, d), dtype=np.float32)  # grown on demand, reused
        self.busy = False  # rank 0: inside a request (see _request)
        self.peer_timeout = float(peer_timeout)
        self.shard_bounds = shard_bounds

    def bcast_header(self, command: int = 0, rnd: int = 0, lr: float = 0.0, m: int = 0,
                     flag: int = 0, window: int = 0
                     ) -> tuple[int, int, float, int, int, int]:
        if self.rank == 0:
            self.header[:] = (command, rnd, lr, m, flag, window)
        # workers may wait here through a whole aggregation: sleep instead of spinning
        wait_idle(self.comm.Ibcast([self.header, self.MPI.DOUBLE], root=0),
                  timeout=self.peer_timeout, waiting_for="rank 0" if self.rank else "a worker rank")
        c, r, lr_, m_, f, win = self.header
        return int(c), int(r), float(lr_), int(m_), int(f), int(win)

    def results_ready(self, poll: Callable[[], None] | None = None) -> None:
        """Rank 0 and the workers meet here once every worker has its results, so that rank 0
        sleeps through the workers' training or evaluation instead of spinning in a Gatherv;
        ``poll()`` runs every :data:`POLL_S` meanwhile (rank 0: an evaluation's progress)."""
        request = self.comm.Ibarrier()
        wait_idle(request if poll is None else _Polled(request, poll), timeout=self.peer_timeout,
                  waiting_for="rank 0" if self.rank else "a worker rank")

    def collective(self, name: str, *args: Any, root: int = 0) -> None:
        """Run the blocking collective ``name`` (Bcast, Gatherv, Scatterv, Gather); with a peer
        timeout, its nonblocking form completed under that timeout instead, so that a rank
        that hangs mid-collective cannot hold the others forever."""
        if not self.peer_timeout:
            getattr(self.comm, name)(*args, root=root)
            return
        # spin (no sleep): large transfers progress only while the request is tested
        wait_idle(getattr(self.comm, "I" + name.lower())(*args, root=root), max_sleep=0.0,
                  timeout=self.peer_timeout, waiting_for="another rank")

    def gatherv(self, local: np.ndarray, counts: np.ndarray | None, out: np.ndarray | None,
                mpitype: Any) -> None:
        """Gather contiguous blocks (rank 0 sends nothing) into ``out`` on rank 0."""
        if self.rank == 0:
            assert counts is not None  # rank 0 passes the blocks it receives
            displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
            self.collective("Gatherv", [local, 0, mpitype], [out, counts, displs, mpitype])
        else:
            self.collective("Gatherv", [local, mpitype], None)

    def send_block(self, a: np.ndarray, dtype: npt.DTypeLike = np.float32) -> None:
        """Worker: this rank's contiguous block of a gathered array."""
        mpitype = self.MPI.FLOAT if dtype == np.float32 else self.MPI.DOUBLE
        self.gatherv(np.ascontiguousarray(a, dtype=dtype), None, None, mpitype)

    def scatterv(self, rows: np.ndarray | None, counts: np.ndarray | None, width: int,
                 mine: int) -> np.ndarray | None:
        """Send contiguous row blocks of ``rows`` (n, width) float32 from rank 0; a worker
        receives its ``mine`` rows."""
        if self.rank == 0:
            assert counts is not None  # rank 0 passes the blocks it sends
            displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
            self.collective("Scatterv", [np.ascontiguousarray(rows, np.float32), counts, displs,
                                         self.MPI.FLOAT], [np.empty(0, np.float32), self.MPI.FLOAT])
            return None
        out = np.empty((mine, width), dtype=np.float32)
        self.collective("Scatterv", None, [out, self.MPI.FLOAT])
        return out

    def updates_buffer(self, m: int) -> np.ndarray:
        if self._updates.shape[0] < m:
            self._updates = np.empty((m, self.d), dtype=np.float32)
        return self._updates[:m]

    def bcast_ids_w(self, ids: np.ndarray, w: np.ndarray | None) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        self.collective("Bcast", [ids, self.MPI.INT64_T])
        if self.rank == 0:
            self.w[:] = w
        self.collective("Bcast", [self.w, self.MPI.FLOAT])
        return ids

    def gather_f64(self, counts: np.ndarray, width: int = 1) -> np.ndarray:
        k = int(counts.sum())
        out = np.empty((k, width) if width > 1 else k, dtype=np.float64)
        self.gatherv(np.empty(0, np.float64), counts * width, out, self.MPI.DOUBLE)
        return out

    def gather_shards(self, updates: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        """Sharded server: one Gatherv per shard j (root: rank j) of every rank's column block
        j of its (m_r, d) updates; returns this rank's gathered (m, hi - lo) block when it is a
        shard, else None."""
        assert self.shard_bounds is not None  # called on a sharded server only
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
            self.collective("Gatherv", [part, self.MPI.FLOAT], recv, root=j)
        return mine

    def gather_status(self, status: float) -> np.ndarray | None:
        send = np.array([status], dtype=np.float64)
        recv = np.empty(self.size, dtype=np.float64) if self.rank == 0 else None
        self.collective("Gather", [send, self.MPI.DOUBLE],
                        [recv, self.MPI.DOUBLE] if recv is not None else None)
        return recv

    def gather_rank_stats(self, seconds: float) -> np.ndarray | None:
        """(size, 2) float64 on rank 0: every rank's [seconds, peak resident bytes]."""
        send = np.array([seconds, peak_rss_bytes()], dtype=np.float64)
        recv = np.empty((self.size, 2), dtype=np.float64) if self.rank == 0 else None
        self.collective("Gather", [send, self.MPI.DOUBLE],
                        [recv, self.MPI.DOUBLE] if recv is not None else None)
        return recv


class _Polled:
    """An MPI request whose ``Test`` also runs ``poll()`` every :data:`POLL_S`, so that
    :func:`mpifl.runtime.comm.wait_idle` (its sleeps and its timeout) serves a polling wait."""

    def __init__(self, request: Any, poll: Callable[[], None]) -> None:
        self.request, self.poll, self.next = request, poll, 0.0

    def Test(self) -> bool:  # noqa: N802 -- mpi4py's name
        now = time.monotonic()
        if now >= self.next:
            self.poll()
            self.next = now + POLL_S
        done: bool = self.request.Test()
        return done


class EvalWatch:
    """Rank 0's end of one EVAL's progress channel (see the module docstring).

    Args:
        wire: the :class:`Wire`. total: the clients of the evaluation.
        on_progress: ``on_progress(done, total) -> bool``, told the clients done on all
            workers together at every poll; False sends every worker the verdict to stop.
    """

    def __init__(self, wire: Wire, total: int,
                 on_progress: Callable[[int, int], bool] | None = None) -> None:
        self.wire, self.total, self.on_progress = wire, total, on_progress
        self.done = np.zeros(wire.size, np.int64)
        self.share = np.zeros(wire.size, np.int64)  # each worker's clients
        self.final = np.zeros(wire.size, bool)
        self.final[0] = True
        self.sent = False
        self.sends: list[tuple[Any, np.ndarray]] = []  # (MPI request, its buffer)
        self.buf = np.empty(3, np.float64)

    def poll(self) -> None:
        """Take the progress messages that arrived; ask to stop if ``on_progress`` says so."""
        x, status = self.wire, self.wire.MPI.Status()
        while x.comm.Iprobe(source=x.MPI.ANY_SOURCE, tag=PROGRESS_TAG, status=status):
            self._receive(status.Get_source())
        keep_going = self.on_progress is None or self.on_progress(int(self.done.sum()),
                                                                  self.total)
        if not keep_going and not self.sent:
            self._verdicts(1.0)

    def settle(self) -> None:
        """After every worker has its results: the verdict 0 if none was sent, then every
        worker's final message (sent before its results, so it is there or on its way)."""
        if not self.sent:
            self._verdicts(0.0)
        for r in range(1, self.wire.size):
            while not self.final[r]:
                self._receive(r)
        if self.on_progress is not None:
            self.on_progress(int(self.done.sum()), self.total)

    def close(self) -> None:
        """Complete the verdicts' sends (each worker posted its receive before evaluating)."""
        for request, _ in self.sends:
            wait_idle(request, timeout=self.wire.peer_timeout, waiting_for="a worker rank")
        self.sends.clear()

    @property
    def complete(self) -> bool:
        """Every worker evaluated all its clients (a late stop verdict changed nothing)."""
        return bool(np.all(self.done == self.share))

    def _receive(self, source: int) -> None:
        x = self.wire
        wait_idle(x.comm.Irecv([self.buf, x.MPI.DOUBLE], source=source, tag=PROGRESS_TAG),
                  timeout=x.peer_timeout, waiting_for=f"rank {source}")
        done, share, final = self.buf
        self.done[source], self.share[source] = int(done), int(share)
        self.final[source] = bool(final)

    def _verdicts(self, value: float) -> None:
        x, self.sent = self.wire, True
        for r in range(1, x.size):
            buf = np.array([value], np.float64)
            self.sends.append((x.comm.Isend([buf, x.MPI.DOUBLE], dest=r, tag=VERDICT_TAG), buf))


class EvalReport:
    """A worker's end of one EVAL's progress channel (see the module docstring): called as
    ``report(done, total) -> bool`` between windows (:data:`mpifl.runtime.backends.OnProgress`);
    False once rank 0's verdict says stop. Built when the request arrives (its verdict's
    receive is posted then)."""

    def __init__(self, wire: Wire) -> None:
        self.wire, self.done, self.total = wire, 0, 0
        self.verdict = np.zeros(1, np.float64)
        self.request = wire.comm.Irecv([self.verdict, wire.MPI.DOUBLE], source=0,
                                       tag=VERDICT_TAG)
        self.arrived = False
        self.sends: list[tuple[Any, np.ndarray]] = []  # (MPI request, its buffer)
        self.last = -np.inf

    def __call__(self, done: int, total: int) -> bool:
        self.done, self.total = done, total
        if time.monotonic() - self.last >= REPORT_S:
            self._send(0.0)
        return not self.stop

    @property
    def stop(self) -> bool:
        """Rank 0's verdict has come and says stop."""
        if not self.arrived:
            self.arrived = bool(self.request.Test())
        return self.arrived and self.verdict[0] == 1.0

    def end(self) -> None:
        """The final message, before the results."""
        self._send(1.0)

    def close(self) -> None:
        """After the results: the verdict (rank 0 sends it at the latest once every worker has
        its results) and the sends complete."""
        x = self.wire
        if not self.arrived:
            wait_idle(self.request, timeout=x.peer_timeout, waiting_for="rank 0")
        for request, _ in self.sends:
            wait_idle(request, timeout=x.peer_timeout, waiting_for="rank 0")
        self.sends.clear()

    def _send(self, final: float) -> None:
        x = self.wire
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]
        buf = np.array([self.done, self.total, final], np.float64)
        self.sends.append((x.comm.Isend([buf, x.MPI.DOUBLE], dest=0, tag=PROGRESS_TAG), buf))
        self.last = time.monotonic()


CommandT = TypeVar("CommandT", bound="Command")
P = ParamSpec("P")
R = TypeVar("R")


def _request(method: Callable[Concatenate[CommandT, P], R]
             ) -> Callable[Concatenate[CommandT, P], R]:
    """Rank 0's ``request`` methods: ``busy`` while a request's collectives are under way, so
    that after a failure rank 0 knows whether the workers are waiting for the next header (then
    a STOP releases them cleanly) or are inside a collective (then only MPI_Abort ends them)."""

    @functools.wraps(method)
    def wrapped(self: CommandT, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.wire.busy = True
        out = method(self, *args, **kwargs)
        self.wire.busy = False  # left True when the request raised
        return out

    return wrapped


#: ``rows(command, client_ids) -> int``: the rows of this rank's block of a TRAIN (selected
#: clients) or EVAL (clients evaluated) request, to receive state rows or per-client parameters.
RowsOf = Callable[[int, np.ndarray], int]


class WorkerRank(Protocol):
    """What a worker rank does for each command (:class:`mpifl.runtime.worker.Worker`
    implements it). The commands' ``serve`` calls these between receiving a request and
    sending its reply, so the order of every collective stays in this module."""

    def rows(self, command: int, client_ids: np.ndarray) -> int:
        """:data:`RowsOf`."""
        ...

    def train(self, req: Request) -> TrainBlock:
        """TRAIN: this rank's block of the selected clients trained from ``req.w``."""
        ...

    def trained(self, req: Request, columns: np.ndarray | None) -> None:
        """After a TRAIN's reply: ``columns`` is this shard rank's column block of every
        update (m, hi - lo) float32 on a sharded server, else None."""
        ...

    def losses(self, req: Request) -> np.ndarray:
        """LOSSES: (m_r,) float32 mean training losses of this rank's block at ``req.w``."""
        ...

    def evaluate(self, req: Request, report: EvalReport) -> Evaluated:
        """EVAL: this rank's clients at ``req.w``, ``report`` told the progress."""
        ...

    def checkpoint(self, req: Request) -> float:
        """CHECKPOINT: write this shard's state for round ``req.round``; 0 = written or
        nothing to write."""
        ...


class Command:
    """One command of the protocol: its header code and the :class:`Wire` it travels on."""

    code = -1

    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    def receive(self, req: Request, flag: int, rows: RowsOf | None) -> None:
        """Worker: the request's payload after the header (none by default)."""

    def serve(self, req: Request, worker: WorkerRank) -> int | None:
        """Worker: do what the received request ``req`` asks and reply; an exit status ends
        the worker's loop (STOP), None goes on."""
        raise NotImplementedError


class Train(Command):
    """TRAIN: the selected clients train from the global parameters; their updates, losses and
    statistics rows come back (to the shards' column blocks on a sharded server)."""

    code = TRAIN

    @_request
    def request(self, rnd: int, lr: float, client_ids: np.ndarray, w: np.ndarray,
                bounds: np.ndarray, inputs: np.ndarray | None = None,
                state: np.ndarray | None = None, phase: Callable[[str], None] | None = None
                ) -> TrainReply:
        """Rank 0: send a TRAIN request and collect the results.

        Args:
            client_ids: (m,) int64 selected clients, ascending. w: (d,) float32.
            bounds: (workers + 1,) block bounds from :func:`mpifl.runtime.comm.split_by_samples`.
            inputs: (columns.inputs,) float64 round inputs (required when columns.inputs > 0).
            state: (m, columns.state) float32 state rows (required when columns.state > 0).
            phase: called ``phase("gathering")`` once every worker has trained (progress
                lines), or None.
        """
        x, m = self.wire, len(client_ids)
        cols = x.columns
        t0 = time.perf_counter()
        x.bcast_header(TRAIN, rnd, lr, m)
        ids = x.bcast_ids_w(client_ids, w)
        sent = x.workers * (x.header.nbytes + ids.nbytes + x.w.nbytes)
        blocks = rank_counts(bounds)
        if cols.inputs:
            x.inputs[:] = inputs
            x.collective("Bcast", [x.inputs, x.MPI.DOUBLE])
            sent += x.workers * x.inputs.nbytes
        if cols.state:
            x.scatterv(state, blocks * cols.state, cols.state, 0)
            sent += m * cols.state * 4
        t_bcast = time.perf_counter() - t0
        x.results_ready()
        if phase is not None:
            phase("gathering")
        updates: np.ndarray | None
        if x.shard_bounds is None:
            updates = x.updates_buffer(m)
            x.gatherv(np.empty(0, np.float32), blocks * x.d, updates, x.MPI.FLOAT)
        else:  # this rank's column block only (shard 0)
            updates = x.gather_shards(np.empty((0, x.d), np.float32), blocks)
        losses = np.empty(m, dtype=np.float32)
        x.gatherv(np.empty(0, np.float32), blocks, losses, x.MPI.FLOAT)
        stats = None
        if cols.stats_width:
            stats = np.empty((m, cols.stats_width), dtype=np.float32)
            x.gatherv(np.empty(0, np.float32), blocks * cols.stats_width, stats, x.MPI.FLOAT)
        ranks = x.gather_rank_stats(0.0)
        assert updates is not None and ranks is not None  # rank 0 (shard 0) receives
        received = m * x.d * 4 + losses.nbytes + (stats.nbytes if stats is not None else 0)
        return TrainReply(updates, losses, stats, ranks[:, 0], ranks[:, 1], sent + received,
                          t_bcast)

    def receive(self, req: Request, flag: int, rows: RowsOf | None) -> None:
        x = self.wire
        x.bcast_ids_w(req.client_ids, None)
        if x.columns.inputs:
            x.collective("Bcast", [x.inputs, x.MPI.DOUBLE])
            req.inputs = x.inputs
        if x.columns.state:
            assert rows is not None, "a trainer with state rows needs the worker's rows"
            req.state = x.scatterv(None, None, x.columns.state, rows(TRAIN, req.client_ids))

    def serve(self, req: Request, worker: WorkerRank) -> None:
        block = worker.train(req)
        columns = self.reply(block)
        del block  # the round's (m_r, d) updates are gone before a shard aggregates
        worker.trained(req, columns)

    def reply(self, block: TrainBlock) -> np.ndarray | None:
        """Worker: contribute this rank's block of updates, losses and statistics rows.

        Returns:
            On a shard rank of a sharded server, its column block of every selected client's
            update (m, hi - lo) float32; else None.
        """
        x = self.wire
        x.results_ready()
        mine = None
        if x.shard_bounds is None:
            x.send_block(block.updates)
        else:
            mine = x.gather_shards(block.updates, block.per_rank)
        x.send_block(block.losses)
        if x.columns.stats_width:
            x.send_block(block.stats)
        x.gather_rank_stats(block.seconds)
        return mine


class Losses(Command):
    """LOSSES: the clients' mean training losses at candidate parameters (evaluation only, no
    training; FedMDFG's line search), same blocks as TRAIN."""

    code = LOSSES

    @_request
    def request(self, client_ids: np.ndarray, w: np.ndarray, bounds: np.ndarray
                ) -> LossesReply:
        """Rank 0: the clients' losses at ``w`` (``bounds`` as :meth:`Train.request`'s)."""
        x, m = self.wire, len(client_ids)
        x.bcast_header(LOSSES, 0, 0.0, m)
        ids = x.bcast_ids_w(client_ids, w)
        losses = np.empty(m, dtype=np.float32)
        blocks = rank_counts(bounds)
        x.results_ready()
        x.gatherv(np.empty(0, np.float32), blocks, losses, x.MPI.FLOAT)
        return LossesReply(losses, x.workers * (x.header.nbytes + ids.nbytes + x.w.nbytes)
                           + losses.nbytes)

    def receive(self, req: Request, flag: int, rows: RowsOf | None) -> None:
        self.wire.bcast_ids_w(req.client_ids, None)

    def serve(self, req: Request, worker: WorkerRank) -> None:
        self.reply(worker.losses(req))

    def reply(self, losses: np.ndarray) -> None:
        """Worker: this rank's block of losses (m_r,)."""
        self.wire.results_ready()
        self.wire.send_block(losses)


class Eval(Command):
    """EVAL: every client evaluated by the workers (each a static share), with per-client
    parameters (PERSONAL), after local adaptation (ADAPTED), with local coordinates (LOCAL)."""

    code = EVAL

    @_request
    def request(self, w: np.ndarray, counts: np.ndarray, width: int = 0,
                personal: np.ndarray | None = None, adapt: tuple[int, float] | None = None,
                local: np.ndarray | None = None, ids: np.ndarray | None = None,
                window: int | None = None,
                on_progress: Callable[[int, int], bool] | None = None) -> EvalReply:
        """Rank 0: evaluate all K clients on the workers, or the clients ``ids``.

        Args:
            counts: (size,) clients per rank (rank 0 has none), from
                :func:`mpifl.runtime.comm.split_by_samples`.
            width: extra float64 statistics per client (group counts), 0 for none.
            personal: (K, d) float32 per-client parameters to evaluate as well, or None.
            adapt: ``(round, lr)``: evaluate after local adaptation too (minibatch order keyed
                by round), or None.
            local: (K, s) float32 every client's local coordinates (s = ``columns.state``),
                or None.
            ids: (n,) int64 ascending, the clients to evaluate (``run.eval_clients``; the
                workers' blocks by test samples, ``counts`` theirs), or None for all K clients
                (each worker its static share). ``personal`` and ``local`` then hold n rows.
            window: samples of a lazy population's window (``run.eval_window_samples``; None:
                the workers' default).
            on_progress: ``on_progress(done, total) -> bool`` (:class:`EvalWatch`): told the
                clients evaluated so far every :data:`POLL_S`; False stops every worker at its
                next window, and the reply is then ``stopped`` unless all had finished.
        """
        x, k = self.wire, int(counts.sum())
        m = 0 if ids is None else len(ids)
        flag = ((PERSONAL if personal is not None else 0) | (ADAPTED if adapt is not None else 0)
                | (LOCAL if local is not None else 0))
        rnd, lr = adapt if adapt is not None else (0, 0.0)
        x.bcast_header(EVAL, rnd, lr, m, flag, window or 0)
        if m:
            assert ids is not None  # m > 0: the sampled clients
            sent = x.workers * (x.header.nbytes + x.bcast_ids_w(ids, w).nbytes + x.w.nbytes)
        else:
            x.w[:] = w
            x.collective("Bcast", [x.w, x.MPI.FLOAT])
            sent = x.workers * (x.header.nbytes + x.w.nbytes)
        if personal is not None:
            x.scatterv(personal, counts * x.d, x.d, 0)
            sent += personal.nbytes
        if local is not None:
            local = np.ascontiguousarray(local, dtype=np.float32)
            x.scatterv(local, counts * x.columns.state, x.columns.state, 0)
            sent += local.nbytes
        watch = EvalWatch(x, k, on_progress)
        x.results_ready(watch.poll)
        watch.settle()
        reply = EvalReply(x.gather_f64(counts), x.gather_f64(counts))
        if width:
            reply.counts = x.gather_f64(counts, width)
        if personal is not None:
            reply.personal = (x.gather_f64(counts), x.gather_f64(counts))
        if adapt is not None:
            reply.adapted = (x.gather_f64(counts), x.gather_f64(counts))
        extra = 2 * ((personal is not None) + (adapt is not None))
        reply.bytes_moved = sent + 8 * k * (2 + width + extra)
        ranks = x.gather_rank_stats(0.0)
        assert ranks is not None  # rank 0 receives
        reply.peak_rss = ranks[:, 1]
        watch.close()
        reply.stopped = not watch.complete
        return reply

    def receive(self, req: Request, flag: int, rows: RowsOf | None) -> None:
        x = self.wire
        if len(req.client_ids):  # the clients to evaluate (run.eval_clients), then w
            x.bcast_ids_w(req.client_ids, None)
        else:
            x.collective("Bcast", [x.w, x.MPI.FLOAT])
        if flag & (PERSONAL | LOCAL):
            assert rows is not None, "per-client rows need the worker's rows"
            mine = rows(EVAL, req.client_ids)
            if flag & PERSONAL:
                req.personal = x.scatterv(None, None, x.d, mine)
            if flag & LOCAL:
                req.local = x.scatterv(None, None, x.columns.state, mine)
        req.adapt = bool(flag & ADAPTED)

    def serve(self, req: Request, worker: WorkerRank) -> None:
        report = EvalReport(self.wire)  # its verdict's receive is posted before evaluating
        self.reply(report, worker.evaluate(req, report))

    def reply(self, report: EvalReport, result: Evaluated) -> None:
        """Worker: this rank's share of accuracies, losses, (if any) statistics, (for a
        personal evaluation) the personal accuracies and losses and (for an adapted one) the
        adapted accuracies and losses, each (K_r,) float64; ``report`` sends its final message
        first and takes rank 0's verdict after."""
        report.end()
        self.wire.results_ready()
        arrays = ([result.accuracy, result.loss]
                  + ([result.counts] if result.counts is not None else [])
                  + list(result.personal or ()) + list(result.adapted or ()))
        for a in arrays:
            self.wire.send_block(a, np.float64)
        self.wire.gather_rank_stats(0.0)  # peak memory after the evaluation
        report.close()


class Checkpoint(Command):
    """CHECKPOINT (sharded server): every shard rank writes its blocks of the rule's state for
    the checkpoint after the header's round; every rank's status comes back."""

    code = CHECKPOINT

    @_request
    def request(self, rounds_done: int, write: Callable[[], float]) -> np.ndarray:
        """Rank 0: ``write() -> status`` runs here meanwhile; (size,) float64 status per rank,
        0 = ok."""
        self.wire.bcast_header(CHECKPOINT, rounds_done)
        status = self.wire.gather_status(write())
        assert status is not None  # rank 0 receives
        return status

    def reply(self, status: float) -> None:
        """Worker: 0 = written or nothing to write."""
        self.wire.gather_status(status)

    def serve(self, req: Request, worker: WorkerRank) -> None:
        self.reply(worker.checkpoint(req))


class Stop(Command):
    """STOP: the workers leave their loop and exit with the status in the header's round."""

    code = STOP

    def request(self, code: int = 0) -> None:
        """Rank 0: release the workers; they exit with status ``code``."""
        self.wire.bcast_header(STOP, code)

    def serve(self, req: Request, worker: WorkerRank) -> int:
        return req.round  # the exit status rode in the header's round


class MPITransport:
    """Both ends of the round protocol over ``comm``: one :class:`Wire` and its commands
    (``train``, ``losses``, ``eval``, ``checkpoint``, ``stop``); arguments as :class:`Wire`."""

    def __init__(self, comm: Any, d: int, columns: Columns = Columns(), peer_timeout: float = 0.0,
                 shard_bounds: np.ndarray | None = None) -> None:
        self.wire = x = Wire(comm, d, columns, peer_timeout, shard_bounds)
        self.comm, self.rank, self.size, self.workers = comm, x.rank, x.size, x.workers
        self.d, self.columns, self.shard_bounds = d, columns, shard_bounds
        self.train, self.losses, self.eval = Train(x), Losses(x), Eval(x)
        self.checkpoint, self.stop = Checkpoint(x), Stop(x)
        self._by_code = {c.code: c for c in (self.train, self.losses, self.eval,
                                             self.checkpoint, self.stop)}

    @property
    def busy(self) -> bool:
        """Rank 0: inside a request's collectives (a failure then needs MPI_Abort)."""
        return self.wire.busy

    def receive(self, rows: RowsOf | None = None) -> Request:
        """Worker: wait for the next request from rank 0 and receive its payload.

        Args:
            rows: :data:`RowsOf`, needed to receive state rows or per-client parameters.
        """
        command, rnd, lr, m, flag, window = self.wire.bcast_header()
        req = Request(command, rnd, lr, np.empty(m, dtype=np.int64), self.wire.w,
                      window=window)
        self._by_code[command].receive(req, flag, rows)
        return req

    def serve_next(self, worker: WorkerRank) -> int | None:
        """Worker: receive the next request and serve it through its command (the same
        objects rank 0's requests go through); the exit status once it was STOP, else None."""
        req = self.receive(worker.rows)
        return self._by_code[req.command].serve(req, worker)

    def abort(self, code: int) -> None:
        """End every rank of the job now (a rank failed; never leave the others hanging).

        Waits ``ABORT_GRACE_S`` first: mpiexec tears the job down on the first abort and drops
        output it has not forwarded yet, so the failing rank's one-line message (printed just
        before) would be lost when two ranks give up at the same moment.
        """
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)
