"""``smoothed_ce``: cross-entropy with label smoothing 0.1 (Szegedy et al., CVPR 2016), a user
loss. A loss is a ``Loss`` (or a plain function ``fn(out, y) -> (batch,)`` per-sample losses,
named by import path ``"mpifl_models.losses:smoothed_ce_fn"``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from mpifl.plugin import Loss, register_loss


def smoothed_ce_fn(out: Tensor, y: Tensor) -> Tensor:
    """(batch,) per-sample cross-entropy of logits ``out`` (batch, C) against labels ``y``
    (batch,) int64, with 0.1 of each target's mass spread evenly over the classes."""
    return F.cross_entropy(out, y, reduction="none", label_smoothing=0.1)


register_loss("smoothed_ce")(Loss("smoothed_ce", smoothed_ce_fn,
                                  predict=lambda out: out.argmax(dim=-1)))
