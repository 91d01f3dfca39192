"""The simplex/box QP helper (mpifl.aggregators.qp): closed forms, an exact brute-force oracle,
degenerate inputs, and status reporting."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpifl.aggregators import qp
from mpifl.aggregators.qp import project_box_simplex, solve_simplex_qp


# ---- independent oracles (written plainly, sharing nothing with qp.py) ------------------------

def brute_force(P, lo, hi):
    """Exact minimiser of lam^T P lam on {sum = 1, lo <= lam <= hi} for small m: try every
    assignment of each coordinate to its lower bound, its upper bound or free, solve the
    equality-constrained problem on the free ones from the KKT equations, keep the best
    feasible point. 3^m small linear solves."""
    m = len(lo)
    best, fbest = None, np.inf
    for assign in itertools.product((0, 1, 2), repeat=m):      # 0: at lo, 1: at hi, 2: free
        a = np.array(assign)
        lam = np.where(a == 0, lo, hi).astype(float)
        free = a == 2
        k = free.sum()
        if k:
            kkt = np.zeros((k + 1, k + 1))
            kkt[:k, :k] = 2 * P[np.ix_(free, free)]
            kkt[:k, k] = kkt[k, :k] = 1
            rhs = np.append(-2 * P[np.ix_(free, ~free)] @ lam[~free], 1 - lam[~free].sum())
            try:
                sol = np.linalg.solve(kkt, rhs)
            except np.linalg.LinAlgError:
                continue
            lam[free] = sol[:k]
        if abs(lam.sum() - 1) > 1e-9 or (lam < lo - 1e-12).any() or (lam > hi + 1e-12).any():
            continue
        f = lam @ P @ lam
        if f < fbest:
            best, fbest = lam, f
    return best, fbest


def segment_min_norm(a, b):
    """Closed form for two rows: the point of the segment [a, b] closest to the origin is
    t a + (1 - t) b with t = clip((b - a) . b / ||a - b||^2, 0, 1)."""
    diff = a - b
    t = np.clip(-(diff @ b) / (diff @ diff), 0.0, 1.0)
    return np.array([t, 1 - t])


def bisection_projection(x, lo, hi, total=1.0):
    """Projection onto {sum = total, lo <= y <= hi} by bisection on the shift."""
    a, b = (x - hi).min() - 1, (x - lo).max() + 1
    for _ in range(200):
        mid = 0.5 * (a + b)
        if np.clip(x - mid, lo, hi).sum() > total:
            a = mid
        else:
            b = mid
    return np.clip(x - 0.5 * (a + b), lo, hi)


def check_feasible(lam, lo, hi):
    assert np.isfinite(lam).all()
    assert lam.sum() == pytest.approx(1.0, abs=1e-12)
    assert (lam >= np.asarray(lo) - 1e-12).all() and (lam <= np.asarray(hi) + 1e-12).all()


# ---- closed forms and the brute-force oracle ------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_two_rows_is_the_segment_min_norm_point(seed):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((2, 5))
    if seed % 2:
        Q[1] = -0.3 * Q[0] + 0.1 * rng.standard_normal(5)     # an interior optimum
    lam, status, obj = solve_simplex_qp(Q @ Q.T)
    want = segment_min_norm(Q[0], Q[1])
    assert status == "optimal"
    np.testing.assert_allclose(lam, want, atol=1e-8)
    assert obj == pytest.approx(np.sum((want @ Q) ** 2), rel=1e-9, abs=1e-14)


def test_two_rows_by_hand():
    """a = (1, 0), b = (0, 1): t = 1/2, the midpoint (1/2, 1/2) with ||.||^2 = 1/2.
    With 0.7 <= lam_1 <= 1 the optimum moves to the bound: (0.7, 0.3), 0.49 + 0.09 = 0.58."""
    P = np.eye(2)
    lam, _, obj = solve_simplex_qp(P)
    np.testing.assert_allclose(lam, [0.5, 0.5], atol=1e-9)
    assert obj == pytest.approx(0.5, abs=1e-9)
    lam, _, obj = solve_simplex_qp(P, lo=[0.7, 0.0], hi=[1.0, 1.0])
    np.testing.assert_allclose(lam, [0.7, 0.3], atol=1e-9)
    assert obj == pytest.approx(0.58, abs=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    m = int(rng.integers(3, 7))
    d = int(rng.integers(m, 12))                   # full rank: a unique minimiser
    Q = rng.standard_normal((m, d)) + (0.8 if seed % 3 else 0.0) * rng.standard_normal(d)
    if seed % 2:                                   # FedMGDA+-style box around a centre
        lam0 = rng.dirichlet(np.ones(m))
        eps = rng.choice([0.02, 0.1, 0.3])
        lo, hi = np.maximum(0, lam0 - eps), np.minimum(1, lam0 + eps)
    else:
        lo, hi = np.zeros(m), np.ones(m)
    P = Q @ Q.T
    lam, status, obj = solve_simplex_qp(P, lo, hi)
    want, fwant = brute_force(P, lo, hi)
    assert status == "optimal"
    check_feasible(lam, lo, hi)
    assert obj == pytest.approx(fwant, rel=1e-9, abs=1e-13)
    np.testing.assert_allclose(lam, want, atol=1e-7)


def test_kkt_conditions_on_a_larger_case():
    """m = 40 (no brute force): the gradient 2 P lam equals a common nu on free coordinates,
    is >= nu at lower bounds and <= nu at upper bounds."""
    rng = np.random.default_rng(7)
    Q = rng.standard_normal((40, 60)) + 0.5 * rng.standard_normal(60)
    lam0 = rng.dirichlet(np.ones(40))
    lo, hi = np.maximum(0, lam0 - 0.03), np.minimum(1, lam0 + 0.03)
    P = Q @ Q.T
    lam, status, _ = solve_simplex_qp(P, lo, hi)
    assert status == "optimal"
    check_feasible(lam, lo, hi)
    g = 2 * P @ lam
    at_lo, at_hi = lam - lo < 1e-9, hi - lam < 1e-9
    free = ~(at_lo | at_hi)
    assert free.sum() >= 1 and at_lo.any() and at_hi.any()
    nu = g[free].mean()
    scale = np.abs(g).max()
    assert np.abs(g[free] - nu).max() < 1e-6 * scale
    assert (g[at_lo] >= nu - 1e-6 * scale).all() and (g[at_hi] <= nu + 1e-6 * scale).all()


@pytest.mark.parametrize("scale", [1e-30, 1e-8, 1.0, 1e12, 1e30])
def test_scale_invariant(scale):
    rng = np.random.default_rng(3)
    Q = rng.standard_normal((5, 8))
    ref, _, _ = solve_simplex_qp(Q @ Q.T)
    lam, status, obj = solve_simplex_qp(scale * (Q @ Q.T))
    assert status == "optimal"
    np.testing.assert_allclose(lam, ref, atol=1e-8)
    assert obj == pytest.approx(scale * (ref @ Q @ Q.T @ ref), rel=1e-7)


# ---- degenerate inputs ----------------------------------------------------------------------

def test_zero_row_takes_all_the_weight():
    rng = np.random.default_rng(4)
    Q = np.vstack([rng.standard_normal((3, 4)), np.zeros(4)])
    lam, status, obj = solve_simplex_qp(Q @ Q.T)
    assert status == "optimal"
    np.testing.assert_allclose(lam, [0, 0, 0, 1], atol=1e-8)
    assert abs(obj) < 1e-15


def test_all_zero_is_trivial_and_uniform():
    lam, status, obj = solve_simplex_qp(np.zeros((4, 4)))
    assert status == "trivial" and obj == 0.0
    np.testing.assert_allclose(lam, 0.25)
    lam, status, _ = solve_simplex_qp(np.zeros((3, 3)), lo=[0.5, 0, 0], hi=1.0)
    np.testing.assert_allclose(lam, [0.5, 0.25, 0.25])       # closest feasible point to uniform


@pytest.mark.parametrize("shift", [0.0, 3.0])
def test_duplicate_rows(shift):
    """Rows 0 and 4 are equal: the minimiser in lam is not unique (any split of the duplicate's
    weight between them is optimal), but the combination lam^T Q is, and so are the other weights
    and the duplicates' sum; the answer is finite, feasible and optimal. How the solver splits
    the duplicate's weight is left to it (it differs between CPUs), so it is not asserted."""
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((4, 6)) + shift
    Q = np.vstack([Q, Q[0]])
    P = Q @ Q.T
    lam, status, obj = solve_simplex_qp(P)
    assert status == "optimal"
    check_feasible(lam, 0, 1)
    # the oracle on the de-duplicated problem
    want, fwant = brute_force(P[:4, :4], np.zeros(4), np.ones(4))
    assert obj == pytest.approx(fwant, rel=1e-9, abs=1e-13)
    np.testing.assert_allclose(lam @ Q, want @ Q[:4], atol=1e-6)
    merged = np.r_[lam[0] + lam[4], lam[1:4]]    # the de-duplicated problem's weights
    np.testing.assert_allclose(merged, want, atol=1e-6)


def test_rank_deficient_more_rows_than_dimensions():
    """m = 12 vectors in 3-D whose hull holds the origin: the minimum is 0 (lam^T Q = 0)."""
    rng = np.random.default_rng(6)
    Q = rng.standard_normal((12, 3))
    lam, status, obj = solve_simplex_qp(Q @ Q.T)
    assert status == "optimal"
    check_feasible(lam, 0, 1)
    assert np.linalg.norm(lam @ Q) < 1e-7
    assert abs(obj) < 1e-13


def test_single_row_and_single_point_sets_are_trivial():
    assert solve_simplex_qp([[2.0]]) == (pytest.approx(np.array([1.0])), "trivial", 2.0)
    P = np.diag([1.0, 2.0, 3.0])
    lam, status, _ = solve_simplex_qp(P, lo=[0.2, 0.3, 0.5], hi=1.0)      # sum(lo) = 1
    assert status == "trivial"
    np.testing.assert_allclose(lam, [0.2, 0.3, 0.5])


def test_fixed_coordinates_are_eliminated():
    """lo == hi for one coordinate: it is a constant, the rest is optimised around it."""
    rng = np.random.default_rng(8)
    Q = rng.standard_normal((4, 6))
    P = Q @ Q.T
    lo, hi = np.array([0.0, 0.25, 0.0, 0.0]), np.array([1.0, 0.25, 1.0, 1.0])
    lam, status, obj = solve_simplex_qp(P, lo, hi)
    want, fwant = brute_force(P, lo, hi)
    assert status == "optimal" and lam[1] == 0.25
    assert obj == pytest.approx(fwant, rel=1e-9)
    np.testing.assert_allclose(lam, want, atol=1e-7)


def test_slightly_indefinite_as_from_rounding_is_accepted():
    """A rank-2 Gram matrix of 6 rows minus 1e-8 of its scale on the diagonal (what float32
    rounding can do to zero eigenvalues): shifted back, solved, no NaN."""
    rng = np.random.default_rng(9)
    Q = rng.standard_normal((6, 2))
    P = Q @ Q.T - 1e-8 * np.abs(Q @ Q.T).max() * np.eye(6)
    assert np.linalg.eigvalsh(P)[0] < 0
    lam, status, obj = solve_simplex_qp(P)
    assert status == "optimal"
    check_feasible(lam, 0, 1)
    assert np.linalg.norm(lam @ Q) < 1e-4


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(lo=0.5), "infeasible.*sum"),                                # sum(lo) = 1.5
    (dict(hi=0.2), "infeasible.*sum"),                                # sum(hi) = 0.6
    (dict(lo=[0, 0.6, 0], hi=[1, 0.5, 1]), r"lo\[1\]"),
    (dict(lo=[0, 0]), "shape"),
    (dict(hi=np.inf), "finite"),
])
def test_bad_bounds(kw, match):
    with pytest.raises(ValueError, match=match):
        solve_simplex_qp(np.eye(3), **kw)


@pytest.mark.parametrize("P,match", [
    (np.zeros((2, 3)), "square"), (np.zeros((0, 0)), "square"),
    (np.array([[1.0, np.nan], [np.nan, 1.0]]), "non-finite"),
    (np.array([[1.0, 0.0], [0.0, -1.0]]), "semidefinite"),
])
def test_bad_matrix(P, match):
    with pytest.raises(ValueError, match=match):
        solve_simplex_qp(P)


# ---- status reporting and output ------------------------------------------------------------

def test_solver_prints_nothing(capfd):
    rng = np.random.default_rng(10)
    Q = rng.standard_normal((6, 9))
    solve_simplex_qp(Q @ Q.T)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_cvxopt_failure_falls_back(monkeypatch):
    from cvxopt import solvers

    def boom(*a, **k):
        raise ValueError("Rank(A) < p or Rank([P; A; G]) < n")

    rng = np.random.default_rng(11)
    Q = rng.standard_normal((5, 7))
    P = Q @ Q.T
    lo, hi = np.zeros(5), np.full(5, 0.5)
    want, fwant = brute_force(P, lo, hi)
    monkeypatch.setattr(solvers, "qp", boom)
    lam, status, obj = solve_simplex_qp(P, lo, hi)
    assert status == "fallback"
    check_feasible(lam, lo, hi)
    assert obj == pytest.approx(fwant, rel=1e-8)


def test_unknown_status_is_reported_and_polished(monkeypatch):
    """cvxopt stopping early (status 'unknown', a rough point) is reported as such; the answer is
    still feasible and optimal after the polish."""
    from cvxopt import solvers

    real = solvers.qp

    def early(*a, **k):
        sol = real(*a, **{**k, "options": {**k["options"], "maxiters": 1}})
        assert sol["status"] == "unknown"
        return sol

    rng = np.random.default_rng(12)
    Q = rng.standard_normal((5, 7))
    P = Q @ Q.T
    want, fwant = brute_force(P, np.zeros(5), np.ones(5))
    monkeypatch.setattr(solvers, "qp", early)
    lam, status, obj = solve_simplex_qp(P)
    assert status == "unknown"
    check_feasible(lam, 0, 1)
    assert obj == pytest.approx(fwant, rel=1e-8)


def test_nan_from_cvxopt_falls_back(monkeypatch):
    from cvxopt import matrix, solvers

    monkeypatch.setattr(solvers, "qp", lambda *a, **k: {"status": "optimal",
                                                        "x": matrix([np.nan] * 3)})
    lam, status, _ = solve_simplex_qp(np.diag([1.0, 2.0, 4.0]))
    assert status == "fallback"
    # 1-D closed form: lam_k proportional to 1 / P_kk -> (4, 2, 1) / 7
    np.testing.assert_allclose(lam, np.array([4, 2, 1]) / 7, atol=1e-9)


def test_statuses_are_documented():
    assert set(qp.STATUSES) == {"optimal", "unknown", "fallback", "trivial"}


# ---- the projection -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(10))
def test_projection_matches_bisection(seed):
    rng = np.random.default_rng(200 + seed)
    m = int(rng.integers(1, 30))
    x = 2 * rng.standard_normal(m)
    if seed % 2:
        lo = rng.random(m) * 0.5 / m
        hi = lo + rng.random(m) * 3 / m + 1e-3
        total = float(np.clip(1.0, lo.sum() + 1e-6, hi.sum() - 1e-6))
    else:
        lo, hi, total = np.zeros(m), np.ones(m), 1.0
    y = project_box_simplex(x, lo, hi, total)
    np.testing.assert_allclose(y, bisection_projection(x, lo, hi, total), atol=1e-12)
    assert y.sum() == pytest.approx(total, abs=1e-12)


def test_projection_by_hand():
    # x = (0.5, 0.9): shift by 0.2 -> (0.3, 0.7); x = (1.5, 3.5): the first coordinate clips
    np.testing.assert_allclose(project_box_simplex([0.5, 0.9]), [0.3, 0.7], atol=1e-15)
    np.testing.assert_allclose(project_box_simplex([1.5, 3.5]), [0.0, 1.0], atol=1e-15)
    # box [0.4, 0.6]^2: (0, 1) -> (0.4, 0.6)
    np.testing.assert_allclose(project_box_simplex([0.0, 1.0], 0.4, 0.6), [0.4, 0.6],
                               atol=1e-15)
