"""``bars``: a data set the user makes themselves — 8 x 8 grey images of one bright bar (class =
which of 4 horizontal or 4 vertical bars, 8 classes) over Gaussian noise, with a random
brightness. Deterministic from the experiment seed.

``sorted_blocks``: a partition that gives each client a contiguous block of the label-sorted
samples (one or two neighbouring classes each).
"""

from __future__ import annotations

import numpy as np

from mpifl.plugin import DataPool, register_dataset, register_partition


@register_dataset("bars")
def bars(*, seed: int, data_root: str | None = None, num_samples: int = 4000,
         noise: float = 0.3) -> DataPool:
    """``num_samples`` images (N, 1, 8, 8) float32, labels 0..7; ``[data.params]`` sets
    ``num_samples`` and ``noise``."""
    rng = np.random.default_rng([seed, 0xBA25])
    y = rng.integers(0, 8, num_samples)
    x = rng.normal(0.0, noise, (num_samples, 8, 8)).astype(np.float32)
    bright = rng.uniform(0.5, 1.5, num_samples).astype(np.float32)
    rows, cols = 2 * (y % 4), 2 * (y % 4)
    horizontal = y < 4
    for i in range(num_samples):
        if horizontal[i]:
            x[i, rows[i]:rows[i] + 2, :] += bright[i]
        else:
            x[i, :, cols[i]:cols[i] + 2] += bright[i]
    return DataPool(x[:, None], y.astype(np.int64), num_classes=8)


@register_partition("sorted_blocks")
def sorted_blocks(labels: np.ndarray, num_clients: int, rng: np.random.Generator
                  ) -> list[np.ndarray]:
    """Label skew without randomness in the shape: the samples sorted by label (random order
    within a label) cut into K contiguous, nearly equal blocks, so each client holds one or two
    neighbouring classes."""
    order = np.lexsort((rng.permutation(len(labels)), labels))
    return list(np.array_split(order, num_clients))
