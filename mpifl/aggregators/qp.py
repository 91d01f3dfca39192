"""Min-norm weights over a box-constrained simplex: the QP behind FedMGDA+ (and FedMDFG, FedLF).

Given the Gram matrix ``P = Q Q^T`` of m vectors (the rows of Q), find

    lambda* = argmin  lambda^T P lambda = ||lambda^T Q||^2
              s.t.    sum(lambda) = 1,   lo <= lambda <= hi        (elementwise)

(the plain simplex is ``lo = 0, hi = 1``) with cvxopt's interior-point ``solvers.qp``. Only m x m
numbers are involved; the d-dimensional work (forming P, applying lambda) stays with the caller.

Robustness, so that degenerate rounds never produce NaN:

- P is symmetrised, scaled by its largest absolute entry (the minimiser does not change, and
  cvxopt's absolute tolerances then mean the same thing whatever the updates' magnitude) and
  shifted by ``(max(0, -eig_min) + ridge) I``: a rank-deficient P (zero rows, duplicate rows,
  m > d) becomes strictly convex, so the minimiser is unique (among equally good weights, the one
  closest to uniform — up to the solver's tolerance, since the shift is ~1e-10 of P's scale).
  The vector ``lambda^T Q`` is unique in any case.
- Coordinates fixed by their bounds (``hi - lo`` below 1e-12) are eliminated, and trivial
  problems (m = 1, a feasible set that is one point, P = 0) are answered without a solver.
- cvxopt's answer is projected exactly onto the feasible set (:func:`project_box_simplex`), so
  the returned weights always satisfy the constraints to rounding, then sharpened: the bounds it
  (nearly) reaches are taken as active and the rest solved exactly from the KKT equations, kept
  only if that lowers the objective (an interior-point point sits ~1e-7 inside active bounds). If
  cvxopt stops without
  reaching its tolerances (``status == "unknown"``) the answer is polished by accelerated
  projected gradient; if it raises (or returns no finite point), projected gradient alone gives
  the answer and the status says ``"fallback"``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["QPResult", "solve_simplex_qp", "project_box_simplex"]

#: statuses of :class:`QPResult`
STATUSES = ("optimal", "unknown", "fallback", "trivial")

_FIXED = 1e-12          # hi - lo below this: the coordinate is a constant
_FEAS_TOL = 1e-9        # slack allowed in sum(lo) <= 1 <= sum(hi)
_SOLVER_OPTIONS = {"show_progress": False, "abstol": 1e-11, "reltol": 1e-10,
                   "feastol": 1e-10, "maxiters": 200}


class QPResult(NamedTuple):
    """Solution of :func:`solve_simplex_qp` (unpacks as ``lam, status, objective``).

    Attributes:
        lam: (m,) float64 weights; ``lo <= lam <= hi`` and ``sum(lam) == 1`` to rounding.
        status: ``"optimal"`` (cvxopt reached its tolerances), ``"unknown"`` (cvxopt stopped
            early; its point was polished by projected gradient), ``"fallback"`` (cvxopt raised
            or returned no finite point; projected gradient only) or ``"trivial"`` (no solver
            needed: m = 1, a single feasible point, or P = 0).
        objective: ``lam^T P lam`` for the P given (not scaled, no ridge).
    """

    lam: np.ndarray
    status: str
    objective: float


def solve_simplex_qp(P: Any, lo: Any = 0.0, hi: Any = 1.0, *, ridge: float = 1e-10) -> QPResult:
    """Minimise ``lambda^T P lambda`` over ``{sum(lambda) = 1, lo <= lambda <= hi}``.

    Args:
        P: (m, m) Gram matrix ``Q Q^T`` (any float dtype; used in float64, symmetrised). It must
            be positive semidefinite up to rounding.
        lo, hi: scalars or (m,) arrays of finite bounds, ``lo <= hi``.
        ridge: relative diagonal shift that makes the problem strictly convex (see the module
            docstring); 0 disables it (a negative eigenvalue from rounding is still shifted out).

    Returns:
        :class:`QPResult` ``(lam, status, objective)``. cvxopt prints nothing.

    Raises:
        ValueError: P not square, empty or not finite; P clearly indefinite; bounds of the wrong
            shape or not finite; infeasible bounds (``lo > hi`` somewhere, ``sum(lo) > 1`` or
            ``sum(hi) < 1``).
    """
    P = np.array(P, dtype=np.float64)
    if P.ndim != 2 or P.shape[0] != P.shape[1] or P.shape[0] == 0:
        raise ValueError(f"qp: P must be a non-empty square matrix, got shape {P.shape}")
    if not np.isfinite(P).all():
        raise ValueError("qp: P has non-finite entries")
    m = P.shape[0]
    P = 0.5 * (P + P.T)
    lo, hi = _bounds(lo, hi, m)
    if not (isinstance(ridge, (int, float)) and np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"qp: ridge must be a finite number >= 0, got {ridge!r}")

    def result(lam: np.ndarray, status: str) -> QPResult:
        return QPResult(lam, status, float(lam @ P @ lam))

    scale = float(np.abs(P).max())
    slack_lo, slack_hi = 1.0 - lo.sum(), hi.sum() - 1.0
    if m == 1 or scale == 0.0 or min(slack_lo, slack_hi) <= _FEAS_TOL:
        # one feasible point, or every feasible point optimal: the one closest to uniform
        return result(project_box_simplex(np.full(m, 1.0 / m), lo, hi), "trivial")

    H = P / scale
    eig_min = float(np.linalg.eigvalsh(H)[0])
    if eig_min < -1e-5 * m:
        raise ValueError(f"qp: P is not positive semidefinite (smallest eigenvalue "
                         f"{eig_min * scale:.3g}, largest |entry| {scale:.3g})")
    H = H + (max(0.0, -eig_min) + float(ridge)) * np.eye(m)

    fixed = (hi - lo) <= _FIXED
    free = ~fixed
    lam = np.where(fixed, lo, 0.0)
    if free.sum() <= 1:
        return result(project_box_simplex(np.full(m, 1.0 / m), lo, hi), "trivial")
    budget = 1.0 - lam[fixed].sum()
    Hff = H[np.ix_(free, free)]
    c = H[np.ix_(free, fixed)] @ lam[fixed]           # objective: x^T Hff x + 2 c^T x
    lo_f, hi_f = lo[free], hi[free]
    x, status = _cvxopt(Hff, c, lo_f, hi_f, budget)
    if x is None:
        x0 = project_box_simplex(np.full(free.sum(), budget / free.sum()), lo_f, hi_f, budget)
        x, status = _projected_gradient(Hff, c, lo_f, hi_f, budget, x0), "fallback"
    else:
        x = _polish(Hff, c, lo_f, hi_f, budget, project_box_simplex(x, lo_f, hi_f, budget))
        if status != "optimal":
            x = _projected_gradient(Hff, c, lo_f, hi_f, budget, x)
    lam[free] = x
    return result(lam, status)


def project_box_simplex(x: Any, lo: Any = 0.0, hi: Any = 1.0, total: float = 1.0) -> np.ndarray:
    """Euclidean projection of ``x`` onto ``{sum(y) = total, lo <= y <= hi}``, exactly.

    The projection is ``clip(x - tau, lo, hi)`` for the ``tau`` where the (non-increasing,
    piecewise linear) sum crosses ``total``; the breakpoints ``x - hi`` and ``x - lo`` are sorted
    once, so the cost is O(m log m). If the bounds leave no room (``sum(lo) >= total`` or
    ``sum(hi) <= total``) the nearest bound vector is returned.

    Raises:
        ValueError: bounds of the wrong shape, not finite, or ``lo > hi`` somewhere.
    """
    x = np.asarray(x, dtype=np.float64)
    lo, hi = _bounds(lo, hi, x.shape[0], check_sum=False)
    if lo.sum() >= total:
        return lo.copy()
    if hi.sum() <= total:
        return hi.copy()
    m = x.shape[0]
    bp = np.concatenate([x - hi, x - lo])
    delta = np.concatenate([np.ones(m), -np.ones(m)])     # slope change at each breakpoint
    order = np.argsort(bp, kind="stable")
    bp, delta = bp[order], delta[order]
    slope = np.cumsum(delta)                               # -d sum / d tau just after bp[j]
    f = hi.sum() - np.concatenate([[0.0], np.cumsum(slope[:-1] * np.diff(bp))])   # sum at bp[j]
    j = int(np.searchsorted(-f, -total, side="right")) - 1  # last j with f[j] >= total
    j = min(max(j, 0), 2 * m - 2)
    tau = bp[j] + (f[j] - total) / slope[j] if slope[j] > 0 else bp[j]
    return np.clip(x - tau, lo, hi)


# ----------------------------------------------------------------------------------------------


def _bounds(lo: Any, hi: Any, m: int, check_sum: bool = True) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for name, v in (("lo", lo), ("hi", hi)):
        a = np.asarray(v, dtype=np.float64)
        if a.ndim == 0:
            a = np.full(m, float(a))
        if a.shape != (m,):
            raise ValueError(f"qp: {name} must be a scalar or have shape ({m},), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"qp: {name} must be finite")
        out.append(a)
    lo, hi = out
    if (lo > hi).any():
        k = int(np.argmax(lo > hi))
        raise ValueError(f"qp: infeasible bounds, lo[{k}] = {lo[k]:g} > hi[{k}] = {hi[k]:g}")
    if check_sum and (lo.sum() > 1.0 + _FEAS_TOL or hi.sum() < 1.0 - _FEAS_TOL):
        raise ValueError(f"qp: infeasible bounds, need sum(lo) <= 1 <= sum(hi), got "
                         f"sum(lo) = {lo.sum():.12g}, sum(hi) = {hi.sum():.12g}")
    return lo, hi


def _cvxopt(H: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray,
            budget: float) -> tuple[np.ndarray | None, str]:
    """cvxopt on ``min x^T H x + 2 c^T x`` (passed as ``1/2 x^T (2H) x + (2c)^T x``); returns
    ``(x, status)``, x None when cvxopt raised or gave no finite point."""
    from cvxopt import matrix, solvers

    n = H.shape[0]
    eye = np.eye(n)
    try:
        sol = solvers.qp(matrix(2.0 * H), matrix(2.0 * c.reshape(n, 1)),
                         matrix(np.vstack([-eye, eye])), matrix(np.concatenate([-lo, hi])),
                         matrix(np.ones((1, n))), matrix(np.array([[budget]])),
                         options=dict(_SOLVER_OPTIONS))
    except (ValueError, ArithmeticError, TypeError):
        return None, "fallback"
    if sol.get("x") is None:
        return None, "fallback"
    x = np.array(sol["x"], dtype=np.float64).ravel()
    if x.shape != (n,) or not np.isfinite(x).all():
        return None, "fallback"
    return x, "optimal" if sol["status"] == "optimal" else "unknown"


def _objective(H: np.ndarray, c: np.ndarray, x: np.ndarray) -> float:
    return float(x @ H @ x + 2.0 * c @ x)


def _polish(H: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray, budget: float,
            x: np.ndarray) -> np.ndarray:
    """Sharpen an interior-point answer: guess the active bounds from ``x`` (a few thresholds),
    solve the equality-constrained problem on the other coordinates exactly (KKT system), project,
    and keep whichever feasible point has the lowest objective. It never makes ``x`` worse."""
    best, fbest = x, _objective(H, c, x)
    for thr in (1e-5, 1e-7, 1e-9):
        at_lo = x - lo <= thr
        at_hi = (hi - x <= thr) & ~at_lo
        bound = at_lo | at_hi
        free = ~bound
        k = int(free.sum())
        y = np.where(at_lo, lo, hi)
        if k > 0:
            kkt = np.zeros((k + 1, k + 1))
            kkt[:k, :k] = 2.0 * H[np.ix_(free, free)]
            kkt[:k, k] = kkt[k, :k] = 1.0
            rhs = np.concatenate([-2.0 * (c[free] + H[np.ix_(free, bound)] @ y[bound]),
                                  [budget - y[bound].sum()]])
            try:
                sol = np.linalg.solve(kkt, rhs)
            except np.linalg.LinAlgError:
                continue
            if not np.isfinite(sol).all():
                continue
            y[free] = sol[:k]
        y = project_box_simplex(y, lo, hi, budget)
        fy = _objective(H, c, y)
        if fy < fbest:
            best, fbest = y, fy
    return best


def _projected_gradient(H: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                        budget: float, x0: np.ndarray, iters: int = 20000) -> np.ndarray:
    """Accelerated projected gradient (FISTA with adaptive restart) on ``x^T H x + 2 c^T x``
    from the feasible ``x0``; returns the best iterate seen."""
    L = 2.0 * float(np.linalg.eigvalsh(H)[-1])
    if L <= 0:
        return x0

    def f(z: np.ndarray) -> float:
        return _objective(H, c, z)

    x, y, t = x0.copy(), x0.copy(), 1.0
    best, fbest = x0.copy(), f(x0)
    for _ in range(iters):
        x_new = project_box_simplex(y - (2.0 * (H @ y + c)) / L, lo, hi, budget)
        fx = f(x_new)
        if fx < fbest:
            best, fbest = x_new, fx
        if np.abs(x_new - x).max() <= 1e-15:
            break
        t_new = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * t * t))
        if (y - x_new) @ (x_new - x) > 0:            # restart when momentum points uphill
            t_new, y = 1.0, x_new.copy()
        else:
            y = x_new + ((t - 1.0) / t_new) * (x_new - x)
        x, t = x_new, t_new
    return best
