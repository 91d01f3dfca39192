"""FedMeta — controllable meta updating (Yao et al., "Federated Learning with Unbiased Gradient
Aggregation and Controllable Meta Updating", NeurIPS 2019 FL workshop, arXiv:1910.08234;
ALGORITHMS.md §6): FedAvg's aggregation followed by one gradient step on a small server-held meta
set.

The meta step itself is :class:`mpifl.clients.meta.MetaStep` (it needs the data and the model, which
an aggregator does not see). Contract with the server, after every aggregation (also for any
other rule when ``server.meta = true``, e.g. "FedMeta w/ UGA" = ``algorithm = "uga"`` +
``server.meta = true``):

    if rule.needs.meta_step or cfg.server.meta:   # see mpifl.experiment.plan.make_plan (Plan.meta)
        w = meta.apply(w)   # w - eta_meta * grad L(w; D_meta); meta: mpifl.clients.meta.MetaStep

The meta step is deterministic (the meta set is drawn from ``run.seed``), so nothing about it
is checkpointed; this aggregator is stateless like FedAvg.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field

from mpifl.aggregators.base import register
from mpifl.aggregators.fedavg import FedAvg
from mpifl.aggregators.needs import Needs

SAMPLINGS = ("iid", "group_balanced")


def check_meta_params(eta_meta: Any, meta_size: Any, meta_sampling: Any) -> tuple[float, int, str]:
    """``(eta_meta, meta_size, meta_sampling)`` validated: finite eta > 0, integer size >= 1,
    a known sampling.

    Raises:
        ValueError: a value out of range.
    """
    eta = float(eta_meta)
    if not (math.isfinite(eta) and eta > 0):
        raise ValueError(f"fedmeta: eta_meta must be finite and > 0, got {eta_meta}")
    if isinstance(meta_size, bool) or int(meta_size) != meta_size or meta_size < 1:
        raise ValueError(f"fedmeta: meta_size must be an integer >= 1, got {meta_size}")
    if meta_sampling not in SAMPLINGS:
        raise ValueError(f"fedmeta: meta_sampling must be one of {SAMPLINGS}, got "
                         f"{meta_sampling!r}")
    return eta, int(meta_size), meta_sampling


@register("fedmeta")
class FedMeta(FedAvg):
    """FedAvg's sample-weighted mean of the updates; the server applies the meta step after it.

    Args:
        eta_meta, meta_size, meta_sampling: the ``[fedmeta]`` table, validated here; the server
            passes them (from the config) to :class:`mpifl.clients.meta.MetaStep`.
        weighting: as FedAvg's (default ``"samples"``, the paper's).
        seed: unused.

    Raises:
        ValueError: a hyper-parameter out of range.
    """

    #: the server applies MetaStep after this rule's aggregation (FedAvg's needs otherwise)
    needs = Needs(losses=False, meta_step=True,
                  shards_note="its meta step trains the whole model on the server's meta set "
                              "at one place")

    class Params(FedAvg.Params):
        eta_meta: float = Field(0.1, gt=0.0)
        """Step size of the meta step (> 0)."""
        meta_size: int = Field(100, ge=1, le=2**31 - 1)
        """Samples in the server-held meta set."""
        meta_sampling: Literal["iid", "group_balanced"] = "iid"
        """``"iid"`` from the training pool, or ``"group_balanced"`` (equal per sensitive group)."""

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        p = self.params
        self.eta_meta, self.meta_size, self.meta_sampling = p.eta_meta, p.meta_size, p.meta_sampling

    def __repr__(self) -> str:
        return (f"FedMeta(eta_meta={self.eta_meta}, meta_size={self.meta_size}, "
                f"meta_sampling={self.meta_sampling!r}, seed={self.seed})")
