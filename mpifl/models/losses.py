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
- ``multilabel_bce``: multi-label classification (FLAIR, Song et al. 2022): out ``(b, C)`` logits,
  one a label, y ``(b, C)`` float32 multi-hot 0/1 targets; a sample's loss is the binary
  cross-entropy with logits averaged over its C labels, so a batch's mean is pfl-research's
  FLAIR loss ``nn.BCEWithLogitsLoss()`` (apple/pfl-research ``benchmarks/model/pytorch``;
  a sum over the labels would be C times larger, the same as a C times larger learning rate).
  Label j is predicted present when its logit is above 0 (probability above 1/2, as
  pfl-research's ``round(sigmoid)``); a sample's accuracy is the share of its C labels predicted
  right (per-label, "Hamming", accuracy), whose mean over a client's samples is pfl-research's
  "micro accuracy". The FLAIR paper reports averaged precision over a whole test set, a ranking
  metric that no per-sample count gives; mpifl does not compute it.

Each built-in loss declares the targets it takes (:attr:`Loss.targets`), and the run's set-up
checks them against the data set's own samples before anything trains
(:func:`check_targets`, :func:`check_fit`): a loss that does not fit the targets is refused in
one line naming the loss, the data set and the mismatch.

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

from mpifl.core.blame import blame, is_plugin, origin
from mpifl.core.errors import ConfigError, MpiflError
from mpifl.core.registry import Registry
from mpifl.core.tokens import PAD

__all__ = ["LOSSES", "Loss", "check_fit", "check_loss", "check_targets", "get_loss"]

Task = Literal["classification", "regression", "multilabel"]
#: What a loss's targets hold a sample (:attr:`Loss.targets`).
Targets = Literal["label", "sequence", "multi_hot", "values"]


@dataclass(frozen=True)
class Loss:
    """A per-sample loss and what it says about the task.

    Attributes:
        name: as named in the config.
        per_sample: ``fn(out, y) -> (b,)`` float tensor, differentiable in ``out``; ``out`` is the
            model's output for a batch of b samples, ``y`` their targets.
        task: ``"classification"`` (integer labels; accuracy and fairness metrics),
            ``"regression"`` (float targets; loss-based summaries only) or ``"multilabel"``
            (float32 multi-hot targets; accuracy, no group fairness counts).
        outputs: model output width for a data set of C classes or targets: ``None`` means C
            (``cross_entropy``, ``mse``), an int a fixed width (``bce``: 1).
        predict: ``fn(out) -> (b,)`` int64 predicted labels (classification: accuracy and the
            group counts compare them with y), or None (regression).
        positive: ``fn(out) -> (b,)`` probability of class 1 for binary tasks (mFairFL's
            constraints), or None when the loss defines none.
        correct: ``fn(out, y) -> (b,)`` float share of each sample predicted right, for a loss
            whose samples hold several targets (``token_cross_entropy``, ``multilabel_bce``);
            None: 1 where ``predict(out) == y``, else 0.
        targets: what y holds a sample, checked at set-up against the run's own samples
            (:func:`check_targets`): ``"label"`` one integer class id in [0, C) (y ``(b,)``),
            ``"sequence"`` T integer token ids in [0, C) (y ``(b, T)``), ``"multi_hot"`` C
            floats 0 or 1 (y ``(b, C)``), ``"values"`` float targets of any shape; None (a
            user loss): only that it runs on the model's output and the targets
            (:func:`check_fit`).
    """

    name: str
    per_sample: Callable[[Tensor, Tensor], Tensor]
    task: Task = "classification"
    outputs: int | None = None
    predict: Callable[[Tensor], Tensor] | None = None
    positive: Callable[[Tensor], Tensor] | None = None
    correct: Callable[[Tensor, Tensor], Tensor] | None = None
    targets: Targets | None = None

    @property
    def classification(self) -> bool:
        """Whether accuracy is defined: single-label (integer labels) or multi-label
        classification; False for a regression loss."""
        return self.task != "regression"

    @property
    def integer_labels(self) -> bool:
        """Whether the targets are integer labels (``task == "classification"``), which the
        group fairness counts need."""
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
        0 for a regression loss (whose y may hold several values a sample: never compared)."""
        if not self.classification:
            return torch.zeros(out.shape[0], dtype=torch.float64, device=out.device)
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
    predict=_argmax, positive=_softmax_positive, targets="label"))
LOSSES.add("bce", Loss("bce", _bce, outputs=1,
                       predict=lambda out: (_logit(out) > 0).long(),
                       positive=lambda out: torch.sigmoid(_logit(out)), targets="label"))
LOSSES.add("mse", Loss("mse", _mse, task="regression", targets="values"))


def _multilabel_bce(out: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(out, y.to(out.dtype), reduction="none").mean(dim=1)


def _multilabel_correct(out: Tensor, y: Tensor) -> Tensor:
    return ((out > 0) == (y > 0.5)).to(out.dtype).mean(dim=1)


LOSSES.add("multilabel_bce", Loss("multilabel_bce", _multilabel_bce, task="multilabel",
                                  correct=_multilabel_correct, targets="multi_hot"))


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
                                       correct=_token_correct, targets="sequence"))


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


def _shape(t: Tensor | np.ndarray) -> str:
    """``(8, 80) int64``: a tensor's shape and dtype, for messages."""
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{tuple(t.shape)} {dtype}"


def _held(y: Tensor) -> tuple[str, str]:
    """What a batch of targets holds a sample, and the built-in loss that takes it."""
    per = tuple(y.shape[1:])
    if not y.is_floating_point():
        if not per:
            return "one class label a sample", "'cross_entropy' (or 'bce' for two classes)"
        if len(per) == 1:
            return (f"a sequence of {per[0]} token targets a sample",
                    "'token_cross_entropy', with a model that predicts every position (e.g. "
                    "char_lstm with model.params.sequence = true)")
        return f"integer targets of shape {per} a sample", "a loss of your own"
    if len(per) == 1 and bool(((y == 0) | (y == 1)).all()):
        return f"{per[0]} multi-hot 0/1 labels a sample", "'multilabel_bce'"
    return f"float targets of shape {per} a sample", "'mse'"


def check_targets(loss: Loss, y: np.ndarray | Tensor, num_classes: int, dataset: str) -> None:
    """Refuse, at set-up, a built-in loss whose targets are not what the data set's samples
    hold (:attr:`Loss.targets`): shape, dtype and classes, checked on a batch of the run's own
    samples, so that the mismatch is named before the first step instead of failing inside it.

    Args:
        loss: the run's loss (a loss with ``targets`` None is not checked here:
            :func:`check_fit` runs it).
        y: (b, ...) targets of b >= 1 of the data set's samples, their own dtype.
        num_classes: C, the data set's classes (or the vocabulary predicted over).
        dataset: ``data.dataset``, named in the message.

    Raises:
        ConfigError: ``model.loss: 'name' needs ..., but data set 'dataset' has ...: use ...``
            (one line).
    """
    kind = loss.targets
    if kind is None:
        return
    y = torch.as_tensor(np.asarray(y))
    held, use = _held(y)
    per = tuple(y.shape[1:])
    integer = not y.is_floating_point() and y.dtype != torch.bool
    wants = {"label": "one integer class label a sample (y (b,))",
             "sequence": "a sequence of integer token targets a sample (y (b, T))",
             "multi_hot": f"{num_classes} multi-hot 0/1 float labels a sample (y (b, "
                          f"{num_classes}))",
             "values": "float targets (y (b,) or (b, T))"}
    fits = {"label": integer and not per, "sequence": integer and len(per) == 1,
            "multi_hot": y.is_floating_point() and per == (num_classes,),
            "values": y.is_floating_point()}
    if not fits[kind]:
        raise ConfigError(f"model.loss: '{loss.name}' needs {wants[kind]}, but data set "
                          f"'{dataset}' has {held} (y {_shape(y)}): use model.loss = {use}")
    if kind in ("label", "sequence") and y.numel():
        classes = loss.width(num_classes) if loss.outputs is None else 2
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= classes:
            raise ConfigError(f"model.loss: '{loss.name}' needs class ids 0..{classes - 1}, but "
                              f"data set '{dataset}' has targets {low}..{high}")
    if kind == "multi_hot" and not bool(((y == 0) | (y == 1)).all()):
        raise ConfigError(f"model.loss: '{loss.name}' needs multi-hot 0/1 labels, but data set "
                          f"'{dataset}' has other values in y ({held}): use model.loss = {use}")


def check_fit(loss: Loss, out: Tensor, y: np.ndarray | Tensor, model: str, dataset: str
              ) -> None:
    """Refuse, at set-up, a loss that cannot score the model's output on a batch of the run's
    own samples against their targets, as training and evaluation will: its per-sample loss
    and accuracy counts must run and give one finite-typed value a sample.

    Args:
        loss: the run's loss. out: (b, ...) the model's output on b of the run's samples
            (eval mode). y: their (b, ...) targets. model, dataset: named in the message.

    Raises:
        ConfigError: one line naming the loss, the model, the data set, the shapes and what
            failed (the error of a loss that raises, or a result that is not (b,)).
    """
    y = torch.as_tensor(np.asarray(y)).to(out.device)
    b = int(out.shape[0])
    where = (f"model '{model}''s output {_shape(out)} against data set '{dataset}''s "
             f"targets {_shape(y)}")
    who = f"'{loss.name}'" + (f" ({origin(loss)})" if is_plugin(loss) else "")
    try:
        with torch.no_grad():
            value = loss.per_sample(out, y)
            hits = loss.hits(out, y) if isinstance(value, Tensor) else None
    except MpiflError:
        raise
    except Exception as exc:  # noqa: BLE001 -- named in one line: the mismatch is the cause
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"model.loss: {who} fails on {where}: {type(exc).__name__}: "
                          f"{first}") from None
    for what, got in (("per-sample loss", value), ("accuracy count", hits)):
        if not isinstance(got, Tensor) or tuple(got.shape) != (b,) \
                or not got.is_floating_point():
            shown = _shape(got) if isinstance(got, Tensor) else type(got).__name__
            raise ConfigError(f"model.loss: {who} gives a {what} of {shown} on {where}, "
                              f"expected ({b},) floats, one a sample")


def check_loss(loss: Loss, num_classes: int, y: np.ndarray | Tensor | None = None, *,
               shape: tuple[int, ...] | None = None) -> None:
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
        shape: (b, ...) the model's output shape on those samples (the run passes it, once
            :func:`check_fit` has run the loss on it); None: ``(b, T, width)`` for integer
            sequence targets, else ``(b, width)``.

    Raises:
        ConfigError: ``model.loss: 'name' does not depend on the model's output ...``.
        PluginFailure: a user loss that raises on these outputs (:mod:`mpifl.core.blame`).
    """
    y = torch.arange(8) % int(num_classes) if y is None else torch.as_tensor(y)
    width = loss.width(num_classes)
    b = int(y.shape[0])
    gen = torch.Generator().manual_seed(0)
    # integer sequence targets (b, T): outputs (b, T, width), one row of logits a position
    if shape is None:
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
