"""mFairFL local work: Lagrangian local training with group-fairness constraints.

mFairFL — Su, Yu, Wang, Li, Li & Yu, "Multi-dimensional Fair Federated Learning", AAAI 2024
(arXiv:2312.05551); ALGORITHMS.md §4, "Local training phase". Client k minimises by local SGD

    L_k(θ, λ) = F_k(θ) + sum_a λ_a c_a(θ),      c_a(θ) = |M_a(θ) - M(θ)| - eps,

with the multipliers λ (A,) it received from the server for this round (the round input of the
protocol, :class:`~mpifl.clients.Columns` ``inputs = A``). F_k is the mean cross-entropy, and the
gaps ``|M_a - M|`` are the differentiable surrogates of :func:`mpifl.metrics.fairness.constraint_values`
(DP: predicted probability of class 1 per group vs overall; EO: the same per (group, true
label); AP: mean cross-entropy per group vs overall). A = G for DP and AP, 2G for EO
(:func:`mpifl.metrics.fairness.num_constraints`).

**Stochastic Lagrangian.** Every SGD step uses the minibatch estimate of the whole objective:
the minibatch's mean cross-entropy plus ``sum_a λ_a c_a`` with the gaps measured on the same
minibatch (padding rows have weight 0 and count for nothing; a group absent from the minibatch
has gap 0, so its constraint is ``-eps`` with zero gradient). Otherwise the training is exactly
:class:`~mpifl.clients.VmapTrainer`'s (same minibatch order, lr, momentum, weight decay, the same
``vmap(grad(...))`` step over stacked clients); the sensitive attribute of the minibatch's
samples joins the step through the trainer's ``_batch_extras`` hook, and λ is the same constant
for every client of the round. With λ = 0 the updates are VmapTrainer's, bit for bit (the
constraint term only adds exact zeros to the gradient).

**Reported per client** (both measured at the round's global w^t on the client's **whole**
training split, before training — ALGORITHMS.md §4):

- ``losses``: the Lagrangian loss ``l_k = F_k(w^t) + sum_a λ_a c_{a,k}(w^t)``, which orders the
  clients for the server's gradient curation;
- ``stats["constraints"]`` (m, A) float32: the constraint values ``c_{a,k}(w^t)``, from which
  the server's multiplier update ``λ_a <- max(0, λ_a + eta_lambda sum_k p_k c_{a,k})`` is made.

They are computed from per-(client, group, label) sums of the sample count, the predicted
probability of class 1 and the cross-entropy, accumulated in float64 over one batched forward of
all the clients' rows (in blocks that fit the memory budget), so no client's split has to be in
one forward; the gaps from those sums are :func:`mpifl.metrics.fairness.group_gaps`' definitions
(:func:`gaps_from_sums`).

The model must have two outputs (a binary task). With ``output = "softmax"`` (a model ending in
``nn.Softmax``) the output already is the probability; otherwise it is ``softmax(logits)[:, 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn
from torch.func import functional_call

from mpifl.metrics import fairness
from mpifl.clients.interface import TrainOptions
from mpifl.clients.trainer import VmapTrainer
from mpifl.core.wire import Columns
from mpifl.core.layout import ParamLayout


def gaps_from_sums(notion: str, count: Tensor, prob_sum: Tensor, loss_sum: Tensor) -> Tensor:
    """Gaps ``|M_a - M|`` per client from per-(group, label) sums, as :func:`fairness.group_gaps`.

    Args:
        notion: ``"dp"``, ``"eo"`` or ``"ap"``.
        count, prob_sum, loss_sum: (m, G, 2) per client k, group a and true label y: the number
            of samples, the sum of ``P(ŷ=1)`` and the sum of the per-sample losses.

    Returns:
        (m, G) for DP and AP, (m, 2G) for EO ordered ``(a0,y0), (a0,y1), (a1,y0), ...``; a cell
        without samples has gap 0.
    """
    fairness.num_constraints(notion, 1)  # validates the notion
    if notion == "eo":
        n_cell = count                                          # (m, G, 2)
        m_cell = prob_sum / n_cell
        overall = prob_sum.sum(dim=1, keepdim=True) / count.sum(dim=1, keepdim=True)
        gaps = torch.where(n_cell > 0, (m_cell - overall).abs(), torch.zeros_like(m_cell))
        return gaps.reshape(count.shape[0], -1)                 # a-major
    values = prob_sum if notion == "dp" else loss_sum
    n_a = count.sum(dim=2)                                      # (m, G)
    m_a = values.sum(dim=2) / n_a
    overall = values.sum(dim=(1, 2))[:, None] / count.sum(dim=(1, 2))[:, None]
    return torch.where(n_a > 0, (m_a - overall).abs(), torch.zeros_like(m_a))


class LagrangianTrainer(VmapTrainer):
    """mFairFL's client computation for many clients at once (ALGORITHMS.md §4); VmapTrainer's
    interface.

    Args:
        model, layout, x, y, epochs, batch_size, momentum, weight_decay, seed, memory_budget_mb,
            device, prox_mu: as in :class:`~mpifl.clients.VmapTrainer`.
        sensitive: (N,) int64 sensitive-group id (>= 0) of every sample of the store.
        fair_notion: ``"dp"``, ``"eo"`` or ``"ap"``.
        fair_eps: tolerance eps >= 0 of the constraints ``c_a = gap_a - eps``.
        num_groups: G; default ``sensitive.max() + 1`` (as :func:`mpifl.runtime.backends.group_setup`,
            so rank 0 and the workers agree on A without exchanging it).

    Raises:
        ValueError: what VmapTrainer refuses, a model without exactly two outputs, labels other
            than 0/1, a sensitive array that does not match y or holds ids outside
            ``0 .. G-1``, an unknown notion, eps < 0, or ``report_accuracy``.
    """

    _has_extras = True

    def __init__(self, model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor,
                 options: TrainOptions, *, sensitive: Tensor, fair_notion: str = "dp",
                 fair_eps: float = 0.05, num_groups: int | None = None) -> None:
        if options.report_accuracy:
            raise ValueError("LagrangianTrainer does not report training accuracies")
        super().__init__(model, layout, x, y, options)
        if fair_notion not in fairness.NOTIONS:
            raise ValueError(f"unknown fairness notion {fair_notion!r} "
                             f"(known: {', '.join(fairness.NOTIONS)})")
        if not float(fair_eps) >= 0:
            raise ValueError(f"fair_eps must be >= 0, got {fair_eps}")
        sensitive = torch.as_tensor(sensitive)
        if sensitive.shape != y.shape or sensitive.dtype != torch.int64:
            raise ValueError(f"sensitive must be {tuple(y.shape)} int64 like y, got "
                             f"{tuple(sensitive.shape)} {sensitive.dtype}")
        lo, hi = (int(sensitive.min()), int(sensitive.max())) if sensitive.numel() else (0, 0)
        num_groups = hi + 1 if num_groups is None else int(num_groups)
        if lo < 0 or hi >= num_groups or num_groups < 1:
            raise ValueError(f"sensitive ids must be in 0..{num_groups - 1}, got {lo}..{hi}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) > 1):
            raise ValueError("mFairFL's group constraints need a binary task (labels 0/1)")
        self._softmax_output = _ends_in_softmax(model)
        with torch.no_grad():
            width = model(x[:1].to(_device_of(model), torch.float32)).shape[-1]
        if width != 2:
            raise ValueError(f"mFairFL's group constraints need a model with 2 outputs, got {width}")
        self.notion, self.eps, self.num_groups = fair_notion, float(fair_eps), num_groups
        self.sensitive = sensitive
        self.columns = self.columns_for(layout.d, num_groups, fair_notion=fair_notion)
        self.num_constraints = self.columns.inputs
        self._lam = torch.zeros(self.num_constraints, device=self.device)

    # ------------------------------------------------------------------ public API

    @classmethod
    def columns_for(cls, d: int, num_groups: int = 0, **options: Any) -> Columns:
        """Round input λ (A,) and the statistic ``("constraints", A)``, A =
        ``num_constraints(fair_notion, num_groups)``; nothing without groups (the trainer itself
        refuses data without a sensitive attribute)."""
        a = fairness.num_constraints(options.get("fair_notion", "dp"), int(num_groups))
        return Columns(inputs=a, stats=(("constraints", a),)) if a else Columns()

    @torch.no_grad()
    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """One round: constraint values and Lagrangian losses at w, then Lagrangian local SGD.

        Args:
            w, round, lr, client_ids, sample_idx: as in :meth:`VmapTrainer.run_round`.
            inputs: (A,) float64 multipliers λ >= 0 (None: all zeros, plain local SGD, and the
                losses are then the mean cross-entropy).
            state: unused (must be None).

        Returns:
            ``updates`` (m, d) ``u_k = w - w_k``; ``losses`` (m,) float32 Lagrangian losses
            ``l_k`` at w; ``{"constraints": (m, A) float32}`` the values ``c_{a,k}(w)``.

        Raises:
            ValueError: state rows given, multipliers not (A,) or negative or not finite, or
                :meth:`VmapTrainer.run_round`'s errors.
        """
        if state is not None:
            raise ValueError("LagrangianTrainer keeps no per-client state")
        lam = self._multipliers(inputs)
        w = self._check_w(w)
        client_ids, sizes = self._check_clients(client_ids, sample_idx)
        ce, cons = self._constraint_stats(w, sample_idx)
        lagrangian = ce + cons @ lam.double()
        self._lam = lam
        updates = torch.empty(len(sizes), self.layout.d, device=self.device)
        for chunk in self.plan_chunks(sizes):
            pos = torch.as_tensor(chunk, device=self.device)
            w_chunk = self._train_chunk(w, round, lr, client_ids[chunk], [sample_idx[i] for i in chunk])
            updates[pos] = w_chunk.neg_().add_(w)  # w - w_k
        return updates, lagrangian.float(), {"constraints": cons.float()}

    @torch.no_grad()
    def constraint_values(self, w: Tensor, sample_idx: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Mean cross-entropy (n,) and constraint values ``c_{a,k}(w)`` (n, A) of w on each
        client's samples, float64 (what :meth:`run_round` reports, before adding λ)."""
        ce, cons = self._constraint_stats(self._check_w(w), sample_idx)
        return ce.cpu().numpy(), cons.cpu().numpy()

    # ------------------------------------------------------------------ internals

    def _multipliers(self, inputs: npt.ArrayLike | None) -> Tensor:
        if inputs is None:
            return torch.zeros(self.num_constraints, device=self.device)
        lam = np.asarray(inputs, dtype=np.float64).reshape(-1)
        if lam.shape != (self.num_constraints,):
            raise ValueError(f"expected {self.num_constraints} multipliers, got {lam.shape[0]}")
        if not (np.isfinite(lam).all() and (lam >= 0).all()):
            raise ValueError(f"multipliers must be finite and >= 0, got {lam.tolist()}")
        return torch.as_tensor(lam, dtype=torch.float32, device=self.device)

    def _positive_probability(self, out: Tensor) -> Tensor:
        return out[..., 1] if self._softmax_output else torch.softmax(out, dim=-1)[..., 1]

    def _batch_extras(self, sample_rows: Tensor) -> tuple[Tensor, ...]:
        """The sensitive group (m, Bp) of every row of the step's minibatches."""
        rows = torch.as_tensor(sample_rows, device=self.sensitive.device)
        return (self.sensitive[rows].to(self.device),)

    # the extras of _batch_extras come between yb and wb (the trainer passes them positionally)
    def _minibatch_loss(  # type: ignore[override]
            self, params: dict[str, Tensor], xb: Tensor, yb: Tensor, sb: Tensor,
            wb: Tensor) -> Tensor:
        """One client's minibatch Lagrangian: mean CE + ``sum_a λ_a c_a`` (gaps on the batch)."""
        out = functional_call(self.model, params, (xb,))
        ce = self.loss.per_sample(out, yb)
        loss = (ce * wb).sum() / wb.sum().clamp(min=1.0)
        c = fairness.constraint_values(self.notion, self._positive_probability(out), yb, sb,
                                       self.num_groups, self.eps, losses=ce, weight=wb)
        return loss + (self._lam * c).sum()

    def _constraint_stats(self, w: Tensor, sample_idx: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
        """Mean CE (n,) and constraints (n, A) of w, float64, from per-(client, group, label)
        sums over one batched forward in row blocks (NaN CE for a client without samples)."""
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        n, g = len(sizes), self.num_groups
        sums = torch.zeros(n * g * 2, 3, dtype=torch.float64, device=self.device)
        for rows, seg, out, yb in self._forward_blocks(w, sample_idx):
            sb = self.sensitive[torch.as_tensor(rows, device=self.sensitive.device)].to(self.device)
            cell = (seg * g + sb) * 2 + yb
            sums.index_add_(0, cell, torch.stack(
                [torch.ones_like(yb, dtype=torch.float64),
                 self._positive_probability(out).double(),
                 self.loss.per_sample(out, yb).double()], dim=1))
        sums = sums.view(n, g, 2, 3)
        count, prob_sum, loss_sum = sums.unbind(dim=3)
        ce = loss_sum.sum(dim=(1, 2)) / torch.as_tensor(sizes, dtype=torch.float64, device=self.device)
        return ce, gaps_from_sums(self.notion, count, prob_sum, loss_sum) - self.eps


def _ends_in_softmax(model: nn.Module) -> bool:
    """True when the model's last leaf module is a softmax (``output = "softmax"``)."""
    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    return bool(leaves) and isinstance(leaves[-1], nn.Softmax)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
