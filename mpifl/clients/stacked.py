"""A faster gradient step for the plain MLP family: batched matrix products and one ordinary
backward pass, instead of ``vmap(grad(loss))``.

For an ``nn.Sequential`` of ``Flatten``, ``Linear`` and ``ReLU`` only (the zoo's ``logreg`` and
``mlp``), m clients' forward passes are ``torch.baddbmm`` over their stacked weights, and the
gradient of the *sum* of their minibatch losses with respect to the stacked parameters is each
client's own gradient (client k's loss depends only on its slice). The arithmetic is the same
as the vmapped path's up to float rounding (about 1e-7 relative), and it skips functorch's
per-op wrapping: about 15% of a W1 training step on the 2-core VM (docs/BENCHMARKS.md). The
vmapped path stays the general one and this one's oracle (tests/inprocess/test_training.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Forward = Callable[[dict[str, Tensor], Tensor], Tensor]


def stacked_forward(model: nn.Module) -> Forward | None:
    """``forward(params, xb)`` for stacked ``params`` ((m, *shape) each) and inputs ``xb``
    (m, B, *input_shape) -> logits (m, B, C), or None when ``model`` is not a Sequential of
    ``Flatten`` (default dims), ``Linear`` and ``ReLU`` modules."""
    if not isinstance(model, nn.Sequential):
        return None
    plan: list[tuple[str, str]] = []
    for name, layer in model.named_children():
        if isinstance(layer, nn.Flatten) and (layer.start_dim, layer.end_dim) == (1, -1):
            plan.append(("flatten", name))
        elif isinstance(layer, nn.Linear):
            plan.append(("linear", name))
        elif isinstance(layer, nn.ReLU):
            plan.append(("relu", name))
        else:
            return None

    def forward(params: dict[str, Tensor], xb: Tensor) -> Tensor:
        h = xb
        for kind, name in plan:
            if kind == "flatten":
                h = h.flatten(2)
            elif kind == "relu":
                h = torch.relu(h)
            else:
                weight_t = params[f"{name}.weight"].transpose(1, 2)
                bias = params.get(f"{name}.bias")
                h = torch.bmm(h, weight_t) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, weight_t)
        return h

    return forward


def stacked_ce_grad(forward: Forward, params: dict[str, Tensor], xb: Tensor, yb: Tensor,
                    wb: Tensor) -> dict[str, Tensor]:
    """Each client's gradient of its weighted mean cross-entropy (the trainer's minibatch loss).

    Args:
        params: stacked parameters (m, *shape) each (not modified).
        xb: (m, B, *input_shape) inputs; yb: (m, B) int64 labels; wb: (m, B) float32 sample
            weights (0 for padding).

    Returns:
        ``{name: (m, *shape) gradient}``.
    """
    return stacked_ce_grad_and_value(forward, params, xb, yb, wb)[0]


def stacked_ce_grad_and_value(forward: Forward, params: dict[str, Tensor], xb: Tensor,
                              yb: Tensor, wb: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`stacked_ce_grad` and the (m,) losses (as ``torch.func.grad_and_value``)."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    with torch.enable_grad():
        out = forward(leaves, xb)
        ce = F.cross_entropy(out.flatten(0, 1), yb.flatten(), reduction="none").view_as(wb)
        loss = (ce * wb).sum(1) / wb.sum(1).clamp(min=1.0)
        grads = torch.autograd.grad(loss.sum(), list(leaves.values()))
    return dict(zip(leaves, grads)), loss.detach()
