"""UGA local work: keep-trace local training and the gradient with respect to the round's start.

UGA — unbiased gradient aggregation (Yao et al., "Federated Learning with Unbiased Gradient
Aggregation and Controllable Meta Updating", NeurIPS 2019 FL workshop, arXiv:1910.08234;
ALGORITHMS.md §6). Client k runs the first ``E-1`` epochs of its local SGD (ALGORITHMS.md §1: the
same minibatch order, learning rate, momentum and weight decay as
:class:`~mpifl.clients.VmapTrainer`) while keeping the autograd trace, reaching ``w_k = h_k(w^t)``;
it then evaluates its loss on its whole training split and reports

    g_k = ∇_{w^t} L(h_k(w^t); D_k)        (L = mean cross-entropy over D_k)

— the gradient with respect to the round's **starting** weights, through the trace. The
efficient form of ALGORITHMS.md §6 is used:

    w_k, pullback = torch.func.vjp(trace, w^t);   v = ∇L(w_k; D_k);   g_k = pullback(v)

so the trace is differentiated once (one reverse pass through the E-1 traced epochs), not
once per parameter. Clients are batched exactly as in VmapTrainer: a chunk of m clients is one
stacked ``(m, d)`` tensor, every traced step is one ``vmap(grad(minibatch loss))`` over the
chunk with padded/masked minibatches, and the chunk's trace is one function
``(m, d) -> (m, d)`` whose clients do not interact, so one ``vjp`` with the stacked cotangent
gives every client's own ``g_k``. ``v`` is the full-data gradient, computed in row blocks
(sums of per-sample losses divided by n_k) so the whole split never has to be in one forward.

Memory grows linearly with the number of traced steps (each keeps its parameters, its
minibatch and the activations and backward intermediates that the second-order reverse pass
needs), so the clients traced at once are bounded by ``memory_budget_mb`` (estimated per client
as below, calibrated on CPU by peak RSS) and optionally by ``max_traced_clients``.

With E = 1 nothing is traced: ``g_k = ∇L(w^t; D_k)``, the plain full-batch gradient.

The rows returned by :meth:`UGATrainer.run_round` are **gradients** (no learning rate in them),
not the pseudo-gradients ``u_k = w^t - w_k`` that VmapTrainer returns; the UGA aggregator
(:mod:`mpifl.aggregators.uga`) steps ``w^{t+1} = w^t - eta_g * sum_k (n_k/n_S) g_k``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap

from mpifl.clients.interface import TrainOptions
from mpifl.clients.trainer import VmapTrainer, check_stop
from mpifl.core.layout import ParamLayout

# The estimate below is deliberately conservative: measured by peak RSS on CPU (torch 2.13), an
# MLP 784-200-200-10 client with 480 samples, B = 50, E = 5 (40 traced steps) takes about 60 MB
# (estimate 123 MB), and cnn_mnist about 13 MB per traced step at B = 20 (estimate 33 MB).
# Float32 copies of d per client alive outside the traced steps: w^t stacked, w_k, v, g_k,
# the gradient being accumulated, and the reverse pass's running cotangents and temporaries.
_FIXED_PARAM_COPIES = 10
# Per traced step: the step's parameters (kept for the reverse pass) and the transient
# weight-sized products of the second-order reverse pass.
_STEP_PARAM_COPIES = 2
# Per traced step and padded minibatch row: activations and their first-order gradients, kept
# for the second-order reverse pass (the minibatch inputs are counted separately).
_STEP_ACTIVATION_COPIES = 3
# Forward + backward of the full-data gradient v, per row of a block.
_FULL_ACTIVATION_COPIES = 3
# Rows per block of the full-data gradient v (and of nothing else).
FULL_BLOCK = 512


class UGATrainer(VmapTrainer):
    """UGA's client computation for many clients at once (ALGORITHMS.md §6); VmapTrainer's
    interface.

    Args:
        model, layout, x, y, options: as in :class:`~mpifl.clients.VmapTrainer` (the minibatch
            order of the traced epochs is VmapTrainer's, keyed by ``batch_order(seed, round,
            client_id, epoch, n)``). ``options.epochs``: E >= 1 local epochs of the round; the
            first ``E-1`` are traced, then the gradient is evaluated on the whole training split
            (UGA's "gradient evaluation" replaces the last epoch). FedProx's ``prox_mu`` must be
            0 (UGA has none).
        max_traced_clients: at most this many clients are traced at once (None: only the memory
            budget decides; at least one client per chunk always).

    Raises:
        ValueError: as VmapTrainer; ``max_traced_clients < 1``; a non-zero ``prox_mu``;
            ``report_accuracy`` (UGA reports no training accuracies).
    """

    _plain_steps = False  # the keep-trace differentiates through every step's gradient

    #: what :meth:`run_round` returns per client (the server's aggregator must expect gradients)
    returns: str = "gradient"

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        x: Tensor,
        y: Tensor,
        options: TrainOptions,
        *,
        max_traced_clients: int | None = None,
    ):
        if options.prox_mu:
            raise ValueError("UGA's local training has no proximal term (prox_mu must be 0)")
        if options.report_accuracy:
            raise ValueError("UGATrainer does not report training accuracies")
        if max_traced_clients is not None and int(max_traced_clients) < 1:
            raise ValueError(f"max_traced_clients must be >= 1 or None, got {max_traced_clients}")
        super().__init__(model, layout, x, y, options)
        self.max_traced_clients = None if max_traced_clients is None else int(max_traced_clients)
        self.traced_epochs = self.epochs - 1
        # The first E-1 epochs of E are exactly the epochs of an (E-1)-epoch schedule: the
        # minibatch order is keyed by the epoch index and the steps per epoch depend on n only.
        self._tracer = (VmapTrainer(model, layout, x, y, TrainOptions(
            epochs=self.traced_epochs, batch_size=options.batch_size, seed=options.seed,
            device=options.device, max_local_steps=options.max_local_steps))
            if self.traced_epochs else None)
        self._sum_grad = vmap(grad(self._block_loss_sum))

    # ------------------------------------------------------------------ public API

    # no_grad as every trainer's round: torch.func's vjp and grad ignore an outer no_grad (their
    # documented behaviour), so the trace is still differentiated.
    @torch.no_grad()
    def run_round(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                  sample_idx: Sequence[np.ndarray], inputs: np.ndarray | None = None,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """UGA's gradients of the selected clients of one round.

        Args:
            w: ``(d,)`` global parameters ``w^t``.
            round: round index t (keys the minibatch order of the traced epochs).
            lr: client learning rate ``lr_t`` of the traced SGD steps.
            client_ids: ``(m,)`` int ids of the clients.
            sample_idx: m arrays of indices into x: each client's training samples (non-empty).
            inputs, state: unused (UGA has no round inputs and no per-client state).

        Returns:
            ``grads``: ``(m, d)`` float32 on ``device`` (float64 for a float64 w: tests),
            ``g_k = ∇_{w^t} L(h_k(w^t); D_k)`` — **gradients**, not pseudo-gradients (no
            learning rate in them);
            ``losses``: ``(m,)`` float32, the mean cross-entropy of ``w^t`` on each client's
            training samples before training (``l_k`` of ALGORITHMS.md §0), as VmapTrainer;
            no statistics (``{}``).

        Raises:
            ValueError: wrong shapes, or a client without samples.
        """
        w = self._check_w(w)
        client_ids, sizes = self._check_clients(client_ids, sample_idx)
        losses, _ = self._client_stats(w, sample_idx)
        grads = torch.empty(len(sizes), self.layout.d, dtype=w.dtype, device=self.device)
        for chunk in self.plan_chunks(sizes):
            g = self._grad_chunk(w, round, lr, client_ids[chunk], [sample_idx[i] for i in chunk])
            grads[torch.as_tensor(chunk, device=self.device)] = g
        return grads, losses.float(), {}

    def plan_chunks(self, sizes: np.ndarray) -> list[np.ndarray]:
        """VmapTrainer's plan with UGA's memory estimate, each chunk cut to at most
        ``max_traced_clients`` clients."""
        chunks = super().plan_chunks(sizes)
        cap = self.max_traced_clients
        if cap is None:
            return chunks
        return [c[i:i + cap] for c in chunks for i in range(0, len(c), cap)]

    def traced_steps(self, n: int) -> int:
        """Number of SGD steps kept in the trace for a client of n samples (0 when E = 1)."""
        return self._tracer._steps(int(n)) if self._tracer is not None else 0

    def _check_w(self, w: Tensor) -> Tensor:
        """As VmapTrainer's, except that a float64 w is kept float64 (with a float64 sample
        store on the device the whole computation is then float64: the finite-difference
        tests). The server always passes float32."""
        if w.shape != (self.layout.d,):
            raise ValueError(f"w must have shape ({self.layout.d},), got {tuple(w.shape)}")
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        return w.detach().to(self.device, dtype)

    def _gather(self, rows: np.ndarray) -> tuple[Tensor, Tensor]:
        """As VmapTrainer's, except that a float64 store stays float64 (see ``_check_w``)."""
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.x.device)
        dtype = torch.float64 if self.x.dtype == torch.float64 else self._x_dtype(self.x)
        return (self.x[idx].to(self.device, dtype, non_blocking=True),
                self.y[idx.to(self.y.device)].to(self.device, non_blocking=True))

    # ------------------------------------------------------------------ computation

    def _client_bytes(self, n_max: int, n: int) -> int:
        """Estimated working memory of one client in a chunk whose largest client has n_max:
        the traced steps (parameters, minibatch, activations kept for the reverse pass), the
        fixed weight-sized tensors, one block of the full-data gradient, its samples."""
        d, act, inp = self.layout.d, self._act_numel, self._in_numel
        steps, bp = self.traced_steps(n_max), self._padded_batch(n_max)
        per_step = _STEP_PARAM_COPIES * d + bp * (_STEP_ACTIVATION_COPIES * act + inp)
        block = min(n_max, FULL_BLOCK) * (_FULL_ACTIVATION_COPIES * act + inp)
        floats = _FIXED_PARAM_COPIES * d + steps * per_step + block + n * inp
        return 4 * floats + 16 * (steps * bp + n_max)

    def _grad_chunk(self, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
                    sample_idx: Sequence[np.ndarray]) -> Tensor:
        """``g_k`` of a chunk of clients, ``(m, d)``."""
        sizes = np.array([len(s) for s in sample_idx], dtype=np.int64)
        m, n_max = len(sizes), int(sizes.max())
        store_rows = np.concatenate([np.asarray(s, dtype=np.int64) for s in sample_idx])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        # The whole split of each client, padded to n_max (weight 0, pointing at its first sample).
        full = np.full((m, n_max), -1, dtype=np.int64)
        for i, (n, start) in enumerate(zip(sizes, starts)):
            full[i, :n] = start + np.arange(n)
        full_w = torch.as_tensor((full >= 0).astype(np.float32), device=self.device)
        full = np.where(full >= 0, full, starts[:, None])
        direct = self._store_on_device()
        if direct:  # index the store itself (see VmapTrainer._train_chunk)
            xs, ys, full = self.x, self.y, store_rows[full]
        else:
            xs, ys = self._gather(store_rows)
        full_rows = torch.as_tensor(full, device=self.device)
        count = torch.as_tensor(sizes, dtype=w.dtype, device=self.device)
        w0 = w.expand(m, -1).clone()
        if self._tracer is None:  # E = 1: the plain gradient at w^t
            return self._full_grad(w0, xs, ys, full_rows, full_w, count)
        plan = self._tracer._plan(round, client_ids, sizes)
        rows = (torch.as_tensor(store_rows, device=self.device)[plan.rows] if direct
                else plan.rows)

        def trace(flat: Tensor) -> Tensor:
            return self._trace(flat, xs, ys, rows, plan.weights, plan.steps, plan.widths, lr)

        # without has_aux, vjp returns (output, pullback)
        w_k, pullback = cast(tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]], vjp(trace, w0))
        v = self._full_grad(w_k.detach(), xs, ys, full_rows, full_w, count)
        del w_k
        (g,) = pullback(v)
        return g.detach()

    def _store_on_device(self) -> bool:
        """True: index the sample store directly; False: move the chunk's samples first."""
        return self.x.device == self.device

    def _trace(self, flat: Tensor, xs: Tensor, ys: Tensor, rows: Tensor, weights: Tensor,
               steps_np: np.ndarray, widths: np.ndarray, lr: float) -> Tensor:
        """The traced local SGD of a chunk, ``(m, d) -> (m, d)``: out-of-place updates (so the
        trace is differentiable), otherwise step for step VmapTrainer's ``_sgd_step``."""
        m = flat.shape[0]
        params = list(self.layout.unflatten(flat).values())
        names = self.layout.names
        steps = torch.as_tensor(steps_np, device=self.device)
        buf: list[Tensor] | None = None
        for t in range(rows.shape[1]):
            check_stop()  # a stop request ends the round here, between traced steps
            b = int(widths[t])
            rt = rows[:, t, :b]
            g = self._step_grad(dict(zip(names, params)), xs[rt], ys[rt], weights[:, t, :b])
            grads = [g[n] for n in names]
            if self.weight_decay:
                grads = [gi + self.weight_decay * p for gi, p in zip(grads, params)]
            step = grads
            if self.momentum:
                buf = (grads if buf is None
                       else [self.momentum * b + gi for b, gi in zip(buf, grads)])
                step = buf
            if steps_np.min() <= t:  # some clients are done: their step is multiplied by 0
                active = (steps > t).to(flat.dtype)
                step = [s * active.view(-1, *[1] * (s.dim() - 1)) for s in step]
            params = [p - lr * s for p, s in zip(params, step)]
        return torch.cat([p.reshape(m, -1) for p in params], dim=1)

    def _block_loss_sum(self, flat: Tensor, xb: Tensor, yb: Tensor, wb: Tensor) -> Tensor:
        """Sum of one client's per-sample losses over the real rows of a block."""
        out = functional_call(self.model, self.layout.unflatten(flat), (xb,))
        return (self.loss.per_sample(out, yb) * wb).sum()

    def _full_grad(self, flat: Tensor, xs: Tensor, ys: Tensor, full_rows: Tensor,
                   full_w: Tensor, count: Tensor) -> Tensor:
        """``∇L(w_k; D_k)`` per client, ``(m, d)``: block sums over the padded split / n_k."""
        total: Tensor | None = None
        for lo in range(0, full_rows.shape[1], FULL_BLOCK):
            r = full_rows[:, lo:lo + FULL_BLOCK]
            g = self._sum_grad(flat, xs[r], ys[r], full_w[:, lo:lo + FULL_BLOCK])
            total = g if total is None else total.add_(g)
        assert total is not None  # every client has samples, so there is a block
        return total.div_(count[:, None])
