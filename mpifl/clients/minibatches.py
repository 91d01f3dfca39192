"""The keyed minibatch schedule: which samples a client visits at each local step.

A client's minibatches depend only on ``(seed, round, client_id, epoch)`` (ALGORITHMS.md §1),
never on the rank or chunk it is trained in: :func:`batch_order` is the order of one epoch,
:func:`client_minibatches` one client's whole round for per-client loops,
:func:`minibatch_schedule` a chunk's padded steps for the vectorised trainers.

Two generators draw the order from the key (``client.minibatch_order``): ``"pcg64"``, numpy's
``default_rng(key)``, one client at a time on the host; ``"counter"``, the counter-based hash of
:mod:`mpifl.core.counter`, which :func:`minibatch_schedule` computes for every client of a chunk
at once on the trainer's device (no host loop over clients: what a GPU round of thousands of
clients needs). Both are keyed by the same coordinates; they give different orders.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from mpifl.core import counter
from mpifl.core.rng import MINIBATCH_TAG


def _counter_key(seed: int, round: int, tag: int | None) -> list[int]:
    """The leading words of the counter order's key; the client id and epoch follow."""
    return [int(seed), MINIBATCH_TAG, int(round)] + ([] if tag is None else [int(tag)])


def batch_order(seed: int, round: int, client_id: int, epoch: int, n: int,
                tag: int | None = None, order: str = "pcg64") -> np.ndarray:
    """Order in which client ``client_id`` visits its n samples in ``epoch`` of ``round``.

    A permutation of ``range(n)`` (int64), so it does not depend on the rank or chunk a client
    is trained in. ``order = "pcg64"``: ``np.random.default_rng([seed, round, client_id,
    epoch])`` (ALGORITHMS.md §1); with a ``tag`` (e.g. :data:`mpifl.core.rng.ADAPT_TAG`) the key
    is ``[seed, round, client_id, epoch, tag]``: a stream of its own, apart from training's.
    ``order = "counter"``: :func:`mpifl.core.counter.order_np` of ``(seed, MINIBATCH_TAG,
    round[, tag], client_id, epoch)``, the oracle of :func:`minibatch_schedule`'s device path.

    Raises:
        ValueError: an unknown ``order``.
    """
    if order == "counter":
        return counter.order_np(int(n), *_counter_key(seed, round, tag), int(client_id),
                                int(epoch))
    if order != "pcg64":
        raise ValueError(f"minibatch order must be 'pcg64' or 'counter', got {order!r}")
    key = [int(seed), int(round), int(client_id), int(epoch)] + ([] if tag is None else [int(tag)])
    rng = np.random.default_rng(key)
    return rng.permutation(int(n)).astype(np.int64, copy=False)


def capped_steps(sizes: npt.ArrayLike, epochs: int, batch_size: int,
                 max_steps: int | None = None) -> npt.NDArray[np.int64]:
    """(m,) int64: the local steps each client takes in a round, ``E * ceil(n / B)`` (E when
    B = 0), at most ``max_steps`` (``client.max_local_steps``; None: no cap).

    Args:
        sizes: (m,) samples per client (>= 1). epochs: E >= 1. batch_size: B >= 0.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    per_epoch = np.ones_like(sizes) if batch_size == 0 else -(-sizes // batch_size)
    steps: npt.NDArray[np.int64] = epochs * per_epoch
    return steps if max_steps is None else np.minimum(steps, int(max_steps))


def trained_samples(sizes: npt.ArrayLike, epochs: int, batch_size: int,
                    max_steps: int | None = None) -> npt.NDArray[np.int64]:
    """(m,) int64: the samples each client's local steps of a round go through, counted with
    repeats: ``E * n`` uncapped; with ``max_steps`` (``client.max_local_steps``) the whole
    epochs its steps cover plus ``B`` for each step of the epoch it stops in (an epoch's
    minibatches are full but for its last). The simulated clock's local work
    (:mod:`mpifl.clients.system`).

    Args:
        sizes: (m,) samples per client (>= 1). epochs: E >= 1. batch_size: B >= 0 (0: the
            whole client's data, one step an epoch).
    """
    n = np.asarray(sizes, dtype=np.int64)
    per_epoch = np.ones_like(n) if batch_size == 0 else -(-n // batch_size)
    full, rest = np.divmod(capped_steps(n, epochs, batch_size, max_steps), per_epoch)
    work: npt.NDArray[np.int64] = full * n + rest * batch_size
    return work


def first_epoch_samples(sizes: npt.ArrayLike, batch_size: int,
                        max_steps: int | None = None) -> npt.NDArray[np.int64]:
    """(m,) int64: the samples in each client's minibatches of its first epoch that it trains
    on (all n, or ``max_steps * B`` when the cap ends the epoch early): what the first
    epoch's summed training loss is divided by when it stands in for ``l_k``."""
    n: npt.NDArray[np.int64] = np.asarray(sizes, dtype=np.int64)
    if max_steps is None or batch_size == 0:  # a full batch is one step, and the cap >= 1
        return n
    return np.minimum(n, int(max_steps) * batch_size)


def client_minibatches(seed: int, round: int, client_id: int, n: int, epochs: int,
                       batch_size: int, tag: int | None = None,
                       order: str = "pcg64", max_steps: int | None = None
                       ) -> Iterator[np.ndarray]:
    """ALGORITHMS.md §1's minibatches of one client in one round, for per-client loops (the oracles
    and the sequential baseline of ``mpifl bench simulate``).

    Yields (b,) int64 positions into the client's n samples: E epochs, each in
    :func:`batch_order` (keyed with ``tag`` when given, drawn by ``order``) cut into runs of
    ``batch_size`` (the last may be shorter); one batch of all n in order per epoch when
    ``batch_size`` is 0. With ``max_steps``, only the first ``max_steps`` of them
    (:func:`capped_steps`).
    """
    size = n if batch_size == 0 else batch_size

    def every() -> Iterator[np.ndarray]:
        for epoch in range(epochs):
            perm = (np.arange(n) if batch_size == 0
                    else batch_order(seed, round, client_id, epoch, n, tag, order))
            for start in range(0, n, size):
                yield perm[start:start + size]

    # the later epochs' orders are never drawn once the cap is reached (islice stops first)
    return every() if max_steps is None else itertools.islice(every(), int(max_steps))


@dataclass(frozen=True)
class Schedule:
    """A chunk's padded minibatch plan (:func:`minibatch_schedule`); T = the most steps of a
    client, Bp the padded minibatch.

    Attributes:
        rows: (m, T, Bp) int64 on the device: indices into the chunk's concatenated samples
            (client i's at ``starts[i]:starts[i] + sizes[i]``); padding points at the client's
            own first sample (a finite loss, weight 0).
        weights: (m, T, Bp) float32 on the device, 1 real, 0 padding (real samples first in
            each minibatch).
        steps: (m,) int64, each client's real steps (a prefix of the step indices), capped
            by ``max_steps``.
        real: (m, T) int64, the real samples of each minibatch (0 past a client's steps):
            known from the sizes alone, so kept on the host.
        per_epoch: (m,) int64, the steps of a whole epoch of each client (``ceil(n / B)``, 1
            for B = 0), before any cap; None: ``steps // epochs`` (an uncapped plan).
    """

    rows: Tensor
    weights: Tensor
    steps: np.ndarray
    real: np.ndarray
    per_epoch: np.ndarray | None = None

    @property
    def widths(self) -> npt.NDArray[np.int64]:
        """(T,) int64 >= 1: the leading minibatch columns that hold a real sample in some
        client at each step (the rest is padding everywhere and may be dropped)."""
        widths: npt.NDArray[np.int64] = np.maximum(self.real.max(axis=0), 1).astype(np.int64)
        return widths

    def first_epoch(self, epochs: int) -> npt.NDArray[np.bool_]:
        """(m, T) bool: the steps of each client's first epoch (those it takes: a cap may end
        it early)."""
        first = self.steps // epochs if self.per_epoch is None else np.minimum(
            self.per_epoch, self.steps)
        return np.arange(self.real.shape[1])[None, :] < first[:, None]


def minibatch_schedule(seed: int, round: int, client_ids: np.ndarray, sizes: np.ndarray,
                       epochs: int, batch_size: int, tag: int | None = None,
                       order: str = "pcg64", device: torch.device | str = "cpu",
                       max_steps: int | None = None) -> Schedule:
    """Every client's minibatches of a round as one padded plan, for the vectorised trainers.

    Client i (id ``client_ids[i]``, n_i = ``sizes[i]`` samples) takes ``E * ceil(n_i / B)``
    steps (E when B = 0): epoch e is :func:`batch_order` cut into runs of B, exactly the
    minibatches of :func:`client_minibatches` (its oracle in tests/inprocess/test_training.py);
    with ``max_steps`` only the first ``max_steps`` of them (:func:`capped_steps`). With
    ``order = "counter"`` the orders are drawn on ``device``, all clients and epochs at once;
    with ``"pcg64"`` on the host, one client at a time. The plan is assembled on ``device``.

    Args:
        client_ids: (m,) int64. sizes: (m,) int64 >= 1 samples per client.
        epochs, batch_size: E >= 1 and B >= 0 (0: one full batch an epoch).
        max_steps: at most this many steps per client (None: no cap).

    Returns:
        A :class:`Schedule`.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    m, n_max = len(sizes), int(sizes.max())
    bp = n_max if batch_size == 0 else min(batch_size, n_max)
    per_epoch = np.ones(m, np.int64) if batch_size == 0 else -(-sizes // batch_size)
    steps = capped_steps(sizes, epochs, batch_size, max_steps)
    t = np.arange(int(steps.max()))
    within = t[None, :] % per_epoch[:, None]
    real = np.where(t[None, :] < steps[:, None],
                    np.clip(sizes[:, None] - within * bp, 0, bp), 0).astype(np.int64)

    dev = torch.device(device)
    sz = torch.as_tensor(sizes, device=dev)
    pe = torch.as_tensor(per_epoch, device=dev)
    tt = torch.arange(len(t), device=dev)
    slot = ((tt[None, :] % pe[:, None]) * bp)[:, :, None] + torch.arange(bp, device=dev)
    is_real = (tt[None, :] < torch.as_tensor(steps, device=dev)[:, None])[:, :, None] & (
        slot < sz[:, None, None])
    if batch_size == 0:
        pos = slot
    else:  # slot s of epoch e: entry s of the client's epoch-e order (clamped where padding)
        # only the epochs a capped client reaches are drawn (E when uncapped): each order is
        # keyed by its epoch, so the ones drawn do not depend on how many are
        drawn = int((-(-steps // per_epoch)).max())
        orders = _orders(seed, round, client_ids, sizes, drawn, tag, order, dev)
        epoch = (tt[None, :] // pe[:, None]).clamp(max=drawn - 1)
        first = torch.as_tensor(np.cumsum(np.repeat(sizes, drawn)) - np.repeat(sizes, drawn),
                                device=dev).view(m, drawn)
        pos = orders[first.gather(1, epoch)[:, :, None] + torch.minimum(slot, sz[:, None, None] - 1)]
    starts = torch.as_tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), device=dev)
    rows = torch.where(is_real, pos + starts[:, None, None], starts[:, None, None])
    return Schedule(rows, is_real.to(torch.float32), steps, real,
                    None if max_steps is None else per_epoch)


def _orders(seed: int, round: int, client_ids: np.ndarray, sizes: np.ndarray, epochs: int,
            tag: int | None, order: str, device: torch.device) -> Tensor:
    """(E * sizes.sum(),) int64 on ``device``: every client's epoch orders one after another,
    client by client, epoch by epoch (no padding)."""
    if order == "counter":
        ids = torch.as_tensor(np.asarray(client_ids, dtype=np.int64), device=device)
        ep = torch.arange(epochs, device=device)
        n = torch.as_tensor(sizes, device=device)[:, None].expand(len(sizes), epochs)
        return counter.orders_torch([*_counter_key(seed, round, tag), ids[:, None], ep[None, :]],
                                    n)
    return torch.as_tensor(np.concatenate([
        batch_order(seed, round, int(cid), e, int(n), tag, order)
        for cid, n in zip(client_ids, sizes) for e in range(epochs)]), device=device)
