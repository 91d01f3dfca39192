"""Two generated data sets, deterministic from the experiment seed.

``cifar_like``: CIFAR-10-shaped images (N, 3, 32, 32) float32 of 10 classes, each class a
coloured blob at its own place over Gaussian noise — learnable in a few rounds, so tests and
examples run on CPUs in seconds without downloading CIFAR-10.

``sensor_regression``: a regression task, (N, 8) float32 features and one float32 target
``y = sin(x . a) + x . b + noise`` per sample (``[model] loss = "mse"``).
"""

from __future__ import annotations

import numpy as np

from mpifl.plugin import DataPool, register_dataset


@register_dataset("cifar_like")
def cifar_like(*, seed: int, data_root: str | None = None, num_samples: int = 2000,
               noise: float = 0.5) -> DataPool:
    """``num_samples`` images (N, 3, 32, 32) float32, labels 0..9."""
    rng = np.random.default_rng([seed, 0xC1FA])
    y = rng.integers(0, 10, num_samples)
    x = rng.normal(0.0, noise, (num_samples, 3, 32, 32)).astype(np.float32)
    colour = np.random.default_rng(0xC0102).uniform(-1, 1, (10, 3)).astype(np.float32)
    for i in range(num_samples):
        r, c = 4 + 6 * (y[i] // 4), 4 + 7 * (y[i] % 4)
        x[i, :, r:r + 8, c:c + 8] += colour[y[i]][:, None, None] + 1.0
    return DataPool(x, y.astype(np.int64), num_classes=10)


@register_dataset("sensor_regression")
def sensor_regression(*, seed: int, data_root: str | None = None, num_samples: int = 3000,
                      noise: float = 0.1) -> DataPool:
    """``num_samples`` rows of 8 float32 features and one float32 target."""
    rng = np.random.default_rng([seed, 0x5E45])
    x = rng.normal(size=(num_samples, 8)).astype(np.float32)
    a, b = rng.normal(size=8) / 3, rng.normal(size=8) / 3
    y = np.sin(x @ a) + x @ b + noise * rng.normal(size=num_samples)
    return DataPool(x, y.astype(np.float32), num_classes=1)
