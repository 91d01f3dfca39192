"""FedMDFG (docs/ALGORITHMS.md §7): the step against an independent direct float64 implementation
(explicit d-space rows, a direct cvxopt solve on Q Q^T, the line search on toy quadratic client
losses) over several rounds with partial participation; a hand-checked 2-client case in 2-D; the
line search's guarantee and its fallbacks; when the fair guidance fires; degenerate rounds; the
number of loss_at calls; state round trips through HDF5 with identical continuation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, create
from mpifl.aggregators.fedmdfg import candidate_rates, guidance_weights, loss_angle
from tests.helpers import h5_round_trip

LR = 0.1


# ----------------------------------------------------------------------------- toy problem

class Quadratics:
    """K clients with losses ``l_k(w) = 0.5 (w - c_k)^T A_k (w - c_k) + b_k`` (float64)."""

    def __init__(self, rng, K, d, curvature=1.0):
        B = rng.standard_normal((K, d, d)) / math.sqrt(d)
        self.A = curvature * (B @ B.transpose(0, 2, 1) + 0.1 * np.eye(d))
        self.c = rng.standard_normal((K, d))
        self.b = rng.uniform(0.0, 2.0, K)

    def loss(self, k, w):
        z = w - self.c[k]
        return 0.5 * z @ self.A[k] @ z + self.b[k]

    def grad(self, k, w):
        return self.A[k] @ (w - self.c[k])

    def losses(self, ids, w):
        """float32, as the server reports them."""
        return np.array([self.loss(k, w) for k in ids], dtype=np.float32)


def make_round(t, ids, U, losses, lr=LR, loss_at=None, dtype=torch.float64):
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=torch.as_tensor(
        np.asarray(U, dtype=np.float64), dtype=dtype), losses=losses,
        num_samples=np.full(len(ids), 10), lr=lr, loss_at=loss_at)


def probe(problem, ids, w, calls):
    """The server's evaluation-only request: the clients' losses at ``w - step`` (float32)."""
    def loss_at(step):
        calls.append(step.detach().double().cpu().numpy().copy())
        return torch.as_tensor(problem.losses(ids, w - calls[-1]))
    return loss_at


# ----------------------------------------------------------------------------- direct oracle

def cvxopt_simplex(P):
    """argmin lam^T P lam over the simplex: cvxopt directly, P scaled to max |entry| 1."""
    from cvxopt import matrix, solvers

    n = P.shape[0]
    if n == 1:
        return np.ones(1)
    H = P / np.abs(P).max()
    sol = solvers.qp(matrix(2.0 * (H + H.T) / 2), matrix(np.zeros((n, 1))),
                     matrix(-np.eye(n)), matrix(np.zeros((n, 1))),
                     matrix(np.ones((1, n))), matrix(np.ones((1, 1))),
                     options={"show_progress": False, "abstol": 1e-13, "reltol": 1e-13,
                              "feastol": 1e-13, "maxiters": 500})
    return np.array(sol["x"]).ravel()


class DirectFedMDFG:
    """docs/ALGORITHMS.md §7 (FedMDFG, Pan et al. 2023) / the reference code's round, written out in
    d-space (float64), without the Gram form: explicit rescaled gradients, fair row and history
    rows, Q Q^T, cvxopt."""

    def __init__(self, theta=11.25, s=5):
        self.theta, self.s = theta, s
        self.expected, self.joins = {}, {}
        self.last_ids, self.last_rows = [], np.zeros((0, 0))

    def step(self, ids, U, losses, lr, loss_fn):
        """``loss_fn(step) -> (m,) float32 losses at w - step``; returns (step, info)."""
        m, D = U.shape
        losses = np.asarray(losses, dtype=np.float32).astype(np.float64)
        rose = 0
        for k, l in zip(ids, losses):
            k = int(k)
            if self.joins.get(k, 0) == 0:
                self.expected[k] = l
            elif l <= self.expected[k]:
                self.expected[k] = (self.expected[k] * self.joins[k] + l) / (self.joins[k] + 1)
            else:
                rose += 1
            self.joins[k] = self.joins.get(k, 0) + 1
        hist = [j for j, k in enumerate(self.last_ids) if k not in set(ids.tolist())]
        g = U / lr
        norms = np.linalg.norm(g, axis=1)
        live = np.flatnonzero(norms > 1e-6)
        info = dict(calls=0, guidance=False, history=len(hist), search="skipped")
        if len(live) == 0:
            return np.zeros(D), info
        n = len(live)
        mu = norms[live].mean()
        Ghat = g[live] * (mu / norms[live])[:, None]
        L = losses[live]
        Lhat = L / np.linalg.norm(L)
        e = np.ones(n) / np.sqrt(n)
        angle = np.degrees(np.arccos(np.clip(e @ Lhat, -1, 1)))
        rows = [Ghat]
        if angle > self.theta or 0 < rose < m:
            b = (e @ Lhat) * Lhat - e
            if n > 1 and np.linalg.norm(b) > 1e-12:
                rows.append(((b / np.linalg.norm(b)) @ Ghat)[None])
                info["guidance"] = True
        if hist:
            rows.append(self.last_rows[hist])
        Q = np.vstack(rows)
        lam = cvxopt_simplex(Q @ Q.T)
        d0 = lam @ Q
        self.last_ids, self.last_rows = [int(ids[k]) for k in live], Ghat
        if np.linalg.norm(d0) <= 1e-8 * mu:
            return np.zeros(D), info
        d = d0 * np.linalg.norm(Ghat.mean(axis=0)) / np.linalg.norm(d0)
        if np.any(Q @ d < -1e-6 * np.linalg.norm(Q, axis=1) * np.linalg.norm(d)):
            d = d0
        c = Ghat @ d
        top = self.s if not hist else 0
        rates = [lr * 2.0 ** (top - j) for j in range(top + self.s + 1)]
        sums = []
        for rate in rates:
            new = np.asarray(loss_fn(rate * d), dtype=np.float64)[live]
            info["calls"] += 1
            sums.append(new.sum() if np.isfinite(new.sum()) else np.inf)
            if np.all(new <= L - 1e-4 * rate * np.maximum(c, 0)):
                info["search"] = "armijo"
                return rate * d, info
        for rate, total in zip(rates, sums):
            if total < L.sum():
                info["search"] = "sum"
                return rate * d, info
        j = int(np.argmin(sums))
        if not np.isfinite(sums[j]):
            info["search"] = "none"
            return np.zeros(D), info
        info["search"] = "min_sum"
        return rates[j] * d, info


def run_both(seed, rounds=8, K=8, D=10, m_range=(2, 6), curvature=1.0, s=5):
    """The rule and the direct oracle on the same rounds; w advances by the rule's step."""
    rng = np.random.default_rng(seed)
    prob = Quadratics(rng, K, D, curvature)
    agg, ref = create("fedmdfg", s=s), DirectFedMDFG(s=s)
    w = rng.standard_normal(D)
    seen = []
    for t in range(rounds):
        m = int(rng.integers(*m_range))
        ids = np.sort(rng.choice(K, m, replace=False))
        U = LR * np.array([prob.grad(k, w) for k in ids])
        losses = prob.losses(ids, w)
        calls = []
        step = agg.aggregate(make_round(t, ids, U, losses, loss_at=probe(prob, ids, w, calls)))
        want, info = ref.step(ids, U, losses, LR, lambda st: prob.losses(ids, w - st))
        seen.append(dict(t=t, ids=ids, w=w.copy(), step=step.numpy(), want=want, info=info,
                         calls=len(calls), search=agg.last_search, guidance=agg.last_guidance,
                         history=len(agg.last_history_ids), losses=losses))
        w = w - step.numpy()
    return prob, seen


# ----------------------------------------------------------------------------- vs direct

# curvature 300: 0.5^s lr is often still too long, so both fallbacks of the search occur
CASES = [(seed, 1.0) for seed in range(5)] + [(seed, 300.0) for seed in range(3)]


@pytest.mark.parametrize("seed,curvature", CASES)
def test_matches_direct_implementation(seed, curvature):
    _, seen = run_both(seed, curvature=curvature)
    for r in seen:
        scale = max(1.0, float(np.linalg.norm(r["want"])))
        np.testing.assert_allclose(r["step"], r["want"], rtol=0, atol=1e-6 * scale,
                                   err_msg=f"round {r['t']}")
        assert r["calls"] == r["info"]["calls"] and r["search"] == r["info"]["search"]
        assert r["guidance"] == r["info"]["guidance"]
        assert r["history"] == r["info"]["history"]


def test_direct_comparison_covers_every_branch():
    """Over the cases above: rounds with and without the fair row, with and without
    absent-client rows, Armijo steps after various numbers of calls, and both fallbacks."""
    rows = [r for seed, curv in CASES for r in run_both(seed, curvature=curv)[1]]
    assert {r["guidance"] for r in rows} == {True, False}
    assert any(r["history"] > 0 for r in rows) and any(r["history"] == 0 for r in rows)
    assert {r["search"] for r in rows} == {"armijo", "sum", "min_sum"}
    assert len({r["calls"] for r in rows}) > 2


def test_float32_updates_match_float64():
    """The server's float32 updates give the float64 step up to float32 rounding."""
    rng = np.random.default_rng(7)
    prob = Quadratics(rng, 5, 12)
    ids, w = np.arange(5), rng.standard_normal(12)
    U = LR * np.array([prob.grad(k, w) for k in ids])
    losses = prob.losses(ids, w)
    steps = [create("fedmdfg").aggregate(make_round(0, ids, U, losses, dtype=dt,
                                                    loss_at=probe(prob, ids, w, [])))
             for dt in (torch.float32, torch.float64)]
    assert steps[0].dtype == torch.float32 and steps[1].dtype == torch.float64
    np.testing.assert_allclose(steps[0].numpy(), steps[1].numpy(), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- hand check

def test_hand_checked_two_clients_in_2d():
    """Two clients in 2-D with losses ``l_k(w) = 1 + g_k · w + 0.5 ||w||^2`` around w^t = 0,
    so their gradients at 0 are ``g_1 = (1, 0)``, ``g_2 = (0, 1)`` (updates ``u = 0.1 g``)."""
    G = np.eye(2)
    w = np.zeros(2)
    trials = []

    def loss_at(step):
        v = w - step.double().numpy()
        trials.append(v.copy())
        return torch.tensor([1 + G[k] @ v + 0.5 * v @ v for k in range(2)], dtype=torch.float32)

    agg = create("fedmdfg")
    # Round 0, equal losses (1, 1): the angle to 1 is 0 < 11.25 and nobody rose, so no fair row.
    # Both gradients have norm 1 = mu; the min-norm point of the segment [g_1, g_2] is
    # d0 = (1/2, 1/2) (lambda = (1/2, 1/2)); the mean gradient (1/2, 1/2) has the same norm, so
    # d = (1/2, 1/2) and g_k · d = 1/2. Along w = -eta d both losses are
    # 1 - eta/2 + eta^2/4; Armijo asks 1 - eta/2 + eta^2/4 <= 1 - 1e-4 * eta / 2, i.e.
    # eta <= 2 - 2e-4. The search starts at 2^5 * 0.1 = 3.2 (fails: loss 1.96), then 1.6
    # (passes: loss 0.84), so the step is 1.6 * (1/2, 1/2) = (0.8, 0.8) after two calls.
    step = agg.aggregate(make_round(0, [0, 1], 0.1 * G, [1.0, 1.0], loss_at=loss_at))
    np.testing.assert_allclose(step.numpy(), [0.8, 0.8], atol=1e-12)
    np.testing.assert_allclose(agg.last_lambda, [0.5, 0.5], atol=1e-8)
    assert agg.last_rates == [3.2, 1.6] and agg.last_search == "armijo"
    assert not agg.last_guidance and agg.last_angle < 1e-4
    np.testing.assert_allclose(agg.last_trials[0][1], [1.96, 1.96], rtol=1e-6)
    np.testing.assert_allclose(agg.last_trials[1][1], [0.84, 0.84], rtol=1e-6)

    # Round 1, same gradients, losses (1, 3): the angle between (1, 3) and (1, 1) is
    # arccos(4 / sqrt(20)) = 26.57 degrees > 11.25, and client 1 rose (3 > its expected 1).
    # L̂ = (1, 3)/sqrt(10), e = (1, 1)/sqrt(2), e · L̂ = 2/sqrt(5), so
    # (e · L̂) L̂ - e = (-0.6, 0.2)/sqrt(2) and h = (-3, 1)/sqrt(10); the fair row is
    # p = h^T G = (-3, 1)/sqrt(10). The hull of g_1, g_2, p is closest to 0 on the edge
    # [g_1, p] at its midpoint (t = a / (a^2 + b^2) = 1/2 with a = 1 + 3/sqrt(10),
    # b = 1/sqrt(10)): lambda = (1/2, 0, 1/2), d0 = ((1 - 3/sqrt(10))/2, 1/(2 sqrt(10))),
    # ||d0||^2 = (1 - 3/sqrt(10))/2. d = d0 * (1/sqrt(2)) / ||d0||.
    # (the probe stays around w = 0: its losses are synthetic, not the model's)
    step = agg.aggregate(make_round(1, [0, 1], 0.1 * G, [1.0, 3.0], loss_at=loss_at))
    assert agg.last_guidance and agg.last_rose == 1 and agg.last_forced
    assert agg.last_angle == pytest.approx(math.degrees(math.acos(4 / math.sqrt(20))))
    np.testing.assert_allclose(agg.last_lambda, [0.5, 0.0, 0.5], atol=1e-7)
    d0 = np.array([(1 - 3 / math.sqrt(10)) / 2, 1 / (2 * math.sqrt(10))])
    d = d0 / math.sqrt(2) / math.sqrt((1 - 3 / math.sqrt(10)) / 2)
    np.testing.assert_allclose(agg.last_direction.numpy(), d, atol=1e-8)
    # The probe's losses are 1 at w^t for both clients (not the (1, 3) reported), so Armijo
    # compares against (1, 3): client 0's loss is 1 - eta d_1 + eta^2 ||d||^2 / 2 with
    # ||d||^2 = 1/2, below 1 - 1e-4 eta (g_1 · d) iff eta <= 4 d_1 (1 - 1e-4) = 0.4530;
    # client 1's bound 3 holds easily. Candidates 3.2, 1.6, 0.8 fail, 0.4 passes.
    assert agg.last_rates == [3.2, 1.6, 0.8, 0.4] and agg.last_search == "armijo"
    np.testing.assert_allclose(step.numpy(), 0.4 * d, atol=1e-12)


# ----------------------------------------------------------------------------- line search

@pytest.mark.parametrize("seed", range(3))
def test_accepted_steps_lower_every_live_clients_loss(seed):
    prob, seen = run_both(seed, rounds=10, curvature=3.0)
    searched = [r for r in seen if r["search"] != "skipped"]
    assert searched
    for r in searched:
        new = prob.losses(r["ids"], r["w"] - r["step"]).astype(np.float64)
        old = r["losses"].astype(np.float64)
        if r["search"] == "armijo":
            assert np.all(new <= old), (r["t"], new - old)
        elif r["search"] == "sum":
            assert new.sum() < old.sum()


def _fake_round(t, losses_fn, m=3, D=5, seed=0, ids=None):
    rng = np.random.default_rng(seed)
    U = LR * rng.standard_normal((m, D))
    calls = []

    def loss_at(step):
        calls.append(float(torch.linalg.vector_norm(step)))
        return torch.as_tensor(losses_fn(len(calls)), dtype=torch.float32)

    ids = np.arange(m) if ids is None else ids
    return make_round(t, ids, U, np.ones(m, dtype=np.float32), loss_at=loss_at), calls


def test_fallback_first_candidate_that_lowers_the_sum():
    """Client 0's loss never falls (no Armijo step); the sum first falls at the 3rd call."""
    sums = {1: 3.5, 2: 3.2, 3: 2.9, 4: 2.5}
    agg = create("fedmdfg", s=2)
    r, calls = _fake_round(0, lambda j: [1.01] + [(sums.get(j, 2.8) - 1.01) / 2] * 2)
    step = agg.aggregate(r)
    assert len(calls) == 5 and agg.last_search == "sum"          # 2s + 1 calls, all failed
    assert agg.last_rate == candidate_rates(LR, 2, True)[2] == LR
    np.testing.assert_allclose(step.numpy(), (LR * agg.last_direction).numpy())


def test_fallback_smallest_sum_when_no_candidate_lowers_it():
    sums = [3.9, 3.4, 3.2, 3.6, 3.8]       # all above the old sum 3
    agg = create("fedmdfg", s=2)
    r, calls = _fake_round(0, lambda j: [sums[j - 1] / 3] * 3)
    step = agg.aggregate(r)
    assert len(calls) == 5 and agg.last_search == "min_sum"
    assert agg.last_rate == candidate_rates(LR, 2, True)[2]
    assert torch.isfinite(step).all()


def test_non_finite_losses_everywhere_give_a_zero_step():
    agg = create("fedmdfg", s=1)
    r, calls = _fake_round(0, lambda j: [float("nan"), 1.0, float("inf")])
    step = agg.aggregate(r)
    assert len(calls) == 3 and agg.last_search == "none"
    assert torch.equal(step, torch.zeros_like(step))


@pytest.mark.parametrize("s", [0, 1, 3, 5])
def test_calls_per_round_are_bounded(s):
    """Never accepted: exactly 2s + 1 calls without absent-client rows, s + 1 with them."""
    agg = create("fedmdfg", s=s)
    r, calls = _fake_round(0, lambda j: [2.0] * 3)
    agg.aggregate(r)
    assert len(calls) == 2 * s + 1
    assert agg.last_rates == [LR * 2.0 ** (s - j) for j in range(2 * s + 1)]
    r, calls = _fake_round(1, lambda j: [2.0] * 3, ids=np.array([0, 1, 7]))   # 2 was last here
    agg.aggregate(r)
    assert list(agg.last_history_ids) == [2]
    assert len(calls) == s + 1 and agg.last_rates[0] == LR


# ----------------------------------------------------------------------------- guidance

def _guidance(losses, theta=11.25, t=0, agg=None, ids=None):
    agg = agg or create("fedmdfg", theta=theta)
    m = len(losses)
    rng = np.random.default_rng(1)
    U = LR * (rng.standard_normal((m, 6)) + 2.0)
    ids = np.arange(m) if ids is None else ids
    agg.aggregate(make_round(t, ids, U, losses, loss_at=lambda st: torch.zeros(m)))
    return agg


@pytest.mark.parametrize("deg,fires", [(11.0, False), (11.5, True), (5.0, False), (30.0, True)])
def test_guidance_fires_iff_the_angle_exceeds_theta(deg, fires):
    # (1, x) makes the angle |atan(x) - 45 deg| with (1, 1)
    losses = [1.0, math.tan(math.radians(45 + deg))]
    agg = _guidance(losses)
    assert agg.last_angle == pytest.approx(deg, abs=1e-4)
    assert agg.last_guidance == fires and agg.last_rose == 0 and not agg.last_forced
    assert len(agg.last_lambda) == 2 + fires


def test_theta_is_the_threshold():
    losses = [1.0, math.tan(math.radians(45 + 20))]
    assert _guidance(losses, theta=11.25).last_guidance
    assert not _guidance(losses, theta=25.0).last_guidance


def test_guidance_fires_when_some_but_not_all_losses_rose():
    agg = _guidance([1.0, 1.0, 1.0])                        # first visit: expectations 1
    assert not agg.last_guidance
    agg = _guidance([1.0, 1.0, 1.001], t=1, agg=agg)        # angle ~0.03 deg, one rose
    assert agg.last_angle < 0.1 and agg.last_rose == 1 and agg.last_forced
    assert agg.last_guidance and len(agg.last_lambda) == 4
    agg = _guidance([1.01, 1.01, 1.01], t=2, agg=agg)       # all rose: not forced (reference)
    assert agg.last_rose == 3 and not agg.last_forced and not agg.last_guidance
    # expectations: clients 0, 1 averaged their two 1.0s (the rise of client 2 was not
    # averaged in); a fall below the expectation updates the running mean over all joins
    agg = _guidance([0.4, 1.0, 1.0], t=3, agg=agg)
    assert agg.last_rose == 0                               # 1.0 is not above 1.0
    st = agg.state_dict()
    exp = dict(zip(st["loss_ids"].tolist(), st["loss_expected"].tolist()))
    assert st["loss_joins"].tolist() == [4, 4, 4]
    assert exp[0] == pytest.approx((1.0 * 3 + 0.4) / 4)


def test_guidance_weights_and_angle():
    h = guidance_weights([1.0, 3.0])
    np.testing.assert_allclose(h, np.array([-3.0, 1.0]) / math.sqrt(10))
    assert guidance_weights([2.0, 2.0]) is None and guidance_weights([1.0]) is None
    assert guidance_weights([0.0, 0.0]) is None
    assert loss_angle([0.0, 0.0]) == 0.0 and loss_angle([1.0, 0.0]) == pytest.approx(45.0)
    L = np.array([0.3, 1.2, 2.5])
    assert guidance_weights(L) @ L == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------- degenerate

def test_zero_updates_give_a_zero_step_without_calls():
    calls = []
    agg = create("fedmdfg")
    r = make_round(0, [0, 1, 2], np.zeros((3, 4)), [1.0, 2.0, 3.0],
                   loss_at=lambda st: calls.append(1) or torch.zeros(3))
    step = agg.aggregate(r)
    assert torch.equal(step, torch.zeros(4, dtype=torch.float64)) and not calls
    assert agg.last_status == "no live client" and len(agg.last_live) == 0


def test_zero_rows_are_left_out():
    """A client without gradient takes no part: the step is the one of the others."""
    rng = np.random.default_rng(3)
    prob = Quadratics(rng, 3, 5)
    w = rng.standard_normal(5)
    U = LR * np.array([prob.grad(k, w) for k in range(3)])
    U0 = np.vstack([U[:1], np.zeros((1, 5)), U[1:]])
    losses = prob.losses([0, 1, 2], w)

    def loss_at(ids_map):
        return lambda st: torch.as_tensor(prob.losses(range(3), w - st.numpy())[ids_map])

    a = create("fedmdfg").aggregate(make_round(0, [0, 1, 2], U, losses, loss_at=loss_at(
        [0, 1, 2])))
    agg = create("fedmdfg")
    b = agg.aggregate(make_round(0, [0, 9, 1, 2], U0, np.insert(losses, 1, 5.0),
                                 loss_at=loss_at([0, 0, 1, 2])))
    assert list(agg.last_live) == [0, 1, 2]
    np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-10)


@pytest.mark.parametrize("losses", [[1.0, 1.0], [1.0, 2.0], [0.0, 0.0]])
def test_duplicate_rows_give_no_nan(losses):
    g = np.array([[0.3, -0.2, 0.5]])
    agg = create("fedmdfg")
    step = agg.aggregate(make_round(0, [0, 1], LR * np.vstack([g, g]), losses,
                                    loss_at=lambda st: torch.tensor([-1.0, -1.0])))
    assert torch.isfinite(step).all()
    if losses[0] == losses[1]:         # no fair row: d = g, accepted at the first candidate
        np.testing.assert_allclose(step.numpy(), 2**5 * LR * g[0], rtol=1e-9)
    else:                              # the fair row is -c g: 0 is in the hull, no step
        assert agg.last_guidance and agg.last_status == "zero direction"
        assert torch.equal(step, torch.zeros(3, dtype=torch.float64))


def test_single_client_and_tiny_or_huge_scales():
    for scale in (1e-5, 1.0, 1e5):
        g = scale * np.array([[1.0, 2.0, -1.0]])
        agg = create("fedmdfg", s=1)
        step = agg.aggregate(make_round(0, [4], LR * g, [0.5],
                                        loss_at=lambda st: torch.tensor([0.1])))
        np.testing.assert_allclose(step.numpy(), 2 * LR * g[0], rtol=1e-12)


# ----------------------------------------------------------------------------- state

def test_state_round_trip_continues_identically(tmp_path):
    rng = np.random.default_rng(11)
    K, D = 7, 9
    prob = Quadratics(rng, K, D)
    plan = [np.sort(rng.choice(K, int(rng.integers(2, 5)), replace=False)) for _ in range(9)]
    w0 = rng.standard_normal(D)

    def play(agg, rounds, w):
        steps = []
        for t in rounds:
            ids = plan[t]
            U = LR * np.array([prob.grad(k, w) for k in ids])
            step = agg.aggregate(make_round(t, ids, U, prob.losses(ids, w), dtype=torch.float32,
                                            loss_at=probe(prob, ids, w, [])))
            steps.append(step.numpy())
            w = w - step.numpy().astype(np.float64)
        return steps, w

    a = create("fedmdfg")
    _, w = play(a, range(5), w0)
    state = h5_round_trip(a.state_dict(), tmp_path / "state.h5")
    b = create("fedmdfg")
    b.load_state_dict(state)
    assert len(state["last_ids"]) > 0 and state["last_rows"].dtype == np.float32
    sa, _ = play(a, range(5, 9), w)
    sb, _ = play(b, range(5, 9), w)
    for x, y in zip(sa, sb):
        assert np.array_equal(x, y)
    sa_state, sb_state = a.state_dict(), b.state_dict()
    for k in sa_state:
        assert np.array_equal(np.asarray(sa_state[k]), np.asarray(sb_state[k])), k


def test_fresh_state_round_trip(tmp_path):
    state = h5_round_trip(create("fedmdfg").state_dict(), tmp_path / "s.h5")
    agg = create("fedmdfg")
    agg.load_state_dict(state)
    assert agg.state_dict()["last_round"] == -1
    with pytest.raises(ValueError, match="missing"):
        agg.load_state_dict({"last_round": 3})


# ----------------------------------------------------------------------------- errors

def test_needs_loss_at():
    with pytest.raises(ValueError, match="loss_at"):
        create("fedmdfg").aggregate(make_round(0, [0, 1], np.eye(2), [1.0, 2.0]))


def test_rejects_bad_inputs():
    for kw in (dict(theta=0), dict(theta=90), dict(theta=True), dict(s=-1), dict(s=1.5),
               dict(s=True), dict(theta=float("nan"))):
        with pytest.raises(ValueError):
            create("fedmdfg", **kw)
    with pytest.raises(TypeError):
        create("fedmdfg", eps=0.1)
    agg = create("fedmdfg")
    with pytest.raises(ValueError, match=r"\(2,\)"):
        agg.aggregate(make_round(0, [0, 1], np.eye(2), [1.0, 2.0],
                                 loss_at=lambda st: torch.zeros(3)))
    agg = create("fedmdfg")
    agg.aggregate(make_round(3, [0, 1], np.eye(2), [1.0, 2.0],
                             loss_at=lambda st: torch.zeros(2)))
    with pytest.raises(ValueError, match="not after"):
        agg.aggregate(make_round(3, [0, 1], np.eye(2), [1.0, 2.0],
                                 loss_at=lambda st: torch.zeros(2)))
    with pytest.raises(ValueError, match="dimension"):
        agg.aggregate(make_round(4, [5, 6], np.ones((2, 3)), [1.0, 2.0],
                                 loss_at=lambda st: torch.zeros(2)))
