"""mFairFL's server (docs/ALGORITHMS.md §4): the GradVac rule, the Gram form against a direct
per-pair oracle with dict goals, hand-checked cases, the multiplier update, sparse goals, state
round trips and the config table."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, available, create, rule
from mpifl.aggregators.mfairfl import (GOAL_MAX, MFairFL, curation_coefficients,
                                       gradvac_coefficient, num_adjusted)
from mpifl.experiment.config import load_config
from mpifl.core.errors import ConfigError
from tests.helpers import h5_round_trip


# ---- the direct oracle: docs/ALGORITHMS.md §4's loop, literally, on d-dimensional vectors ------

class DirectMFairFL:
    """Per client, per target, in the updates' dtype; goals in a dict keyed by (id_i, id_j)."""

    def __init__(self, *, alpha, beta, eta_lambda=0.1):
        self.alpha, self.beta, self.eta_lambda = alpha, beta, eta_lambda
        self.goals: dict[tuple[int, int], float] = {}
        self.lam = None

    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        U, m, ids = r.updates, r.m, [int(k) for k in r.client_ids]
        losses = r.losses.double().numpy()
        po = sorted(range(m), key=lambda k: (losses[k], ids[k]))
        adjusted = set(po[:num_adjusted(m, self.alpha)])
        updated, gs = {}, []
        for i in range(m):
            g = U[i].clone()
            if i in adjusted:
                for j in po:
                    if j == i:
                        continue
                    ng, nu = float(g.norm()), float(U[j].norm())
                    if ng == 0 or nu == 0:
                        continue
                    phi = min(1.0, max(-1.0, float(g @ U[j]) / (ng * nu)))
                    goal = self.goals.get((ids[i], ids[j]), 0.0)
                    target = min(goal, GOAL_MAX)
                    if phi < target:
                        root = math.sqrt(1 - target ** 2)
                        a = ng * (target * math.sqrt(1 - phi ** 2) - phi * root) / (nu * root)
                        g = g + a * U[j]
                    updated[(ids[i], ids[j])] = (1 - self.beta) * goal + self.beta * phi
            gs.append(g)
        self.goals.update(updated)
        c = r.stats.get("constraints")
        if c is not None:
            n = r.num_samples.double().numpy()
            p = n / n.sum()
            lam = np.zeros(c.shape[1]) if self.lam is None else self.lam
            self.lam = np.maximum(0.0, lam + self.eta_lambda * (p @ c.double().numpy()))
        g = torch.stack(gs).sum(0) / m
        gn = float(g.norm())
        return g * (U.mean(0).norm() / gn) if gn > 0 else torch.zeros_like(g)


# ---- data ------------------------------------------------------------------------------------

def make_round(t, ids, U, losses=None, dtype=torch.float64, constraints=None, samples=None):
    U = torch.as_tensor(np.asarray(U, dtype=np.float64), dtype=dtype)
    m = U.shape[0]
    losses = np.linspace(0.1, 1.0, m) if losses is None else losses
    samples = np.full(m, 10) if samples is None else samples
    stats = {} if constraints is None else {"constraints": np.asarray(constraints)}
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=U, losses=losses,
                        num_samples=samples, lr=0.1, stats=stats)


def conflicting_rounds(dtype, *, num_rounds=8, K=12, d=40, A=2, seed=0):
    """Partial participation from a small pool (pairs meet again, so the EMA goals matter),
    updates = shared direction + large low-rank noise (many conflicts), loss ties, constraints."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((4, d))
    out = []
    for t in range(num_rounds):
        m = int(rng.integers(4, 10))
        z = rng.standard_normal((m, 4))
        z[:, 0] = 0.4 + 0.3 * z[:, 0]
        U = z @ basis + 0.3 * rng.standard_normal((m, d))
        losses = rng.random(m)
        losses[:2] = losses[2]                                  # ties, broken by client id
        out.append(make_round(t, rng.choice(K, m, replace=False), U, losses, dtype,
                              constraints=rng.normal(0.0, 0.1, (m, A)),
                              samples=rng.integers(5, 60, m)))
    return out


def rel(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def with_goals(agg: MFairFL, goals: dict) -> MFairFL:
    """Load hand-set goals through the public state interface."""
    state = agg.state_dict()
    keys = sorted(goals)
    state["goal_pairs"] = np.array(keys, dtype=np.int64).reshape(-1, 2)
    state["goal_values"] = np.array([goals[k] for k in keys], dtype=np.float64)
    agg.load_state_dict(state)
    return agg


# ---- the GradVac rule ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_one_adjustment_sets_cosine_to_goal(dtype, tol):
    """docs/ALGORITHMS.md §4 (GradVac, Wang et al. 2021): after one adjustment cos(g_i, u_j) equals
    phi_hat to 1e-6."""
    rng = np.random.default_rng(0)
    done = 0
    for _ in range(200):
        g, u = (torch.as_tensor(rng.standard_normal(30) * rng.uniform(0.01, 10), dtype=dtype)
                for _ in range(2))
        goal = rng.uniform(-0.9, 0.95)
        phi = cos(g, u)
        if not phi < goal:
            continue
        a = gradvac_coefficient(float(g.norm()), float(u.norm()), phi, goal)
        assert a > 0
        assert cos(g + a * u, u) == pytest.approx(goal, abs=tol)
        done += 1
    assert done > 50


def test_adjustment_through_the_aggregator_reaches_the_goal():
    """Two clients, alpha = 0.5: only the lower-loss client 4 is curated, against u_9, with a
    stored goal 0.6. The step is proportional to g_4 + u_9 = u_4 + (1 + a) u_9; recover a by
    least squares and check cos(u_4 + a u_9, u_9) = 0.6, then the EMA of Eq. 15."""
    rng = np.random.default_rng(1)
    U = rng.standard_normal((2, 25))
    phi0 = cos(U[0], U[1])
    assert phi0 < 0.6
    agg = with_goals(create("mfairfl", alpha=0.5, beta=0.25), {(4, 9): 0.6, (9, 4): 0.99})
    s = agg.aggregate(make_round(0, [4, 9], U, [0.1, 0.2])).numpy()
    (k1, k2), *_ = np.linalg.lstsq(U.T, s, rcond=None)
    np.testing.assert_allclose(U.T @ [k1, k2], s, atol=1e-12)     # s is in span(u_4, u_9)
    a = k2 / k1 - 1
    assert cos(U[0] + a * U[1], U[1]) == pytest.approx(0.6, abs=1e-10)
    assert np.linalg.norm(s) == pytest.approx(np.linalg.norm(U.mean(0)), rel=1e-12)
    assert agg.goal(4, 9) == pytest.approx(0.75 * 0.6 + 0.25 * phi0, abs=1e-15)
    assert agg.goal(9, 4) == 0.99                                  # client 9 is kept: not visited
    assert agg.num_goals == 2


def test_last_target_cosine_equals_goal_in_gram_form():
    """In a full curation, each client whose last target in PO fired ends at cos = goal."""
    rng = np.random.default_rng(2)
    m, d = 7, 30
    U = rng.standard_normal((m, d)) + 0.2
    goals = rng.uniform(-0.3, 0.8, (m, m))
    po = rng.permutation(m)
    C, phi, visited = curation_coefficients(U @ U.T, po, np.ones(m, bool), goals)
    Gs = U + C @ U
    checked = 0
    for i in range(m):
        j = po[-1] if po[-1] != i else po[-2]
        if phi[i, j] < goals[i, j]:
            assert cos(Gs[i], U[j]) == pytest.approx(goals[i, j], abs=1e-10)
            checked += 1
    assert checked >= 2
    assert visited.sum() == m * (m - 1) and not visited.diagonal().any()


def test_zero_goal_is_fedfv_projection():
    """With phi_hat = 0 the rule is the projection onto the normal plane of u_j."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        g, u = rng.standard_normal(10), rng.standard_normal(10)
        phi = cos(g, u)
        a = gradvac_coefficient(np.linalg.norm(g), np.linalg.norm(u), phi, 0.0)
        assert a == pytest.approx(-(g @ u) / (u @ u), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fresh_goals_equal_fedfv(dtype):
    """Goals start at 0, so the first round of mFairFL (alpha = 1: everyone curated) is FedFV's
    internal step with nobody kept (alpha = 0, tau = 0); later rounds differ (goals moved)."""
    rounds = conflicting_rounds(dtype, num_rounds=4)
    for r in rounds:
        s = create("mfairfl", alpha=1.0, beta=0.5).aggregate(r)
        assert rel(s, create("fedfv", alpha=0.0, tau=0).aggregate(r)) < (
            1e-5 if dtype == torch.float32 else 1e-12)
    agg = create("mfairfl", alpha=1.0, beta=0.5)
    diffs = [rel(agg.aggregate(r), create("fedfv", alpha=0.0, tau=0).aggregate(r))
             for r in rounds]
    assert diffs[0] < 1e-5 and max(diffs[1:]) > 1e-3


# ---- Gram form == direct oracle --------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("alpha,beta", list(itertools.product([0.0, 0.3, 0.7, 1.0],
                                                               [0.01, 0.5, 1.0])))
def test_gram_equals_direct(alpha, beta, dtype, tol):
    gram, direct = create("mfairfl", alpha=alpha, beta=beta), DirectMFairFL(alpha=alpha, beta=beta)
    fresh_differs = False
    for r in conflicting_rounds(dtype):
        s, expected = gram.aggregate(r), direct.aggregate(r)
        assert s.dtype == dtype and s.shape == (r.d,)
        assert rel(s, expected) < tol, f"round {r.round}"
        # a gram aggregator without history: the goals must change the result
        fresh_differs |= rel(s, create("mfairfl", alpha=alpha, beta=beta).aggregate(r)) > 1e-3
        np.testing.assert_allclose(gram.multipliers, direct.lam, rtol=1e-12, atol=1e-15)
    assert fresh_differs == (alpha > 0)
    pairs, values = gram.goals()
    assert [tuple(p) for p in pairs.tolist()] == sorted(direct.goals)
    np.testing.assert_allclose(values, [direct.goals[k] for k in sorted(direct.goals)],
                               atol=10 * tol)


def test_data_has_conflicts_and_goals_fire():
    """Guard for the oracle comparison: the rule fires with negative and positive goals."""
    agg = create("mfairfl", alpha=1.0, beta=0.5)
    hits_positive_goal = 0
    for r in conflicting_rounds(torch.float64):
        G = (r.updates @ r.updates.T).numpy()
        assert (G < 0).sum() >= 4
        ids = r.client_ids
        goals = np.array([[agg.goal(i, j) for j in ids] for i in ids])
        _, phi, visited = curation_coefficients(G, np.argsort(r.losses.numpy()),
                                                np.ones(r.m, bool), goals)
        hits_positive_goal += int(((phi < goals) & (goals > 0) & visited).sum())
        agg.aggregate(r)
    assert hits_positive_goal >= 5


def test_row_order_does_not_matter():
    rounds = conflicting_rounds(torch.float64, num_rounds=4)
    a, b = create("mfairfl", alpha=0.7, beta=0.5), create("mfairfl", alpha=0.7, beta=0.5)
    rng = np.random.default_rng(4)
    for r in rounds:
        perm = rng.permutation(r.m)
        shuffled = RoundUpdates(round=r.round, client_ids=r.client_ids[perm],
                                updates=r.updates[perm], losses=r.losses[perm],
                                num_samples=r.num_samples[perm], lr=r.lr,
                                stats={"constraints": r.stats["constraints"][perm]})
        torch.testing.assert_close(a.aggregate(r), b.aggregate(shuffled), rtol=1e-12,
                                   atol=1e-14)
    np.testing.assert_allclose(a.goals()[1], b.goals()[1], atol=1e-13)
    np.testing.assert_allclose(a.multipliers, b.multipliers, rtol=1e-14)


# ---- hand-checked 2-client 2-D case ----------------------------------------------------------
# u1 = (1, 0) (client 1, lower loss), u2 = (-1, 1); cos = -1/sqrt2; mean u = (0, 0.5).
# Round 0, goals 0: the FedFV projections g1 = (0.5, 0.5), g2 = (0, 1); g = (0.25, 0.75).
#   beta = 0.5: both goals become -1/(2 sqrt2).
# Round 1, same updates: phi = -1/sqrt2 < goal, sqrt(1 - goal^2) = sqrt(7/8), sqrt(1-phi^2) =
#   1/sqrt2, so a1 = 1 * (-1/4 + sqrt7/4) / (sqrt2 sqrt(7/8)) = (1 - 1/sqrt7)/2,
#   a2 = sqrt2 * (same numerator) / sqrt(7/8) = 1 - 1/sqrt7;
#   g1 = u1 + a1 u2 = ((1 + 1/sqrt7)/2, (1 - 1/sqrt7)/2), g2 = u2 + a2 u1 = (-1/sqrt7, 1);
#   g = ((1 - 1/sqrt7)/4, (3 - 1/sqrt7)/4); goals -> (goal + phi)/2 = -3/(4 sqrt2).

U2 = [[1.0, 0.0], [-1.0, 1.0]]
LOSS2 = [0.1, 0.2]


def test_two_clients_by_hand():
    r7 = 1 / math.sqrt(7)
    for agg in (create("mfairfl", alpha=1.0, beta=0.5), DirectMFairFL(alpha=1.0, beta=0.5)):
        s0 = agg.aggregate(make_round(0, [1, 2], U2, LOSS2)).numpy()
        np.testing.assert_allclose(s0, 0.5 * unit([0.25, 0.75]), atol=1e-14)
        s1 = agg.aggregate(make_round(1, [1, 2], U2, LOSS2)).numpy()
        np.testing.assert_allclose(s1, 0.5 * unit([1 - r7, 3 - r7]), atol=1e-14)
    assert agg.goals == pytest.approx({(1, 2): -3 / (4 * math.sqrt(2)),
                                       (2, 1): -3 / (4 * math.sqrt(2))}, abs=1e-15)
    gram = create("mfairfl", alpha=1.0, beta=0.5)
    for t in range(2):
        gram.aggregate(make_round(t, [1, 2], U2, LOSS2))
    assert gram.goal(1, 2) == pytest.approx(-3 / (4 * math.sqrt(2)), abs=1e-15)
    assert gram.goal(2, 1) == pytest.approx(-3 / (4 * math.sqrt(2)), abs=1e-15)


def test_two_clients_alpha_half_curates_the_lower_loss_only():
    """alpha = 0.5, m = 2: ceil(1) = 1 curated, the lower loss (client 1): g = (g1 + u2)/2 =
    (-0.25, 0.75); with the losses swapped client 2 is curated: (u1 + g2)/2 = (0.5, 0.5)."""
    for losses, g in ((LOSS2, [-0.25, 0.75]), (LOSS2[::-1], [0.5, 0.5])):
        s = create("mfairfl", alpha=0.5).aggregate(make_round(0, [1, 2], U2, losses)).numpy()
        np.testing.assert_allclose(s, 0.5 * unit(g), atol=1e-14)


def test_loss_ties_broken_by_client_id():
    """Equal losses: the smaller id comes first in PO and is the one curated (alpha = 0.5)."""
    s = create("mfairfl", alpha=0.5).aggregate(make_round(0, [2, 1], U2[::-1], [0.3, 0.3]))
    np.testing.assert_allclose(s.numpy(), 0.5 * unit([-0.25, 0.75]), atol=1e-14)


# ---- alpha -----------------------------------------------------------------------------------

@pytest.mark.parametrize("m,alpha,n", [(10, 0.7, 7), (10, 0.1, 1), (3, 0.5, 2), (5, 0.0, 0),
                                       (5, 1.0, 5), (1, 0.01, 1), (10, 0.75, 8), (3, 1 / 3, 1)])
def test_num_adjusted(m, alpha, n):
    assert num_adjusted(m, alpha) == n


def test_alpha_zero_is_the_plain_mean():
    agg = create("mfairfl", alpha=0.0, beta=0.5)
    for r in conflicting_rounds(torch.float32):
        assert torch.equal(agg.aggregate(r), r.updates.mean(0))
    assert agg.num_goals == 0
    assert agg.multipliers.shape == (2,)                 # the multipliers still move


def test_no_conflicts_no_goals_is_the_mean():
    rng = np.random.default_rng(5)
    agg = create("mfairfl", alpha=1.0, beta=0.01)
    r = make_round(0, np.arange(6), rng.random((6, 20)))  # all cosines > 0 = the goals
    assert torch.equal(agg.aggregate(r), r.updates.mean(0))
    assert agg.num_goals == 30


def test_zero_updates():
    agg = create("mfairfl", alpha=1.0)
    r = make_round(0, [0, 1, 2], np.zeros((3, 4)))
    assert torch.equal(agg.aggregate(r), torch.zeros(4, dtype=torch.float64))
    assert agg.num_goals == 0                             # no cosine, nothing visited
    # one zero update among others: it is skipped as a target and as a curated client
    U = [[1.0, 0.0], [0.0, 0.0], [-1.0, 1.0]]
    for agg in (create("mfairfl", alpha=1.0), DirectMFairFL(alpha=1.0, beta=0.01)):
        s = agg.aggregate(make_round(0, [1, 5, 2], U, [0.1, 0.15, 0.2])).numpy()
        # g = (g1 + 0 + g2)/3 with the FedFV projections: direction (0.25, 0.75)
        np.testing.assert_allclose(s, np.linalg.norm(np.mean(U, 0)) * unit([0.25, 0.75]),
                                   atol=1e-14)
    assert create("mfairfl").goal(5, 1) == 0.0


def test_goal_of_one_does_not_blow_up():
    """beta = 1 and identical directions make a goal of exactly 1; the rule aims at GOAL_MAX."""
    agg = create("mfairfl", alpha=1.0, beta=1.0)
    agg.aggregate(make_round(0, [0, 1], [[1.0, 0.0], [2.0, 0.0]]))
    assert agg.goal(0, 1) == 1.0
    U = np.array([[1.0, 0.0], [1.0, 1.0]])
    s = agg.aggregate(make_round(1, [0, 1], U, [0.1, 0.2])).numpy()
    assert np.isfinite(s).all()
    assert np.linalg.norm(s) == pytest.approx(np.linalg.norm(U.mean(0)), rel=1e-12)


# ---- multipliers -----------------------------------------------------------------------------

def test_multiplier_update_formula_and_clipping():
    agg = create("mfairfl", eta_lambda=0.5, alpha=0.0)
    assert agg.multipliers.shape == (0,)
    U = np.eye(3)
    c0 = np.array([[0.2, -0.4, 0.1], [0.1, -0.2, -0.6]])
    agg.aggregate(make_round(0, [3, 8], U[:2], constraints=c0, samples=[10, 30]))
    p = np.array([0.25, 0.75])
    lam = np.maximum(0, 0.5 * (p @ c0))      # 0.5 * (0.05 + 0.075, -0.25, -0.425)
    np.testing.assert_allclose(agg.multipliers, lam, rtol=1e-15)
    assert agg.multipliers.tolist() == pytest.approx([0.0625, 0.0, 0.0], abs=1e-15)
    c1 = np.array([[-0.05, 0.3, 0.2], [0.0, 0.1, 0.4], [-0.3, 0.0, 0.0]])
    agg.aggregate(make_round(1, [1, 3, 8], U, constraints=c1, samples=[20, 20, 60]))
    p = np.array([0.2, 0.2, 0.6])
    lam = np.maximum(0, lam + 0.5 * (p @ c1))   # (0.0625 - 0.095 -> 0, 0.04, 0.06)
    np.testing.assert_allclose(agg.multipliers, lam, rtol=1e-15, atol=1e-17)
    assert agg.multipliers.tolist() == pytest.approx([0.0, 0.04, 0.06], abs=1e-15)
    # a round without constraint values leaves them
    agg.aggregate(make_round(2, [1, 3], U[:2]))
    np.testing.assert_allclose(agg.multipliers, lam, rtol=1e-15, atol=1e-17)
    # the property is a copy
    agg.multipliers[:] = 7
    assert not (agg.multipliers == 7).any()


def test_multipliers_sized_in_advance_and_checked():
    agg = create("mfairfl", notion="eo", num_constraints=4)
    assert agg.multipliers.tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="reports 2 constraint values"):
        agg.aggregate(make_round(0, [0, 1], U2, constraints=np.zeros((2, 2))))
    with pytest.raises(ValueError, match="odd"):
        create("mfairfl", notion="eo").aggregate(make_round(0, [0, 1], U2,
                                                           constraints=np.zeros((2, 3))))
    with pytest.raises(ValueError, match="odd"):
        create("mfairfl", notion="eo", num_constraints=3)
    with pytest.raises(ValueError, match=r"\(m, A\)"):
        create("mfairfl").aggregate(make_round(0, [0, 1], U2, constraints=np.zeros(2)))


def test_bad_constraints_change_nothing():
    agg = create("mfairfl", alpha=1.0, beta=0.5)
    agg.aggregate(make_round(0, [1, 2], U2, LOSS2, constraints=[[0.1], [0.2]]))
    before = agg.state_dict()
    with pytest.raises(ValueError, match="client 2 reports non-finite"):
        agg.aggregate(make_round(1, [1, 2], U2, LOSS2, constraints=[[0.1], [np.nan]]))
    after = agg.state_dict()
    assert after["last_round"] == 0
    for k in ("goal_pairs", "goal_values", "multipliers"):
        assert np.array_equal(before[k], after[k])
    agg.aggregate(make_round(1, [1, 2], U2, LOSS2))       # round 1 still possible


def test_zero_samples_weigh_uniformly():
    agg = create("mfairfl", eta_lambda=1.0)
    agg.aggregate(make_round(0, [0, 1], U2, constraints=[[0.2], [0.4]], samples=[0, 0]))
    assert agg.multipliers.tolist() == pytest.approx([0.3])


# ---- sparse goals ----------------------------------------------------------------------------

def test_goals_are_sparse_bounded_and_match_a_dict():
    """K = 10,000 clients, m = 10: the store holds exactly the ordered pairs visited (adjusted
    i, any j != i), sorted, and agrees with the oracle's dict."""
    rng = np.random.default_rng(6)
    gram, direct = create("mfairfl", alpha=0.5, beta=0.3), DirectMFairFL(alpha=0.5, beta=0.3)
    seen = set()
    for t in range(40):
        ids = rng.choice(10_000, 10, replace=False) if t % 4 else rng.choice(30, 10, replace=False)
        losses = rng.random(10)
        r = make_round(t, ids, rng.standard_normal((10, 16)), losses)
        gram.aggregate(r)
        direct.aggregate(r)
        po = np.lexsort((ids, losses))
        seen |= {(int(ids[i]), int(j)) for i in po[:5] for j in ids if j != ids[i]}
        assert gram.num_goals == len(seen) <= (t + 1) * 5 * 9
    pairs, values = gram.goals()
    assert [tuple(p) for p in pairs.tolist()] == sorted(seen) == sorted(direct.goals)
    np.testing.assert_allclose(values, [direct.goals[k] for k in sorted(seen)], atol=1e-12)
    assert len(seen) < 40 * 45                          # the small pool met again


def test_large_client_ids():
    big = [2 ** 31 - 1, 2 ** 31 - 2, 7]
    rng = np.random.default_rng(7)
    agg, direct = create("mfairfl", alpha=1.0, beta=0.5), DirectMFairFL(alpha=1.0, beta=0.5)
    for t in range(3):
        r = make_round(t, big, rng.standard_normal((3, 5)))
        torch.testing.assert_close(agg.aggregate(r), direct.aggregate(r), rtol=1e-10, atol=0)
    pairs, values = agg.goals()
    assert [tuple(p) for p in pairs.tolist()] == sorted(direct.goals)
    with pytest.raises(ValueError, match=r"\[0, 2\^31\)"):
        agg.aggregate(make_round(3, [2 ** 31, 1], U2))


# ---- state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("via_hdf5", [False, True])
def test_state_dict_round_trip(tmp_path, via_hdf5):
    params = dict(notion="eo", eps=0.02, eta_lambda=0.3, alpha=0.7, beta=0.4, seed=2)
    rounds = conflicting_rounds(torch.float32, num_rounds=8)
    a = create("mfairfl", **params)
    for r in rounds[:4]:
        a.aggregate(r)
    state = a.state_dict()
    assert state["goal_pairs"].dtype == np.int64 and state["goal_pairs"].shape[1] == 2
    assert state["goal_values"].dtype == np.float64 and state["multipliers"].dtype == np.float64
    if via_hdf5:
        state = h5_round_trip(state, tmp_path / "s.h5")
    b = create("mfairfl", **params)
    b.load_state_dict(state)
    for k, v in a.state_dict().items():
        w = b.state_dict()[k]
        assert (np.array_equal(v, w) and v.dtype == w.dtype) if isinstance(v, np.ndarray) \
            else v == w, k
    for r in rounds[4:]:
        assert torch.equal(a.aggregate(r), b.aggregate(r))
    assert np.array_equal(a.multipliers, b.multipliers)
    assert all(np.array_equal(x, y) for x, y in zip(a.goals(), b.goals()))


def test_fresh_state_round_trip(tmp_path):
    state = h5_round_trip(create("mfairfl").state_dict(), tmp_path / "s.h5")
    b = create("mfairfl")
    b.load_state_dict(state)
    assert b.num_goals == 0 and b.multipliers.shape == (0,)


def test_state_is_checked():
    a = create("mfairfl", alpha=0.5)
    a.aggregate(make_round(0, [1, 2, 3], np.random.default_rng(8).standard_normal((3, 4))))
    state = a.state_dict()
    with pytest.raises(ValueError, match="alpha=0.5"):
        create("mfairfl", alpha=0.6).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        create("mfairfl", alpha=0.5).load_state_dict({k: v for k, v in state.items()
                                                      if k != "goal_values"})
    bad = dict(state, goal_pairs=state["goal_pairs"][::-1].copy())
    with pytest.raises(ValueError, match="sorted"):
        create("mfairfl", alpha=0.5).load_state_dict(bad)
    bad = dict(state, goal_values=state["goal_values"][:-1])
    with pytest.raises(ValueError, match="goal values"):
        create("mfairfl", alpha=0.5).load_state_dict(bad)
    with pytest.raises(ValueError, match="expects 3"):
        create("mfairfl", alpha=0.5, num_constraints=3).load_state_dict(
            dict(state, multipliers=np.zeros(2)))


def test_rounds_must_increase():
    agg = create("mfairfl")
    agg.aggregate(make_round(3, [0, 1], U2, LOSS2))
    with pytest.raises(ValueError, match="round 3"):
        agg.aggregate(make_round(3, [0, 1], U2, LOSS2))


def test_non_finite_loss_rejected():
    with pytest.raises(ValueError, match="client 1 has loss"):
        create("mfairfl").aggregate(make_round(0, [0, 1], U2, [0.1, np.nan]))


# ---- hyper-parameters, registry, config ------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(alpha=1.1), dict(alpha=-0.1), dict(alpha="0.5"),
                                dict(beta=0.0), dict(beta=1.5), dict(eps=-0.1),
                                dict(eta_lambda=-1.0), dict(eta_lambda=float("nan")),
                                dict(notion="sp"), dict(num_constraints=0), dict(seed=-1)])
def test_bad_hyper_parameters(kw):
    with pytest.raises(ValueError):
        create("mfairfl", **kw)


def test_registered_with_client_options():
    assert "mfairfl" in available() and rule("mfairfl") is MFairFL
    p = MFairFL.Params(notion="ap", eps=0.1, eta_lambda=0.1, alpha=0.5, beta=0.1)
    assert rule("mfairfl").client_options(p) == {"fair_notion": "ap", "fair_eps": 0.1}
    assert not MFairFL.needs.num_clients and MFairFL.needs.num_groups


def test_config_table():
    # the table validates while another rule runs (mfairfl itself is refused until its
    # client-side training exists: tests/inprocess/test_config.py)
    cfg = load_config("jobs/fmnist-fedfv.toml", ["mfairfl.notion=\"eo\"", "mfairfl.alpha=1"])
    params = cfg.mfairfl.model_dump()
    assert params == {"notion": "eo", "eps": 0.05, "eta_lambda": 0.1, "alpha": 1.0, "beta": 0.01}
    agg = create("mfairfl", seed=cfg.run.seed, **params)
    assert agg.notion == "eo" and agg.alpha == 1.0


@pytest.mark.parametrize("override,key", [("mfairfl.alpha=2", "mfairfl.alpha"),
                                          ("mfairfl.beta=0", "mfairfl.beta"),
                                          ("mfairfl.eps=-0.1", "mfairfl.eps"),
                                          ("mfairfl.eta_lambda=-1", "mfairfl.eta_lambda"),
                                          ("mfairfl.notion=\"sp\"", "mfairfl.notion"),
                                          ("mfairfl.gamma=1", "mfairfl.gamma")])
def test_config_validation(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("jobs/fmnist-fedfv.toml", ["server.algorithm=mfairfl", override])
