"""The keyed minibatch schedule: which samples a client visits at each local step.

A client's minibatches depend only on ``(seed, round, client_id, epoch)`` (ALGORITHMS.md §1),
never on the rank or chunk it is trained in: :func:`batch_order` is the order of one epoch,
:func:`client_minibatches` one client's whole round for per-client loops, and
:func:`step_widths` how much of a chunk's padded schedule holds real samples.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt


def batch_order(seed: int, round: int, client_id: int, epoch: int, n: int,
                tag: int | None = None) -> np.ndarray:
    """Order in which client ``client_id`` visits its n samples in ``epoch`` of ``round``.

    A permutation of ``range(n)`` (int64) from ``np.random.default_rng([seed, round, client_id,
    epoch])`` (ALGORITHMS.md §1), so it does not depend on the rank or chunk a client is trained in.
    With a ``tag`` (e.g. :data:`mpifl.core.rng.ADAPT_TAG`) the key is ``[seed, round, client_id,
    epoch, tag]``: a stream of its own, apart from training's.
    """
    key = [int(seed), int(round), int(client_id), int(epoch)] + ([] if tag is None else [int(tag)])
    rng = np.random.default_rng(key)
    return rng.permutation(int(n)).astype(np.int64, copy=False)


def client_minibatches(seed: int, round: int, client_id: int, n: int, epochs: int,
                       batch_size: int, tag: int | None = None) -> Iterator[np.ndarray]:
    """ALGORITHMS.md §1's minibatches of one client in one round, for per-client loops (the oracles
    and the sequential baseline of ``mpifl bench simulate``).

    Yields (b,) int64 positions into the client's n samples: E epochs, each in
    :func:`batch_order` (keyed with ``tag`` when given) cut into runs of ``batch_size`` (the last
    may be shorter); one batch of all n in order per epoch when ``batch_size`` is 0.
    """
    size = n if batch_size == 0 else batch_size
    for epoch in range(epochs):
        order = (np.arange(n) if batch_size == 0
                 else batch_order(seed, round, client_id, epoch, n, tag))
        for start in range(0, n, size):
            yield order[start:start + size]


def step_widths(weights: np.ndarray) -> npt.NDArray[np.int64]:
    """Per step index, how many leading minibatch positions hold a real sample in some client.

    ``weights`` (m, T, Bp) 0/1 from :meth:`mpifl.clients.trainer.VmapTrainer._schedule` (real
    samples first in each padded minibatch). Returns (T,) int64 >= 1: a step may drop the
    columns past this width, which are padding in every client (e.g. everyone's short last
    minibatch), exactly.
    """
    # numpy types reductions along an axis as Any; the astype makes this int64
    widths: npt.NDArray[np.int64] = np.maximum((weights > 0).sum(axis=2).max(axis=0),
                                               1).astype(np.int64)
    return widths
