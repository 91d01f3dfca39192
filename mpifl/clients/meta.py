"""FedMeta's controllable meta updating (Yao et al., "Federated Learning with Unbiased Gradient
Aggregation and Controllable Meta Updating", NeurIPS 2019 FL workshop, arXiv:1910.08234;
ALGORITHMS.md §6): after every aggregation the server takes one full-batch gradient step on a small
meta set it holds,

    w^{t+1} <- w^{t+1} - eta_meta * ∇L(w^{t+1}; D_meta)       (L = the mean of [model] loss, cross-entropy by default),

which states the target distribution explicitly. The meta set is a seeded sample of the
training pool (the union of the clients' train splits): IID (default), or group-balanced
(equal counts per sensitive group, for fairness studies on data with a sensitive attribute).

Server contract: :func:`mpifl.experiment.assemble.meta_step_for` builds it on rank 0 when
the run's plan has a meta step (:attr:`mpifl.experiment.plan.Plan.meta`), and after every aggregation
(``w <- w - s``) set ``w = meta.apply(w)``. The step depends only on w and ``run.seed``: nothing
to checkpoint, a resumed run rebuilds the same meta set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from torch import Tensor, nn
from torch.func import functional_call, grad

from mpifl.aggregators.fedmeta import check_meta_params
from mpifl.core.errors import ConfigError
from mpifl.core.layout import ParamLayout
from mpifl.core.rng import META_TAG
from mpifl.models.losses import Loss, get_loss

if TYPE_CHECKING:  # pragma: no cover
    from mpifl.data.federated import FederatedData


def meta_indices(fed: FederatedData, *, seed: int, size: int, sampling: str = "iid") -> np.ndarray:
    """The meta set: ``size`` distinct indices into ``fed.x`` drawn from the training pool.

    ``"iid"``: uniformly without replacement from the pool. ``"group_balanced"``: ``size / G``
    from each of the G sensitive groups present in the pool (``fed.sensitive``), uniformly
    without replacement within a group. The draw uses ``default_rng([seed, META_TAG])`` only.

    Returns:
        (size,) int64, sorted.

    Raises:
        ConfigError: size larger than the pool (or than a group's share), group_balanced without
            a sensitive attribute, or a size not divisible by the number of groups.
    """
    _, size, sampling = check_meta_params(1.0, size, sampling)
    pool = np.unique(np.asarray(fed.train_idx, dtype=np.int64))
    rng = np.random.default_rng([int(seed), META_TAG])
    if sampling == "iid":
        if size > len(pool):
            raise ConfigError(f"fedmeta.meta_size: {size} exceeds the training pool "
                              f"({len(pool)} samples)")
        return np.sort(rng.choice(pool, size=size, replace=False))
    if fed.sensitive is None:
        raise ConfigError(f"fedmeta.meta_sampling: 'group_balanced' needs a dataset with a "
                          f"sensitive attribute, '{fed.name}' has none")
    group = fed.sensitive[pool]
    groups = np.unique(group)
    if size % len(groups):
        raise ConfigError(f"fedmeta.meta_size: group_balanced needs a multiple of the number of "
                          f"sensitive groups ({len(groups)}), got {size}")
    per = size // len(groups)
    picked = []
    for a in groups:
        members = pool[group == a]
        if per > len(members):
            raise ConfigError(f"fedmeta.meta_size: group_balanced takes {per} samples per group, "
                              f"but sensitive group {a} has {len(members)} in the training pool")
        picked.append(rng.choice(members, size=per, replace=False))
    return np.sort(np.concatenate(picked))


class MetaStep:
    """The server's meta step ``w -> w - eta_meta * ∇L(w; D_meta)`` (full batch, mean loss).

    Args:
        fed: the federated data; the meta set is drawn from its training pool.
        model: the architecture (its own parameters are never used: ``functional_call`` with
            parameters from w). layout: ``ParamLayout.from_module(model)``.
        seed: the experiment seed (keys the meta-set draw).
        meta_size: number of meta samples (>= 1).
        eta_meta: meta step size (> 0).
        meta_sampling: ``"iid"`` or ``"group_balanced"`` (see :func:`meta_indices`).
        device: where the meta samples live and the step is computed.
        loss: the run's :class:`mpifl.models.losses.Loss` (``[model] loss``; default
            cross-entropy).

    Attributes:
        indices: (meta_size,) int64 sorted indices of the meta set into ``fed.x``.
        x, y: the meta samples (float32) and labels (int64) on ``device``.

    Raises:
        ValueError: hyper-parameters out of range, a layout not matching the model.
        ConfigError: the meta set cannot be drawn (see :func:`meta_indices`).
    """

    def __init__(self, fed: FederatedData, model: nn.Module, layout: ParamLayout, *, seed: int,
                 meta_size: int, eta_meta: float, meta_sampling: str = "iid",
                 device: str | torch.device = "cpu", loss: Loss | None = None):
        self.eta_meta, self.meta_size, self.meta_sampling = check_meta_params(
            eta_meta, meta_size, meta_sampling)
        if ParamLayout.from_module(model) != layout:
            raise ValueError("the layout does not match the model's named_parameters()")
        self.model, self.layout = model, layout
        self.loss_fn = get_loss("cross_entropy") if loss is None else loss
        self.device = torch.device(device)
        self.indices = meta_indices(fed, seed=seed, size=self.meta_size, sampling=meta_sampling)
        x = fed.x[self.indices]
        self.x = torch.as_tensor(x, dtype=torch.float32 if x.dtype.kind == "f" else torch.int64,
                                 device=self.device)
        self.y = torch.as_tensor(fed.y[self.indices], device=self.device)
        self._grad: Callable[[Tensor], Tensor] = grad(self.loss)

    def loss(self, w: Tensor) -> Tensor:
        """Mean loss of w ``(d,)`` on the meta set (a 0-d tensor)."""
        out = functional_call(self.model, self.layout.unflatten(w), (self.x.to(w.dtype) if self.x.is_floating_point() else self.x,))
        return self.loss_fn.per_sample(out, self.y).mean()

    def gradient(self, w: Tensor) -> Tensor:
        """``∇L(w; D_meta)``, ``(d,)`` in w's dtype, on ``device``."""
        if w.shape != (self.layout.d,):
            raise ValueError(f"w must have shape ({self.layout.d},), got {tuple(w.shape)}")
        return self._grad(w.detach().to(self.device))

    def apply(self, w: Tensor) -> Tensor:
        """``w - eta_meta * ∇L(w; D_meta)``: a new ``(d,)`` tensor, w's dtype, on ``device``."""
        w = w.detach().to(self.device)
        return w - self.eta_meta * self.gradient(w)

    def __repr__(self) -> str:
        return (f"MetaStep(meta_size={self.meta_size}, eta_meta={self.eta_meta}, "
                f"meta_sampling={self.meta_sampling!r})")
