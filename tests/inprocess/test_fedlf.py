"""FedLF (docs/ALGORITHMS.md §5): the no-conflict invariant on random inputs, the combine-layers
rule, the QP against a direct cvxopt solve on explicit vectors, absent-client history, bounded
memory, state round trips through HDF5, a hand-checked 2-client case, and the jobs."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, create
from mpifl.aggregators.fedlf import fair_weights, fedlf_direction, layer_slices
from mpifl.experiment.config import load_config

REPO = Path(__file__).resolve().parents[2]
LR = 0.1


def make_round(t, ids, G, losses, layers=None, dtype=torch.float64, lr=LR):
    """A round whose gradient estimates are the rows of G (updates u = lr g)."""
    U = torch.as_tensor(np.asarray(G, dtype=np.float64) * lr, dtype=dtype)
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=U, losses=losses,
                        num_samples=np.full(len(ids), 10), lr=lr, layers=layers)


def random_layers(rng, num_layers, lo=2, hi=9):
    sizes = rng.integers(lo, hi, num_layers)
    b = np.concatenate([[0], np.cumsum(sizes)])
    return [slice(int(x), int(y)) for x, y in zip(b[:-1], b[1:])], int(b[-1])


def fair_row(G, h):
    """p = sum_k h_k g_k / ||g_k|| (the fair row before its rescaling to mu)."""
    return h @ (G / np.linalg.norm(G, axis=1, keepdims=True))


def assert_no_conflict(X, m, losses, layers, direction, tol=1e-8):
    """docs/ALGORITHMS.md §5.8 per solved layer group: every row (clients, history) and the fair row
    have a non-negative dot product with d_g, up to tol relative, unless d_g is zero."""
    d, h = direction.d.cpu().numpy(), fair_weights(losses)
    checked = 0
    for grp in direction.groups:
        idx = np.concatenate([np.arange(layers[j].start, layers[j].stop) for j in grp.layers])
        dg = d[idx]
        if np.linalg.norm(dg) <= 1e-8 * grp.mu:
            continue
        rows = X[:, idx]
        rel = rows @ dg / (np.linalg.norm(rows, axis=1) * np.linalg.norm(dg))
        assert rel.min() >= -tol, (grp.layers, rel.min())
        p = fair_row(X[:m, idx], h)
        if np.linalg.norm(p) > 0:
            assert p @ dg >= -tol * np.linalg.norm(p) * np.linalg.norm(dg)
        checked += 1
    return checked


# ----------------------------------------------------------------------------- invariant

@pytest.mark.parametrize("seed", range(6))
def test_invariant_on_random_rounds(seed):
    """Partial participation over K clients, so absent-client rows join; the step never
    conflicts with a selected client, per solved layer group or for the whole model."""
    rng = np.random.default_rng(seed)
    layers, D = random_layers(rng, int(rng.integers(1, 5)), lo=6, hi=20)
    agg, last_g = create("fedlf"), {}
    K, checked = 12, 0
    for t in range(8):
        m = int(rng.integers(2, 6))
        ids = rng.choice(K, m, replace=False)
        G = rng.standard_normal((m, D)) * rng.uniform(0.1, 5, (m, 1)) + rng.standard_normal(D)
        losses = rng.uniform(0.1, 3.0, m)
        step = agg.aggregate(make_round(t, ids, G, losses, layers)).numpy()
        hist = np.array([last_g[int(k)] for k in agg.last_history_ids]).reshape(-1, D)
        X = np.vstack([G, hist])
        checked += assert_no_conflict(X, m, losses, layers, agg.last_direction)
        model_rel = G @ step / (np.linalg.norm(G, axis=1) * np.linalg.norm(step))
        assert model_rel.min() >= -1e-8
        last_g.update({int(k): g for k, g in zip(ids, G)})
    assert checked > 0


def test_invariant_float32_updates():
    rng = np.random.default_rng(7)
    layers, D = random_layers(rng, 3, lo=30, hi=60)
    G = rng.standard_normal((6, D)) + 0.5 * rng.standard_normal(D)
    r = make_round(0, np.arange(6), G, rng.uniform(0.5, 2, 6), layers, dtype=torch.float32)
    step = create("fedlf").aggregate(r)
    assert step.dtype == torch.float32 and step.shape == (D,)
    Gf = r.updates.double() / LR
    rel = Gf @ step.double() / (Gf.norm(dim=1) * step.double().norm())
    assert float(rel.min()) >= -1e-6


def test_fair_row_is_normalised_not_raw():
    """docs/ALGORITHMS.md §5.8 also names g_P = sum h_k g_k; the rule guarantees the fair row built
    from the normalised slices (p_l), not the raw g_P: a documented difference, checked here so that
    a change of the rule is noticed."""
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(60):
        m = int(rng.integers(2, 6))
        G = rng.standard_normal((m, 5)) * rng.uniform(0.1, 10, (m, 1))
        L = rng.uniform(0.1, 3, m)
        d = fedlf_direction(torch.tensor(G), m, L).d.numpy()
        gp = fair_weights(L) @ G
        if np.linalg.norm(d) > 0 and np.linalg.norm(gp) > 0:
            worst = min(worst, gp @ d / (np.linalg.norm(gp) * np.linalg.norm(d)))
    assert worst < -1e-3


# ----------------------------------------------------------------------------- combine rule

def test_combine_layers_rule_fires_on_opposite_rows():
    # layer 0 (3 parameters): the two clients' slices are exactly opposite, so the min-norm
    # point of {a, -a} is 0; layer 1 (2 parameters) agrees. Equal losses: no fair row.
    a = np.array([1.0, -2.0, 0.5])
    G = np.array([[*a, 1.0, 0.2], [*(-a), 0.8, 0.4]])
    layers = [slice(0, 3), slice(3, 5)]
    agg = create("fedlf")
    step = agg.aggregate(make_round(0, [0, 1], G, [1.0, 1.0], layers)).numpy()
    groups = agg.last_direction.groups
    assert [g.layers for g in groups] == [[0, 1]]
    assert not groups[0].fair_row
    assert np.linalg.norm(step) > 0
    assert (G @ step >= -1e-12 * np.linalg.norm(G, axis=1) * np.linalg.norm(step)).all()
    # without merging, layer 0 alone would give exactly nothing
    alone = fedlf_direction(torch.tensor(G[:, :3]), 2, [1.0, 1.0])
    assert alone.groups[0].norm <= 1e-8 * alone.groups[0].mu


def test_combine_last_layer_merges_with_previous():
    b = np.array([0.3, -1.0])
    G = np.array([[1.0, 0.1, 0.5, 0.2, *b], [0.7, 0.3, 0.4, 0.1, *(-b)]])
    layers = [slice(0, 2), slice(2, 4), slice(4, 6)]
    d = fedlf_direction(torch.tensor(G), 2, [1.0, 1.0], layers)
    assert [g.layers for g in d.groups] == [[0], [1, 2]]


def test_everything_zero_gives_zero_step():
    G = np.array([[1.0, 2.0], [-1.0, -2.0]])
    agg = create("fedlf")
    step = agg.aggregate(make_round(0, [0, 1], G, [1.0, 1.0], [slice(0, 1), slice(1, 2)]))
    assert torch.equal(step, torch.zeros(2, dtype=torch.float64))
    assert [g.layers for g in agg.last_direction.groups] == [[0, 1]]


# ----------------------------------------------------------------------------- QP oracle

def direct_direction(X, m, L, layers):
    """The reference code's per-layer construction on explicit vectors, solved with cvxopt."""
    from cvxopt import matrix, solvers

    h = fair_weights(L)
    out = []
    for s in layers:
        Xl = X[:, s]
        norms = np.linalg.norm(Xl, axis=1)
        mu = norms[:m].mean()
        Q = Xl / norms[:, None] * mu                         # clients and history, norm mu
        p = h @ Q[:m]
        Q = np.vstack([Q[:m], p / np.linalg.norm(p) * mu, Q[m:]])
        n = len(Q)
        P = Q @ Q.T
        sol = solvers.qp(matrix(0.5 * (P + P.T)), matrix(np.zeros(n)), matrix(-np.eye(n)),
                         matrix(np.zeros(n)), matrix(np.ones((1, n))), matrix(np.ones(1)),
                         options={"show_progress": False, "abstol": 1e-12, "reltol": 1e-12,
                                  "feastol": 1e-12})
        out.append(np.asarray(sol["x"]).ravel() @ Q)
    return np.concatenate(out)


def test_qp_matches_direct_cvxopt_on_explicit_vectors():
    rng = np.random.default_rng(4)
    layers = [slice(0, 7), slice(7, 12)]
    X = rng.standard_normal((5, 12)) * rng.uniform(0.5, 3, (5, 1))   # 3 clients, 2 history
    X[:3] += rng.standard_normal(12)
    L = np.array([0.4, 1.3, 0.9])
    got = fedlf_direction(torch.tensor(X), 3, L, layers)
    assert all(g.fair_row and len(g.layers) == 1 for g in got.groups)
    want = direct_direction(X, 3, L, layers)
    np.testing.assert_allclose(got.d.numpy(), want, rtol=0, atol=1e-6 * np.linalg.norm(want))


# ----------------------------------------------------------------------------- history

def test_absent_clients_join_with_tau():
    rng = np.random.default_rng(5)
    layers = [slice(0, 4), slice(4, 9)]
    g = {k: rng.standard_normal(9) + 1.0 for k in range(6)}
    L = [0.5, 1.5]
    agg = create("fedlf")
    # rounds 0, 1: M = 0 then 2 (not > m = 2): no history
    for t, ids in enumerate(([0, 1], [2, 3])):
        agg.aggregate(make_round(t, ids, [g[k] for k in ids], L, layers))
        assert agg.last_tau == 0 and len(agg.last_history_ids) == 0
    # round 2: M = 4 > 2, tau = 2: absent clients seen in rounds 0..1 join (1 and 3)
    step = agg.aggregate(make_round(2, [0, 2], [g[0], g[2]], L, layers))
    assert agg.last_tau == 2 and agg.last_history_ids.tolist() == [1, 3]
    X = np.vstack([g[0], g[2], g[1], g[3]])
    d = fedlf_direction(torch.tensor(X), 2, L, layers).d
    target = np.linalg.norm((g[0] + g[2]) / 2)
    np.testing.assert_allclose(step.numpy(), LR * d.numpy() * target / float(d.norm()),
                               rtol=1e-12, atol=1e-15)
    # round 5 (rounds 3, 4 skipped): M = 4, tau = 2: rounds >= 3 only, nobody is left
    agg.aggregate(make_round(5, [4, 5], [g[4], g[5]], L, layers))
    assert agg.last_tau == 2 and len(agg.last_history_ids) == 0


def test_history_memory_is_bounded_by_the_rule():
    rng = np.random.default_rng(6)
    agg, K, m, D = create("fedlf"), 30, 5, 12
    seen = {}
    for t in range(40):
        ids = rng.choice(K, m, replace=False)
        agg.aggregate(make_round(t, ids, rng.standard_normal((m, D)) + 1.0,
                                 rng.uniform(0.5, 2, m)))
        seen.update({int(k): t for k in ids})
        # rounds >= t + 1 - floor(M/m) can still be used by a later round (tau grows <= 1/round)
        span = len(seen) // m
        needed = sum(1 for tk in seen.values() if tk >= t + 1 - span)
        assert agg.history_rows == needed <= min(len(seen), span * m)
    assert 0 < agg.history_rows < K


def test_dropouts_do_not_shrink_the_nominal_round_size():
    rng = np.random.default_rng(8)
    agg = create("fedlf")
    for t, ids in enumerate(([0, 1, 2], [3, 4, 5], [6, 7])):      # the last round lost one
        agg.aggregate(make_round(t, ids, rng.standard_normal((len(ids), 4)) + 1, [1.0] *
                                 len(ids)))
    assert agg.last_tau == 6 // 3                                  # m = 3, not 2


# ----------------------------------------------------------------------------- state

def rounds_for_state(rng, D=10, K=8):
    out = []
    for t in range(6):
        m = int(rng.integers(2, 5))
        ids = rng.choice(K, m, replace=False)
        out.append(make_round(t, ids, rng.standard_normal((m, D)) + 0.5, rng.uniform(0.2, 2, m),
                              [slice(0, 4), slice(4, D)], dtype=torch.float32))
    return out


def test_state_round_trip_through_hdf5_is_bit_exact(tmp_path):
    rounds = rounds_for_state(np.random.default_rng(9))
    a = create("fedlf")
    for r in rounds[:5]:
        a.aggregate(r)
    state = a.state_dict()
    assert all(isinstance(v, (np.ndarray, int, float, str)) for v in state.values())
    assert a.history_rows > 0
    with h5py.File(tmp_path / "s.h5", "w") as f:
        for k, v in state.items():
            f[k] = v
    with h5py.File(tmp_path / "s.h5", "r") as f:
        loaded = {k: f[k][()] for k in f}
    b = create("fedlf")
    b.load_state_dict(loaded)
    for k, v in b.state_dict().items():
        assert np.array_equal(np.asarray(v), np.asarray(state[k])), k
    assert torch.equal(a.aggregate(rounds[5]), b.aggregate(rounds[5]))


def test_state_errors():
    agg = create("fedlf")
    with pytest.raises(ValueError, match="missing"):
        agg.load_state_dict({"zero_tol": 1e-8})
    state = create("fedlf", zero_tol=1e-6).state_dict()
    with pytest.raises(ValueError, match="zero_tol"):
        agg.load_state_dict(state)


# ----------------------------------------------------------------------------- by hand

def test_two_clients_in_two_dimensions_by_hand():
    # g1 = e1, g2 = e2, lr 0.1, one layer.
    G = np.eye(2)
    # Equal losses: h = 0, no fair row; both rows have norm mu = 1 and the min-norm point of
    # the segment [e1, e2] is (1/2, 1/2); ||mean g|| = ||(1/2, 1/2)||, so d stays (1/2, 1/2).
    agg = create("fedlf")
    step = agg.aggregate(make_round(0, [0, 1], G, [1.0, 1.0]))
    np.testing.assert_allclose(step.numpy(), [0.05, 0.05], atol=1e-12)
    # Losses (1, 2): e = (1,1)/sqrt2, e.L = 3/sqrt2, ||L||^2 = 5,
    # h = [(3/sqrt2)(1,2)/5 - (1,1)/sqrt2] / sqrt5 = (-2, 1) / (5 sqrt10).
    h = fair_weights([1.0, 2.0])
    np.testing.assert_allclose(h, np.array([-2.0, 1.0]) / (5 * math.sqrt(10)), atol=1e-15)
    # Fair row p = h1 e1 + h2 e2 rescaled to mu = 1: c = (-2, 1)/sqrt5. All three rows have
    # norm 1; the min-norm point of the triangle {e1, e2, c} is the midpoint of e1 and c,
    # q = ((1 - 2/sqrt5)/2, 1/(2 sqrt5)) (lambda = (1/2, 0, 1/2)); e2 . q = 1/(2 sqrt5) >= ||q||^2
    # = (1 - 2/sqrt5)/2, so e2 does not pull it. Rescaled to ||mean g|| = 1/sqrt2, times lr.
    step = agg.aggregate(make_round(1, [0, 1], G, [1.0, 2.0]))
    q = np.array([(1 - 2 / math.sqrt(5)) / 2, 1 / (2 * math.sqrt(5))])
    want = LR * q / np.linalg.norm(q) / math.sqrt(2)
    np.testing.assert_allclose(step.numpy(), want, rtol=1e-8)
    np.testing.assert_allclose(agg.last_direction.groups[0].lam, [0.5, 0.0, 0.5], atol=1e-8)
    assert step[1] > step[0] > 0           # the high-loss client descends more; nobody ascends


def test_fair_weights():
    L = np.array([0.3, 1.2, 0.7, 2.0])
    h = fair_weights(L)
    assert abs(h @ L) < 1e-15
    # h is the gradient of -cos(1, L) with respect to L
    Lt = torch.tensor(L, requires_grad=True)
    (-(Lt.sum() / (2.0 * Lt.norm()))).backward()
    np.testing.assert_allclose(h, Lt.grad.numpy(), rtol=1e-12)
    assert not fair_weights([0.5, 0.5, 0.5]).any()
    assert not fair_weights([1.7]).any()
    with pytest.raises(ValueError):
        fair_weights([1.0, float("nan")])


def test_one_client_without_history_is_its_own_gradient():
    g = np.array([[3.0, -1.0, 2.0]])
    step = create("fedlf").aggregate(make_round(0, [4], g, [0.7], [slice(0, 1), slice(1, 3)]))
    np.testing.assert_allclose(step.numpy(), LR * g[0], rtol=1e-12)


def test_bad_inputs():
    agg = create("fedlf")
    with pytest.raises(ValueError, match="tile"):
        agg.aggregate(make_round(0, [0, 1], np.ones((2, 4)), [1, 2], [slice(0, 2), slice(3, 4)]))
    with pytest.raises(ValueError, match="cover"):
        layer_slices([slice(0, 2)], 4)
    agg.aggregate(make_round(3, [0, 1], np.ones((2, 4)), [1, 2]))
    with pytest.raises(ValueError, match="not after"):
        agg.aggregate(make_round(3, [0, 1], np.ones((2, 4)), [1, 2]))
    with pytest.raises(ValueError, match="zero_tol"):
        create("fedlf", zero_tol=0)


# ----------------------------------------------------------------------------- jobs

@pytest.mark.parametrize("job", ["fedlf-fmnist-dir01", "fedlf-fmnist-pat1", "fedlf-fmnist-pat2"])
def test_jobs_validate(job):
    cfg = load_config(REPO / "jobs" / f"{job}.toml")
    assert cfg.server.algorithm == "fedlf" and cfg.data.num_clients == 100
    assert cfg.server.clients_per_round == 10 and cfg.model.hidden == [200, 200, 200]
    assert (cfg.client.batch_size, cfg.client.lr, cfg.client.lr_decay) == (0, 0.1, 0.999)
