"""Server-side baselines of docs/ALGORITHMS.md §7: qFedAvg, DRFL, AFL, FedMGDA+. Each aggregation
against a direct computation of the reference's formula written plainly here, a hand-checked
2-client case in 2-D, state round trips, and the config tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cvxopt import matrix, solvers

from mpifl.aggregators import RoundUpdates, available, create
from mpifl.aggregators.afl import project_simplex
from mpifl.experiment.config import load_config
from mpifl.core.errors import ConfigError
from tests.helpers import h5_round_trip

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
MAIN_JOB = ROOT / "jobs" / "fmnist-fedfv.toml"
NEW = ("qfedavg", "drfl", "afl", "fedmgda_plus")


def make_round(t, ids, U, losses, n=None, lr=0.1, dtype=torch.float64):
    U = torch.as_tensor(np.asarray(U, dtype=np.float64), dtype=dtype)
    m = U.shape[0]
    n = np.full(m, 10) if n is None else n
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=U, losses=losses,
                        num_samples=n, lr=lr)


def random_round(seed, m=6, d=15, dtype=torch.float64, t=0, ids=None):
    """Updates with a shared direction plus noise (so some pairs conflict), distinct losses and
    sample counts."""
    rng = np.random.default_rng(seed)
    U = 0.5 * rng.standard_normal(d) + rng.standard_normal((m, d)) * rng.uniform(0.2, 2.0, (m, 1))
    losses = rng.uniform(0.1, 2.5, m)
    n = rng.integers(5, 200, m)
    ids = np.arange(m) if ids is None else ids
    return make_round(t, ids, U, losses, n=n, lr=float(rng.choice([0.01, 0.1, 0.5])),
                      dtype=dtype)


def as64(r):
    """The round as float64 numpy arrays (losses as the aggregator sees them: float32)."""
    return (r.updates.double().numpy(), r.losses.double().numpy(),
            r.num_samples.numpy().astype(np.float64))


TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=2e-5, atol=1e-6)}


# ---- qFedAvg ---------------------------------------------------------------------------------

def direct_qfedavg(r, q):
    U, losses, _ = as64(r)
    L = 1.0 / r.lr
    num, den = np.zeros(U.shape[1]), 0.0
    for u, l in zip(U, losses):
        delta = L * u
        F = l + 1e-10
        num += F ** q * delta
        den += q * F ** (q - 1) * (delta @ delta) + L * F ** q
    return num / den


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q", [0.0, 0.1, 1.0, 2.0, 5.0])
def test_qfedavg_matches_direct(q, dtype):
    for seed in range(5):
        r = random_round(seed, dtype=dtype)
        s = create("qfedavg", q=q).aggregate(r)
        assert s.dtype == dtype and s.shape == (r.d,)
        np.testing.assert_allclose(s.double().numpy(), direct_qfedavg(r, q), **TOL[dtype])


def test_qfedavg_two_clients_by_hand():
    """u1 = (1, 0), u2 = (0, 1), losses 1 and 4, q = 1, lr = 0.5 so L = 2:
    Delta1 = (2, 0), Delta2 = (0, 2); d1 = 1 * (2, 0), d2 = 4 * (0, 2) = (0, 8);
    h1 = 1 * 1^0 * 4 + 2 * 1 = 6, h2 = 1 * 4^0 * 4 + 2 * 4 = 12; s = (2, 8) / 18 = (1/9, 4/9)."""
    r = make_round(0, [0, 1], [[1, 0], [0, 1]], [1.0, 4.0], lr=0.5)
    np.testing.assert_allclose(create("qfedavg", q=1.0).aggregate(r).numpy(), [1 / 9, 4 / 9],
                               atol=1e-9)


def test_qfedavg_q0_is_the_mean():
    r = random_round(1)
    np.testing.assert_allclose(create("qfedavg", q=0).aggregate(r).numpy(),
                               r.updates.mean(0).numpy(), rtol=1e-12)


def test_qfedavg_higher_q_favours_high_loss_clients():
    """Two orthogonal unit updates, losses 0.5 and 2: the share of the high-loss client's
    direction grows with q."""
    r = make_round(0, [0, 1], [[1, 0], [0, 1]], [0.5, 2.0])
    shares = [float(s[1] / s.sum()) for s in
              (create("qfedavg", q=q).aggregate(r) for q in (0.0, 0.5, 1.0, 3.0))]
    assert shares[0] == pytest.approx(0.5) and np.all(np.diff(shares) > 0)


# ---- DRFL ------------------------------------------------------------------------------------

def direct_drfl(r):
    U, losses, _ = as64(r)
    s = np.zeros(U.shape[1])
    for u, l in zip(U, losses):
        s += l / losses.sum() * u
    return s


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_drfl_matches_direct(dtype):
    for seed in range(5):
        r = random_round(seed, dtype=dtype)
        s = create("drfl").aggregate(r)
        assert s.dtype == dtype
        np.testing.assert_allclose(s.double().numpy(), direct_drfl(r), **TOL[dtype])


def test_drfl_two_clients_by_hand():
    """u1 = (1, 0), u2 = (0, 1), losses 1 and 3: p = (1/4, 3/4), s = (0.25, 0.75)."""
    r = make_round(0, [4, 9], [[1, 0], [0, 1]], [1.0, 3.0])
    np.testing.assert_allclose(create("drfl").aggregate(r).numpy(), [0.25, 0.75], atol=1e-15)


def test_drfl_all_zero_losses_fall_back_to_uniform():
    r = make_round(0, [0, 1, 2], np.eye(3), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(create("drfl").aggregate(r).numpy(), [1 / 3] * 3)


@pytest.mark.parametrize("name", ["qfedavg", "drfl", "afl"])
@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_loss_weighted_rules_reject_bad_losses(name, bad):
    r = make_round(0, [0, 1], np.eye(2), [1.0, bad])
    with pytest.raises(ValueError, match="client 1 has loss"):
        create(name).aggregate(r)


# ---- FedMGDA+ ---------------------------------------------------------------------------------

def direct_fedmgda(r, eps, eta):
    """docs/ALGORITHMS.md §7 (FedMGDA+) on explicit normalised vectors, with a plain cvxopt call (as
    the reference code: P = 2 J J^T, box rows -I and I, one equality row)."""
    U, _, n = as64(r)
    m = U.shape[0]
    unit = np.array([u / (np.linalg.norm(u) + 1e-8) for u in U])
    lam0 = n / n.sum()
    lb = np.array([max(0.0, x - eps) for x in lam0])
    ub = np.array([min(1.0, x + eps) for x in lam0])
    sol = solvers.qp(matrix(2 * unit @ unit.T), matrix(np.zeros((m, 1))),
                     matrix(np.vstack([-np.eye(m), np.eye(m)])),
                     matrix(np.concatenate([-lb, ub]).reshape(-1, 1)),
                     matrix(np.ones((1, m))), matrix(np.ones((1, 1))),
                     options={"show_progress": False, "abstol": 1e-12, "reltol": 1e-12,
                              "feastol": 1e-12})
    lam = np.array(sol["x"]).ravel()
    return eta * lam @ unit, lam


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eps,eta", [(0.02, 1.0), (0.1, 1.0), (0.3, 0.5), (1.0, 2.0)])
def test_fedmgda_matches_direct_cvxopt(eps, eta, dtype):
    moved = 0
    for seed in range(4):
        r = random_round(10 + seed, m=6, d=15, dtype=dtype)
        agg = create("fedmgda_plus", eps=eps, eta=eta)
        s = agg.aggregate(r)
        want, lam = direct_fedmgda(r, eps, eta)
        assert s.dtype == dtype and agg.last_status == "optimal"
        np.testing.assert_allclose(s.double().numpy(), want,
                                   atol=1e-7 if dtype == torch.float64 else 2e-6)
        np.testing.assert_allclose(agg.last_lambda, lam, atol=1e-6)
        lam0 = as64(r)[2] / as64(r)[2].sum()
        moved += np.abs(lam - lam0).max() > 1e-3
    assert moved >= 3          # the QP does real work on these inputs


def test_fedmgda_two_clients_by_hand():
    """u1 = (2, 0), u2 = (0, 1) normalise to e1, e2 (up to the 1e-8); n = (1, 3) so
    lam0 = (1/4, 3/4). Unconstrained min-norm point of [e1, e2]: lam = (1/2, 1/2).
    eps = 0.1: lam_1 <= 0.35, so lam = (0.35, 0.65) and s = eta (0.35, 0.65).
    eps = 0.5: (1/2, 1/2) is inside the box: s = eta (0.5, 0.5)."""
    r = make_round(0, [0, 1], [[2, 0], [0, 1]], [1.0, 1.0], n=[1, 3])
    np.testing.assert_allclose(create("fedmgda_plus", eps=0.1, eta=1.0).aggregate(r).numpy(),
                               [0.35, 0.65], atol=1e-8)
    np.testing.assert_allclose(create("fedmgda_plus", eps=0.5, eta=0.2).aggregate(r).numpy(),
                               [0.1, 0.1], atol=1e-8)


def test_fedmgda_eps0_is_sample_weighted_unit_vectors():
    r = random_round(3)
    U, _, n = as64(r)
    unit = U / (np.linalg.norm(U, axis=1, keepdims=True) + 1e-8)
    agg = create("fedmgda_plus", eps=0.0, eta=0.7)
    np.testing.assert_allclose(agg.aggregate(r).numpy(), 0.7 * (n / n.sum()) @ unit, atol=1e-12)
    assert agg.last_status == "trivial"


def test_fedmgda_degenerate_updates_give_finite_steps():
    """A zero update (its unit vector is 0, so the min-norm point puts all it may on it),
    duplicated updates, and more clients than dimensions."""
    rng = np.random.default_rng(4)
    U = rng.standard_normal((4, 3))
    for V in (np.vstack([U, np.zeros(3)]), np.vstack([U, U]), rng.standard_normal((9, 2))):
        r = make_round(0, np.arange(len(V)), V, np.ones(len(V)))
        agg = create("fedmgda_plus", eps=1.0)
        s = agg.aggregate(r)
        assert torch.isfinite(s).all() and agg.last_status == "optimal"
        want, _ = direct_fedmgda(r, 1.0, 1.0)
        np.testing.assert_allclose(s.numpy(), want, atol=1e-6)
    all_zero = make_round(0, [0, 1], np.zeros((2, 3)), [1.0, 1.0])
    assert torch.equal(create("fedmgda_plus").aggregate(all_zero), torch.zeros(3,
                                                                               dtype=torch.float64))


def test_fedmgda_step_does_not_conflict_with_any_client_on_the_simplex():
    """eps = 1 is MGDA: the min-norm point d of the hull satisfies d . û_k >= ||d||^2 >= 0."""
    for seed in range(5):
        r = random_round(20 + seed, m=5, d=12)
        s = create("fedmgda_plus", eps=1.0).aggregate(r)
        assert (r.updates @ s >= -1e-9).all()


# ---- AFL -------------------------------------------------------------------------------------

def direct_projection(v):
    """Euclidean projection onto the simplex as a QP, solved by a plain cvxopt call:
    min ||y - v||^2 = y^T y - 2 v^T y  s.t. y >= 0, sum y = 1."""
    k = len(v)
    sol = solvers.qp(matrix(2 * np.eye(k)), matrix(-2 * np.asarray(v, float).reshape(-1, 1)),
                     matrix(-np.eye(k)), matrix(np.zeros((k, 1))), matrix(np.ones((1, k))),
                     matrix(np.ones((1, 1))),
                     options={"show_progress": False, "abstol": 1e-13, "reltol": 1e-13,
                              "feastol": 1e-13})
    return np.array(sol["x"]).ravel()


def assert_projection_kkt(y, v):
    """y = proj(v) iff y >= 0, sum y = 1 and, for one theta: y_i = v_i - theta where y_i > 0 and
    v_i - theta <= 0 where y_i = 0."""
    assert (y >= 0).all() and y.sum() == pytest.approx(1.0, abs=1e-13)
    pos = y > 0
    theta = v[pos] - y[pos]
    np.testing.assert_allclose(theta, theta[0], atol=1e-13)
    assert (v[~pos] - theta[0] <= 1e-13).all()


@pytest.mark.parametrize("eta", [0.01, 0.3, 2.0])
def test_afl_two_rounds_against_direct_projection(eta):
    rng = np.random.default_rng(5)
    K, d = 7, 10
    agg = create("afl", eta_lambda=eta, num_clients=K)
    np.testing.assert_array_equal(agg.lam, np.full(K, 1 / K))
    clipped = 0
    for t in range(2):
        lam = agg.lam                    # round 1 starts from round 0's lam, checked below
        perm = rng.permutation(K)                              # rows in any order
        U = rng.standard_normal((K, d))
        losses = rng.uniform(0.1, 3.0, K).astype(np.float32)
        r = make_round(t, perm, U, losses)
        s = agg.aggregate(r).numpy()
        want = np.zeros(d)
        for row, k in enumerate(perm):
            want += lam[k] * U[row]
        np.testing.assert_allclose(s, want, rtol=1e-12, atol=1e-14)
        v = lam.copy()
        v[perm] += eta * losses.astype(np.float64)
        np.testing.assert_allclose(agg.lam, direct_projection(v), atol=1e-9)
        assert_projection_kkt(agg.lam, v)
        clipped += int((agg.lam == 0).sum())
    assert (clipped > 0) == (eta >= 0.3)


@pytest.mark.parametrize("seed", range(6))
def test_project_simplex_against_qp(seed):
    rng = np.random.default_rng(30 + seed)
    v = rng.standard_normal(int(rng.integers(1, 40))) * rng.choice([0.01, 1, 10])
    y = project_simplex(v)
    assert_projection_kkt(y, v)
    np.testing.assert_allclose(y, direct_projection(v), atol=1e-9)


def test_afl_two_clients_by_hand():
    """K = 2, lam = (1/2, 1/2), u1 = (1, 0), u2 = (0, 2), losses (1, 3), eta_lambda = 0.1.
    Round 0: s = (0.5, 1.0); lam <- proj(0.6, 0.8) = (0.4, 0.6) (shift by 0.2).
    Round 1: s = (0.4, 1.2); lam <- proj(0.5, 0.9) = (0.3, 0.7).
    From w^0 = 0: w^1 = (-0.5, -1.0), w^2 = (-0.9, -2.2); evaluated: mean(w^1, w^2) = (-0.7, -1.6).
    eta_lambda = 1: proj(1.5, 3.5) = (0, 1) (theta = 2.5 clips client 0)."""
    agg = create("afl", eta_lambda=0.1)
    w = torch.zeros(2, dtype=torch.float64)
    assert agg.evaluation_params(w) is w                       # nothing observed yet
    steps = []
    for t in range(2):
        s = agg.aggregate(make_round(t, [0, 1], [[1, 0], [0, 2]], [1.0, 3.0]))
        steps.append(s.numpy())
        w = w - s
        agg.observe_params(w)
    np.testing.assert_allclose(steps, [[0.5, 1.0], [0.4, 1.2]], atol=1e-15)
    np.testing.assert_allclose(agg.lam, [0.3, 0.7], atol=1e-15)
    np.testing.assert_allclose(w.numpy(), [-0.9, -2.2], atol=1e-15)
    np.testing.assert_allclose(agg.evaluation_params(w).numpy(), [-0.7, -1.6], atol=1e-15)
    agg = create("afl", eta_lambda=1.0)
    agg.aggregate(make_round(0, [0, 1], [[1, 0], [0, 2]], [1.0, 3.0]))
    np.testing.assert_allclose(agg.lam, [0.0, 1.0], atol=1e-15)


def test_afl_evaluation_params_keeps_dtype_device_and_shape():
    agg = create("afl")
    agg.aggregate(make_round(0, [0, 1], [[1, 0], [0, 2]], [1.0, 3.0]))
    w = torch.tensor([1.0, 2.0], dtype=torch.float32)
    agg.observe_params(w)
    agg.aggregate(make_round(1, [0, 1], [[1, 0], [0, 2]], [1.0, 3.0]))
    agg.observe_params(torch.tensor([2.0, 5.0], dtype=torch.float32))
    out = agg.evaluation_params(w)
    assert out.dtype == torch.float32 and out.shape == w.shape and out is not w
    np.testing.assert_allclose(out.numpy(), [1.5, 3.5])
    assert torch.equal(w, torch.tensor([1.0, 2.0]))             # not modified


def test_afl_missing_clients_renormalise():
    """K = 3 with client 1 missing (dropped out): lam = 1/3 each, renormalised over {0, 2} to
    1/2 each; only the present clients' losses push lam: proj(1/3 + 0.1, 1/3, 1/3 + 0.3)."""
    agg = create("afl", eta_lambda=0.1, num_clients=3)
    s = agg.aggregate(make_round(0, [0, 2], [[1, 0], [0, 1]], [1.0, 3.0]))
    np.testing.assert_allclose(s.numpy(), [0.5, 0.5], atol=1e-15)
    v = np.array([1 / 3 + 0.1, 1 / 3, 1 / 3 + 0.3])
    np.testing.assert_allclose(agg.lam, v - (v.sum() - 1) / 3, atol=1e-15)


def test_afl_rejects_bad_rounds():
    with pytest.raises(ValueError, match="num_clients"):           # K unknown and ids not 0..m-1
        create("afl").aggregate(make_round(0, [0, 2], np.eye(2), [1.0, 1.0]))
    agg = create("afl", num_clients=2)
    with pytest.raises(ValueError, match="outside 0..1"):
        agg.aggregate(make_round(0, [0, 2], np.eye(2), [1.0, 1.0]))
    agg.aggregate(make_round(0, [0, 1], np.eye(2), [1.0, 1.0]))
    with pytest.raises(ValueError, match="round 0"):
        agg.aggregate(make_round(0, [0, 1], np.eye(2), [1.0, 1.0]))
    agg.observe_params(torch.zeros(2))
    with pytest.raises(ValueError, match="size"):
        agg.observe_params(torch.zeros(3))


# ---- state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("via_hdf5", [False, True])
@pytest.mark.parametrize("num_clients", [None, 6])
def test_afl_state_round_trip_is_bit_exact(tmp_path, via_hdf5, num_clients):
    rounds = [random_round(40 + t, m=6, d=9, dtype=torch.float32, t=t) for t in range(5)]
    w0 = torch.randn(9, generator=torch.Generator().manual_seed(0))
    params = dict(eta_lambda=0.5, num_clients=num_clients)
    live = create("afl", **params)
    w = w0.clone()
    for r in rounds[:2]:
        w = w - live.aggregate(r)
        live.observe_params(w)
    state = live.state_dict()
    for v in state.values():
        assert isinstance(v, (np.ndarray, int, float, str))
    if via_hdf5:
        state = h5_round_trip(state, tmp_path / "afl.h5")
    resumed = create("afl", **params)
    resumed.load_state_dict(state)
    w_live, w_res = w.clone(), w.clone()
    for r in rounds[2:]:
        s_live, s_res = live.aggregate(r), resumed.aggregate(r)
        assert torch.equal(s_live, s_res)
        w_live, w_res = w_live - s_live, w_res - s_res
        live.observe_params(w_live)
        resumed.observe_params(w_res)
        assert np.array_equal(live.lam, resumed.lam)
        assert torch.equal(live.evaluation_params(w_live), resumed.evaluation_params(w_res))


def test_afl_fresh_state_round_trip_and_mismatch():
    fresh = create("afl", num_clients=4).state_dict()
    agg = create("afl", num_clients=4)
    agg.load_state_dict(fresh)
    assert np.array_equal(agg.lam, np.full(4, 0.25))
    with pytest.raises(ValueError, match="eta_lambda"):
        create("afl", eta_lambda=0.2, num_clients=4).load_state_dict(fresh)
    with pytest.raises(ValueError, match="num_clients"):
        create("afl", num_clients=5).load_state_dict(fresh)
    with pytest.raises(ValueError, match="missing"):
        create("afl").load_state_dict({"eta_lambda": 0.01})


@pytest.mark.parametrize("name", ["qfedavg", "drfl", "fedmgda_plus"])
def test_stateless_rules(name):
    agg = create(name)
    agg.aggregate(random_round(0))
    assert agg.state_dict() == {}
    agg.load_state_dict({})
    with pytest.raises(ValueError):
        agg.load_state_dict({"lam": np.zeros(3)})


# ---- registry and configuration --------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    ("qfedavg", dict(q=-1.0)), ("qfedavg", dict(q=float("nan"))), ("qfedavg", dict(q="1")),
    ("afl", dict(eta_lambda=-0.1)), ("afl", dict(num_clients=0)), ("afl", dict(num_clients=2.5)),
    ("fedmgda_plus", dict(eps=-0.1)), ("fedmgda_plus", dict(eta=0.0)),
    ("fedmgda_plus", dict(eta=True)), ("drfl", dict(seed=-1)),
])
def test_bad_hyper_parameters(kw):
    name, params = kw
    with pytest.raises(ValueError):
        create(name, **params)


def test_registry_names():
    assert set(NEW) <= set(available())
    for name in NEW:
        assert create(name).name == name


@pytest.mark.parametrize("name,extra,params", [
    ("qfedavg", [], {"q": 1.0}),
    ("drfl", [], {}),
    ("afl", ["server.sampling=all"], {"eta_lambda": 0.01}),
    ("fedmgda_plus", [], {"eps": 0.1, "eta": 1.0}),
])
def test_main_job_tables(name, extra, params):
    cfg = load_config(MAIN_JOB, [f"server.algorithm={name}", *extra])
    assert cfg.algorithm_params() == params
    agg = create(cfg.server.algorithm, seed=cfg.run.seed, **cfg.algorithm_params())
    assert agg.name == name


@pytest.mark.parametrize("overrides,message", [
    (["server.algorithm=qfedavg", "qfedavg.q=-1"],
     "qfedavg.q: input should be greater than or equal to 0"),
    (["afl.eta_lambda=-0.5"], "afl.eta_lambda: input should be greater than or equal to 0"),
    (["fedmgda_plus.eps=1.5"], "fedmgda_plus.eps: input should be less than or equal to 1"),
    (["fedmgda_plus.eta=0"], "fedmgda_plus.eta: input should be greater than 0"),
    (["qfedavg.q=\"big\""], "qfedavg.q: input should be a valid number"),
    (["drfl.p=1"], "unknown key 'drfl.p'"),
    (["server.algorithm=afl"], "server.sampling: afl needs every client every round"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN_JOB, overrides)
    assert message in str(exc.value) and "\n" not in str(exc.value)
