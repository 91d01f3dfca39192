"""A small CNN for 1 x 8 x 8 images: Conv(8, 3x3, pad 1) ReLU MaxPool2 -> FC 32 ReLU -> FC C.

Plain layers only, so either trainer can train it (``client.trainer``: vmap over stacked
parameters, or the per-client loop). A plugin model may also have BatchNorm and Dropout: mpifl
then trains it with the loop trainer, where BatchNorm's running statistics are part of w (``model.batchnorm`` = "global",
"local" for FedBN, or "local_stats") and dropout masks are keyed by (seed, round, client, step)
(docs/ALGORITHMS.md §1 "Random layers" and §9 "BatchNorm"; examples/models/ has such a model).
"""

from __future__ import annotations

import math

from torch import nn

from mpifl.plugin import register_model


@register_model("small_cnn")
def small_cnn(input_shape: tuple[int, ...], num_classes: int, *, seed: int,
              channels: int = 8, width: int = 32) -> nn.Module:
    """The model for ``input_shape`` (C, H, W); ``channels`` and ``width`` come from
    ``[model.params]``. mpifl seeds torch's RNG with ``seed`` around this call."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(channels * math.prod((h // 2, w // 2)), width), nn.ReLU(),
        nn.Linear(width, num_classes),
    )
