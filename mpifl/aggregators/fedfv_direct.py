"""FedFV written straight from ALGORITHMS.md §3 (Wang et al., "Federated Learning with Fair
Averaging", IJCAI 2021, Algorithms 2 and 3): per-pair Python loops over d-dimensional vectors and a
plain dict history ``H[k] = (u_k, t_k)``.

This is the test oracle for the Gram form (:mod:`mpifl.aggregators.fedfv`) and the baseline of
``mpifl bench aggregation``. It is deliberately not registered: O(m^2) Python-level vector
operations per round and O(K d) history memory are exactly what the Gram form avoids. It
only shares the hyper-parameter validation with the Gram form; the order, kept clients,
projections and history are re-derived here so that a mistake in one shows up against the other.
Two economies that do not change the algorithm: ``||u_j||^2`` is computed once per client, and
projections update ``g_i`` in place (so the baseline is not slower than it has to be).
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch

from mpifl.aggregators.base import RoundUpdates, check_seed
from mpifl.aggregators.fedfv import FedFV


def direct_like(rule: FedFV, seed: int = 0) -> DirectFedFV:
    """The direct form with ``rule``'s hyper-parameters: FedFV's benchmark baseline
    (``FedFV.bench_inputs().baseline``)."""
    return DirectFedFV(alpha=rule.alpha, tau=rule.tau, order=rule.order,
                       external_window=rule.external_window, seed=seed)


class DirectFedFV:
    """The direct FedFV; same constructor and ``aggregate`` as
    :class:`~mpifl.aggregators.fedfv.FedFV`, plus :meth:`observe`.

    Raises:
        ValueError: a hyper-parameter out of range (same rules as the Gram form).
    """

    name = "fedfv_direct"

    def __init__(self, *, alpha: float = 0.1, tau: int = 1, order: str = "loss",
                 external_window: str = "paper", seed: int = 0) -> None:
        p = cast(FedFV.Params, FedFV.validate_params(dict(alpha=alpha, tau=tau, order=order,
                                                          external_window=external_window)))
        self.alpha, self.tau = p.alpha, p.tau
        self.order, self.external_window = order, external_window
        self.seed = check_seed(seed)
        self.H: dict[int, tuple[torch.Tensor, int]] = {}

    def observe(self, r: RoundUpdates) -> None:
        """Step 1: record the round's updates as the clients' latest (no aggregation)."""
        for k, u in zip(r.client_ids.tolist(), r.updates):
            self.H[k] = (u.clone(), r.round)

    @torch.no_grad()
    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``s`` (d,) in the dtype and on the device of ``r.updates``."""
        t, U, m = r.round, r.updates, r.m
        self.observe(r)
        po = self._order(r)
        keep = set(po[math.ceil((m - 1) * (1 - self.alpha)):]) if self.alpha > 0 else set()
        sq = [torch.dot(u, u) for u in U]
        gs = []
        for i in range(m):
            g_i = U[i].clone()
            if i not in keep:
                for j in po:
                    if j == i:
                        continue
                    dot = torch.dot(g_i, U[j])
                    if dot < 0:
                        g_i.sub_(U[j], alpha=float(dot / sq[j]))
            gs.append(g_i)
        g = torch.stack(gs).mean(dim=0)
        if self.tau > 0 and t >= self.tau:
            if self.external_window == "paper":
                rounds = [t - i for i in range(self.tau, 0, -1)]
            else:
                rounds = [t - i for i in range(self.tau - 1, -1, -1)]
            for rnd in rounds:
                g = self._project_external(g, rnd)
        gnorm = torch.linalg.vector_norm(g)
        if gnorm == 0:
            return torch.zeros_like(g)
        return g / gnorm * torch.linalg.vector_norm(U.mean(dim=0))

    def _project_external(self, g: torch.Tensor, rnd: int) -> torch.Tensor:
        conflicting = [u for u, tk in self.H.values() if tk == rnd and torch.dot(g, u) < 0]
        if not conflicting:
            return g
        g_con = torch.stack(conflicting).sum(dim=0)
        dot = torch.dot(g, g_con)
        if dot < 0:
            g = g - dot / torch.dot(g_con, g_con) * g_con
        return g

    def _order(self, r: RoundUpdates) -> list[int]:
        ids = r.client_ids.tolist()
        losses = r.losses.cpu().tolist()
        rows = range(r.m)
        if self.order == "loss":
            return sorted(rows, key=lambda i: (losses[i], ids[i]))
        if self.order == "reverse":
            return sorted(rows, key=lambda i: (-losses[i], ids[i]))
        by_id = sorted(rows, key=lambda i: ids[i])
        perm = np.random.default_rng([self.seed, r.round]).permutation(r.m)
        return [by_id[p] for p in perm]
