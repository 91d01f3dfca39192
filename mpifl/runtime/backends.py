"""How the server reaches its clients: in this process (world size 1) or on MPI worker ranks.

Both backends give the server loop the same calls (:class:`ClientBackend`: train, losses,
evaluate, stop), so :mod:`mpifl.runtime.server` does not know where clients run. Timings, byte counts and peak memory come
back with the results for /rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from mpifl.clients.interface import ClientTrainer
from mpifl.clients.trainer import TrainingStopped, stop_between_steps
from mpifl.core.wire import Columns
from mpifl.runtime.comm import (peak_rss_bytes, rank_counts, release_free_memory,
                                split_by_samples)
from mpifl.runtime.protocol import EvalReply, Evaluated, MPITransport


@dataclass
class TrainResult:
    updates: torch.Tensor  # (m, d) float32, u_k = w - w_k, rows in client-id order
    losses: torch.Tensor  # (m,) float32, global model's loss before training
    stats: dict[str, torch.Tensor]  # name -> (m,) or (m, width) float32 (trainer's Columns)
    time_broadcast: float  # seconds
    time_train: float  # seconds, slowest rank
    time_gather: float  # seconds spent waiting beyond the slowest training
    bytes_moved: int
    peak_rss_server: float  # bytes, rank 0
    peak_rss_worker: float  # bytes, largest over the worker ranks (rank 0 in one process)


def num_groups(fed: Any) -> int:
    """G sensitive groups of a binary task with a sensitive attribute (group metrics), else 0."""
    if getattr(fed, "sensitive", None) is None or fed.num_classes != 2:
        return 0
    return int(fed.sensitive.max()) + 1


def group_setup(fed: Any, device: torch.device) -> tuple[torch.Tensor, int] | None:
    """(sensitive (N,) int64 on ``device``, G) for binary tasks with a sensitive attribute."""
    g = num_groups(fed)
    return (torch.from_numpy(fed.sensitive).to(device), g) if g else None


def stats_width(num_groups: int) -> int:
    """Float64 statistics per client in an evaluation: G groups x 2 labels x 3 counts."""
    return num_groups * 2 * 3


def evaluate(trainer: ClientTrainer, w: torch.Tensor, idx: Sequence[np.ndarray],
             groups: tuple[torch.Tensor, int] | None, local: torch.Tensor | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Accuracy, loss and (with ``groups``) flat (n, G*2*3) group counts of some clients; with
    ``local`` (n, s) rows each client is evaluated with its own local coordinates."""
    if local is not None:
        out = trainer.evaluate_local(w, local, idx, groups)
        return out[0], out[1], None if groups is None else out[2].reshape(len(idx), -1)
    if groups is None:
        acc, loss = trainer.evaluate(w, idx)
        return acc, loss, None
    acc, loss, counts = trainer.evaluate_groups(w, idx, *groups)
    return acc, loss, counts.reshape(len(idx), -1)


#: Samples a lazy population draws at once in a streamed evaluation by default
#: (``run.eval_window_samples``): its clients go through the trainer in windows of about this
#: many samples (synthetic: 2^18 x 60 float32, ~64 MB).
STREAM_SAMPLES = 2**18

#: ``on_progress(done, total) -> bool`` of a streamed evaluation: called before each window
#: with the clients done so far and once at the end; False stops it before the next window.
OnProgress = Callable[[int, int], bool]


@contextmanager
def client_rows(fed: Any, client_ids: np.ndarray, *trainers: ClientTrainer | None
                ) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
    """The clients' rows in the trainers' sample store: ``(train, test)``, each a list of (n_k,)
    int64 index arrays in the order of ``client_ids``.

    Eager data (:class:`mpifl.data.FederatedData`): the store is the whole pool, the rows its
    own. A lazy population (:mod:`mpifl.data.lazy`): the clients are drawn into a window, which
    is each trainer's store inside the block (``None`` trainers are skipped); after the block
    the heap's free pages go back to the OS (:func:`release_free_memory`), or the windows of a
    long run would fragment it and a rank's memory would climb round after round. A population
    that draws whole windows on a device (``fed.device_windows``: Synthetic's counter generator)
    draws it on the first trainer's device (a worker's GPU), so the samples never cross the bus.
    """
    if not fed.lazy:
        yield [fed.train_indices(k) for k in client_ids], [fed.test_indices(k) for k in client_ids]
        return
    device = None
    if getattr(fed, "device_windows", False):
        device = next((_device_of(t) for t in trainers if t is not None), None)
    window = fed.clients(client_ids, device) if device is not None else fed.clients(client_ids)
    try:
        with ExitStack() as stack:
            for trainer in trainers:
                if trainer is not None:
                    stack.enter_context(trainer.samples(window.x, window.y))
            yield ([window.train_indices(j) for j in range(len(client_ids))],
                   [window.test_indices(j) for j in range(len(client_ids))])
    finally:
        del window
        release_free_memory()


def _device_of(trainer: Any) -> torch.device:
    """The device a trainer computes on (a wrapper forwards the wrapped trainer's), else its
    sample store's."""
    return torch.device(getattr(trainer, "device", trainer.x.device))


def stream_blocks(fed: Any, client_ids: np.ndarray, window: int | None = None
                  ) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` consecutive blocks of ``client_ids`` evaluated at once: one block for
    eager data; for a lazy population, windows of about ``window`` samples (at least one client
    each; None: :data:`STREAM_SAMPLES`), so a full evaluation of K clients never holds them
    all."""
    n = len(client_ids)
    if not fed.lazy or n == 0:
        return [(0, n)]
    window = window or STREAM_SAMPLES
    ends = np.cumsum(fed.sizes[client_ids])
    marks = np.arange(window, int(ends[-1]), window)
    cuts = np.unique(np.searchsorted(ends, marks, side="left") + 1)
    bounds = [0, *(int(c) for c in cuts if 0 < c < n), n]
    return list(zip(bounds[:-1], bounds[1:]))


def evaluate_clients(trainer: ClientTrainer, fed: Any, w: torch.Tensor, client_ids: np.ndarray,
                     groups: tuple[torch.Tensor, int] | None,
                     personal: torch.Tensor | None = None, local: torch.Tensor | None = None,
                     adapter: ClientTrainer | None = None, adapt: tuple[int, float] | None = None,
                     window: int | None = None, on_progress: OnProgress | None = None
                     ) -> Evaluated:
    """Evaluate the clients ``client_ids`` at ``w`` (block by block, :func:`stream_blocks`).

    Args:
        trainer: the run's trainer. fed: the federated data or lazy population.
        w: (d,) float32 global parameters. client_ids: (n,) int64, n >= 1.
        groups: :func:`group_setup`'s (sensitive, G), or None.
        personal: (n, d) float32 per-client parameters, also evaluated, or None.
        local: (n, s) float32 each client's local coordinates (local BatchNorm), or None.
        adapter: the trainer of evaluation after local adaptation
            (:func:`mpifl.experiment.assemble.make_adapter`); needed with ``adapt``.
        adapt: ``(round, lr)``: also evaluate after local adaptation from w (round keys the
            minibatch order), or None.
        window: samples a lazy population draws at once (``run.eval_window_samples``; None:
            :data:`STREAM_SAMPLES`).
        on_progress: told the clients done before each window and at the end; when it returns
            False the evaluation stops there and returns ``complete=False``, NaN for the rest.

    Raises:
        RuntimeError: ``adapt`` without an adapter (``run.adapt_epochs = 0`` here).
    """
    if adapt is not None and adapter is None:
        raise RuntimeError("an adapted evaluation was requested but run.adapt_epochs is 0 here")
    parts: list[Evaluated] = []
    n = len(client_ids)
    for lo, hi in stream_blocks(fed, client_ids, window):
        if on_progress is not None and not on_progress(lo, n):
            width = 0 if groups is None else stats_width(groups[1])
            parts.append(_unreached(n - lo, width, personal is not None, adapt is not None))
            return _joined(parts, complete=False)
        ids = client_ids[lo:hi]
        with client_rows(fed, ids, trainer, adapter if adapt else None) as (train, test):
            acc, loss, counts = evaluate(trainer, w, test, groups,
                                         None if local is None else local[lo:hi])
            own = None if personal is None else trainer.evaluate_each(personal[lo:hi], test)
            adapted = None
            if adapt is not None:
                assert adapter is not None  # checked above
                adapted = adapter.evaluate_adapted(w, adapt[0], adapt[1], ids, train, test)
        parts.append(Evaluated(acc, loss, counts, own, adapted))
    if on_progress is not None:
        on_progress(n, n)
    return parts[0] if len(parts) == 1 else _joined(parts)


def _unreached(n: int, width: int, personal: bool, adapted: bool) -> Evaluated:
    """NaN rows for ``n`` clients a stopped evaluation did not reach, shaped as the others."""
    nan: Callable[..., np.ndarray] = lambda *shape: np.full(shape, np.nan)  # noqa: E731
    return Evaluated(nan(n), nan(n), nan(n, width) if width else None,
                     (nan(n), nan(n)) if personal else None, (nan(n), nan(n)) if adapted else None)


def _joined(parts: list[Evaluated], complete: bool = True) -> Evaluated:
    """The blocks of one evaluation as one."""
    def cat(name: str) -> Any:  # an array, an (accuracy, loss) pair or None, by name
        first = getattr(parts[0], name)
        if first is None:
            return None
        if isinstance(first, tuple):  # (accuracy, loss) pairs
            return tuple(np.concatenate([getattr(p, name)[i] for p in parts]) for i in (0, 1))
        return np.concatenate([getattr(p, name) for p in parts])

    return Evaluated(cat("accuracy"), cat("loss"), cat("counts"), cat("personal"), cat("adapted"),
                     complete=complete)


def shape_stats(columns: Columns, stats: dict[str, torch.Tensor], m: int
                ) -> dict[str, torch.Tensor]:
    """A trainer's statistics in the shapes :func:`split_stats` gives (float32, (m,) when the
    width is 1, else (m, width)), without gathering them into one buffer first."""
    out = {}
    for name, width in columns.stats:
        col = stats[name].reshape(m, width).float()
        out[name] = col[:, 0] if width == 1 else col
    return out


def split_stats(columns: Columns, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Cut gathered (m, S) statistics rows into the named columns ((m,) when the width is 1)."""
    out, at = {}, 0
    for name, width in columns.stats:
        assert rows is not None  # gathered whenever there are statistics
        col = rows[:, at:at + width]
        out[name] = col[:, 0] if width == 1 else col
        at += width
    return out


def stats_rows(columns: Columns, stats: dict[str, torch.Tensor], m: int) -> torch.Tensor:
    """Inverse of :func:`split_stats`: one (m, S) float32 tensor in ``columns.stats`` order."""
    parts = [stats[name].reshape(m, width).float() for name, width in columns.stats]
    return torch.cat(parts, dim=1) if parts else torch.empty(m, 0)


class ClientBackend(Protocol):
    """The calls the server loop makes on its clients, wherever they run: :class:`LocalClients`
    (this process) and :class:`RemoteClients` (MPI worker ranks) implement it."""

    def train(self, rnd: int, lr: float, client_ids: np.ndarray, w: torch.Tensor,
              inputs: np.ndarray | None = None, state: torch.Tensor | None = None,
              phase: Callable[[str], None] | None = None) -> TrainResult:
        """The round's training of the clients ``client_ids`` from ``w``."""
        ...

    def losses(self, client_ids: np.ndarray, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(m,) float32 mean training losses of the clients at ``w``, and bytes moved."""
        ...

    def evaluate(self, w: torch.Tensor, personal: torch.Tensor | None = None,
                 adapt: tuple[int, float] | None = None,
                 local: torch.Tensor | None = None, ids: np.ndarray | None = None,
                 window: int | None = None, on_progress: OnProgress | None = None
                 ) -> EvalReply:
        """The clients' evaluation at ``w`` (:meth:`LocalClients.evaluate`)."""
        ...

    def stop(self, code: int = 0) -> None:
        """End the clients' service (the workers' loop) with ``code``."""
        ...


class LocalClients:
    """World size 1: the server trains and evaluates the clients itself.

    Args:
        trainer: the run's :class:`~mpifl.clients.interface.ClientTrainer` over the whole
            sample store.
        fed: the federated data (CSR client index).
        adapter: the trainer of evaluation after local adaptation, or None (``run.adapt_epochs``
            = 0; see :func:`mpifl.experiment.assemble.make_adapter`).
        stopping: ``stopping() -> bool``, True once a stop is requested (the run's
            :class:`mpifl.runtime.signals.StopRequest`): training then ends at its next step
            (:func:`mpifl.clients.trainer.stop_between_steps`); None: every round's training
            runs to its end.
    """

    def __init__(self, trainer: ClientTrainer, fed: Any, device: torch.device,
                 adapter: ClientTrainer | None = None,
                 stopping: Callable[[], bool] | None = None) -> None:
        self.trainer, self.fed, self.adapter = trainer, fed, adapter
        self.groups = group_setup(fed, device)
        self.stopping = stopping

    def train(self, rnd: int, lr: float, client_ids: np.ndarray, w: torch.Tensor,
              inputs: np.ndarray | None = None, state: torch.Tensor | None = None,
              phase: Callable[[str], None] | None = None) -> TrainResult:
        """The round's training here (``phase`` is not called: there is nothing to gather).

        Raises:
            TrainingStopped: ``stopping()`` said stop between two local steps (nothing of the
                round is returned).
        """
        t0 = time.perf_counter()
        with client_rows(self.fed, client_ids, self.trainer) as (idx, _), \
                stop_between_steps(self.stopping):
            updates, losses, stats = self.trainer.run_round(w, rnd, lr, client_ids, idx, inputs,
                                                            state)
        stats = shape_stats(self.trainer.columns, stats, len(client_ids))
        rss = float(peak_rss_bytes())
        return TrainResult(updates, losses, stats, 0.0, time.perf_counter() - t0, 0.0, 0, rss, rss)

    def losses(self, client_ids: np.ndarray, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(m,) float32 mean training losses of the clients at ``w``, and bytes moved (0)."""
        with client_rows(self.fed, client_ids, self.trainer) as (idx, _):
            _, loss = self.trainer.evaluate(w, idx)
        return torch.from_numpy(loss).float().to(w.device), 0

    def evaluate(self, w: torch.Tensor, personal: torch.Tensor | None = None,
                 adapt: tuple[int, float] | None = None,
                 local: torch.Tensor | None = None, ids: np.ndarray | None = None,
                 window: int | None = None, on_progress: OnProgress | None = None
                 ) -> EvalReply:
        """All K clients at ``w``, or the (n,) clients ``ids`` (ascending), each with its own
        row of ``local`` (K or n, s) coordinates if given, at its own row of ``personal`` (K or
        n, d) if given, and after local adaptation from ``w`` if ``adapt = (round, lr)`` is
        given; every array of the reply in the order of the clients. A lazy population goes in
        windows of ``window`` samples; ``on_progress`` (:data:`OnProgress`) is told the clients
        done and may stop it between windows (the reply is then ``stopped``)."""
        ids = np.arange(self.fed.num_clients) if ids is None else ids
        out = evaluate_clients(self.trainer, self.fed, w, ids, self.groups, personal, local,
                               self.adapter, adapt, window, on_progress)
        reply = EvalReply(out.accuracy, out.loss, out.counts, out.personal, out.adapted,
                          stopped=not out.complete)
        reply.peak_rss = np.array([float(peak_rss_bytes())])
        return reply

    def stop(self, code: int = 0) -> None:
        pass


class RemoteClients:
    """World size > 1: clients live on ranks 1..W, reached through :class:`MPITransport`.

    Args:
        transport: the rank-0 end of the protocol.
        fed: the federated data (sample counts decide the blocks).
        device: where the server keeps the gathered updates.
    """

    def __init__(self, transport: MPITransport, fed: Any, device: torch.device) -> None:
        self.transport, self.fed, self.device = transport, fed, device
        bounds = split_by_samples(fed.num_test, transport.workers)
        self._eval_counts = rank_counts(bounds)
        self._width = stats_width(num_groups(fed))

    def train(self, rnd: int, lr: float, client_ids: np.ndarray, w: torch.Tensor,
              inputs: np.ndarray | None = None, state: torch.Tensor | None = None,
              phase: Callable[[str], None] | None = None) -> TrainResult:
        """The round's training on the workers; ``phase("gathering")`` once they all have
        their results.

        Raises:
            TrainingStopped: a worker abandoned its training at a stop request of its own
                (its seconds come back NaN, :meth:`mpifl.runtime.worker.Worker.train`),
                after every reply arrived: the round's results are incomplete.
        """
        bounds = split_by_samples(self.fed.num_train[client_ids], self.transport.workers)
        t0 = time.perf_counter()
        rep = self.transport.train.request(
            rnd, lr, client_ids, w.detach().cpu().numpy(), bounds, inputs,
            None if state is None else state.detach().cpu().numpy(), phase)
        if np.isnan(rep.seconds[1:]).any():
            raise TrainingStopped("a worker rank stopped its training at a stop request")
        waited = time.perf_counter() - t0 - rep.time_broadcast
        slowest = float(rep.seconds[1:].max())
        to: Callable[[np.ndarray], torch.Tensor] = (  # noqa: E731
            lambda a: torch.from_numpy(a).to(self.device))
        stats = split_stats(self.transport.columns, None if rep.stats is None else to(rep.stats))
        return TrainResult(to(rep.updates), to(rep.losses), stats, rep.time_broadcast, slowest,
                           max(0.0, waited - slowest), rep.bytes_moved, float(rep.peak_rss[0]),
                           float(rep.peak_rss[1:].max()))

    def checkpoint_shards(self, rounds_done: int, write: Callable[[], float]) -> np.ndarray:
        """Sharded server: every shard rank writes its checkpoint file (``write()`` here on
        rank 0); (world size,) float64 status, 0 = written or nothing to write."""
        return self.transport.checkpoint.request(rounds_done, write)

    def losses(self, client_ids: np.ndarray, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(m,) float32 mean training losses of the clients at ``w`` (a LOSSES request)."""
        bounds = split_by_samples(self.fed.num_train[client_ids], self.transport.workers)
        rep = self.transport.losses.request(client_ids, w.detach().cpu().numpy(), bounds)
        return torch.from_numpy(rep.losses).to(self.device), rep.bytes_moved

    def evaluate(self, w: torch.Tensor, personal: torch.Tensor | None = None,
                 adapt: tuple[int, float] | None = None,
                 local: torch.Tensor | None = None, ids: np.ndarray | None = None,
                 window: int | None = None, on_progress: OnProgress | None = None
                 ) -> EvalReply:
        """As :meth:`LocalClients.evaluate`, on the workers: all K clients in static shares,
        or the clients ``ids`` in blocks of about equal test samples; ``on_progress`` is told
        the clients done on all workers together, and when it returns False every worker
        stops at its next window (:class:`mpifl.runtime.protocol.Eval`)."""
        counts = (self._eval_counts if ids is None else
                  rank_counts(split_by_samples(self.fed.num_test[ids], self.transport.workers)))
        return self.transport.eval.request(
            w.detach().cpu().numpy(), counts, self._width,
            None if personal is None else personal.detach().cpu().numpy(), adapt,
            None if local is None else local.detach().cpu().numpy(), ids, window, on_progress)

    def stop(self, code: int = 0) -> None:
        self.transport.stop.request(code)
