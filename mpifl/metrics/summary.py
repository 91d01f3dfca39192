"""Client-fairness metrics and conflict counts (ALGORITHMS.md §10).

Accuracies and their ``std`` are fractions in [0, 1]; reports print the std in percentage
points, as the FedFV paper's "Var." column (Wang et al., IJCAI 2021), which is a standard
deviation, not a variance.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SUMMARY_KEYS = ("mean", "weighted_mean", "std", "worst5", "best5", "fair_angle", "cf")
LOSS_SUMMARY_KEYS = ("mean", "std", "worst5", "best5")


def loss_summary(loss: np.ndarray) -> dict[str, float]:
    """Summarise the per-client test losses of one evaluation (regression tasks, where there
    is no accuracy).

    Args:
        loss: (K,) float, each client's mean loss on its local test split (NaN: no test data).

    Returns:
        ``mean`` and ``std`` (population) over the clients with test data, ``worst5`` (mean of
        the highest ``max(1, floor(0.05 K))`` losses) and ``best5`` (of the lowest), in the
        loss's units.
    """
    values = np.sort(np.asarray(loss, dtype=np.float64))
    values = values[~np.isnan(values)]
    if values.size == 0:
        return dict.fromkeys(LOSS_SUMMARY_KEYS, math.nan)
    tail = max(1, math.floor(0.05 * values.size))
    return {"mean": float(values.mean()), "std": float(values.std()),
            "worst5": float(values[-tail:].mean()), "best5": float(values[:tail].mean())}


def client_summary(accuracy: np.ndarray, num_test: np.ndarray) -> dict[str, float]:
    """Summarise the per-client test accuracies of one evaluation.

    Args:
        accuracy: (K,) float, each client's accuracy in [0, 1] on its local test split.
        num_test: (K,) int, each client's test-split size (weights of ``weighted_mean``).

    Returns:
        ``mean`` (unweighted over clients), ``weighted_mean`` (by test size), ``std`` (population
        standard deviation, a fraction), ``worst5``/``best5`` (mean accuracy of the lowest /
        highest ``max(1, floor(0.05 K))`` clients), ``fair_angle`` (FedLF's angle between the
        accuracy vector and the all-ones vector, radians; NaN if every accuracy is 0), ``cf``
        (mFairFL's client-fairness violation ``max_k |acc_k - mean acc|``, a fraction).
    """
    acc = np.asarray(accuracy, dtype=np.float64)
    weights = np.asarray(num_test, dtype=np.float64)
    k = acc.size
    tail = max(1, math.floor(0.05 * k))
    ordered = np.sort(acc)
    norm = np.linalg.norm(acc)
    cos = acc.sum() / (norm * math.sqrt(k)) if norm > 0 else math.nan
    return {
        "mean": float(acc.mean()),
        "weighted_mean": float((acc * weights).sum() / weights.sum()) if weights.sum() > 0 else math.nan,
        "std": float(acc.std()),
        "worst5": float(ordered[:tail].mean()),
        "best5": float(ordered[-tail:].mean()),
        "fair_angle": float(math.acos(min(1.0, cos))) if not math.isnan(cos) else math.nan,
        "cf": float(np.abs(acc - acc.mean()).max()),
    }


def count_conflicts(updates: torch.Tensor, step: torch.Tensor) -> int:
    """MC (FedLF appendix, Table 4): selected clients whose update conflicts with the step.

    Args:
        updates: (m, d) client updates ``u_k``.
        step: (d,) server step ``s`` (``w_new = w - s``).

    Returns:
        The number of clients with ``u_k · s < 0``.
    """
    return int((updates @ step < 0).sum())


def count_layer_conflicts(updates: torch.Tensor, step: torch.Tensor, layers: list[slice]) -> np.ndarray:
    """LC (FedLF appendix, Table 4): per layer, the clients whose update conflicts with the step.

    Args:
        updates: (m, d) client updates; step: (d,) server step; layers: L slices of [0, d).

    Returns:
        (L,) int64: for each layer l, the number of clients with ``u_k,l · s_l < 0``.
    """
    return np.array([int((updates[:, sl] @ step[sl] < 0).sum()) for sl in layers], dtype=np.int64)
