"""FedFa — Wei Huang, Tianrui Li, Dexian Wang, Shengdong Du & Junbo Zhang, "Fairness and Accuracy
in Federated Learning" (arXiv:2012.10069, 2020; also cited as "FedFa: a fair federated learning
framework with double momentum", 2022); ALGORITHMS.md §7.

Each round the selected clients report ``ACC_k``, the training accuracy of the global model
``w^t`` on their training split measured **before** local training, and the server keeps
``f_k``, the number of rounds client k has been selected in. Over the round's m clients:

    A_k  = -log2(ACC_k / sum_j ACC_j + 1e-6),      A_k  <- A_k  / sum_j A_j
    Fq_k = -log2(1 - f_k / sum_j f_j + 1e-5),      Fq_k <- Fq_k / sum_j Fq_j
    p_k  = alpha A_k + beta Fq_k,                  alpha = 1 - beta        (so sum_k p_k = 1)
    w_agg = sum_k p_k w_k
    v <- gamma_s v + (w_agg - w^t),                w^{t+1} = w^t + v       (v^0 = 0)

The second momentum ("double momentum") is the clients' local SGD momentum ``gamma_c``, which this
rule requests from local training through :meth:`FedFa.client_options`, together with
``report_accuracy`` (the trainer then delivers ``stats["train_accuracy"]``).

In the update form of ALGORITHMS.md §0 (``u_k = w^t - w_k``, ``w^{t+1} = w^t - s``): since
``sum p_k = 1``, ``w_agg - w^t = -sum_k p_k u_k``, so ``v <- gamma_s v - sum_k p_k u_k`` and the
returned step is ``s = -v``.

Where this follows the reference code (the FedFV authors' github.com/WwZzz/easyFL,
``algorithm/fedfa.py`` and its FLGo successor ``flgo/algorithm/fedfa.py``; FedFa is a baseline of
the FedFV paper's Table 2):

- ``f_k`` **counts the current round**: the reference client increments its frequency before it
  replies, so a client selected for the first time has ``f_k = 1`` (never 0, so ``sum f > 0``).
- ``ACC_k`` is the accuracy of the received global model on the client's *training* data,
  measured before local training (the reference's ``test(model, 'train')``).
- Both sums run over the round's clients only, as in the reference.

Where it does not: the reference's server update is
``m <- gamma m + (1 - gamma)(w_agg - w^t)``, ``w^{t+1} = w_agg - eta m`` (eta the client learning
rate; the older easyFL ``algorithm/fedfa.py`` even builds a tuple there), with one ``gamma``
(FLGo defaults: beta 0.5, gamma 0.9) shared by the server and the clients' SGD momentum. This
rule follows the paper's form as ALGORITHMS.md §7 writes it (``v <- gamma_s v + (w_agg - w^t)``,
``w^{t+1} = w^t + v``) with separate ``gamma_s`` and ``gamma_c``; the defaults here (beta,
gamma_s, gamma_c = 0.5, 0.5, 0.5, :class:`FedFa.Params`) differ from FLGo's
``gamma = 0.9``. The FedLF authors' FedFa baseline (github.com/zibinpan/FedLF,
``gfedplat/algorithm/FedFa/FedFa.py``: beta 0.5, gamma 0.9) has exactly this server update
(``ms <- gamma ms + dw``, ``w <- w + ms``) and also counts the current round, but measures ACC
*after* local training, trains with the run's plain SGD (momentum 0 by default), and weighs by
the raw accuracies and frequencies divided by the summed information quantities, which neither
the paper nor ALGORITHMS.md §7 does.

A case neither the paper nor the reference covers: if every client of the round has
``ACC_k = 0`` (``sum ACC = 0``), the accuracy shares ``ACC_k / sum ACC`` are taken as ``1/m``
(all clients equally inaccurate) instead of 0/0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import (Aggregator, RoundUpdates, check_num_clients, check_round_order,
                                    register, state_scalar)
from mpifl.aggregators.needs import BenchSpec, Needs
from mpifl.core.params import Params


def fedfa_weights(acc: np.ndarray, freq: np.ndarray, beta: float) -> np.ndarray:
    """FedFa's aggregation weights ``p`` (m,) float64 (summing to 1) from the round's training
    accuracies ``acc`` (m,) in [0, 1] and selection counts ``freq`` (m,) >= 1 (current round
    included); see the module docstring."""
    acc = np.asarray(acc, dtype=np.float64)
    freq = np.asarray(freq, dtype=np.float64)
    total = acc.sum()
    share = acc / total if total > 0 else np.full(acc.size, 1.0 / acc.size)
    a = -np.log2(share + 1e-6)
    fq = -np.log2(1.0 - freq / freq.sum() + 1e-5)
    # for m >= 2 both sums are > 0 (convexity of -log2 with shares summing to 1); for m = 1
    # each is a single nonzero number, so both normalised vectors are exactly [1]
    return (1.0 - beta) * (a / a.sum()) + beta * (fq / fq.sum())


@register("fedfa")
class FedFa(Aggregator):
    """FedFa aggregation with server momentum (Huang et al. 2020/2022); ALGORITHMS.md §7 and the
    module docstring.

    Args:
        beta: weight of the participation-frequency term in [0, 1]; alpha = 1 - beta weighs the
            accuracy term.
        gamma_s: server momentum in [0, 1).
        gamma_c: clients' local SGD momentum in [0, 1) (used by local training only, through
            :meth:`client_options`).
        num_clients: K, the number of clients the counts cover (the server passes it); None: the
            counts grow to the largest client id seen.
        seed: unused (nothing is drawn); kept for the common constructor.

    Inputs (:meth:`aggregate`): ``r.updates`` (m, d) float; ``r.stats["train_accuracy"]``
    (m,) or (m, 1) float in [0, 1], ``ACC_k`` of ``w^t``.

    State (``state_dict``): ``v`` (d,) server momentum in the dtype of the updates (float32 from
    the server; empty before the first round), ``counts`` (K,) int64 selection counts ``f``,
    ``last_round``, and the hyper-parameters (checked on load).

    Raises:
        ValueError: a hyper-parameter out of range; in ``aggregate``, a round not later than the
            previous one, a client id outside ``0 .. K-1``, a missing, misshapen or out-of-range
            ``train_accuracy`` statistic, or a changed parameter size.
    """

    # losses=False: its train_accuracy statistic still needs the pre-training pass
    needs = Needs(num_clients=True, losses=False,
                  shards_note="its server momentum v (d,) is not split into blocks yet")

    class Params(Params):
        beta: float = Field(0.5, ge=0.0, le=1.0)
        """Weight of participation frequency against training accuracy (alpha = 1 - beta)."""
        gamma_s: float = Field(0.5, ge=0.0, lt=1.0)
        """Server momentum; 0: no momentum (the step is the weighted mean)."""
        gamma_c: float = Field(0.5, ge=0.0, lt=1.0)
        """The clients' local SGD momentum; 0: plain SGD."""

    def __init__(self, *, num_clients: int | None = None, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        p = self.params
        self.beta, self.gamma_s, self.gamma_c = p.beta, p.gamma_s, p.gamma_c
        self.num_clients = check_num_clients("fedfa", num_clients)
        self._counts = np.zeros(num_clients or 0, dtype=np.int64)
        self._v: torch.Tensor | None = None
        self._last_round = -1

    @classmethod
    def client_options(cls, p: Params) -> dict[str, Any]:
        """Local SGD momentum ``gamma_c`` and the pre-training accuracy statistic."""
        return {"momentum": p.gamma_c, "report_accuracy": True}

    @classmethod
    def bench_inputs(cls) -> BenchSpec:
        """The benchmarks give it training accuracies (m,) (:class:`~mpifl.aggregators.needs.
        BenchInputs`)."""
        return BenchSpec(stats={"train_accuracy": ()})

    @property
    def counts(self) -> np.ndarray:
        """(K,) int64 copy of the selection counts ``f`` (K = the largest id seen + 1 when
        ``num_clients`` is None)."""
        return self._counts.copy()

    def _accuracy(self, r: RoundUpdates) -> np.ndarray:
        stat = r.stats.get("train_accuracy")
        if stat is None:
            raise ValueError(f"fedfa: round {r.round} has no 'train_accuracy' statistic; FedFa "
                             "needs each client's training accuracy of the global model (local "
                             "training must run with report_accuracy=True, see client_options)")
        if tuple(stat.shape) not in ((r.m,), (r.m, 1)):
            raise ValueError(f"fedfa: stats['train_accuracy'] must have shape ({r.m},) or "
                             f"({r.m}, 1), got {tuple(stat.shape)}")
        acc = stat.detach().reshape(-1).double().cpu().numpy()
        bad = ~np.isfinite(acc) | (acc < 0) | (acc > 1)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"fedfa: round {r.round}: client {int(r.client_ids[k])} has "
                             f"train_accuracy {acc[k]!r}; accuracies must lie in [0, 1]")
        return acc

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``s = -v`` (d,), dtype and device of ``r.updates``; updates ``f`` and ``v``."""
        check_round_order("fedfa", r.round, self._last_round)
        ids = r.client_ids
        if ids.min() < 0 or (self.num_clients is not None and ids.max() >= self.num_clients):
            top = "K-1" if self.num_clients is None else str(self.num_clients - 1)
            raise ValueError(f"fedfa: round {r.round} has client ids outside 0..{top}")
        if self._v is not None and self._v.numel() != r.d:
            raise ValueError(f"fedfa: parameter size changed from {self._v.numel()} to {r.d}")
        acc = self._accuracy(r)
        counts = self._counts
        if ids.max() >= counts.size:                       # num_clients=None: grow
            counts = np.concatenate([counts, np.zeros(ids.max() + 1 - counts.size, np.int64)])
        counts = counts.copy()
        counts[ids] += 1                                   # f counts this round (reference)
        p = fedfa_weights(acc, counts[ids], self.beta)
        U = r.updates
        delta = -(torch.as_tensor(p, dtype=U.dtype, device=U.device) @ U)   # w_agg - w^t
        v = delta if self._v is None else self.gamma_s * self._v.to(U.device, U.dtype) + delta
        self._v, self._counts, self._last_round = v, counts, r.round
        return -v

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """``v`` (d,) (empty before the first round), ``counts`` (K,) int64, ``last_round``,
        ``num_clients`` (-1 for None) and the hyper-parameters, as numpy arrays and scalars."""
        return {
            "beta": self.beta,
            "gamma_s": self.gamma_s,
            "gamma_c": self.gamma_c,
            "num_clients": -1 if self.num_clients is None else int(self.num_clients),
            "counts": self._counts.copy(),
            "v": (self._v.cpu().numpy().copy() if self._v is not None
                  else np.zeros(0, dtype=np.float32)),
            "last_round": self._last_round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``v`` lands on the CPU and moves to the updates'
        device on the next round).

        Raises:
            ValueError: missing keys, inconsistent arrays, or hyper-parameters / ``num_clients``
                that differ from this object's (a resumed run must use the same configuration).
        """
        keys = {"beta", "gamma_s", "gamma_c", "num_clients", "counts", "v", "last_round"}
        missing = keys - set(state)
        if missing:
            raise ValueError(f"fedfa state is missing {sorted(missing)}")
        for name in ("beta", "gamma_s", "gamma_c"):
            saved = float(state_scalar(state[name]))
            if saved != getattr(self, name):
                raise ValueError(f"fedfa state was saved with {name}={saved!r}, this aggregator "
                                 f"has {name}={getattr(self, name)!r}")
        k = int(state_scalar(state["num_clients"]))
        if k != (-1 if self.num_clients is None else self.num_clients):
            raise ValueError(f"fedfa state was saved with num_clients={None if k == -1 else k}, "
                             f"this aggregator has num_clients={self.num_clients}")
        counts = np.asarray(state["counts"])
        v = np.asarray(state["v"])
        last = int(state_scalar(state["last_round"]))
        if (counts.ndim != 1 or counts.dtype.kind not in "iu" or (counts < 0).any()
                or (k != -1 and counts.size != k) or v.ndim != 1 or v.dtype.kind != "f"
                or (v.size == 0) != (last < 0)):
            raise ValueError("fedfa state: arrays are inconsistent with their counters")
        self._counts = counts.astype(np.int64).copy()
        self._v = torch.from_numpy(v.copy()) if v.size else None
        self._last_round = last

    def __repr__(self) -> str:
        return (f"FedFa(beta={self.beta}, gamma_s={self.gamma_s}, gamma_c={self.gamma_c}, "
                f"num_clients={self.num_clients}, seed={self.seed})")
