"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (ALGORITHMS.md §7).

The global model is trained exactly as FedAvg (this rule's step is FedAvg's weighted mean of the
updates). Every client also keeps a personal model v_k, trained locally on
``F_k(v_k) + (lam/2) ||v_k - w^t||^2`` by :class:`mpifl.clients.ditto.DittoTrainer` (requested
through ``Ditto.needs.trainer`` and :meth:`Ditto.client_options`); clients are evaluated on
v_k as well as on the global model (``/eval/personal_accuracy`` beside
``/eval/client_accuracy``).

The server keeps the K personal models: each round it sends the selected clients' rows
(:meth:`Ditto.client_state`), and the trained rows come back as ``RoundUpdates.stats
["client_state"]``; only the clients whose updates are aggregated (not dropped out, not rejected)
keep their new personal model. Following the authors' code (github.com/litian96/ditto,
``flearn/trainers_MTL/fedbase.py``: ``local_models`` are deep copies of the initial model),
every v_k starts as a copy of the initial global model — here the first global parameters the
rule is given (round 0's w^0). The reference averages the updates uniformly
(``simple_average``); ALGORITHMS.md §7 says "trained as FedAvg", so the default weighting is
FedAvg's ``"samples"``, and ``weighting = "uniform"`` is the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import Field

from mpifl.aggregators.base import (RoundUpdates, check_num_clients,
                                    check_round_order, register)
from mpifl.aggregators.fedavg import FedAvg
from mpifl.aggregators.needs import BenchSpec, Needs


@register("ditto")
class Ditto(FedAvg):
    """FedAvg's step plus the server-side store of the clients' personal models.

    Args:
        lam: Ditto's lambda >= 0 (passed to local training by :meth:`client_options`).
        num_clients: K, the number of clients (the server passes it: ``needs.num_clients``).
        weighting: as :class:`~mpifl.aggregators.fedavg.FedAvg` (default ``"samples"``).
        seed: unused (Ditto draws nothing); kept for the common constructor.

    Attributes:
        V: ``(K, d)`` float32 personal models on the device of the parameters the rule was
            given, or None before the first round.

    Raises:
        ValueError: lam or num_clients out of range, an unknown weighting; in ``client_state``
            and ``aggregate``, a client id outside ``0 .. K-1`` or a parameter size that
            changed; in ``aggregate``, a round that is not later than the previous one or a
            missing/mis-shaped ``stats["client_state"]``.
    """

    #: Ditto's local training; its personal models are the protocol PersonalModels
    #: (:meth:`client_state`, :meth:`personal_params`).
    needs = Needs(num_clients=True, trainer="ditto", losses=False,
                  shards_note="its personal models (K, d) are sent to and kept at one place")

    class Params(FedAvg.Params):
        lam: float = Field(0.1, ge=0.0)
        """Pull of each personal model towards the global one; 0: purely local models."""

    def __init__(self, *, num_clients: int | None = None, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self.lam = self.params.lam
        self.num_clients = check_num_clients("ditto", num_clients)
        self.V: torch.Tensor | None = None
        self._last_round = -1

    @classmethod
    def client_options(cls, p: Params) -> dict[str, Any]:
        return {"lam": p.lam}

    # ---- personal models ----------------------------------------------------------------------

    def _k(self) -> int:
        if self.num_clients is None:
            raise ValueError("ditto: num_clients (K) is needed to keep the personal models")
        return self.num_clients

    def _check_ids(self, ids: np.ndarray, what: str) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        k = self._k()
        if ids.size and (ids.min() < 0 or ids.max() >= k):
            raise ValueError(f"ditto: {what} has client ids outside 0..{k - 1}")
        return ids

    def _check_d(self, d: int) -> None:
        if self.V is not None and self.V.shape[1] != d:
            raise ValueError(f"ditto: parameter size changed from {self.V.shape[1]} to {d}")

    @classmethod
    def bench_inputs(cls) -> BenchSpec:
        """The benchmarks give it (m, d) personal-model rows as ``stats["client_state"]``
        (:class:`~mpifl.aggregators.needs.BenchInputs`)."""
        return BenchSpec(stats={"client_state": ("d",)})

    @torch.no_grad()
    def client_state(self, client_ids: np.ndarray, w: torch.Tensor) -> torch.Tensor:
        """(m, d) float32: the selected clients' personal models, sent with this round's
        request. The first call copies w (round 0's global model) into every v_k."""
        ids = self._check_ids(client_ids, "client_state")
        w = w.detach().reshape(-1)
        self._check_d(w.numel())
        if self.V is None:
            self.V = w.to(torch.float32).expand(self._k(), -1).clone()
        self.V = self.V.to(w.device)
        return self.V[torch.as_tensor(ids, device=self.V.device)]

    @torch.no_grad()
    def personal_params(self, w: torch.Tensor) -> torch.Tensor:
        """(K, d) float32: every client's personal model (w itself, broadcast, before the
        first round)."""
        w = w.detach().reshape(-1)
        self._check_d(w.numel())
        if self.V is None:
            return w.to(torch.float32).expand(self._k(), -1)
        self.V = self.V.to(w.device)
        return self.V

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """FedAvg's step (d,); stores the aggregated clients' trained personal models.

        Without a prior :meth:`client_state` (direct library use, e.g. benchmarks) the store
        starts as NaN rows: only clients that were aggregated then hold a personal model.
        """
        check_round_order("ditto", r.round, self._last_round)
        ids = self._check_ids(r.client_ids, f"round {r.round}")
        rows = r.stats.get("client_state")
        if rows is None or tuple(rows.shape) != (r.m, r.d):
            got = None if rows is None else tuple(rows.shape)
            raise ValueError(f"ditto: round {r.round} needs stats['client_state'] ({r.m}, {r.d}) "
                             f"(the personal models trained by DittoTrainer), got {got}")
        self._check_d(r.d)
        step = super().aggregate(r)
        if self.V is None:
            self.V = torch.full((self._k(), r.d), float("nan"), device=r.updates.device)
        self.V = self.V.to(r.updates.device)
        self.V[torch.as_tensor(ids, device=self.V.device)] = rows.to(self.V)
        self._last_round = r.round
        return step

    # ---- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """lam, K, the last aggregated round and the personal models ``personal`` (K, d)
        float32 (shape (0, 0) before the first round)."""
        return {
            "lam": self.lam,
            "num_clients": -1 if self.num_clients is None else int(self.num_clients),
            "last_round": self._last_round,
            "personal": (self.V.cpu().numpy().copy() if self.V is not None
                         else np.zeros((0, 0), dtype=np.float32)),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the personal models land on the CPU and move to
        the parameters' device on the next call).

        Raises:
            ValueError: a missing key, or a state of another lam or K.
        """
        missing = sorted({"lam", "num_clients", "last_round", "personal"} - set(state))
        if missing:
            raise ValueError(f"ditto: state is missing {missing}")
        if float(state["lam"]) != self.lam:
            raise ValueError(f"ditto: state has lam {float(state['lam'])}, this rule {self.lam}")
        k = int(state["num_clients"])
        if k != (-1 if self.num_clients is None else self.num_clients):
            raise ValueError(f"ditto: state has num_clients {k}, this rule {self.num_clients}")
        personal = np.asarray(state["personal"], dtype=np.float32)
        if personal.size == 0:
            self.V = None
        elif personal.ndim != 2 or personal.shape[0] != k:
            raise ValueError(f"ditto: state's personal models have shape {personal.shape}, "
                             f"expected ({k}, d)")
        else:
            self.V = torch.from_numpy(personal.copy())
        self._last_round = int(state["last_round"])
