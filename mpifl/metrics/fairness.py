"""Group and client fairness metrics (ALGORITHMS.md §4, §10), after Su et al., "Multi-dimensional
Fair Federated Learning" (mFairFL), AAAI 2024, Eq. 2-6.

Every group notion is the largest gap between a group and the whole population,
``violation = max_a |M_a - M|``:

- **DP** (demographic parity): ``M_a = P(ŷ=1 | A=a)``, ``M = P(ŷ=1)``.
- **EO** (equalized odds): ``M_{a,y} = P(ŷ=1 | A=a, Y=y)``, ``M_y = P(ŷ=1 | Y=y)``, for y in {0, 1};
  the violation is the largest gap over groups a and labels y.
- **AP** (accuracy parity): ``M_a`` = error rate on group a, ``M`` = overall error rate.
- **CF** (client fairness): ``max_k |acc_k - mean_j acc_j|`` over the clients' accuracies.

The hard metrics take numpy arrays of 0/1 predictions, 0/1 labels and int group ids and return
Python floats (fractions in [0, 1]). A cell (group, or group and label) without samples has no
rate: it is left out of the maximum (a gap of 0); a violation of data where no cell can be
compared is 0.

The differentiable surrogates (torch) replace the hard prediction ``ŷ`` by the predicted
probability ``p = P(ŷ=1)`` (DP, EO) and the error by a per-sample loss (AP), and give the gaps
``|M_a - M|`` per constraint, from which mFairFL's local constraints are
``c_a(θ) = |M_a - M| - eps <= 0`` (:func:`constraint_values`). With probabilities exactly 0/1
(and the 0/1 loss for AP) they equal the hard metrics. They are built from elementwise ops and
matrix products only (no ``bincount``/``index_add``), so they run under ``torch.func.vmap``, and
take optional per-sample weights (0 for padding).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

__all__ = ["NOTIONS", "dp_violation", "eo_violation", "ap_violation", "group_violations",
           "cf_violation", "positive_probability", "group_gaps", "constraint_values",
           "num_constraints"]

NOTIONS = ("dp", "eo", "ap")


# --------------------------------------------------------------------------- hard metrics

def dp_violation(pred: npt.ArrayLike, groups: npt.ArrayLike) -> float:
    """Demographic-parity violation ``max_a |P(ŷ=1|A=a) - P(ŷ=1)|``.

    Args:
        pred: (n,) 0/1 (or bool) predictions, n >= 1.
        groups: (n,) int group ids >= 0.
    Raises:
        ValueError: shapes differ, n = 0, predictions not 0/1, negative group ids.
    """
    p, g = _check(pred, groups)
    return _max_gap(p, g)


def eo_violation(pred: npt.ArrayLike, labels: npt.ArrayLike, groups: npt.ArrayLike) -> float:
    """Equalized-odds violation ``max_{a,y} |P(ŷ=1|A=a,Y=y) - P(ŷ=1|Y=y)|``, y in {0, 1}.

    Args: as :func:`dp_violation`, plus labels (n,) 0/1.
    """
    p, g = _check(pred, groups)
    y = _check_labels(labels, p)
    return max((_max_gap(p[y == v], g[y == v]) for v in (0, 1) if (y == v).any()),
               default=0.0)


def ap_violation(pred: npt.ArrayLike, labels: npt.ArrayLike, groups: npt.ArrayLike) -> float:
    """Accuracy-parity violation ``max_a |err_a - err|`` (error rates ``P(ŷ != y)``).

    Args: as :func:`eo_violation`.
    """
    p, g = _check(pred, groups)
    y = _check_labels(labels, p)
    return _max_gap((p != y).astype(np.float64), g)


def group_violations(pred: npt.ArrayLike, labels: npt.ArrayLike,
                     groups: npt.ArrayLike) -> dict[str, float]:
    """``{"dp": ..., "eo": ..., "ap": ...}`` of one set of predictions (e.g. the union of the
    clients' test data, ALGORITHMS.md §10)."""
    return {"dp": dp_violation(pred, groups), "eo": eo_violation(pred, labels, groups),
            "ap": ap_violation(pred, labels, groups)}


#: Per (group, label) cell, the counts that :func:`violations_from_counts` needs.
COUNT_FIELDS = ("samples", "predicted_positive", "errors")


def violations_from_counts(counts: npt.ArrayLike) -> dict[str, float]:
    """DP, EO and AP violations from summed counts (same definitions as the functions above).

    Counting per client and summing lets workers evaluate their clients independently while the
    server gets the violations on the union of all clients' test data, with no predictions moved.

    Args:
        counts: (G, 2, 3) array: for sensitive group a and true label y, the number of samples,
            of predicted positives (ŷ = 1) and of errors (ŷ != y).

    Returns:
        ``{"dp", "eo", "ap"}`` violations (NaN where no group has samples).
    """
    c = np.asarray(counts, dtype=np.float64)
    n, pos, err = c[..., 0], c[..., 1], c[..., 2]
    n_a = n.sum(axis=1)
    present = n_a > 0
    if not present.any():
        return {"dp": float("nan"), "eo": float("nan"), "ap": float("nan")}
    dp = np.abs(pos.sum(axis=1)[present] / n_a[present] - pos.sum() / n.sum()).max()
    ap = np.abs(err.sum(axis=1)[present] / n_a[present] - err.sum() / n.sum()).max()
    gaps = [abs(pos[a, y] / n[a, y] - pos[:, y].sum() / n[:, y].sum())
            for a in range(c.shape[0]) for y in (0, 1) if n[a, y] > 0]
    return {"dp": float(dp), "eo": float(max(gaps)), "ap": float(ap)}


def cf_violation(acc: npt.ArrayLike) -> float:
    """Client-fairness violation ``max_k |acc_k - mean_j acc_j|`` (ALGORITHMS.md §4).

    Args:
        acc: (K,) accuracies, K >= 1, finite.
    Raises:
        ValueError: empty or non-finite input.
    """
    a = np.asarray(acc, dtype=np.float64).reshape(-1)
    if a.size == 0 or not np.isfinite(a).all():
        raise ValueError("cf_violation needs at least one finite accuracy")
    return float(np.abs(a - a.mean()).max())


def _check(pred: npt.ArrayLike, groups: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(pred).reshape(-1)
    g = np.asarray(groups).reshape(-1)
    if p.size == 0 or p.shape != g.shape:
        raise ValueError(f"pred {p.shape} and groups {g.shape} must be the same non-empty shape")
    if g.dtype.kind not in "iu" or (g < 0).any():
        raise ValueError("groups must be integer ids >= 0")
    return _binary(p, "pred"), g.astype(np.int64)


def _check_labels(labels: npt.ArrayLike, p: np.ndarray) -> np.ndarray:
    y = _binary(np.asarray(labels).reshape(-1), "labels")
    if y.shape != p.shape:
        raise ValueError(f"labels {y.shape} must match pred {p.shape}")
    return y


def _binary(a: np.ndarray, what: str) -> np.ndarray:
    if not np.isin(a, (0, 1)).all():
        raise ValueError(f"{what} must be 0/1")
    return a.astype(np.float64)


def _max_gap(values: np.ndarray, groups: np.ndarray) -> float:
    """``max_a |mean(values[groups==a]) - mean(values)|`` over the groups present."""
    if values.size == 0:
        return 0.0
    overall = values.mean()
    return float(max(abs(values[groups == a].mean() - overall) for a in np.unique(groups)))


# --------------------------------------------------------------------------- surrogates

def positive_probability(logits: Tensor) -> Tensor:
    """``P(ŷ=1)`` from a model output: (n, 2) logits -> ``softmax[:, 1]``; (n,) -> sigmoid."""
    if logits.ndim == 2 and logits.shape[1] == 2:
        return torch.softmax(logits, dim=1)[:, 1]
    if logits.ndim == 1:
        return torch.sigmoid(logits)
    raise ValueError(f"expected (n, 2) or (n,) logits, got shape {tuple(logits.shape)}")


def num_constraints(notion: str, num_groups: int) -> int:
    """Constraints (multipliers) of a notion: G for DP and AP, 2G for EO (one per (a, y))."""
    _notion(notion)
    return num_groups * (2 if notion == "eo" else 1)


def group_gaps(notion: str, prob: Tensor, labels: Tensor, groups: Tensor, num_groups: int,
               *, losses: Tensor | None = None, weight: Tensor | None = None) -> Tensor:
    """Differentiable gaps ``|M_a - M|`` of one notion (ALGORITHMS.md §4 surrogates).

    Args:
        notion: ``"dp"``, ``"eo"`` or ``"ap"``.
        prob: (n,) floating ``P(ŷ=1)`` (e.g. :func:`positive_probability`); DP and EO use it.
        labels: (n,) 0/1 integer labels (EO; also checked for shape otherwise).
        groups: (n,) integer group ids in ``0 .. num_groups-1``.
        num_groups: G.
        losses: (n,) per-sample losses (AP's surrogate is the mean loss), required for AP.
        weight: optional (n,) non-negative sample weights (0 = ignore, e.g. padding).
    Returns:
        (G,) gaps for DP and AP, (2G,) for EO ordered ``(a0,y0), (a0,y1), (a1,y0), ...``, in
        the dtype of ``prob`` (``losses`` for AP). A cell without (weighted) samples has gap 0.
    Raises:
        ValueError: unknown notion, AP without losses, shapes that differ.
    """
    _notion(notion)
    values = prob if notion != "ap" else losses
    if values is None:
        raise ValueError("group_gaps: notion 'ap' needs the per-sample losses")
    if values.shape != groups.shape or labels.shape != groups.shape:
        raise ValueError(f"group_gaps: values {tuple(values.shape)}, labels "
                         f"{tuple(labels.shape)}, groups {tuple(groups.shape)} must match")
    w = torch.ones_like(values) if weight is None else weight.to(values.dtype)
    member = _onehot(groups, num_groups, values.dtype)              # (n, G)
    if notion != "eo":
        return _gaps(values, w[:, None] * member, w)
    out = []
    for v in (0, 1):
        wy = w * (labels == v).to(values.dtype)
        out.append(_gaps(values, wy[:, None] * member, wy))
    return torch.stack(out, dim=1).reshape(-1)                      # a-major


def constraint_values(notion: str, prob: Tensor, labels: Tensor, groups: Tensor,
                      num_groups: int, eps: float, *, losses: Tensor | None = None,
                      weight: Tensor | None = None) -> Tensor:
    """mFairFL's local constraints ``c = |M_a - M| - eps`` (<= 0 when satisfied), shaped as
    :func:`group_gaps`; the Lagrangian adds ``sum(lam * c)``."""
    return group_gaps(notion, prob, labels, groups, num_groups, losses=losses,
                      weight=weight) - eps


def _notion(notion: str) -> None:
    if notion not in NOTIONS:
        raise ValueError(f"unknown fairness notion {notion!r} (known: {', '.join(NOTIONS)})")


def _onehot(groups: Tensor, num_groups: int, dtype: torch.dtype) -> Tensor:
    """(n, G) membership matrix by comparison (vmap-friendly, unlike ``F.one_hot``)."""
    return (groups[:, None] == torch.arange(num_groups, device=groups.device)).to(dtype)


def _gaps(values: Tensor, member: Tensor, w: Tensor) -> Tensor:
    """``|M_a - M|`` per column of the weighted membership ``member`` (n, G); weights ``w``."""
    counts = member.sum(dim=0)                                      # (G,)
    total = w.sum()
    overall = (w * values).sum() / total.clamp_min(torch.finfo(values.dtype).tiny)
    means = (values @ member) / counts.clamp_min(torch.finfo(values.dtype).tiny)
    return torch.where(counts > 0, (means - overall).abs(), torch.zeros_like(means))
