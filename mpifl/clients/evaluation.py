"""Evaluation of many clients at once: per-client loss, accuracy and group counts of one shared
model, of each client's own model, and of each client's model after local adaptation.

The functions take the :class:`~mpifl.clients.trainer.TrainerBase` (VmapTrainer, LoopTrainer or
a subclass) whose model, layout, loss, sample store, device and memory budget they use, and call
its overridable methods
(``_check_w``, ``_gather``, ``_forward_blocks``, ``_client_stats``, ``plan_chunks``,
``_train_chunk``, ``evaluate``, ``evaluate_each``) through it, so a subclass's version is the one
that runs. The trainer's public methods of the same names delegate here; they run under
``torch.no_grad``, as do the public functions below.

A client's accuracy is the mean over its samples of each sample's share predicted right
(:meth:`mpifl.models.losses.Loss.hits`): 0 or 1 for one label a sample, the share of counted
positions for sequence targets, the share of the C labels for multi-hot targets
(``multilabel_bce``); NaN for a regression loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call, vmap

from mpifl.clients import memory

if TYPE_CHECKING:  # pragma: no cover -- the trainer module imports this one
    from mpifl.clients.trainer import TrainerBase


@torch.no_grad()
def evaluate(trainer: TrainerBase, w: Tensor, sample_idx: Sequence[np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and mean loss of the global model w on each client's samples.

    One batched forward over the concatenated samples (in row chunks that fit the memory
    budget) and segment sums; no per-client loop of forwards.

    Args:
        trainer: the trainer whose model, loss and sample store are used.
        w: ``(d,)`` parameters.
        sample_idx: n arrays of indices into x (e.g. the clients' test splits).

    Returns:
        ``accuracy`` ``(n,)`` float64 in [0, 1] and ``loss`` ``(n,)`` float64 (nats);
        NaN for a client without samples.
    """
    w = trainer._check_w(w)
    loss, acc = trainer._client_stats(w, sample_idx)
    return acc.cpu().numpy(), loss.cpu().numpy()


@torch.no_grad()
def evaluate_groups(trainer: TrainerBase, w: Tensor, sample_idx: Sequence[np.ndarray],
                    sensitive: Tensor, num_groups: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`evaluate` plus group counts for binary tasks, in the same forward pass.

    Args:
        trainer, w, sample_idx: as in :func:`evaluate`.
        sensitive: (N,) int64 sensitive-group id of every sample of the store.
        num_groups: G.

    Returns:
        ``accuracy`` (n,), ``loss`` (n,), and ``counts`` (n, G, 2, 3) float64: per client,
        group a and true label y, the samples, predicted positives (class 1) and errors —
        the input of :func:`mpifl.metrics.fairness.violations_from_counts` once summed over clients.
    """
    w = trainer._check_w(w)
    loss, acc, counts = trainer._client_stats(w, sample_idx, (sensitive, num_groups))
    return acc.cpu().numpy(), loss.cpu().numpy(), counts.cpu().numpy()


@torch.no_grad()
def evaluate_adapted(trainer: TrainerBase, w: Tensor, round: int, lr: float,
                     client_ids: np.ndarray, train_idx: Sequence[np.ndarray],
                     test_idx: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation after local adaptation (``run.adapt_epochs``): each client's accuracy and
    loss on its test samples after the trainer's local SGD (its ``epochs``, batch size,
    momentum, weight decay; minibatch order keyed by ``order_tag``) from w on its own
    training samples.

    The same vectorised training as the trainer's ``run_round``, in the same memory-bounded chunks;
    each chunk's trained parameters (c, d) are evaluated at once (``evaluate_each``) and
    dropped, so at most one chunk of models is alive.

    Args:
        trainer: the trainer that adapts and evaluates.
        w: ``(d,)`` the global parameters every client starts from.
        round: keys the minibatch order (with ``order_tag``), e.g. the rounds completed.
        lr: the local learning rate.
        client_ids: ``(n,)`` int ids of the clients. train_idx, test_idx: n arrays of
            indices into x, each client's training and test samples.

    Returns:
        ``accuracy`` ``(n,)`` float64 in [0, 1] and ``loss`` ``(n,)`` float64 (nats); NaN for
        a client without test samples; a client without training samples is evaluated at w.
    """
    w = trainer._check_w(w)
    client_ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
    if not len(client_ids) == len(train_idx) == len(test_idx):
        raise ValueError(f"{len(client_ids)} client ids, {len(train_idx)} training and "
                         f"{len(test_idx)} test index arrays")
    sizes = np.array([len(s) for s in train_idx], dtype=np.int64)
    acc = np.full(len(sizes), math.nan)
    loss = np.full(len(sizes), math.nan)
    idle = np.flatnonzero(sizes == 0)
    if idle.size:  # nothing to adapt on: the global model itself
        acc[idle], loss[idle] = trainer.evaluate(w, [test_idx[int(i)] for i in idle])
    busy = np.flatnonzero(sizes > 0)
    for chunk in trainer.plan_chunks(sizes[busy]):
        pos = busy[chunk]
        W = trainer._train_chunk(w, round, lr, client_ids[pos], [train_idx[i] for i in pos])
        acc[pos], loss[pos] = trainer.evaluate_each(W, [test_idx[i] for i in pos])
    return acc, loss


@torch.no_grad()
def evaluate_each(trainer: TrainerBase, W: Tensor, sample_idx: Sequence[np.ndarray]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and mean loss of client i's own parameters ``W[i]`` on its samples.

    Batched over clients: clients (sorted by sample count, so that a chunk holds similar
    sizes) are cut into chunks that fit the memory budget; a chunk's samples are padded to
    its largest client (padding rows weigh 0) and evaluated with one ``vmap`` of
    ``functional_call`` over the clients' parameter rows per block of sample positions.

    Args:
        trainer: the trainer whose model, loss and sample store are used.
        W: ``(n, d)`` per-client parameters (e.g. Ditto's personal models, or the
            adapted models of :func:`evaluate_adapted`).
        sample_idx: n arrays of indices into x (e.g. the clients' test splits).

    Returns:
        ``accuracy`` ``(n,)`` float64 and ``loss`` ``(n,)`` float64 (nats); NaN for a client
        without samples — as :func:`evaluate` gives for one shared w.

    Raises:
        ValueError: W is not ``(len(sample_idx), d)``.
    """
    n = len(sample_idx)
    if tuple(W.shape) != (n, trainer.layout.d):
        raise ValueError(f"W must have shape ({n}, {trainer.layout.d}), got {tuple(W.shape)}")
    W = W.detach()
    device, loss_fn = trainer.device, trainer.loss
    sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
    ce_sum = np.zeros(n, dtype=np.float64)
    hits = np.zeros(n, dtype=np.float64)
    per_row = memory.eval_row_bytes(trainer._act_numel, trainer._in_numel)
    per_client = memory.eval_client_bytes(trainer.layout.d)
    forward = vmap(lambda p, xb: functional_call(trainer.model, p, (xb,)))
    for chunk in trainer._eval_chunks(sizes, per_client, per_row):
        c, n_max = len(chunk), int(sizes[chunk[0]])
        rows = np.empty((c, n_max), dtype=np.int64)
        mask = np.zeros((c, n_max), dtype=bool)
        for j, i in enumerate(chunk):
            s = np.asarray(sample_idx[i], dtype=np.int64).reshape(-1)
            rows[j, :len(s)], rows[j, len(s):] = s, s[0]  # padding: own first sample
            mask[j, :len(s)] = True
        params = trainer.layout.unflatten(
            W[torch.as_tensor(chunk, device=W.device)].to(device, torch.float32))
        block = memory.rows_per_block(trainer.memory_budget, c * per_client, c * per_row)
        ce_c = torch.zeros(c, dtype=torch.float64, device=device)
        hit_c = torch.zeros(c, dtype=torch.float64, device=device)
        for lo in range(0, n_max, block):
            idx, keep = rows[:, lo:lo + block], mask[:, lo:lo + block]
            xb, yb = trainer._gather(idx.reshape(-1))
            xb = xb.view(c, idx.shape[1], *xb.shape[1:])
            yb = yb.view(c, idx.shape[1], *yb.shape[1:])
            out = forward(params, xb)
            flat_out, flat_y = out.flatten(0, 1), yb.flatten(0, 1)
            ce = loss_fn.per_sample(flat_out, flat_y)
            keep_t = torch.as_tensor(keep, device=device)
            ce_c += torch.where(keep_t, ce.view(c, -1).double(), 0.0).sum(1)
            hit = loss_fn.hits(flat_out, flat_y).view(c, -1)
            hit_c += torch.where(keep_t, hit, 0.0).sum(1)
        ce_sum[chunk] = ce_c.cpu().numpy()
        hits[chunk] = hit_c.cpu().numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        count = sizes.astype(np.float64)
        acc = hits / count if loss_fn.classification else np.full(n, math.nan)
        return acc, ce_sum / count


def client_stats(trainer: TrainerBase, w: Tensor, sample_idx: Sequence[np.ndarray],
                 groups: tuple[Tensor, int] | None = None) -> tuple[Tensor, ...]:
    """Per-client mean loss and accuracy of w (d,), float64 ``(n,)`` each, NaN where empty
    (accuracy NaN for a regression loss); with ``groups = (sensitive (N,) int64, G)`` also the
    (n, G, 2, 3) group counts of :func:`evaluate_groups`. w must have passed ``_check_w``."""
    device, loss_fn = trainer.device, trainer.loss
    sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
    n = len(sizes)
    ce_sum = torch.zeros(n, dtype=torch.float64, device=device)
    hits = torch.zeros(n, dtype=torch.float64, device=device)
    cells = torch.zeros(n * (groups[1] if groups else 0) * 2, 3, dtype=torch.float64,
                        device=device)
    for rows, seg, out, yb in trainer._forward_blocks(w, sample_idx):
        ce_sum.index_add_(0, seg, loss_fn.per_sample(out, yb).double())
        hits.index_add_(0, seg, loss_fn.hits(out, yb))
        if groups is not None:  # cell = (client, group, true label); one integer label a sample
            pred = loss_fn.labels(out)
            sens = groups[0][torch.as_tensor(rows, device=groups[0].device)]
            cell = (seg * groups[1] + sens.to(device)) * 2 + yb
            cells.index_add_(0, cell, torch.stack(
                [torch.ones_like(pred), pred == 1, pred != yb], dim=1).double())
    count = torch.as_tensor(sizes, dtype=torch.float64, device=device)
    acc = hits / count if loss_fn.classification else torch.full_like(hits, math.nan)
    if groups is not None:
        return ce_sum / count, acc, cells.view(n, groups[1], 2, 3)
    return ce_sum / count, acc


def forward_blocks(trainer: TrainerBase, w: Tensor, sample_idx: Sequence[np.ndarray]
                   ) -> Iterator[tuple[np.ndarray, Tensor, Tensor, Tensor]]:
    """One forward of w (d,) over the clients' concatenated samples, in row blocks that fit
    the memory budget. Yields ``(rows (b,) int64 numpy store indices, client (b,) int64
    position of each row's client, outputs (b, C), labels (b,))``."""
    sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
    if sizes.sum() == 0:
        return
    all_rows = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in sample_idx])
    segment = torch.as_tensor(np.repeat(np.arange(len(sizes)), sizes), device=trainer.device)
    params = trainer.layout.unflatten(w)
    per_row = memory.eval_row_bytes(trainer._act_numel, trainer._in_numel)
    step = memory.rows_per_block(trainer.memory_budget, 4 * trainer.layout.d, per_row)
    for lo in range(0, len(all_rows), step):
        xb, yb = trainer._gather(all_rows[lo:lo + step])
        yield (all_rows[lo:lo + step], segment[lo:lo + step],
               functional_call(trainer.model, params, (xb,)), yb)
