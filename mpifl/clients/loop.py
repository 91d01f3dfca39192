"""The per-client loop trainer (``client.trainer = "loop"``): any model, any buffer, any loss.

Each selected client, one after the other, loads the round's global state w into a private copy
of the model, puts it in train mode and runs FedAvg's local update (McMahan et al., AISTATS
2017; ALGORITHMS.md §1) with ``torch.optim.SGD``: E epochs over the minibatches of
:func:`~mpifl.clients.minibatches.client_minibatches`, the same minibatches, momentum, weight decay
and FedProx term as the vectorised trainers, so on the models those accept it is their oracle.

What the vectorised trainers cannot do, this one does exactly:

- **Buffers.** BatchNorm's running statistics are part of w (:func:`mpifl.core.layout.model_state`);
  the forward passes of local training update them and they come back in the update
  ``u_k = w - w_k`` like the parameters, so the rule aggregates them (``model.batchnorm =
  "global"``, ALGORITHMS.md §9). Evaluation runs the model in eval mode with the statistics of
  the evaluated w, never the test batch's own.
- **Local BatchNorm** (``model.batchnorm = "local"`` or ``"local_stats"``; FedBN, Li et al.,
  ICLR 2021): with ``local_index`` the coordinates it lists (BatchNorm statistics, and affine
  parameters for FedBN) are each client's own. A client starts from w with those coordinates
  replaced by its state row, its losses are measured there, its update is 0 on them (the rule
  never averages them) and its trained values come back as the statistic ``local_state``; the
  server keeps the (K, s) rows (:class:`mpifl.runtime.client_state.LocalCoordinates`) and
  evaluates every client with its own (:meth:`LoopTrainer.evaluate_local`).
- **Randomness.** Dropout and any other random layer or functional call draw from torch's
  generator reseeded at every step from ``[seed, round, client, step, LAYER_TAG]``
  (:data:`mpifl.core.rng.LAYER_TAG`): a client's masks do not depend on the rank, the other
  clients, the chunking or a resume, so runs stay bit-identical across world sizes.
  The caller's random streams are left as they were.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mpifl.clients.minibatches import client_minibatches
from mpifl.clients.interface import TrainOptions
from mpifl.clients.trainer import TrainerBase, check_stop
from mpifl.core.layout import ParamLayout, model_state
from mpifl.core.rng import LAYER_TAG
from mpifl.core.wire import Columns
from mpifl.models.zoo import model_traits

__all__ = ["LoopTrainer", "step_seed"]


def step_seed(seed: int, round: int, client_id: int, step: int, tag: int | None = None) -> int:
    """The torch seed of client ``client_id``'s random layers at local ``step`` of ``round``:
    a 63-bit integer from ``np.random.SeedSequence([seed, round, client, step, LAYER_TAG])``
    (with the trainer's order ``tag`` appended when given: adaptation's own stream)."""
    key = [int(seed), int(round), int(client_id), int(step), LAYER_TAG]
    key += [] if tag is None else [int(tag)]
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> np.uint64(1))


class LoopTrainer(TrainerBase):
    """Local SGD of each selected client in turn, on a plain ``nn.Module`` in train mode.

    :class:`~mpifl.clients.VmapTrainer`'s sibling: the same arguments (model, layout, x, y and
    the :class:`~mpifl.clients.interface.TrainOptions`) and the same results; evaluation
    (:meth:`evaluate`, :meth:`evaluate_groups`) is the shared batched forward of w
    (:class:`~mpifl.clients.trainer.TrainerBase`), in eval mode. ``memory_budget_mb`` bounds
    the evaluation blocks only: training holds one client.

    Args:
        local_index: (s,) int64 positions in w that stay with each client (local BatchNorm,
            :func:`mpifl.models.zoo.batchnorm_coordinates`); None or empty: none.
        random: the model draws random numbers in train mode (:class:`mpifl.models.zoo.
            ModelTraits`); None: measured here on the store's first samples.

    Raises:
        ValueError: a layout that is not the model's state (parameters and float buffers),
            or mismatched shapes.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor,
                 options: TrainOptions, *, local_index: np.ndarray | None = None,
                 random: bool | None = None) -> None:
        super().__init__(model, layout, x, y, options)
        self.local_index = np.zeros(0, np.int64) if local_index is None else np.asarray(
            local_index, dtype=np.int64).reshape(-1)
        self.columns = self.columns_for(layout.d, local_index=self.local_index,
                                        report_accuracy=options.report_accuracy)
        self._local = torch.as_tensor(self.local_index, device=self.device)
        self.net = copy.deepcopy(model).to(self.device).train()
        if self.device.type == "cpu" and _plain_cnn(self.net):
            # oneDNN's channels-last kernels: max-pooling vectorised over channels, faster
            # convolutions (docs/BENCHMARKS.md, "Peer benchmark W2"); w goes in and out in
            # logical order, whatever the strides
            self.net = self.net.to(  # type: ignore[call-overload]  # stubs omit memory_format
                memory_format=torch.channels_last)
        self.model = copy.deepcopy(model).eval()  # evaluation: running statistics, no dropout
        self._state = [t for _, t in model_state(self.net)]  # the tensors w is loaded into
        self._params = list(self.net.parameters())
        if random is None:  # not told by the run (ModelTraits.random): measured on the store
            sample = x[:4].to(self.device) if len(x) >= 2 else None
            random = model_traits(model, tuple(x.shape[1:]), sample).random
        self.random = bool(random)

    @classmethod
    def columns_for(cls, d: int, num_groups: int = 0, **options: Any) -> Columns:
        """As :meth:`VmapTrainer.columns_for`, plus, with ``local_index`` (s positions), the
        clients' local coordinates as state rows (s wide) and back as ``local_state``."""
        base = super().columns_for(d, num_groups, **options)
        local = options.get("local_index")
        s = 0 if local is None else len(local)
        if not s:
            return base
        return Columns(state=s, stats=(("local_state", s),) + base.stats)

    @torch.no_grad()
    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """:meth:`VmapTrainer.run_round`; with local coordinates, ``state`` (m, s) are the
        clients' rows of them and ``stats["local_state"]`` (m, s) their trained values."""
        if not len(self.local_index):
            return super().run_round(w, round, lr, client_ids, sample_idx, inputs, state)
        m, s = len(sample_idx), len(self.local_index)
        if state is None or tuple(state.shape) != (m, s):
            raise ValueError(f"local BatchNorm: run_round needs the clients' local coordinates "
                             f"({m}, {s}), got {None if state is None else tuple(state.shape)}")
        w = self._check_w(w)
        start = w.expand(m, -1).clone()
        start[:, self._local] = state.to(start)
        updates, losses, acc = self._train(w, round, lr, client_ids, sample_idx, start=start)
        stats = {"local_state": self._last_finals[:, self._local].clone()}
        updates[:, self._local] = 0.0  # never averaged: the rule leaves w's copy alone
        if self.report_accuracy:
            stats["train_accuracy"] = acc.float().view(-1, 1)
        return updates, losses, stats

    def _train(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
               sample_idx: Sequence[np.ndarray], start: Tensor | None = None,
               prox_mu: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`VmapTrainer._train`, with losses and accuracies measured at each client's
        ``start`` row when given (its own local coordinates)."""
        w = self._check_w(w)
        client_ids, sizes = self._check_clients(client_ids, sample_idx)
        measure = self.pretrain_losses or self.report_accuracy
        loss_out = None
        if measure and start is None:
            losses, acc = self._client_stats(w, sample_idx)
        elif measure and start is not None:
            pairs = [self._client_stats(start[i], [sample_idx[i]]) for i in range(len(sizes))]
            losses, acc = (torch.cat(c) for c in zip(*pairs))
        else:
            loss_out = torch.zeros(len(sizes), dtype=torch.float64, device=self.device)
            acc = torch.full((len(sizes),), math.nan, dtype=torch.float64, device=self.device)
        finals = self._train_chunk(w, round, lr, client_ids, sample_idx, start=start,
                                   prox_mu=prox_mu, loss_out=loss_out)
        self._last_finals = finals
        if loss_out is not None:
            losses = loss_out / torch.as_tensor(self._first_epoch_samples(sizes),
                                                dtype=torch.float64, device=self.device)
        return w - finals, losses.float(), acc

    @torch.no_grad()
    def evaluate_local(self, w: Tensor, rows: Tensor, sample_idx: Sequence[np.ndarray],
                       groups: tuple[Tensor, int] | None = None) -> tuple[np.ndarray, ...]:
        """Each client's accuracy and mean loss at w with its own local coordinates.

        Args:
            w: (d,) global state. rows: (n, s) float32, client i's local coordinates.
            sample_idx: n arrays of sample indices (e.g. the clients' test splits).
            groups: ``(sensitive (N,) int64, G)`` for the group counts, or None.

        Returns:
            ``accuracy`` (n,) and ``loss`` (n,) float64 numpy (NaN without samples), and with
            ``groups`` the (n, G, 2, 3) counts of :meth:`VmapTrainer.evaluate_groups`.
        """
        w = self._check_w(w)
        n = len(sample_idx)
        acc, loss = np.full(n, math.nan), np.full(n, math.nan)
        counts = None if groups is None else np.zeros((n, groups[1], 2, 3))
        for i in range(n):
            if not len(sample_idx[i]):
                continue
            own = w.clone()
            own[self._local] = rows[i].to(own)
            out = self._client_stats(own, [sample_idx[i]], groups)
            loss[i], acc[i] = float(out[0][0]), float(out[1][0])
            if counts is not None:
                counts[i] = out[2][0].cpu().numpy()
        return (acc, loss) if counts is None else (acc, loss, counts)  # counts iff groups

    def _check_model(self, model: nn.Module, layout: ParamLayout) -> None:
        if ParamLayout.from_module(model) != layout:
            raise ValueError("the layout does not match the model's parameters and buffers")

    def plan_chunks(self, sizes: np.ndarray) -> list[np.ndarray]:
        """One chunk of every client: the loop holds one model at a time, whatever the chunk."""
        sizes = np.asarray(sizes, dtype=np.int64)
        return [np.arange(len(sizes), dtype=np.int64)] if len(sizes) else []

    def _train_chunk(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                     sample_idx: Sequence[np.ndarray], start: Tensor | None = None,
                     prox_mu: float | None = None, loss_out: Tensor | None = None) -> Tensor:
        """Each client's local SGD from w (or its row of ``start``); returns ``(m, d)`` final
        states. ``loss_out`` ((m,) float64) gets each client's first-epoch sum of minibatch loss
        times minibatch size, as in :meth:`VmapTrainer._train_chunk`."""
        mu = self.prox_mu if prox_mu is None else float(prox_mu)
        out = torch.empty(len(sample_idx), self.layout.d, device=self.device)
        for i, (cid, idx) in enumerate(zip(client_ids, sample_idx)):
            # A start row is w with the client's local coordinates: also its proximal anchor.
            begin = w if start is None else start[i].to(w)
            sums = self._train_one(begin, begin, int(round), lr, int(cid), idx, mu,
                                   want_loss=loss_out is not None)
            out[i] = self.layout.flatten_module(self.net)
            if loss_out is not None:
                loss_out[i] += sums
        return out

    def _train_one(self, begin: Tensor, anchor: Tensor, round: int, lr: float, cid: int,
                   idx: np.ndarray, mu: float, want_loss: bool) -> float:
        """Train ``self.net`` from ``begin`` (d,) on one client's samples ``idx``; the proximal
        term (``mu`` > 0) pulls towards ``anchor`` (d,), the round's w. Returns the first
        epoch's sum of minibatch loss x minibatch size (0 when not ``want_loss``)."""
        with torch.no_grad():
            for t, v in zip(self._state, self.layout.unflatten(begin).values()):
                t.copy_(v)
        anchors = ([a.detach() for n, a in self.layout.unflatten(anchor).items()
                    if n in dict(self.net.named_parameters())] if mu else None)
        opt = torch.optim.SGD(self._params, lr=lr, momentum=self.momentum,
                              weight_decay=self.weight_decay)
        xs, ys = self._gather(np.asarray(idx, dtype=np.int64))
        n = len(idx)
        first_epoch_steps = 1 if self.batch_size == 0 else math.ceil(n / self.batch_size)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=self.random), torch.enable_grad():
            for step, pos in enumerate(client_minibatches(self.seed, round, cid, n, self.epochs,
                                                          self.batch_size, self.order_tag,
                                                          self.minibatch_order,
                                                          self.max_local_steps)):
                check_stop()  # a stop request ends the round here, between steps
                if self.random:
                    torch.manual_seed(step_seed(self.seed, round, cid, step, self.order_tag))
                p = torch.as_tensor(pos, device=self.device)
                loss = self.loss.per_sample(self.net(xs[p]), ys[p]).mean()
                if want_loss and step < first_epoch_steps:
                    total += loss.detach().double() * len(pos)
                if anchors is not None:
                    loss = loss + 0.5 * mu * sum((q - a).square().sum()
                                                 for q, a in zip(self._params, anchors))
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                opt.step()
        return float(total)

    @torch.no_grad()
    def evaluate_each(self, W: Tensor, sample_idx: Sequence[np.ndarray]
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and mean loss of client i's own state ``W[i]`` on its samples, one client
        at a time (:meth:`VmapTrainer.evaluate_each`'s contract)."""
        n = len(sample_idx)
        if tuple(W.shape) != (n, self.layout.d):
            raise ValueError(f"W must have shape ({n}, {self.layout.d}), got {tuple(W.shape)}")
        acc, loss = np.full(n, math.nan), np.full(n, math.nan)
        for i in range(n):
            if len(sample_idx[i]):
                a, l = self.evaluate(W[i], [sample_idx[i]])
                acc[i], loss[i] = a[0], l[0]
        return acc, loss


#: the layers of a plain CNN, which train in channels-last memory format on a CPU (others are
#: left in the default format: BatchNorm in channels-last crashed torch 2.13's CPU backward
#: in examples/models' ResNet)
_CHANNELS_LAST_LAYERS = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.ReLU, nn.Flatten, nn.Linear,
                         nn.Dropout)


def _plain_cnn(model: nn.Module) -> bool:
    """True for a model with a convolution whose every layer is one of
    :data:`_CHANNELS_LAST_LAYERS` (the zoo's ``cnn_mnist`` and ``cnn_cifar``)."""
    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    return (any(isinstance(m, nn.Conv2d) for m in leaves)
            and all(isinstance(m, _CHANNELS_LAST_LAYERS) for m in leaves))

