"""Vectorised local training: many clients' SGD as one batched computation.

Local training is FedAvg's client update (McMahan et al., AISTATS 2017): E epochs of minibatch
SGD on the client's data, starting from the global parameters w, reporting ``u_k = w - w_k``
(ALGORITHMS.md §0-1). Instead of looping over clients, :class:`VmapTrainer` stacks the parameters of
a chunk of clients into an ``(m, d)`` tensor and takes one ``torch.func.vmap(grad(loss))`` step
for all of them per step index (the torch.func "model ensembling" pattern; for the plain MLP
family :mod:`mpifl.clients.stacked` takes the same step with batched matmuls and one backward,
faster, with the vmapped step as its oracle). Clients with fewer
samples, hence fewer or smaller minibatches, are padded and masked instead of looped:

- every minibatch is padded to a common length with per-sample weight 0, and the loss is the
  weighted sum divided by the number of real samples (= the mean over the real minibatch);
- at step indices beyond a client's own step count its step is multiplied by a 0/1 active
  mask, so its parameters stay exactly as they are.

A client's update depends only on w, its samples and ``(seed, round, client_id)``: not on which
other clients share its chunk, on the chunking, or on the order of clients (up to float rounding
of differently shaped batched kernels).

Local work may be capped (``client.max_local_steps``): each client then takes only the first
steps of its schedule (:func:`mpifl.clients.minibatches.capped_steps`), in every trainer alike.

A stop request is acted on between steps: inside :func:`stop_between_steps` (the runtime
arms it around a round's training) every trainer calls :func:`check_stop` before each local
step, which raises :class:`TrainingStopped` once the request is made; the round's training
is then abandoned and nothing of it is returned (the runtime drops the round).

This module is the training (schedule, step, chunk); the trainer's other jobs live beside it and
its methods delegate to them: the keyed minibatch order in :mod:`mpifl.clients.minibatches`, the
memory plan (chunks of clients, blocks of rows) in :mod:`mpifl.clients.memory`, the evaluators
and per-client statistics in :mod:`mpifl.clients.evaluation`.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, vmap

from mpifl.clients import evaluation, memory
from mpifl.clients.interface import TrainOptions
from mpifl.clients.minibatches import Schedule, capped_steps, first_epoch_samples, minibatch_schedule
from mpifl.clients.stacked import stacked_ce_grad, stacked_ce_grad_and_value, stacked_forward
from mpifl.core.layout import ParamLayout
from mpifl.core.wire import Columns
from mpifl.models.losses import get_loss

__all__ = ["TrainerBase", "TrainingStopped", "VmapTrainer", "check_stop", "stop_between_steps"]


class TrainingStopped(BaseException):
    """Local training abandoned between two steps because a stop was requested
    (:func:`stop_between_steps`): the round's training returns nothing, and the caller drops
    the round (resume trains it again from the same state, so the results do not change).
    A BaseException, as KeyboardInterrupt: not an error, so no handler of errors (a plugin's
    blame, :func:`mpifl.core.blame.blame`) turns it into one."""


#: the stop check :func:`check_stop` consults (None: training is never interrupted)
_STOP_CHECK: Callable[[], bool] | None = None


@contextmanager
def stop_between_steps(check: Callable[[], bool] | None) -> Iterator[None]:
    """Inside the block, local training calls ``check()`` before each step (every trainer,
    every client chunk) and raises :class:`TrainingStopped` as soon as it returns True;
    None: no check. The previous check comes back afterwards. ``check`` must be cheap (a
    flag read: it runs once a step) and never synchronises a device."""
    global _STOP_CHECK
    saved, _STOP_CHECK = _STOP_CHECK, check
    try:
        yield
    finally:
        _STOP_CHECK = saved


def check_stop() -> None:
    """Raises TrainingStopped: the check of :func:`stop_between_steps` says stop."""
    if _STOP_CHECK is not None and _STOP_CHECK():
        raise TrainingStopped("a stop was requested during local training")


class TrainerBase(ABC):
    """What :class:`VmapTrainer` and :class:`~mpifl.clients.loop.LoopTrainer` share: the sample
    store, the options, :meth:`run_round` over their own ``_train``, the batched evaluations of
    :mod:`mpifl.clients.evaluation` and the memory plan of evaluation.

    Args:
        model: the architecture (its own parameters are never used nor changed; the computation
            runs ``functional_call`` with parameters taken from w).
        layout: ``ParamLayout.from_module(model)`` (the loop: of the model's state).
        x: ``(N, *input_shape)`` float32 or ``(N, T)`` int64 token ids, the whole sample store
            (any device; only the samples of the clients being processed are moved to
            ``options.device``).
        y: ``(N,)`` int64 labels, ``(N, T)`` int64 sequence targets, or ``(N,)`` / ``(N, T)``
            float32 targets for a regression ``options.loss``.
        options: the local-training options (:class:`~mpifl.clients.interface.TrainOptions`).

    Raises:
        ValueError: inconsistent shapes or a layout not matching the model.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor,
                 options: TrainOptions) -> None:
        self._check_model(model, layout)
        self.options = options
        self.loss = get_loss("cross_entropy") if options.loss is None else options.loss
        if x.shape[0] != y.shape[0] or (self.loss.classification and y.dim() > 2):
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} do not match")
        self.prox_mu = float(options.prox_mu)
        self.report_accuracy = bool(options.report_accuracy)
        self.pretrain_losses = bool(options.pretrain_losses)
        self.columns = self.columns_for(layout.d, report_accuracy=options.report_accuracy)
        self.model, self.layout = model, layout
        self.x, self.y = x, y
        self.epochs, self.batch_size = int(options.epochs), int(options.batch_size)
        self.max_local_steps = (None if options.max_local_steps is None
                                else int(options.max_local_steps))
        self.momentum, self.weight_decay = float(options.momentum), float(options.weight_decay)
        self.seed = int(options.seed)
        self.order_tag = None if options.order_tag is None else int(options.order_tag)
        self.minibatch_order = options.minibatch_order
        self.memory_budget = int(options.memory_budget_mb * 2**20)
        self.device = torch.device(options.device)
        self._in_numel = math.prod(x.shape[1:])
        self._act_numel = memory.activation_numel(model, tuple(x.shape[1:]), self._x_dtype(x))

    @abstractmethod
    def _check_model(self, model: nn.Module, layout: ParamLayout) -> None:
        """Refuse a model this trainer cannot run (ValueError)."""

    @abstractmethod
    def _train(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
               sample_idx: Sequence[np.ndarray], start: Tensor | None = None,
               prox_mu: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`run_round`'s updates and losses plus the training accuracies of w (m,)
        float64 (NaN when neither ``pretrain_losses`` nor ``report_accuracy`` measures them);
        local SGD starts from ``start`` (m, d) instead of w when given, with the proximal term
        towards w of coefficient ``prox_mu`` (default: the options')."""

    @abstractmethod
    def _train_chunk(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                     sample_idx: Sequence[np.ndarray], start: Tensor | None = None,
                     prox_mu: float | None = None, loss_out: Tensor | None = None) -> Tensor:
        """Local SGD of a chunk of clients; returns their final parameters ``(m, d)``."""

    @abstractmethod
    def plan_chunks(self, sizes: np.ndarray) -> list[np.ndarray]:
        """Clients (by position) in the chunks training takes them in."""

    # ------------------------------------------------------------------ public API

    @classmethod
    def columns_for(cls, d: int, num_groups: int = 0, **options: Any) -> Columns:
        """The :class:`Columns` a trainer built with these keyword ``options`` exchanges.

        Args:
            d: parameters of the model. num_groups: sensitive groups G of the data (0: none).
            options: the trainer's own keyword arguments (others are ignored).
        """
        return Columns(stats=(("train_accuracy", 1),) if options.get("report_accuracy") else ())

    @contextmanager
    def samples(self, x: np.ndarray | Tensor, y: np.ndarray | Tensor) -> Iterator[None]:
        """Train and evaluate on the sample store ``x``, ``y`` inside the block, then on the
        trainer's own again: a lazy population's window of a round's clients
        (:mod:`mpifl.data.lazy`), whose rows the block's ``sample_idx`` index.

        Args:
            x: (n, *input_shape) float32 samples. y: (n,) labels (or targets), as the store's.
                numpy arrays, or torch tensors (a window drawn on a device), moved to the
                store's device and dtype only where they differ (no copy when they match).
        """
        def store(a: np.ndarray | Tensor, like: Tensor) -> Tensor:
            t = a if isinstance(a, Tensor) else torch.from_numpy(np.ascontiguousarray(a))
            return t.to(like.device, like.dtype)

        own = self.x, self.y
        self.x, self.y = store(x, own[0]), store(y, own[1])
        try:
            yield
        finally:
            self.x, self.y = own

    @torch.no_grad()
    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Run local training for the selected clients of one round, with the extras of
        :attr:`columns`: the :class:`~mpifl.clients.interface.ClientTrainer` entry point.

        Args:
            w: ``(d,)`` global parameters.
            round: round index t (keys the minibatch order).
            lr: client learning rate ``lr_t`` of this round.
            client_ids: ``(m,)`` int ids of the clients (key the minibatch order).
            sample_idx: m arrays of indices into x: each client's training samples (non-empty).
            inputs: ``(columns.inputs,)`` float64 round inputs, or None when there are none.
            state: ``(m, columns.state)`` float32 per-client state rows, or None.

        Returns:
            ``updates``: ``(m, d)`` float32 on ``device``, ``u_k = w - w_k``;
            ``losses``: ``(m,)`` float32 on ``device``, the mean loss (``[model] loss``) of w on each
            client's training samples, measured before training (``l_k`` of ALGORITHMS.md §0);
            with ``pretrain_losses = False`` (and no ``report_accuracy``) the first epoch's
            mean training loss instead (see the class docstring);
            ``stats``: name -> float32 tensor (m, width) for every column of ``columns.stats``
            (``train_accuracy`` (m, 1), the accuracy of w, with ``report_accuracy``).

        Raises:
            ValueError: wrong shapes, or a client without samples.
        """
        updates, losses, acc = self._train(w, round, lr, client_ids, sample_idx)
        if self.report_accuracy:
            return updates, losses, {"train_accuracy": acc.float().view(-1, 1)}
        return updates, losses, {}

    @staticmethod
    def _check_clients(client_ids: npt.ArrayLike, sample_idx: Sequence[np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray]:
        client_ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if len(client_ids) != len(sample_idx):
            raise ValueError(f"{len(client_ids)} client ids but {len(sample_idx)} sample index arrays")
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        if (sizes == 0).any():
            raise ValueError(f"clients {client_ids[sizes == 0].tolist()} have no training samples")
        return client_ids, sizes

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, w: Tensor, sample_idx: Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and mean loss ``(n,)`` float64 of w ``(d,)`` on each client's samples
        (NaN without samples): :func:`mpifl.clients.evaluation.evaluate`."""
        return evaluation.evaluate(self, w, sample_idx)

    def evaluate_groups(self, w: Tensor, sample_idx: Sequence[np.ndarray], sensitive: Tensor,
                        num_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`evaluate` plus the (n, G, 2, 3) float64 group counts of binary tasks:
        :func:`mpifl.clients.evaluation.evaluate_groups`."""
        return evaluation.evaluate_groups(self, w, sample_idx, sensitive, num_groups)

    def evaluate_adapted(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                         train_idx: Sequence[np.ndarray], test_idx: Sequence[np.ndarray]
                         ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and loss ``(n,)`` float64 on each client's test samples after this
        trainer's local SGD from w on its training samples (``run.adapt_epochs``):
        :func:`mpifl.clients.evaluation.evaluate_adapted`."""
        return evaluation.evaluate_adapted(self, w, round, lr, client_ids, train_idx, test_idx)

    def evaluate_each(self, W: Tensor, sample_idx: Sequence[np.ndarray]
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and loss ``(n,)`` float64 of client i's own parameters ``W[i]`` (W (n, d))
        on its samples: :func:`mpifl.clients.evaluation.evaluate_each`."""
        return evaluation.evaluate_each(self, W, sample_idx)

    def evaluate_local(self, w: Tensor, rows: Tensor, sample_idx: Sequence[np.ndarray],
                       groups: tuple[Tensor, int] | None = None) -> tuple[np.ndarray, ...]:
        """Each client's accuracy and loss at w with its own local coordinates: only the loop
        trainer keeps local coordinates (local BatchNorm), this one refuses."""
        raise ValueError(f"{type(self).__name__} keeps no local coordinates "
                         "(local BatchNorm trains with client.trainer = 'loop')")

    def _client_stats(self, w: Tensor, sample_idx: Sequence[np.ndarray],
                      groups: tuple[Tensor, int] | None = None) -> tuple[Tensor, ...]:
        """Per-client loss and accuracy (n,) float64 of w (and group counts with ``groups``):
        :func:`mpifl.clients.evaluation.client_stats`."""
        return evaluation.client_stats(self, w, sample_idx, groups)

    def _forward_blocks(self, w: Tensor, sample_idx: Sequence[np.ndarray]
                        ) -> Iterator[tuple[np.ndarray, Tensor, Tensor, Tensor]]:
        """One forward of w over the clients' samples in memory-bounded row blocks:
        :func:`mpifl.clients.evaluation.forward_blocks`."""
        return evaluation.forward_blocks(self, w, sample_idx)

    # ------------------------------------------------------------------ memory plan

    def _eval_chunks(self, sizes: np.ndarray, per_client: int, per_row: int) -> list[np.ndarray]:
        """Clients with samples in evaluation chunks that fit the memory budget:
        :func:`mpifl.clients.memory.eval_chunks`."""
        return memory.eval_chunks(sizes, per_client, per_row, self.memory_budget)

    # ------------------------------------------------------------------ helpers

    def _gather(self, rows: np.ndarray) -> tuple[Tensor, Tensor]:
        """Samples ``rows`` of the store, moved to the device (only these are moved)."""
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.x.device)
        if self.device.type == "cuda" and self.x.is_pinned():
            # a host store (client.samples_on = "host"): gather the rows into pinned memory,
            # so the copies to the device are DMAs left queued on the stream
            xs = torch.empty((len(idx), *self.x.shape[1:]), dtype=self.x.dtype, pin_memory=True)
            ys = torch.empty((len(idx), *self.y.shape[1:]), dtype=self.y.dtype, pin_memory=True)
            torch.index_select(self.x, 0, idx, out=xs)
            torch.index_select(self.y, 0, idx.to(self.y.device), out=ys)
            return (xs.to(self.device, self._x_dtype(self.x), non_blocking=True),
                    ys.to(self.device, non_blocking=True))
        return (self.x[idx].to(self.device, self._x_dtype(self.x), non_blocking=True),
                self.y[idx.to(self.y.device)].to(self.device, non_blocking=True))

    def _first_epoch_samples(self, sizes: np.ndarray) -> np.ndarray:
        """(m,) int64: the samples of each client's first-epoch steps that it trains on (the
        divisor of the first epoch's loss sum; ``sizes`` themselves without a cap)."""
        return first_epoch_samples(sizes, self.batch_size, self.max_local_steps)

    @staticmethod
    def _x_dtype(x: Tensor) -> torch.dtype:
        """float32 features (whatever float the store holds), int64 token ids."""
        return torch.float32 if x.is_floating_point() else torch.int64

    def _check_w(self, w: Tensor) -> Tensor:
        if w.shape != (self.layout.d,):
            raise ValueError(f"w must have shape ({self.layout.d},), got {tuple(w.shape)}")
        return w.detach().to(self.device, torch.float32)



class VmapTrainer(TrainerBase):
    """Local SGD for many clients at once, plus batched per-client loss and accuracy.

    Args:
        model, layout, x, y: as in :class:`TrainerBase`; the model has parameters only, no
            buffers.
        options: :class:`~mpifl.clients.interface.TrainOptions`. ``pretrain_losses = False``
            (rules with ``needs.losses = False``): no forward pass of w before training unless
            ``report_accuracy`` asks for it; the reported loss is then the training pass's own:
            the mean over the client's samples of the minibatch loss of the first epoch, each
            sample's loss taken at the parameters its minibatch's step started from (equal to
            ``l_k`` for full-batch training, B = 0). Accuracies are NaN for a regression loss.

    Raises:
        ValueError: inconsistent shapes, a layout not matching the model, or buffers in the
            model.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor,
                 options: TrainOptions) -> None:
        super().__init__(model, layout, x, y, options)
        # (params, xb, yb, *extras, wb) -> gradients (and with the value, the (m,) losses)
        self._step_grad: Callable[..., dict[str, Tensor]] = vmap(grad(self._minibatch_loss))
        self._step_grad_value: Callable[..., tuple[dict[str, Tensor], Tensor]] = vmap(
            grad_and_value(self._minibatch_loss))
        forward = (stacked_forward(model) if self._plain_steps
                   and self.loss is get_loss("cross_entropy")
                   and type(self)._minibatch_loss is VmapTrainer._minibatch_loss
                   and not self._has_extras else None)
        if forward is not None:  # the plain MLP family: batched matmuls, one backward (faster)
            self._step_grad = functools.partial(stacked_ce_grad, forward)
            self._step_grad_value = functools.partial(stacked_ce_grad_and_value, forward)

    def _check_model(self, model: nn.Module, layout: ParamLayout) -> None:
        """The vmap contract: the layout is the model's parameters, and no buffers."""
        _check_model(model, layout)

    def _train(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
               sample_idx: Sequence[np.ndarray], start: Tensor | None = None,
               prox_mu: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`run_round`'s updates and losses plus the training accuracies of w (m,) float64;
        local SGD starts from ``start`` (m, d) instead of w when given (Ditto's personal
        models), with the proximal term towards w of coefficient ``prox_mu`` (default: the
        trainer's)."""
        w = self._check_w(w)
        client_ids, sizes = self._check_clients(client_ids, sample_idx)
        measure = self.pretrain_losses or self.report_accuracy
        if measure:  # the forward pass of w over every client's samples, before training
            losses, acc = self._client_stats(w, sample_idx)
        else:  # the first epoch's training losses, summed per client by _train_chunk
            loss_sums = torch.zeros(len(sizes), dtype=torch.float64, device=self.device)
            acc = torch.full((len(sizes),), math.nan, dtype=torch.float64, device=self.device)
        updates = torch.empty(len(sizes), self.layout.d, device=self.device)
        for chunk in self.plan_chunks(sizes):
            pos = torch.as_tensor(chunk, device=self.device)
            loss_out = None if measure else torch.zeros(len(chunk), dtype=torch.float64,
                                                        device=self.device)
            w_chunk = self._train_chunk(w, round, lr, client_ids[chunk],
                                        [sample_idx[i] for i in chunk],
                                        start=None if start is None else start[pos],
                                        prox_mu=prox_mu, loss_out=loss_out)
            updates[pos] = w_chunk.neg_().add_(w)  # w - w_k
            if loss_out is not None:
                loss_sums[pos] = loss_out
        if not measure:
            losses = loss_sums / torch.as_tensor(self._first_epoch_samples(sizes),
                                                 dtype=torch.float64, device=self.device)
        return updates, losses.float(), acc

    # ------------------------------------------------------------------ memory plan

    def plan_chunks(self, sizes: np.ndarray) -> list[np.ndarray]:
        """Split clients (by position) into chunks whose estimated memory (:meth:`_client_bytes`)
        fits the budget, largest clients first (:func:`mpifl.clients.memory.plan_chunks`).

        Args:
            sizes: ``(m,)`` number of training samples per client.

        Returns:
            Arrays of positions into ``sizes``; together a permutation of ``range(m)``.
        """
        return memory.plan_chunks(sizes, self._client_bytes, self.memory_budget)

    def _client_bytes(self, n_max: int, n: int) -> int:
        """Estimated working memory of one client in a chunk whose largest client has n_max."""
        return memory.client_bytes(self.layout.d, self._act_numel, self._in_numel,
                                   self._padded_batch(n_max), self._steps(n_max), n)

    # ------------------------------------------------------------------ training

    def _padded_batch(self, n_max: int) -> int:
        return n_max if self.batch_size == 0 else min(self.batch_size, n_max)

    def _steps(self, n: int) -> int:
        """Local steps of a client of n samples (``client.max_local_steps`` applied)."""
        return int(capped_steps([n], self.epochs, self.batch_size, self.max_local_steps)[0])

    def _plan(self, round: int, client_ids: np.ndarray, sizes: np.ndarray) -> Schedule:
        """The chunk's padded minibatch plan on the device
        (:func:`mpifl.clients.minibatches.minibatch_schedule`)."""
        return minibatch_schedule(self.seed, round, client_ids, sizes, self.epochs,
                                  self.batch_size, self.order_tag, self.minibatch_order,
                                  self.device, self.max_local_steps)

    #: True when :meth:`_batch_extras` adds per-sample inputs to the minibatch loss.
    _has_extras = False
    #: False in subclasses that differentiate through the gradient steps (UGA's keep-trace):
    #: the batched path of :mod:`mpifl.clients.stacked` returns detached gradients.
    _plain_steps = True

    def _batch_extras(self, sample_rows: Tensor) -> tuple[Tensor, ...]:
        """Extra per-sample tensors (m, Bp, ...) of one step's minibatches, passed to
        :meth:`_minibatch_loss` between ``yb`` and ``wb``; ``sample_rows`` (m, Bp) int64 on the
        device are indices into the sample store (e.g. mFairFL's sensitive attribute). None by
        default."""
        return ()

    def _minibatch_loss(self, params: dict[str, Tensor], xb: Tensor, yb: Tensor, wb: Tensor) -> Tensor:
        """Mean loss over the real samples of one client's padded minibatch."""
        out = functional_call(self.model, params, (xb,))
        return (self.loss.per_sample(out, yb) * wb).sum() / wb.sum().clamp(min=1.0)

    def _train_chunk(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                     sample_idx: Sequence[np.ndarray], start: Tensor | None = None,
                     prox_mu: float | None = None, loss_out: Tensor | None = None) -> Tensor:
        """Local SGD of a chunk of clients; returns their final parameters ``(m, d)``.

        With ``loss_out`` ((m,) float64 zeros), each client's sum over its first epoch's real
        samples of the minibatch loss (the value of :meth:`_minibatch_loss` at the step's
        parameters times the real samples of the minibatch) is added into it.

        Training starts from w, or from ``start`` (m, d) when given; the proximal term (if
        ``prox_mu``, default the trainer's, is > 0) always pulls towards the round's w.
        Subclasses change the local objective through :meth:`_minibatch_loss` and
        :meth:`_batch_extras`.

        The stacked parameters live in one ``(m, d)`` buffer and are updated in place through
        per-tensor views (``_foreach`` ops, like ``torch.optim.SGD``): fresh large allocations
        (and their page faults) would otherwise cost more than the arithmetic.
        """
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        plan = self._plan(round, client_ids, sizes)
        rows, weights, steps_np = plan.rows, plan.weights, plan.steps
        store_np = np.concatenate([np.asarray(s, dtype=np.int64) for s in sample_idx])
        store_rows = torch.as_tensor(store_np, device=self.device)
        if self.x.device == self.device:
            # The store is already here: index it directly, one copy per step instead of two.
            xs, ys, rows = self.x, self.y, store_rows[rows]
            sample_rows = rows
        else:  # move the chunk's samples once, then index on the device
            xs, ys = self._gather(store_np)
            sample_rows = store_rows[rows] if self._has_extras else rows
        steps = torch.as_tensor(steps_np, device=self.device)
        flat = (w.expand(len(sizes), -1) if start is None else start.to(w)).clone()
        params = self.layout.unflatten(flat)  # views into flat, (m, *shape) each
        views = list(params.values())
        anchor = list(self.layout.unflatten(w).values())  # the round's global params, per tensor
        mu = self.prox_mu if prox_mu is None else float(prox_mu)
        buf: list[Tensor] | None = None
        widths = plan.widths
        if loss_out is not None:  # (m, T) real samples of each first-epoch minibatch, else 0
            loss_weight = torch.as_tensor(plan.real * plan.first_epoch(self.epochs),
                                          dtype=torch.float64, device=self.device)
        for t in range(rows.shape[1]):
            check_stop()  # a stop request ends the round here, between steps
            b = int(widths[t])  # columns that are padding in every client cost nothing
            rt = rows[:, t, :b]
            extras = self._batch_extras(sample_rows[:, t, :b]) if self._has_extras else ()
            flat_rt = rt.reshape(-1)  # index_select: one contiguous gather, not advanced indexing
            batch = (xs.index_select(0, flat_rt).view(*rt.shape, *xs.shape[1:]),
                     ys.index_select(0, flat_rt).view(*rt.shape, *ys.shape[1:]), *extras, weights[:, t, :b])
            if loss_out is None:
                grads = list(self._step_grad(params, *batch).values())
            else:
                g, value = self._step_grad_value(params, *batch)
                grads = list(g.values())
                loss_out.add_(value.double() * loss_weight[:, t])
            grads = _unaliased(grads)
            if mu:  # gradient of (mu/2)||w_k - w||^2 joins the loss gradient
                torch._foreach_add_(grads, torch._foreach_sub(views, anchor), alpha=mu)
            masked = bool(steps_np.min() <= t)
            active = (steps > t).to(flat.dtype)
            self._sgd_step(views, grads, buf, lr, active if masked else None)
            if self.momentum and buf is None:
                buf = grads  # step 0 (every client active): the buffer starts as the gradient
        return flat

    def _sgd_step(self, params: list[Tensor], grads: list[Tensor], buf: list[Tensor] | None,
                  lr: float, active: Tensor | None) -> None:
        """One ``torch.optim.SGD`` step (dampening 0, no Nesterov), in place, on stacked tensors.

        ``active`` (m,) 0/1, or None when every client is active. An inactive client's step is
        multiplied by 0, so its parameters stay exactly as they are. Its momentum buffer may
        still change, but it is never read again: a client's steps are a prefix of the step
        indices, so once inactive it stays inactive for the rest of the round.
        """
        if self.weight_decay:
            torch._foreach_add_(grads, params, alpha=self.weight_decay)
        step: tuple[Tensor, ...] | list[Tensor] = grads
        if self.momentum and buf is not None:
            torch._foreach_mul_(buf, self.momentum)
            torch._foreach_add_(buf, grads)
            step = buf
        if active is not None:
            step = torch._foreach_mul(step, [active.view(-1, *[1] * (p.dim() - 1)) for p in params])
        torch._foreach_add_(params, step, alpha=-lr)


def _unaliased(grads: list[Tensor]) -> list[Tensor]:
    """Each gradient in its own memory: vmap returns one tensor for parameters whose gradients
    are equal (``nn.LSTM``'s ``bias_ih`` and ``bias_hh``), and the in-place weight decay,
    proximal and momentum updates of a step would otherwise apply twice to it."""
    seen: set[int] = set()
    out = []
    for g in grads:
        ptr = g.untyped_storage().data_ptr()
        out.append(g.clone() if ptr in seen else g)
        seen.add(ptr)
    return out


def _check_model(model: nn.Module, layout: ParamLayout) -> None:
    if ParamLayout.from_module(model) != layout:
        raise ValueError("the layout does not match the model's named_parameters()")
    if any(True for _ in model.buffers()):
        raise ValueError("models with buffers (e.g. BatchNorm) cannot be trained with vmap; "
                         "use client.trainer = 'loop'")
