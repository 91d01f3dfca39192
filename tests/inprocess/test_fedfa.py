"""FedFa (Huang et al. 2020/2022, docs/ALGORITHMS.md §7): weights, server momentum, counts, state,
bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, available, create
from mpifl.aggregators.fedfa import FedFa
from tests.helpers import h5_round_trip


def fedfa_round(t, ids, U, acc, dtype=torch.float64, acc_shape="flat"):
    U = torch.as_tensor(np.asarray(U, dtype=np.float64), dtype=dtype)
    m = U.shape[0]
    acc = torch.as_tensor(np.asarray(acc, dtype=np.float32))
    stats = {"train_accuracy": acc if acc_shape == "flat" else acc.view(-1, 1)}
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=U, losses=np.ones(m),
                        num_samples=np.full(m, 10), lr=0.1, stats=stats)


def random_rounds(seed, K=8, m=4, d=7, T=6, dtype=torch.float64):
    """T rounds of m of K clients (partial, uneven participation), random updates and
    accuracies, one of them with an accuracy of 0 and one of 1."""
    rng = np.random.default_rng(seed)
    rounds = []
    for t in range(T):
        ids = rng.choice(K, size=m, replace=False)
        acc = rng.uniform(0.0, 1.0, m)
        if t == 2:
            acc[0], acc[1] = 0.0, 1.0
        rounds.append(fedfa_round(t, ids, rng.standard_normal((m, d)), acc, dtype=dtype))
    return rounds


def direct_fedfa(rounds, K, beta, gamma_s):
    """docs/ALGORITHMS.md §7 (FedFa) written out in float64 numpy on the client models
    w_k = w^t - u_k (with w^t = 0, so the weights act on the models themselves), f counting the
    current round (as the reference code): the steps s^t = w^t - w^{t+1} and the final counts."""
    f = np.zeros(K, dtype=np.int64)
    w = None
    v = None
    steps = []
    for r in rounds:
        U = r.updates.double().numpy()
        acc = r.stats["train_accuracy"].double().numpy().reshape(-1)
        ids = r.client_ids
        if w is None:
            w, v = np.zeros(U.shape[1]), np.zeros(U.shape[1])
        f[ids] += 1
        A = np.array([-np.log2(a / acc.sum() + 1e-6) for a in acc])
        Fq = np.array([-np.log2(1 - fk / f[ids].sum() + 1e-5) for fk in f[ids]])
        A, Fq = A / A.sum(), Fq / Fq.sum()
        p = (1 - beta) * A + beta * Fq
        models = w[None, :] - U
        w_agg = sum(pk * wk for pk, wk in zip(p, models))
        v = gamma_s * v + (w_agg - w)
        w_new = w + v
        steps.append(w - w_new)
        w = w_new
    return steps, f


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("beta,gamma_s", [(0.5, 0.5), (0.0, 0.9), (1.0, 0.0), (0.3, 0.7)])
@pytest.mark.parametrize("seed", range(3))
def test_matches_direct_computation(seed, beta, gamma_s, dtype, tol):
    K = 8
    rounds = random_rounds(seed, K=K, dtype=dtype)
    agg = create("fedfa", beta=beta, gamma_s=gamma_s, gamma_c=0.3, num_clients=K)
    want, f = direct_fedfa(rounds, K, beta, gamma_s)
    for r, s_want in zip(rounds, want):
        s = agg.aggregate(r)
        assert s.dtype == dtype and s.shape == (r.d,)
        np.testing.assert_allclose(s.double().numpy(), s_want, rtol=tol, atol=tol)
    assert np.array_equal(agg.counts, f) and agg.counts.dtype == np.int64
    assert agg.counts.sum() == sum(r.m for r in rounds)
    np.testing.assert_allclose(-agg.state_dict()["v"], want[-1], rtol=tol, atol=tol)


def test_two_clients_by_hand():
    # K = 2, beta = 0.5 (alpha = 0.5), gamma_s = 0.5, d = 2.
    agg = create("fedfa", beta=0.5, gamma_s=0.5, gamma_c=0.5, num_clients=2)
    # Round 0: client 0 alone, u_0 = (1, 0). With m = 1 both normalised terms are [1], so
    # p = [1], w_agg - w = -(1, 0), v = (-1, 0), s = -v = (1, 0); f = (1, 0).
    s0 = agg.aggregate(fedfa_round(0, [0], [[1.0, 0.0]], [0.5]))
    np.testing.assert_allclose(s0.numpy(), [1.0, 0.0], atol=1e-12)
    assert list(agg.counts) == [1, 0]
    # Round 1: both, u_0 = (2, 0), u_1 = (0, 2), ACC = (0.25, 0.75); f = (2, 1), sum f = 3.
    #   A  = (-log2 1/4, -log2 3/4) = (2, 0.4150375)       / 2.4150375 -> (0.828144, 0.171856)
    #   Fq = (-log2 1/3, -log2 2/3) = (1.5849625, 0.5849625) / 2.169925 -> (0.730423, 0.269577)
    #   p  = 0.5 A + 0.5 Fq = (0.779283, 0.220717)
    #   w_agg - w = -(p_0 u_0 + p_1 u_1) = -(1.558567, 0.441433)
    #   v = 0.5 (-1, 0) - (1.558567, 0.441433) = (-2.058567, -0.441433),  s = -v
    # (the +1e-6 / +1e-5 inside the logs move these by ~2e-6, hence atol 1e-5)
    s1 = agg.aggregate(fedfa_round(1, [0, 1], [[2.0, 0.0], [0.0, 2.0]], [0.25, 0.75]))
    np.testing.assert_allclose(s1.numpy(), [2.058567, 0.441433], atol=1e-5)
    assert list(agg.counts) == [2, 1]


def test_accuracy_as_column_and_all_zero_accuracy():
    U = np.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    a = create("fedfa", num_clients=5).aggregate(fedfa_round(0, [4, 0, 2], U, [0.2, 0.5, 0.9]))
    b = create("fedfa", num_clients=5).aggregate(
        fedfa_round(0, [4, 0, 2], U, [0.2, 0.5, 0.9], acc_shape="column"))
    assert torch.equal(a, b)
    # every accuracy 0: shares taken as 1/m; with equal counts too, p = 1/m (plain mean)
    s = create("fedfa", num_clients=5).aggregate(fedfa_round(0, [4, 0, 2], U, [0.0, 0.0, 0.0]))
    assert torch.isfinite(s).all()
    np.testing.assert_allclose(s.numpy(), U.mean(0), rtol=1e-12)


def test_num_clients_none_grows_counts():
    agg = create("fedfa")
    agg.aggregate(fedfa_round(0, [3, 1], np.eye(2), [0.5, 0.5]))
    agg.aggregate(fedfa_round(1, [6, 1], np.eye(2), [0.5, 0.5]))
    assert list(agg.counts) == [0, 2, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("via_hdf5", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_state_round_trip_continues_identically(tmp_path, via_hdf5, dtype):
    rounds = random_rounds(11, K=8, m=3, d=9, T=6, dtype=dtype)
    params = dict(beta=0.4, gamma_s=0.8, gamma_c=0.5, num_clients=8)
    live = create("fedfa", **params)
    for r in rounds[:3]:
        live.aggregate(r)
    state = live.state_dict()
    for v in state.values():
        assert isinstance(v, (np.ndarray, int, float, str))
    assert state["v"].shape == (9,) and state["v"].dtype == dtype_np(dtype)
    assert state["counts"].shape == (8,) and state["counts"].dtype == np.int64
    if via_hdf5:
        state = h5_round_trip(state, tmp_path / "fedfa.h5")
    resumed = create("fedfa", **params)
    resumed.load_state_dict(state)
    assert np.array_equal(resumed.counts, live.counts)
    for r in rounds[3:]:
        s_live, s_res = live.aggregate(r), resumed.aggregate(r)
        assert torch.equal(s_live, s_res)
        assert np.array_equal(live.counts, resumed.counts)
    assert all(np.array_equal(a, b) for a, b in zip(live.state_dict().values(),
                                                     resumed.state_dict().values()))


def dtype_np(dtype):
    return np.float32 if dtype == torch.float32 else np.float64


def test_fresh_state_and_mismatch(tmp_path):
    fresh = create("fedfa", num_clients=4).state_dict()
    assert fresh["v"].size == 0 and np.array_equal(fresh["counts"], np.zeros(4, np.int64))
    agg = create("fedfa", num_clients=4)
    agg.load_state_dict(h5_round_trip(fresh, tmp_path / "fresh.h5"))
    agg.aggregate(fedfa_round(0, [1, 2], np.eye(2), [0.5, 0.5]))
    with pytest.raises(ValueError, match="beta"):
        create("fedfa", beta=0.2, num_clients=4).load_state_dict(fresh)
    with pytest.raises(ValueError, match="gamma_s"):
        create("fedfa", gamma_s=0.9, num_clients=4).load_state_dict(fresh)
    with pytest.raises(ValueError, match="num_clients"):
        create("fedfa", num_clients=5).load_state_dict(fresh)
    with pytest.raises(ValueError, match="missing"):
        create("fedfa").load_state_dict({"beta": 0.5})


# ---- bad inputs ------------------------------------------------------------------------------

def test_missing_accuracy_stat():
    r = RoundUpdates(round=0, client_ids=np.array([0, 1]), updates=np.eye(2), losses=np.ones(2),
                     num_samples=np.full(2, 10), lr=0.1)
    with pytest.raises(ValueError, match="train_accuracy.*report_accuracy"):
        create("fedfa", num_clients=2).aggregate(r)


@pytest.mark.parametrize("ids,acc,match", [
    ([0, 4], [0.5, 0.5], "outside 0..3"),
    ([0, 7], [0.5, 0.5], "outside 0..3"),
    ([0, 1], [0.5, 1.5], "in \\[0, 1\\]"),
    ([0, 1], [0.5, -0.1], "in \\[0, 1\\]"),
    ([0, 1], [0.5, float("nan")], "in \\[0, 1\\]"),
])
def test_bad_round(ids, acc, match):
    agg = create("fedfa", num_clients=4)
    with pytest.raises(ValueError, match=match):
        agg.aggregate(fedfa_round(0, ids, np.eye(2), acc))
    assert agg.counts.sum() == 0 and agg.state_dict()["v"].size == 0   # nothing half-applied


def test_bad_accuracy_shape_round_order_and_size():
    agg = create("fedfa", num_clients=4)
    r = fedfa_round(0, [0, 1], np.eye(2), [0.5, 0.5])
    r.stats["train_accuracy"] = torch.ones(2, 2)
    with pytest.raises(ValueError, match="shape"):
        agg.aggregate(r)
    agg.aggregate(fedfa_round(1, [0, 1], np.eye(2), [0.5, 0.5]))
    with pytest.raises(ValueError, match="round 1 is not after"):
        agg.aggregate(fedfa_round(1, [0, 1], np.eye(2), [0.5, 0.5]))
    with pytest.raises(ValueError, match="parameter size"):
        agg.aggregate(fedfa_round(2, [0, 1], np.eye(3)[:2], [0.5, 0.5]))


@pytest.mark.parametrize("params", [
    dict(beta=-0.1), dict(beta=1.5), dict(beta=float("nan")), dict(gamma_s=1.0),
    dict(gamma_c=-0.5), dict(gamma_s=True), dict(num_clients=0), dict(num_clients=2.5),
    dict(seed=-1),
])
def test_bad_hyper_parameters(params):
    with pytest.raises(ValueError):
        create("fedfa", **params)


def test_registry_and_client_options():
    assert "fedfa" in available()
    agg = create("fedfa", beta=0.2, gamma_s=0.1, gamma_c=0.7, num_clients=3)
    assert isinstance(agg, FedFa) and agg.name == "fedfa" and FedFa.needs.num_clients
    assert FedFa.client_options(FedFa.Params(beta=0.2, gamma_s=0.1, gamma_c=0.7)) == {
        "momentum": 0.7, "report_accuracy": True}
    assert FedFa.client_options(FedFa.Params()) == {"momentum": 0.5, "report_accuracy": True}
