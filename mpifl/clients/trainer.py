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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, vmap

from mpifl.clients.stacked import stacked_ce_grad, stacked_forward
from mpifl.core.layout import ParamLayout
from mpifl.core.wire import Columns
from mpifl.models.losses import Loss, get_loss

# Rough float32 copies of d per client alive during one step: parameters, gradient, momentum,
# the masked step, and backward temporaries (weight gradients before they are returned).
_PARAM_COPIES = 8
# Activations are kept by the forward pass and met again by their gradients in the backward.
_ACTIVATION_COPIES = 3


def batch_order(seed: int, round: int, client_id: int, epoch: int, n: int,
                tag: int | None = None) -> np.ndarray:
    """Order in which client ``client_id`` visits its n samples in ``epoch`` of ``round``.

    A permutation of ``range(n)`` (int64) from ``np.random.default_rng([seed, round, client_id,
    epoch])`` (ALGORITHMS.md §1), so it does not depend on the rank or chunk a client is trained in.
    With a ``tag`` (e.g. :data:`mpifl.core.rng.ADAPT_TAG`) the key is ``[seed, round, client_id,
    epoch, tag]``: a stream of its own, apart from training's.
    """
    key = [int(seed), int(round), int(client_id), int(epoch)] + ([] if tag is None else [int(tag)])
    rng = np.random.default_rng(key)
    return rng.permutation(int(n)).astype(np.int64, copy=False)


def client_minibatches(seed: int, round: int, client_id: int, n: int, epochs: int,
                       batch_size: int, tag: int | None = None):
    """ALGORITHMS.md §1's minibatches of one client in one round, for per-client loops (the oracles
    and the sequential baseline of ``mpifl bench simulate``).

    Yields (b,) int64 positions into the client's n samples: E epochs, each in
    :func:`batch_order` (keyed with ``tag`` when given) cut into runs of ``batch_size`` (the last
    may be shorter); one batch of all n in order per epoch when ``batch_size`` is 0.
    """
    size = n if batch_size == 0 else batch_size
    for epoch in range(epochs):
        order = (np.arange(n) if batch_size == 0
                 else batch_order(seed, round, client_id, epoch, n, tag))
        for start in range(0, n, size):
            yield order[start:start + size]


def step_widths(weights: np.ndarray) -> np.ndarray:
    """Per step index, how many leading minibatch positions hold a real sample in some client.

    ``weights`` (m, T, Bp) 0/1 from :meth:`VmapTrainer._schedule` (real samples first in each
    padded minibatch). Returns (T,) int64 >= 1: a step may drop the columns past this width,
    which are padding in every client (e.g. everyone's short last minibatch), exactly.
    """
    return np.maximum((weights > 0).sum(axis=2).max(axis=0), 1).astype(np.int64)


class VmapTrainer:
    """Local SGD for many clients at once, plus batched per-client loss and accuracy.

    Args:
        model: the architecture (its own parameters are never used nor changed; the computation
            runs ``functional_call`` with parameters taken from w). Parameters only, no buffers.
        layout: ``ParamLayout.from_module(model)``.
        x: ``(N, *input_shape)`` float32, the whole sample store (any device; only the samples
            of the clients being processed are moved to ``device``).
        y: ``(N,)`` int64 labels, or ``(N,)`` / ``(N, T)`` float32 targets for a regression
            ``loss``.
        epochs: E >= 1 local epochs.
        batch_size: B >= 0 samples per minibatch; 0 means one full batch per epoch.
        momentum, weight_decay: as in ``torch.optim.SGD`` (dampening 0, no Nesterov); the
            optimiser state is fresh every round.
        seed: experiment seed, keys :func:`batch_order`.
        prox_mu: FedProx's proximal coefficient mu >= 0 (Li et al., MLSys 2020): the local loss
            gets ``+ (mu/2) ||w_k - w||^2`` towards the round's global parameters w.
        report_accuracy: also report each client's training accuracy of w, measured with the
            pre-training loss, as the statistic ``train_accuracy`` (FedFa's ACC_k).
        pretrain_losses: measure the reported losses with a forward pass of w over every
            client's samples before training (``l_k`` of ALGORITHMS.md §0, what loss-based rules
            such as FedFV and qFedAvg need). False (rules with ``needs_losses = False``): no
            such pass unless ``report_accuracy`` asks for it; the reported loss is then the
            training pass's own: the mean over the client's samples of the minibatch loss of
            the first epoch, each sample's loss taken at the parameters its minibatch's step
            started from (equal to ``l_k`` for full-batch training, B = 0).
        memory_budget_mb: clients are trained in chunks whose estimated working memory
            (stacked parameters, gradients, momentum, padded minibatch activations, samples)
            stays below this many MiB; at least one client per chunk.
        device: where the computation runs (``"cpu"``, ``"cuda"``, ...).
        order_tag: keys :func:`batch_order` with this tag (None: training's own stream); the
            trainer of ``run.adapt_epochs`` uses :data:`mpifl.core.rng.ADAPT_TAG`.
        loss: the :class:`mpifl.models.losses.Loss` of training and evaluation (``[model]
            loss``; default cross-entropy). Accuracies are NaN for a regression loss.

    Raises:
        ValueError: inconsistent shapes, a layout not matching the model, buffers in the model,
            or out-of-range hyper-parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        x: Tensor,
        y: Tensor,
        *,
        epochs: int,
        batch_size: int,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        memory_budget_mb: float = 1024.0,
        device: str | torch.device = "cpu",
        prox_mu: float = 0.0,
        report_accuracy: bool = False,
        pretrain_losses: bool = True,
        order_tag: int | None = None,
        loss: Loss | None = None,
    ):
        self._check_model(model, layout)
        self.loss = get_loss("cross_entropy") if loss is None else loss
        if x.shape[0] != y.shape[0] or (y.dim() != 1 and self.loss.classification):
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} do not match")
        if (epochs < 1 or batch_size < 0 or momentum < 0 or weight_decay < 0
                or memory_budget_mb <= 0 or prox_mu < 0):
            raise ValueError("need epochs >= 1, batch_size >= 0, momentum >= 0, "
                             "weight_decay >= 0, prox_mu >= 0 and memory_budget_mb > 0")
        self.prox_mu = float(prox_mu)
        self.report_accuracy = bool(report_accuracy)
        self.pretrain_losses = bool(pretrain_losses)
        self.columns = self.columns_for(layout.d, report_accuracy=report_accuracy)
        self.model, self.layout = model, layout
        self.x, self.y = x, y
        self.epochs, self.batch_size = int(epochs), int(batch_size)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.seed = int(seed)
        self.order_tag = None if order_tag is None else int(order_tag)
        self.memory_budget = int(memory_budget_mb * 2**20)
        self.device = torch.device(device)
        self._in_numel = math.prod(x.shape[1:])
        self._act_numel = _activation_numel(model, tuple(x.shape[1:]))
        self._step_grad = vmap(grad(self._minibatch_loss))
        self._step_grad_value = vmap(grad_and_value(self._minibatch_loss))
        forward = (stacked_forward(model) if self._plain_steps
                   and self.loss is get_loss("cross_entropy")
                   and type(self)._minibatch_loss is VmapTrainer._minibatch_loss
                   and not self._has_extras else None)
        if forward is not None:  # the plain MLP family: batched matmuls, one backward (faster)
            self._step_grad = functools.partial(stacked_ce_grad, forward)
            self._step_grad_value = functools.partial(stacked_ce_grad, forward, with_value=True)

    # ------------------------------------------------------------------ public API

    def _check_model(self, model: nn.Module, layout: ParamLayout) -> None:
        """The vmap contract: the layout is the model's parameters, and no buffers."""
        _check_model(model, layout)

    @classmethod
    def columns_for(cls, d: int, num_groups: int = 0, **options) -> Columns:
        """The :class:`Columns` a trainer built with these keyword ``options`` exchanges.

        Args:
            d: parameters of the model. num_groups: sensitive groups G of the data (0: none).
            options: the trainer's own keyword arguments (others are ignored).
        """
        return Columns(stats=(("train_accuracy", 1),) if options.get("report_accuracy") else ())

    @torch.no_grad()
    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """One round of the selected clients' work, with the extras of :attr:`columns`.

        Args:
            w, round, lr, client_ids, sample_idx: as in :meth:`train`.
            inputs: ``(columns.inputs,)`` float64 round inputs, or None when there are none.
            state: ``(m, columns.state)`` float32 per-client state rows, or None.

        Returns:
            ``updates`` (m, d) and ``losses`` (m,) as in :meth:`train`, and ``stats``: name ->
            float32 tensor (m, width) for every column of ``columns.stats``.
        """
        if self.report_accuracy:
            updates, losses, acc = self._train(w, round, lr, client_ids, sample_idx)
            return updates, losses, {"train_accuracy": acc.float().view(-1, 1)}
        updates, losses = self.train(w, round, lr, client_ids, sample_idx)
        return updates, losses, {}

    @torch.no_grad()
    def train(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
              sample_idx: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
        """Run local training for the selected clients of one round.

        Args:
            w: ``(d,)`` global parameters.
            round: round index t (keys the minibatch order).
            lr: client learning rate ``lr_t`` of this round.
            client_ids: ``(m,)`` int ids of the clients (key the minibatch order).
            sample_idx: m arrays of indices into x: each client's training samples (non-empty).

        Returns:
            ``updates``: ``(m, d)`` float32 on ``device``, ``u_k = w - w_k``;
            ``losses``: ``(m,)`` float32 on ``device``, the mean loss (``[model] loss``) of w on each
            client's training samples, measured before training (``l_k`` of ALGORITHMS.md §0);
            with ``pretrain_losses = False`` (and no ``report_accuracy``) the first epoch's
            mean training loss instead (see the class docstring).

        Raises:
            ValueError: wrong shapes, or a client without samples.
        """
        updates, losses, _ = self._train(w, round, lr, client_ids, sample_idx)
        return updates, losses

    def _train(self, w, round, lr, client_ids, sample_idx, start: Tensor | None = None,
               prox_mu: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`train` plus the training accuracies of w (m,) float64; local SGD starts from
        ``start`` (m, d) instead of w when given (Ditto's personal models), with the proximal
        term towards w of coefficient ``prox_mu`` (default: the trainer's)."""
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
            losses = loss_sums / torch.as_tensor(sizes, dtype=torch.float64, device=self.device)
        return updates, losses.float(), acc

    @staticmethod
    def _check_clients(client_ids, sample_idx) -> tuple[np.ndarray, np.ndarray]:
        client_ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if len(client_ids) != len(sample_idx):
            raise ValueError(f"{len(client_ids)} client ids but {len(sample_idx)} sample index arrays")
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        if (sizes == 0).any():
            raise ValueError(f"clients {client_ids[sizes == 0].tolist()} have no training samples")
        return client_ids, sizes

    @torch.no_grad()
    def evaluate(self, w: Tensor, sample_idx: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and mean loss of the global model w on each client's samples.

        One batched forward over the concatenated samples (in row chunks that fit the memory
        budget) and segment sums; no per-client loop of forwards.

        Args:
            w: ``(d,)`` parameters.
            sample_idx: n arrays of indices into x (e.g. the clients' test splits).

        Returns:
            ``accuracy`` ``(n,)`` float64 in [0, 1] and ``loss`` ``(n,)`` float64 (nats);
            NaN for a client without samples.
        """
        w = self._check_w(w)
        loss, acc = self._client_stats(w, sample_idx)
        return acc.cpu().numpy(), loss.cpu().numpy()

    @torch.no_grad()
    def evaluate_groups(self, w: Tensor, sample_idx: Sequence[np.ndarray], sensitive: Tensor,
                        num_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`evaluate` plus group counts for binary tasks, in the same forward pass.

        Args:
            sensitive: (N,) int64 sensitive-group id of every sample of the store.
            num_groups: G.

        Returns:
            ``accuracy`` (n,), ``loss`` (n,), and ``counts`` (n, G, 2, 3) float64: per client,
            group a and true label y, the samples, predicted positives (class 1) and errors —
            the input of :func:`mpifl.metrics.fairness.violations_from_counts` once summed over clients.
        """
        w = self._check_w(w)
        loss, acc, counts = self._client_stats(w, sample_idx, (sensitive, num_groups))
        return acc.cpu().numpy(), loss.cpu().numpy(), counts.cpu().numpy()

    @torch.no_grad()
    def evaluate_adapted(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                         train_idx: Sequence[np.ndarray], test_idx: Sequence[np.ndarray]
                         ) -> tuple[np.ndarray, np.ndarray]:
        """Evaluation after local adaptation (``run.adapt_epochs``): each client's accuracy and
        loss on its test samples after this trainer's local SGD (its ``epochs``, batch size,
        momentum, weight decay; minibatch order keyed by ``order_tag``) from w on its own
        training samples.

        The same vectorised training as :meth:`train`, in the same memory-bounded chunks; each
        chunk's trained parameters (c, d) are evaluated at once (:meth:`evaluate_each`) and
        dropped, so at most one chunk of models is alive.

        Args:
            w: ``(d,)`` the global parameters every client starts from.
            round: keys the minibatch order (with ``order_tag``), e.g. the rounds completed.
            lr: the local learning rate.
            client_ids: ``(n,)`` int ids of the clients. train_idx, test_idx: n arrays of
                indices into x, each client's training and test samples.

        Returns:
            ``accuracy`` ``(n,)`` float64 in [0, 1] and ``loss`` ``(n,)`` float64 (nats); NaN for
            a client without test samples; a client without training samples is evaluated at w.
        """
        w = self._check_w(w)
        client_ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if not len(client_ids) == len(train_idx) == len(test_idx):
            raise ValueError(f"{len(client_ids)} client ids, {len(train_idx)} training and "
                             f"{len(test_idx)} test index arrays")
        sizes = np.array([len(s) for s in train_idx], dtype=np.int64)
        acc = np.full(len(sizes), math.nan)
        loss = np.full(len(sizes), math.nan)
        idle = np.flatnonzero(sizes == 0)
        if idle.size:  # nothing to adapt on: the global model itself
            acc[idle], loss[idle] = self.evaluate(w, [test_idx[i] for i in idle])
        busy = np.flatnonzero(sizes > 0)
        for chunk in self.plan_chunks(sizes[busy]):
            pos = busy[chunk]
            W = self._train_chunk(w, round, lr, client_ids[pos], [train_idx[i] for i in pos])
            acc[pos], loss[pos] = self.evaluate_each(W, [test_idx[i] for i in pos])
        return acc, loss

    @torch.no_grad()
    def evaluate_each(self, W: Tensor, sample_idx: Sequence[np.ndarray]
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Accuracy and mean loss of client i's own parameters ``W[i]`` on its samples.

        Batched over clients: clients (sorted by sample count, so that a chunk holds similar
        sizes) are cut into chunks that fit the memory budget; a chunk's samples are padded to
        its largest client (padding rows weigh 0) and evaluated with one ``vmap`` of
        ``functional_call`` over the clients' parameter rows per block of sample positions.

        Args:
            W: ``(n, d)`` per-client parameters (e.g. Ditto's personal models, or the
                adapted models of :meth:`evaluate_adapted`).
            sample_idx: n arrays of indices into x (e.g. the clients' test splits).

        Returns:
            ``accuracy`` ``(n,)`` float64 and ``loss`` ``(n,)`` float64 (nats); NaN for a client
            without samples — as :meth:`VmapTrainer.evaluate` gives for one shared w.

        Raises:
            ValueError: W is not ``(len(sample_idx), d)``.
        """
        n = len(sample_idx)
        if tuple(W.shape) != (n, self.layout.d):
            raise ValueError(f"W must have shape ({n}, {self.layout.d}), got {tuple(W.shape)}")
        W = W.detach()
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        ce_sum = np.zeros(n, dtype=np.float64)
        hits = np.zeros(n, dtype=np.float64)
        per_row = 4 * (2 * self._act_numel + self._in_numel) + 64
        per_client = 4 * 2 * self.layout.d  # the chunk's parameter rows (+ their views' copies)
        forward = vmap(lambda p, xb: functional_call(self.model, p, (xb,)))
        for chunk in self._eval_chunks(sizes, per_client, per_row):
            c, n_max = len(chunk), int(sizes[chunk[0]])
            rows = np.empty((c, n_max), dtype=np.int64)
            mask = np.zeros((c, n_max), dtype=bool)
            for j, i in enumerate(chunk):
                s = np.asarray(sample_idx[i], dtype=np.int64).reshape(-1)
                rows[j, :len(s)], rows[j, len(s):] = s, s[0]  # padding: own first sample
                mask[j, :len(s)] = True
            params = self.layout.unflatten(
                W[torch.as_tensor(chunk, device=W.device)].to(self.device, torch.float32))
            block = max(1, (self.memory_budget - c * per_client) // (c * per_row))
            ce_c = torch.zeros(c, dtype=torch.float64, device=self.device)
            hit_c = torch.zeros(c, dtype=torch.float64, device=self.device)
            for lo in range(0, n_max, block):
                idx, keep = rows[:, lo:lo + block], mask[:, lo:lo + block]
                xb, yb = self._gather(idx.reshape(-1))
                xb = xb.view(c, idx.shape[1], *xb.shape[1:])
                yb = yb.view(c, idx.shape[1], *yb.shape[1:])
                out = forward(params, xb)
                flat_out, flat_y = out.flatten(0, 1), yb.flatten(0, 1)
                ce = self.loss.per_sample(flat_out, flat_y)
                keep_t = torch.as_tensor(keep, device=self.device)
                ce_c += torch.where(keep_t, ce.view(c, -1).double(), 0.0).sum(1)
                hit = (self.loss.labels(flat_out) == flat_y).view(c, -1)
                hit_c += (hit & keep_t).double().sum(1)
            ce_sum[chunk] = ce_c.cpu().numpy()
            hits[chunk] = hit_c.cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            count = sizes.astype(np.float64)
            acc = hits / count if self.loss.classification else np.full(n, math.nan)
            return acc, ce_sum / count

    def _eval_chunks(self, sizes: np.ndarray, per_client: int, per_row: int) -> list[np.ndarray]:
        """Clients with samples, largest first, in chunks whose parameter rows and padded
        samples fit the memory budget (at least one client per chunk; a client whose samples
        alone exceed it is evaluated in blocks of sample positions)."""
        order = [int(i) for i in np.argsort(-sizes, kind="stable") if sizes[i] > 0]
        chunks: list[list[int]] = []
        for i in order:
            if chunks:
                c, n_max = len(chunks[-1]) + 1, int(sizes[chunks[-1][0]])
                if c * (per_client + n_max * per_row) <= self.memory_budget:
                    chunks[-1].append(i)
                    continue
            chunks.append([i])
        return [np.array(c, dtype=np.int64) for c in chunks]

    def plan_chunks(self, sizes: np.ndarray) -> list[np.ndarray]:
        """Split clients (by position) into chunks whose estimated memory fits the budget.

        Clients are sorted by sample count (largest first) so that a chunk holds clients of
        similar size and little compute is wasted on padding and masked steps.

        Args:
            sizes: ``(m,)`` number of training samples per client.

        Returns:
            Arrays of positions into ``sizes``; together a permutation of ``range(m)``.
        """
        sizes = np.asarray(sizes, dtype=np.int64)
        order = np.argsort(-sizes, kind="stable")
        chunks: list[list[int]] = []
        used = 0
        for pos in order:
            if chunks:
                # The chunk's first (largest) client fixes its padded batch and step count.
                cost = self._client_bytes(int(sizes[chunks[-1][0]]), int(sizes[pos]))
                if used + cost <= self.memory_budget:
                    chunks[-1].append(int(pos))
                    used += cost
                    continue
            chunks.append([int(pos)])
            used = self._client_bytes(int(sizes[pos]), int(sizes[pos]))
        return [np.array(c, dtype=np.int64) for c in chunks]

    # ------------------------------------------------------------------ training

    def _padded_batch(self, n_max: int) -> int:
        return n_max if self.batch_size == 0 else min(self.batch_size, n_max)

    def _steps(self, n: int) -> int:
        per_epoch = 1 if self.batch_size == 0 else -(-n // self.batch_size)
        return self.epochs * per_epoch

    def _client_bytes(self, n_max: int, n: int) -> int:
        """Estimated working memory of one client in a chunk whose largest client has n_max."""
        bp, steps = self._padded_batch(n_max), self._steps(n_max)
        per_sample = _ACTIVATION_COPIES * self._act_numel + self._in_numel
        return 4 * (_PARAM_COPIES * self.layout.d + bp * per_sample + n * self._in_numel) + 16 * steps * bp

    def _schedule(self, round: int, client_ids: np.ndarray, sizes: np.ndarray):
        """Padded minibatch plan of a chunk.

        Returns ``rows`` ``(m, T, Bp)`` int64 indices into the chunk's concatenated samples,
        ``weights`` ``(m, T, Bp)`` float32 (1 real, 0 padding) and ``steps`` ``(m,)`` the
        number of real steps per client; T = the largest step count, Bp the padded batch.
        """
        bp = self._padded_batch(int(sizes.max()))
        steps = np.array([self._steps(int(n)) for n in sizes], dtype=np.int64)
        rows = np.full((len(sizes), int(steps.max()), bp), -1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for i, (cid, n, start) in enumerate(zip(client_ids, sizes, starts)):
            per_epoch = steps[i] // self.epochs
            for epoch in range(self.epochs):
                order = (np.arange(n) if self.batch_size == 0
                         else batch_order(self.seed, round, cid, epoch, n, self.order_tag))
                # Minibatches are consecutive runs of B samples (one of n when B = 0 or B >= n,
                # in which case n <= Bp); the tail of the last one is padding.
                padded = np.full(per_epoch * bp, -1, dtype=np.int64)
                padded[:n] = order + start
                rows[i, epoch * per_epoch:(epoch + 1) * per_epoch] = padded.reshape(per_epoch, bp)
        weights = (rows >= 0).astype(np.float32)
        # Padding points at the client's own first sample: finite loss, weight 0.
        rows = np.where(rows >= 0, rows, starts[:, None, None])
        return rows, weights, steps

    #: True when :meth:`_batch_extras` adds per-sample inputs to the minibatch loss.
    _has_extras = False
    #: False in subclasses that differentiate through the gradient steps (UGA's keep-trace):
    #: the batched path of :mod:`mpifl.clients.stacked` returns detached gradients.
    _plain_steps = True

    def _batch_extras(self, sample_rows: np.ndarray) -> tuple[Tensor, ...]:
        """Extra per-sample tensors (m, Bp, ...) of one step's minibatches, passed to
        :meth:`_minibatch_loss` between ``yb`` and ``wb``; ``sample_rows`` (m, Bp) int64 are
        indices into the sample store (e.g. mFairFL's sensitive attribute). None by default."""
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
        rows_np, weights_np, steps_np = self._schedule(round, client_ids, sizes)
        store_rows = np.concatenate([np.asarray(s, dtype=np.int64) for s in sample_idx])
        if self.x.device == self.device:
            # The store is already here: index it directly, one copy per step instead of two.
            xs, ys, rows_np = self.x, self.y, store_rows[rows_np]
            sample_rows = rows_np
        else:  # move the chunk's samples once, then index on the device
            xs, ys = self._gather(store_rows)
            sample_rows = store_rows[rows_np] if self._has_extras else None
        rows = torch.as_tensor(rows_np, device=self.device)
        weights = torch.as_tensor(weights_np, device=self.device)
        steps = torch.as_tensor(steps_np, device=self.device)
        flat = (w.expand(len(sizes), -1) if start is None else start.to(w)).clone()
        params = self.layout.unflatten(flat)  # views into flat, (m, *shape) each
        views = list(params.values())
        anchor = list(self.layout.unflatten(w).values())  # the round's global params, per tensor
        mu = self.prox_mu if prox_mu is None else float(prox_mu)
        buf: list[Tensor] | None = None
        widths = step_widths(weights_np)
        if loss_out is not None:  # (m, T) real samples of each first-epoch minibatch, else 0
            first = np.arange(rows.shape[1])[None, :] < (steps_np // self.epochs)[:, None]
            loss_weight = torch.as_tensor(weights_np.sum(axis=2) * first, dtype=torch.float64,
                                          device=self.device)
        for t in range(rows.shape[1]):
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
        step = grads
        if self.momentum and buf is not None:
            torch._foreach_mul_(buf, self.momentum)
            torch._foreach_add_(buf, grads)
            step = buf
        if active is not None:
            step = torch._foreach_mul(step, [active.view(-1, *[1] * (p.dim() - 1)) for p in params])
        torch._foreach_add_(params, step, alpha=-lr)

    # ------------------------------------------------------------------ evaluation

    def _client_stats(self, w: Tensor, sample_idx: Sequence[np.ndarray],
                      groups: tuple[Tensor, int] | None = None):
        """Per-client mean loss and accuracy of w, float64 ``(n,)`` each, NaN where empty (accuracy
        NaN for a regression loss); with
        ``groups = (sensitive (N,) int64, G)`` also the (n, G, 2, 3) group counts of
        :meth:`evaluate_groups`."""
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        n = len(sizes)
        ce_sum = torch.zeros(n, dtype=torch.float64, device=self.device)
        hits = torch.zeros(n, dtype=torch.float64, device=self.device)
        cells = torch.zeros(n * (groups[1] if groups else 0) * 2, 3, dtype=torch.float64,
                            device=self.device)
        for rows, seg, out, yb in self._forward_blocks(w, sample_idx):
            ce_sum.index_add_(0, seg, self.loss.per_sample(out, yb).double())
            pred = self.loss.labels(out)
            hits.index_add_(0, seg, (pred == yb).double())
            if groups is not None:  # cell = (client, group, true label)
                sens = groups[0][torch.as_tensor(rows, device=groups[0].device)]
                cell = (seg * groups[1] + sens.to(self.device)) * 2 + yb
                cells.index_add_(0, cell, torch.stack(
                    [torch.ones_like(pred), pred == 1, pred != yb], dim=1).double())
        count = torch.as_tensor(sizes, dtype=torch.float64, device=self.device)
        acc = hits / count if self.loss.classification else torch.full_like(hits, math.nan)
        if groups is not None:
            return ce_sum / count, acc, cells.view(n, groups[1], 2, 3)
        return ce_sum / count, acc

    def _forward_blocks(self, w: Tensor, sample_idx: Sequence[np.ndarray]):
        """One forward of w over the clients' concatenated samples, in row blocks that fit the
        memory budget. Yields ``(rows (b,) int64 numpy store indices, client (b,) int64 position
        of each row's client, outputs (b, C), labels (b,))``."""
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        if sizes.sum() == 0:
            return
        all_rows = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in sample_idx])
        segment = torch.as_tensor(np.repeat(np.arange(len(sizes)), sizes), device=self.device)
        params = self.layout.unflatten(w)
        per_row = 4 * (2 * self._act_numel + self._in_numel) + 64
        step = max(1, (self.memory_budget - 4 * self.layout.d) // per_row)
        for lo in range(0, len(all_rows), step):
            xb, yb = self._gather(all_rows[lo:lo + step])
            yield (all_rows[lo:lo + step], segment[lo:lo + step],
                   functional_call(self.model, params, (xb,)), yb)

    # ------------------------------------------------------------------ helpers

    def _gather(self, rows: np.ndarray) -> tuple[Tensor, Tensor]:
        """Samples ``rows`` of the store, moved to the device (only these are moved)."""
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.x.device)
        return (self.x[idx].to(self.device, torch.float32, non_blocking=True),
                self.y[idx.to(self.y.device)].to(self.device, non_blocking=True))

    def _check_w(self, w: Tensor) -> Tensor:
        if w.shape != (self.layout.d,):
            raise ValueError(f"w must have shape ({self.layout.d},), got {tuple(w.shape)}")
        return w.detach().to(self.device, torch.float32)


def _check_model(model: nn.Module, layout: ParamLayout) -> None:
    if ParamLayout.from_module(model) != layout:
        raise ValueError("the layout does not match the model's named_parameters()")
    if any(True for _ in model.buffers()):
        raise ValueError("models with buffers (e.g. BatchNorm) cannot be trained with vmap; "
                         "use client.trainer = 'loop'")


def _activation_numel(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Number of activation values one sample produces in a forward pass (all leaf outputs)."""
    total = 0

    def count(_module, _inputs, output):
        nonlocal total
        total += output.numel()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    was_training = model.training
    try:
        device = next(model.parameters()).device
        model.eval()  # a batch of one: BatchNorm would refuse it in train mode
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=device))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return total
