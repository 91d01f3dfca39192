"""Counter-based random numbers: a pure function of integer coordinates, computed bit for bit
the same by numpy on the host and by torch on any device.

A counter-based generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC
2011) has no state: the value at ``(key, counter)`` is a hash of the two. A GPU can then draw a
whole round's randomness (every client's minibatch order) in a few element-wise kernels, with
no generator object to carry per client and no host loop. mpifl's streams stay keyed the way
:mod:`mpifl.core.rng` keys them (seed, round, client, epoch, tag); this module only supplies
the other generator.

The mixing function is ``lowbias32`` (C. Wellons, "Hash Prospector", 2020: a bijection of
32-bit words with low avalanche bias). A key of any number of non-negative integers (each up
to 2^63) is folded word by word into two 32-bit states ``(h1, h2)``; the value of counter j is
``mix(mix(j + h1) ^ h2)``, a bijection of j for a fixed key, so the n values of a key are
distinct and their ranking is a permutation without ties (:func:`orders_torch`).

Two implementations: numpy's ``uint64`` arithmetic masked to 32 bits (the direct one, the
oracle) and torch's ``int64`` with every product kept below 2^63 (the one that runs on the
device); ``tests/inprocess/test_minibatch_schedule.py`` holds them equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["key_np", "key_torch", "mix_np", "mix_torch", "order_np", "orders_torch", "values_int64",
           "values_np", "values_torch"]

MASK = 0xFFFFFFFF
#: lowbias32's two multipliers
_M1, _M2 = 0x7FEB352D, 0x846CA68B
#: 2^32 / golden ratio: the fold's seed and the split of (h1, h2)
_GOLDEN = 0x9E3779B9


def mix_np(x: np.ndarray) -> np.ndarray:
    """lowbias32 of (...) uint64 words < 2^32 (the oracle): (...) uint64 < 2^32."""
    x = np.asarray(x, dtype=np.uint64)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(_M1)) & np.uint64(MASK)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(_M2)) & np.uint64(MASK)
    out: np.ndarray = x ^ (x >> np.uint64(16))
    return out


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), by 16-bit halves of c (no product reaches
    2^63, so nothing depends on how a device wraps signed overflow)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK


def mix_torch(x: Tensor) -> Tensor:
    """lowbias32 of (...) int64 words in [0, 2^32) on any device: (...) int64 in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def key_np(*words: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (h1, h2) states of a key: non-negative integers (or broadcastable arrays of them)
    below 2^63, each folded as its low and high 32-bit halves. Returns two uint64 arrays of
    the broadcast shape, values < 2^32."""
    h = np.asarray(_GOLDEN, dtype=np.uint64)
    for w in words:
        w = np.asarray(w, dtype=np.uint64)
        h = mix_np(h ^ (w & np.uint64(MASK)))
        h = mix_np(h ^ (w >> np.uint64(32)))
    return h, mix_np(h ^ np.uint64(_GOLDEN))


def key_torch(*words: int | Tensor, device: torch.device | str = "cpu"
              ) -> tuple[Tensor, Tensor]:
    """:func:`key_np` in torch: words are ints or int64 tensors (broadcast), on ``device``."""
    h = torch.tensor(_GOLDEN, dtype=torch.int64, device=device)
    for w in words:
        w = torch.as_tensor(w, dtype=torch.int64, device=device)
        h = mix_torch(h ^ (w & MASK))
        h = mix_torch(h ^ (w >> 32))
    return h, mix_torch(h ^ _GOLDEN)


def values_np(h1: np.ndarray, h2: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """The 32-bit values of ``counter`` (uint64 < 2^32) under the key (h1, h2): uint64."""
    counter = np.asarray(counter, dtype=np.uint64)
    return mix_np(mix_np((counter + h1) & np.uint64(MASK)) ^ h2)


def values_torch(h1: Tensor, h2: Tensor, counter: Tensor) -> Tensor:
    """:func:`values_np` in torch (int64 in [0, 2^32), broadcast shapes), on the tensors'
    device. On a CPU the same integers come from numpy's uint32 arithmetic (wrapping mod 2^32
    is numpy's defined behaviour), several times faster there than the int64 emulation a GPU
    runs (:func:`values_int64`)."""
    if counter.device.type != "cpu":
        return values_int64(h1, h2, counter)
    a, c = np.uint32(_M1), np.uint32(_M2)

    def mix(x: np.ndarray) -> np.ndarray:
        x ^= x >> np.uint32(16)
        x *= a
        x ^= x >> np.uint32(15)
        x *= c
        x ^= x >> np.uint32(16)
        return x

    words = [torch.as_tensor(t).numpy().astype(np.uint32) for t in (h1, h2, counter)]
    out = mix(mix(words[2] + words[0]) ^ words[1])
    return torch.from_numpy(out.astype(np.int64))


def values_int64(h1: Tensor, h2: Tensor, counter: Tensor) -> Tensor:
    """:func:`values_np` in torch's int64 arithmetic (every product below 2^63), on any
    device: what :func:`values_torch` runs off the CPU."""
    return mix_torch(mix_torch((counter + h1) & MASK) ^ h2)


def order_np(n: int, *key: int) -> np.ndarray:
    """The permutation of ``range(n)`` keyed by ``key``: positions ranked by their values
    (distinct, see the module docstring). Returns (n,) int64; the oracle of
    :func:`orders_torch`."""
    h1, h2 = key_np(*key)
    return np.argsort(values_np(h1, h2, np.arange(n)), kind="stable").astype(np.int64)


def orders_torch(key: Sequence[int | Tensor], sizes: Tensor) -> Tensor:
    """Many keyed permutations at once, on the device of ``sizes``, with no padding.

    Args:
        key: the key's words; tensors broadcast to ``sizes``' shape (e.g. one client id per
            row, one epoch per column).
        sizes: (...) int64 >= 0, the n of each permutation.

    Returns:
        (sizes.sum(),) int64: the permutations one after another in ``sizes``' row-major
        order, each :func:`order_np` of its key (positions 0 .. n - 1 of its own).
    """
    dev = sizes.device
    h1, h2 = (h.expand(sizes.shape).reshape(-1) for h in key_torch(*key, device=dev))
    n = sizes.reshape(-1)
    starts = torch.cumsum(n, 0) - n
    segment = torch.repeat_interleave(torch.arange(len(n), device=dev), n)
    j = torch.arange(len(segment), device=dev) - starts[segment]
    # one sort of (segment, value): segments stay in order, each ranked by its own values
    ranked = torch.sort((segment << 32) | values_torch(h1[segment], h2[segment], j)).indices
    return ranked - starts[segment]
