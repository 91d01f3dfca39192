"""The memory plan of the vectorised trainer: how many clients, and how many sample rows, fit in
``client.memory_budget_mb`` at once.

Estimates are in bytes (float32 = 4), from the model's parameter count d, the activation values
one sample produces (:func:`activation_numel`) and the input values of one sample. Training cuts
clients into chunks by :func:`plan_chunks` with a per-client estimate (:func:`client_bytes`, or
a subclass's own); evaluation cuts clients by :func:`eval_chunks` and sample rows into blocks by
:func:`rows_per_block`. Every chunk and block holds at least one client or row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils._pytree import tree_leaves
from torch import nn

# Rough float32 copies of d per client alive during one step: parameters, gradient, momentum,
# the masked step, and backward temporaries (weight gradients before they are returned).
_PARAM_COPIES = 8
# Activations are kept by the forward pass and met again by their gradients in the backward.
_ACTIVATION_COPIES = 3


def client_bytes(d: int, act_numel: int, in_numel: int, padded_batch: int, steps: int,
                 n: int) -> int:
    """Estimated training memory of one client of n samples in a chunk whose largest client
    fixes the ``padded_batch`` Bp and the ``steps`` T: its parameter copies, one padded
    minibatch's activations and inputs, its samples, and its (T, Bp) padded schedule (16
    bytes an entry)."""
    per_sample = _ACTIVATION_COPIES * act_numel + in_numel
    floats = _PARAM_COPIES * d + padded_batch * per_sample + n * in_numel
    return 4 * floats + 16 * steps * padded_batch


def plan_chunks(sizes: np.ndarray, client_bytes: Callable[[int, int], int],
                budget: int) -> list[np.ndarray]:
    """Split clients (by position) into chunks whose estimated memory fits ``budget`` bytes.

    Clients are sorted by sample count (largest first) so that a chunk holds clients of
    similar size and little compute is wasted on padding and masked steps.

    Args:
        sizes: ``(m,)`` number of training samples per client.
        client_bytes: ``(n_max, n) -> bytes`` of one client of n samples in a chunk whose
            first (largest) client has n_max.
        budget: bytes a chunk may take.

    Returns:
        Arrays of positions into ``sizes`` (int64); together a permutation of ``range(m)``.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    chunks: list[list[int]] = []
    used = 0
    for pos in order:
        if chunks:
            # The chunk's first (largest) client fixes its padded batch and step count.
            cost = client_bytes(int(sizes[chunks[-1][0]]), int(sizes[pos]))
            if used + cost <= budget:
                chunks[-1].append(int(pos))
                used += cost
                continue
        chunks.append([int(pos)])
        used = client_bytes(int(sizes[pos]), int(sizes[pos]))
    return [np.array(c, dtype=np.int64) for c in chunks]


def eval_row_bytes(act_numel: int, in_numel: int) -> int:
    """Estimated memory of one sample row in an evaluation forward pass (no backward)."""
    return 4 * (2 * act_numel + in_numel) + 64


def eval_client_bytes(d: int) -> int:
    """Estimated memory of one client's parameter row in a batched evaluation (+ its views'
    copies)."""
    return 4 * 2 * d


def rows_per_block(budget: int, fixed: int, per_row: int) -> int:
    """Sample rows (>= 1) of ``per_row`` bytes that fit ``budget`` beside ``fixed`` bytes."""
    return max(1, (budget - fixed) // per_row)


def eval_chunks(sizes: np.ndarray, per_client: int, per_row: int, budget: int) -> list[np.ndarray]:
    """Clients with samples, largest first, in chunks whose parameter rows (``per_client``
    bytes each) and padded samples (``per_row`` bytes each) fit ``budget`` bytes (at least one
    client per chunk; a client whose samples alone exceed it is evaluated in blocks of sample
    positions). Returns int64 arrays of positions into ``sizes`` ``(n,)``."""
    order = [int(i) for i in np.argsort(-sizes, kind="stable") if sizes[i] > 0]
    chunks: list[list[int]] = []
    for i in order:
        if chunks:
            c, n_max = len(chunks[-1]) + 1, int(sizes[chunks[-1][0]])
            if c * (per_client + n_max * per_row) <= budget:
                chunks[-1].append(i)
                continue
        chunks.append([i])
    return [np.array(c, dtype=np.int64) for c in chunks]


def activation_numel(model: nn.Module, input_shape: tuple[int, ...],
                     dtype: torch.dtype = torch.float32) -> int:
    """Number of activation values one sample produces in a forward pass (all leaf outputs),
    measured on a zero sample of ``dtype`` (int64 token ids: all padding, a valid input)."""
    total = 0

    def count(_module: nn.Module, _inputs: tuple[object, ...], output: object) -> None:
        nonlocal total  # an LSTM returns (outputs, (h, c)): count every tensor
        total += sum(t.numel() for t in tree_leaves(output) if isinstance(t, torch.Tensor))

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    was_training = model.training
    try:
        device = next(model.parameters()).device
        model.eval()  # a batch of one: BatchNorm would refuse it in train mode
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, dtype=dtype, device=device))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return total
