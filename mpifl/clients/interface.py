"""What every client trainer takes and offers: :class:`TrainOptions` and :class:`ClientTrainer`.

The two backends of local training, :class:`~mpifl.clients.VmapTrainer` (stacked clients, one
``vmap`` step) and :class:`~mpifl.clients.LoopTrainer` (one client at a time, any module), are
siblings: both take the client section's options as one :class:`TrainOptions` and implement
:class:`ClientTrainer`, whose single training entry point is :meth:`ClientTrainer.run_round`.
The wrappers around a run's trainer (:class:`~mpifl.clients.blamed.Blamed`,
:class:`~mpifl.clients.faults.NaNClients`) implement it too, through :class:`TrainerWrapper`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from mpifl.core.wire import Columns
from mpifl.models.losses import Loss

__all__ = ["ClientTrainer", "TrainOptions", "TrainerWrapper", "trainer_keywords"]

T = TypeVar("T")

#: the two generators of the keyed minibatch order (:mod:`mpifl.clients.minibatches`)
ORDERS = ("pcg64", "counter")


@dataclass(frozen=True)
class TrainOptions:
    """The local-training options a trainer is built with (the ``[client]`` section).

    Attributes:
        epochs: E >= 1 local epochs.
        batch_size: B >= 0 samples per minibatch; 0 means one full batch per epoch.
        momentum, weight_decay: as in ``torch.optim.SGD`` (dampening 0, no Nesterov); the
            optimiser state is fresh every round.
        seed: experiment seed, keys :func:`~mpifl.clients.minibatches.batch_order`.
        memory_budget_mb: clients are trained in chunks whose estimated working memory stays
            below this many MiB; at least one client per chunk.
        device: where the computation runs (``"cpu"``, ``"cuda"``, ...).
        prox_mu: FedProx's proximal coefficient mu >= 0 (Li et al., MLSys 2020): the local loss
            gets ``+ (mu/2) ||w_k - w||^2`` towards the round's global parameters w.
        report_accuracy: also report each client's training accuracy of w as the statistic
            ``train_accuracy`` (FedFa's ACC_k).
        pretrain_losses: measure the reported losses with a forward pass of w before training
            (``l_k`` of ALGORITHMS.md §0); False: the first epoch's training losses instead.
        order_tag: keys :func:`~mpifl.clients.minibatches.batch_order` with this tag (None:
            training's own stream; :data:`mpifl.core.rng.ADAPT_TAG` for adaptation).
        loss: the :class:`mpifl.models.losses.Loss` of training and evaluation (None:
            cross-entropy).
        minibatch_order: how :func:`~mpifl.clients.minibatches.batch_order` draws from the
            key: ``"pcg64"`` (numpy's generator, a client at a time on the host) or
            ``"counter"`` (:mod:`mpifl.core.counter`, a chunk's clients at once on ``device``).
        max_local_steps: at most this many local SGD steps per client and round (the first
            ones of its E epochs, :func:`~mpifl.clients.minibatches.capped_steps`); None: no
            cap, all E epochs.

    Raises:
        ValueError: out-of-range values.
    """

    epochs: int
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    memory_budget_mb: float = 1024.0
    device: str | torch.device = "cpu"
    prox_mu: float = 0.0
    report_accuracy: bool = False
    pretrain_losses: bool = True
    order_tag: int | None = None
    loss: Loss | None = None
    minibatch_order: str = "pcg64"
    max_local_steps: int | None = None

    def __post_init__(self) -> None:
        cap = self.max_local_steps
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer))
                                or cap < 1):
            raise ValueError(f"max_local_steps must be an integer >= 1 or None, got "
                             f"{self.max_local_steps!r}")
        if (self.epochs < 1 or self.batch_size < 0 or self.momentum < 0 or self.weight_decay < 0
                or self.memory_budget_mb <= 0 or self.prox_mu < 0
                or self.minibatch_order not in ORDERS):
            raise ValueError("need epochs >= 1, batch_size >= 0, momentum >= 0, "
                             "weight_decay >= 0, prox_mu >= 0, memory_budget_mb > 0 and a "
                             f"minibatch_order of {ORDERS}")

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[TrainOptions, dict[str, Any]]:
        """A run's trainer options (the client section's and the rule's, one mapping) as the
        :class:`TrainOptions` and the rest: the trainer class's own keywords (Ditto's ``lam``,
        UGA's ``max_traced_clients``, the loop's ``local_index``, ...)."""
        names = {f.name for f in dataclasses.fields(cls)}
        own = {k: v for k, v in options.items() if k in names}
        return cls(**own), {k: v for k, v in options.items() if k not in names}


def trainer_keywords(cls: type) -> frozenset[str]:
    """The option names a trainer class is built with: :class:`TrainOptions`' fields and the
    class's own keywords (what a rule's ``client_options`` may name)."""
    own = set(inspect.signature(cls).parameters) - {"model", "layout", "x", "y", "options"}
    return frozenset({f.name for f in dataclasses.fields(TrainOptions)} | own)


class ClientTrainer(Protocol):
    """The client computation a worker runs: one round of the selected clients' work
    (:meth:`run_round`, the one training entry point) and the evaluations of the run."""

    #: the round inputs, state rows and statistics this trainer exchanges
    @property
    def columns(self) -> Columns: ...

    #: the sample store ``(x, y)`` the clients' ``sample_idx`` index (shared with the adapter)
    @property
    def x(self) -> Tensor: ...

    @property
    def y(self) -> Tensor: ...

    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``updates`` (m, d), ``losses`` (m,) and the statistics of :attr:`columns`."""
        ...

    def samples(self, x: np.ndarray | Tensor, y: np.ndarray | Tensor
                ) -> AbstractContextManager[None]:
        """Train and evaluate on the sample store ``x``, ``y`` inside the block."""
        ...

    def evaluate(self, w: Tensor, sample_idx: Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and mean loss (n,) of w on each client's samples."""
        ...

    def evaluate_groups(self, w: Tensor, sample_idx: Sequence[np.ndarray], sensitive: Tensor,
                        num_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`evaluate` plus the (n, G, 2, 3) group counts of binary tasks."""
        ...

    def evaluate_adapted(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                         train_idx: Sequence[np.ndarray], test_idx: Sequence[np.ndarray]
                         ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and loss (n,) on the test samples after local SGD on the training ones."""
        ...

    def evaluate_each(self, W: Tensor, sample_idx: Sequence[np.ndarray]
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and loss (n,) of client i's own parameters ``W[i]`` on its samples."""
        ...

    def evaluate_local(self, w: Tensor, rows: Tensor, sample_idx: Sequence[np.ndarray],
                       groups: tuple[Tensor, int] | None = None) -> tuple[np.ndarray, ...]:
        """Each client's accuracy and loss at w with its own local coordinates ``rows``
        (local BatchNorm; the loop trainer's)."""
        ...


class TrainerWrapper:
    """A :class:`ClientTrainer` around another: every call goes to the wrapped trainer
    through :meth:`_call`, which subclasses override to add to each call (a plugin's failures
    named, faults injected) without unwrapping.

    Args:
        trainer: the wrapped :class:`ClientTrainer`.
    """

    def __init__(self, trainer: ClientTrainer):
        self.trainer = trainer

    def _call(self, phase: str, fn: Callable[..., T], *args: Any) -> T:
        """Run the wrapped trainer's ``fn(*args)``; ``phase`` ("train", "evaluate",
        "evaluate (adapted)") says which kind of work it is."""
        return fn(*args)

    @property
    def columns(self) -> Columns:
        return self.trainer.columns

    @property
    def x(self) -> Tensor:
        return self.trainer.x

    @property
    def y(self) -> Tensor:
        return self.trainer.y

    @property
    def device(self) -> torch.device:
        """Where the wrapped trainer computes (its ``device``, else its store's)."""
        return torch.device(getattr(self.trainer, "device", self.trainer.x.device))

    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return self._call("train", self.trainer.run_round, w, round, lr, client_ids,
                          sample_idx, inputs, state)

    def samples(self, x: np.ndarray | Tensor, y: np.ndarray | Tensor
                ) -> AbstractContextManager[None]:
        return self.trainer.samples(x, y)

    def evaluate(self, w: Tensor, sample_idx: Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
        return self._call("evaluate", self.trainer.evaluate, w, sample_idx)

    def evaluate_groups(self, w: Tensor, sample_idx: Sequence[np.ndarray], sensitive: Tensor,
                        num_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._call("evaluate", self.trainer.evaluate_groups, w, sample_idx, sensitive,
                          num_groups)

    def evaluate_adapted(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                         train_idx: Sequence[np.ndarray], test_idx: Sequence[np.ndarray]
                         ) -> tuple[np.ndarray, np.ndarray]:
        return self._call("evaluate (adapted)", self.trainer.evaluate_adapted, w, round, lr,
                          client_ids, train_idx, test_idx)

    def evaluate_each(self, W: Tensor, sample_idx: Sequence[np.ndarray]
                      ) -> tuple[np.ndarray, np.ndarray]:
        return self._call("evaluate", self.trainer.evaluate_each, W, sample_idx)

    def evaluate_local(self, w: Tensor, rows: Tensor, sample_idx: Sequence[np.ndarray],
                       groups: tuple[Tensor, int] | None = None) -> tuple[np.ndarray, ...]:
        return self._call("evaluate", self.trainer.evaluate_local, w, rows, sample_idx, groups)
