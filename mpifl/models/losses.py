"""The training and evaluation loss, declared once (``[model] loss``) and used by every trainer,
rule-side client computation and evaluation.

A :class:`Loss` gives the per-sample loss of a model's outputs and, for a classification task,
which samples the model got right (accuracy and the group-fairness counts are built on that).
Built-ins:

- ``cross_entropy`` (default): ``F.cross_entropy(out, y)``, out ``(b, C)`` logits, y ``(b,)`` int64
  class labels; predicted label ``argmax(out)``.
- ``bce``: binary cross-entropy with logits, ``F.binary_cross_entropy_with_logits``; out
  ``(b, 1)`` or ``(b,)`` (one logit, the model is built with one output), y ``(b,)`` 0/1 labels
  of a two-class data set; predicted label ``out > 0``.
- ``mse``: mean squared error over the targets, a regression task: out ``(b, T)`` or ``(b,)``,
  y ``(b,)`` or ``(b, T)`` float32; no accuracy (NaN), summaries are of the client losses.
- ``token_cross_entropy``: next-token prediction over sequences (char- and word-level language
  models, as LEAF's and TFF's Shakespeare and TFF's StackOverflow): out ``(b, T, V)`` logits,
  y ``(b, T)`` int64 token ids; positions whose target is the padding id
  (:data:`mpifl.core.tokens.PAD` = 0) are skipped. A sample's loss is the mean over its
  counted positions and its accuracy the share of them predicted right (every sequence weighs
  the same in a client's mean, as every image does); a sample with no counted position has
  loss 0 and accuracy 0.

A user loss is a registered :class:`Loss` (``@LOSSES.register("name")`` in a plugin) or an import
path ``"pkg.module:obj"`` naming a :class:`Loss` or a plain function ``fn(out, y) -> (b,)``, taken
as a classification loss with argmax accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mpifl.core.blame import blame
from mpifl.core.errors import ConfigError
from mpifl.core.registry import Registry
from mpifl.core.tokens import PAD

__all__ = ["LOSSES", "Loss", "check_loss", "get_loss"]

Task = Literal["classification", "regression"]


@dataclass(frozen=True)
class Loss:
    """A per-sample loss and what it says about the task.

    Attributes:
        name: as named in the config.
        per_sample: ``fn(out, y) -> (b,)`` float tensor, differentiable in ``out``; ``out`` is the
            model's output for a batch of b samples, ``y`` their targets.
        task: ``"classification"`` (integer labels; accuracy and fairness metrics) or
            ``"regression"`` (float targets; loss-based summaries only).
        outputs: model output width for a data set of C classes or targets: ``None`` means C
            (``cross_entropy``, ``mse``), an int a fixed width (``bce``: 1).
        predict: ``fn(out) -> (b,)`` int64 predicted labels (classification: accuracy and the
            group counts compare them with y), or None (regression).
        positive: ``fn(out) -> (b,)`` probability of class 1 for binary tasks (mFairFL's
            constraints), or None when the loss defines none.
        correct: ``fn(out, y) -> (b,)`` float share of each sample predicted right, for a loss
            whose samples hold several targets (``token_cross_entropy``); None: 1 where
            ``predict(out) == y``, else 0.
    """

    name: str
    per_sample: Callable[[Tensor, Tensor], Tensor]
    task: Task = "classification"
    outputs: int | None = None
    predict: Callable[[Tensor], Tensor] | None = None
    positive: Callable[[Tensor], Tensor] | None = None
    correct: Callable[[Tensor, Tensor], Tensor] | None = None

    @property
    def classification(self) -> bool:
        return self.task == "classification"

    def width(self, num_classes: int) -> int:
        """The model's output width for a data set of ``num_classes`` classes (or targets)."""
        return int(num_classes) if self.outputs is None else int(self.outputs)

    def labels(self, out: Tensor) -> Tensor:
        """(b,) int64 predicted labels; -1 for a regression loss (never equal to a label, and
        callers report NaN accuracy for a regression task)."""
        if self.predict is None:
            return torch.full((out.shape[0],), -1, dtype=torch.int64, device=out.device)
        return self.predict(out)

    def hits(self, out: Tensor, y: Tensor) -> Tensor:
        """(b,) float64: each sample's share predicted right (0 or 1 for one label a sample);
        0 for a regression loss."""
        if self.correct is not None:
            return self.correct(out, y).double()
        return (self.labels(out) == y).double()


def _check_loss(name: str, loss: object) -> None:
    if not isinstance(loss, Loss) and not callable(loss):
        raise TypeError(f"loss {name!r} must be a mpifl.models.losses.Loss or a function "
                        f"fn(out, y) -> (batch,) per-sample losses")


#: Losses by name (``[model] loss``); plugins add theirs with ``@LOSSES.register("name")``.
LOSSES: Registry[Loss | Callable[[Tensor, Tensor], Tensor]] = Registry("loss", _check_loss)


def _argmax(out: Tensor) -> Tensor:
    return out.argmax(dim=-1)


def _softmax_positive(out: Tensor) -> Tensor:
    return torch.softmax(out, dim=-1)[..., 1]


def _logit(out: Tensor) -> Tensor:
    return out.reshape(out.shape[0]) if out.dim() > 1 else out


def _bce(out: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(_logit(out), y.to(out.dtype), reduction="none")


def _mse(out: Tensor, y: Tensor) -> Tensor:
    err = out.reshape(out.shape[0], -1) - y.to(out.dtype).reshape(y.shape[0], -1)
    return err.square().mean(dim=1)


LOSSES.add("cross_entropy", Loss(
    "cross_entropy", lambda out, y: F.cross_entropy(out, y, reduction="none"),
    predict=_argmax, positive=_softmax_positive))
LOSSES.add("bce", Loss("bce", _bce, outputs=1,
                       predict=lambda out: (_logit(out) > 0).long(),
                       positive=lambda out: torch.sigmoid(_logit(out))))
LOSSES.add("mse", Loss("mse", _mse, task="regression"))


def _token_mask(y: Tensor) -> tuple[Tensor, Tensor]:
    """(b, T) bool mask of the counted positions and (b,) their number (at least 1)."""
    keep = y != PAD
    return keep, keep.sum(dim=1).clamp_min(1)


def _token_ce(out: Tensor, y: Tensor) -> Tensor:
    keep, count = _token_mask(y)
    ce = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    return torch.where(keep, ce, 0.0).sum(dim=1) / count


def _token_correct(out: Tensor, y: Tensor) -> Tensor:
    keep, count = _token_mask(y)
    return ((out.argmax(dim=-1) == y) & keep).sum(dim=1) / count


LOSSES.add("token_cross_entropy", Loss("token_cross_entropy", _token_ce, predict=_argmax,
                                       correct=_token_correct))


def get_loss(name: str) -> Loss:
    """The :class:`Loss` a config names (a registered name or ``"pkg.module:obj"``).

    A plain function found by import path becomes a classification loss with argmax accuracy.

    Raises:
        ConfigError: ``model.loss: ...`` one line naming the unknown name and the known ones.
    """
    try:
        obj = LOSSES.get(name)
    except LookupError as exc:
        raise ConfigError(f"model.loss: {exc}") from None
    except TypeError:  # the registry's check: an import path to something else
        raise ConfigError(f"model.loss: '{name}' is not callable: name a "
                          f"mpifl.models.losses.Loss or a function fn(out, y) -> (batch,) "
                          f"per-sample losses") from None
    except ValueError as exc:  # the path clashes with a registered name
        raise ConfigError(f"model.loss: '{name}': {exc}") from None
    if isinstance(obj, Loss):
        return obj
    return Loss(name, obj, predict=_argmax, positive=_softmax_positive)


_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_loss(loss: Loss, num_classes: int, y: np.ndarray | Tensor | None = None) -> None:
    """Refuse, at set-up, a loss that does not depend on the model's output: its gradient
    with respect to the output, hence to the model, would be zero at every step and the run
    would train nothing (quietly: the loss is finite).

    The loss is evaluated, by autograd, on outputs ``(b, loss.width(num_classes))`` drawn at
    scales from 0.01 to 100 (so a loss of logits and one of probabilities both meet points
    where they are differentiable) against targets ``y``: it depends on the output when any
    gradient entry is non-zero (NaN counts as non-zero: not this check's business).

    Args:
        loss: the run's loss. num_classes: the data set's classes (or regression targets).
        y: (b,) or (b, T) targets of b >= 1 of the data set's samples; None: 8 class labels
            0, 1, ... mod ``num_classes`` (a lazy population, whose samples are drawn later).

    Raises:
        ConfigError: ``model.loss: 'name' does not depend on the model's output ...``.
        PluginFailure: a user loss that raises on these outputs (:mod:`mpifl.core.blame`).
    """
    y = torch.arange(8) % int(num_classes) if y is None else torch.as_tensor(y)
    width = loss.width(num_classes)
    b = int(y.shape[0])
    gen = torch.Generator().manual_seed(0)
    # integer sequence targets (b, T): outputs (b, T, width), one row of logits a position
    shape = (b, *y.shape[1:], width) if y.dtype in _INTEGER and y.dim() == 2 else (b, width)
    scale = torch.logspace(-2, 2, b).view(b, *[1] * (len(shape) - 1))
    out = (torch.randn(*shape, generator=gen) * scale).requires_grad_()
    with torch.enable_grad(), blame([("loss", loss.name, loss)], "check"):
        value = loss.per_sample(out, y)
        depends = isinstance(value, Tensor) and value.requires_grad
        if depends:
            (grad,) = torch.autograd.grad(value.sum(), out, allow_unused=True)
            depends = grad is not None and bool((grad != 0).any())
    if not depends:
        raise ConfigError(f"model.loss: '{loss.name}' does not depend on the model's output "
                          f"(its gradient with respect to the output is zero, or it is not "
                          f"computed from the output), so training would never change the "
                          f"model; compute the per-sample loss from `out` without detaching it")
