"""FedFV (docs/ALGORITHMS.md §3): the Gram form against the direct oracle, hand-checked cases, the
history ring, the guarantees docs/ALGORITHMS.md §3 states, and checkpoint round trips."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, create
from mpifl.aggregators.fedfv import num_kept, projection_order
from mpifl.aggregators.fedfv_direct import DirectFedFV
from tests.helpers import h5_round_trip

ALPHAS = [0.0, 0.1, 0.5, 2 / 3]
TAUS = [0, 1, 3]
ORDERS = ["loss", "random", "reverse"]
WINDOWS = ["paper", "flgo"]


def make_round(t, ids, U, losses=None, dtype=torch.float64):
    U = torch.as_tensor(np.asarray(U, dtype=np.float64), dtype=dtype)
    m = U.shape[0]
    if losses is None:
        losses = np.linspace(0.1, 1.0, m)
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=U, losses=losses,
                        num_samples=np.full(m, 10), lr=0.1)


def conflicting_rounds(dtype, *, num_rounds=7, K=24, d=48, seed=0):
    """Partial participation (m varies, clients come back within tau rounds, so superseding
    matters) and updates = shared direction + large low-rank noise, so that many pairs conflict.
    """
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((4, d))
    out = []
    for t in range(num_rounds):
        m = int(rng.integers(5, 11))
        z = rng.standard_normal((m, 4))
        z[:, 0] = 0.4 + 0.3 * z[:, 0]
        U = z @ basis + 0.3 * rng.standard_normal((m, d))
        losses = rng.random(m)
        losses[:2] = losses[2]          # ties, broken by client id
        out.append(make_round(t, rng.choice(K, m, replace=False), U, losses, dtype))
    return out


def rel(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    """Both Gram products of mpifl.aggregators.gram: numpy's syrk (one thread), torch's GEMM."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("alpha,tau,order,window",
                         list(itertools.product(ALPHAS, TAUS, ORDERS, WINDOWS)))
def test_gram_equals_direct(alpha, tau, order, window, dtype, tol, torch_threads):
    params = dict(alpha=alpha, tau=tau, order=order, external_window=window, seed=5)
    gram, direct = create("fedfv", **params), DirectFedFV(**params)
    no_hist = create("fedfv", **{**params, "tau": 0})
    external_moved = False
    for r in conflicting_rounds(dtype):
        s = gram.aggregate(r)
        expected = direct.aggregate(r)
        assert s.dtype == dtype and s.shape == (r.d,)
        assert rel(s, expected) < tol, f"round {r.round}"
        external_moved |= rel(s, no_hist.aggregate(r)) > 1e-3
    # the data must exercise Algorithm 3 whenever it is switched on
    assert external_moved == (tau > 0)


def test_data_has_internal_conflicts():
    """Guard for the oracle comparison: without conflicts it would compare two means."""
    for r in conflicting_rounds(torch.float64):
        G = r.updates @ r.updates.T
        assert (G < 0).sum() >= 4
        s = create("fedfv", alpha=0.0, tau=0).aggregate(r)
        mean = r.updates.mean(0)
        assert rel(s, mean) > 1e-3


@pytest.mark.parametrize("m,alpha,kept", [(10, 0.1, 1), (3, 2 / 3, 2), (11, 0.7, 7),
                                          (10, 0.0, 0), (1, 0.5, 1), (1, 0.0, 0), (4, 0.5, 2)])
def test_num_kept(m, alpha, kept):
    # (11, 0.7): 10 * (1 - 0.7) = 3.0000000000000004 in floats, so 7 kept, not 8
    assert num_kept(m, alpha) == kept


def test_projection_order_ties_and_reverse():
    ids = np.array([9, 3, 7])
    losses = np.array([0.5, 0.5, 0.1], dtype=np.float32)
    assert projection_order(ids, losses, "loss", 0, 0).tolist() == [2, 1, 0]
    assert projection_order(ids, losses, "reverse", 0, 0).tolist() == [1, 0, 2]


def test_random_order_keyed_by_seed_and_round_not_row_order():
    ids = np.arange(100, 112)
    losses = np.zeros(12)
    po = projection_order(ids, losses, "random", 3, 7)
    perm = np.random.default_rng(0).permutation(12)
    po_shuffled = projection_order(ids[perm], losses, "random", 3, 7)
    assert ids[po].tolist() == ids[perm][po_shuffled].tolist()      # same client sequence
    assert sorted(po.tolist()) == list(range(12))
    assert po.tolist() != projection_order(ids, losses, "random", 3, 8).tolist()
    assert po.tolist() != projection_order(ids, losses, "random", 4, 7).tolist()


# ---- hand-checked 2-D cases ------------------------------------------------------------------
# u1 = (1, 0) with the lower loss, u2 = (-1, 1); u1 . u2 = -1, ||u1||^2 = 1, ||u2||^2 = 2.
#   g1 = u1 - (-1/2) u2 = (0.5, 0.5)      g2 = u2 - (-1/1) u1 = (0, 1)
#   mean u = (0, 0.5), so every step is rescaled to norm 0.5.
U2 = [[1.0, 0.0], [-1.0, 1.0]]
LOSS2 = [0.1, 0.2]


def unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("alpha,order,g", [
    (0.0, "loss", [0.25, 0.75]),          # both projected: (g1 + g2) / 2
    (0.5, "loss", [-0.25, 0.75]),         # 1 kept (the higher loss, u2): (g1 + u2) / 2
    (0.5, "reverse", [0.5, 0.5]),         # PO = [2, 1]: u1 is last and kept: (u1 + g2) / 2
])
def test_two_clients_by_hand(alpha, order, g):
    r = make_round(0, [1, 2], U2, LOSS2)
    params = dict(alpha=alpha, tau=0, order=order)
    for agg in (create("fedfv", **params), DirectFedFV(**params)):
        s = agg.aggregate(r).numpy()
        np.testing.assert_allclose(s, 0.5 * unit(g), atol=1e-12)


def test_external_conflict_by_hand():
    """Round 0: client 7 sent h = (0, -1). Round 1: clients 1, 2 as above, internal
    g = (0.25, 0.75).
    g . h = -0.75 < 0, so g <- g - (-0.75 / 1) h = (0.25, 0); rescaled: (0.5, 0)."""
    rounds = [make_round(0, [7], [[0.0, -1.0]]), make_round(1, [1, 2], U2, LOSS2)]
    for agg in (create("fedfv", alpha=0.0, tau=1), DirectFedFV(alpha=0.0, tau=1)):
        agg.aggregate(rounds[0])
        np.testing.assert_allclose(agg.aggregate(rounds[1]).numpy(), [0.5, 0.0], atol=1e-12)
    # FLGo's window for tau = 1 is the current round only: u1, u2 both agree with g = (0.25, 0.75)
    agg = create("fedfv", alpha=0.0, tau=1, external_window="flgo")
    agg.aggregate(rounds[0])
    np.testing.assert_allclose(agg.aggregate(rounds[1]).numpy(), 0.5 * unit([0.25, 0.75]),
                               atol=1e-12)


def test_external_step_needs_t_at_least_tau():
    """tau = 3 at round 2: Algorithm 3 is off even though a conflicting round is stored."""
    agg = create("fedfv", alpha=0.0, tau=3)
    agg.aggregate(make_round(1, [7], [[0.0, -1.0]]))
    np.testing.assert_allclose(agg.aggregate(make_round(2, [1, 2], U2, LOSS2)).numpy(),
                               0.5 * unit([0.25, 0.75]), atol=1e-12)


@pytest.mark.parametrize("make", [lambda: create("fedfv", alpha=0.0, tau=2),
                                  lambda: DirectFedFV(alpha=0.0, tau=2)])
def test_history_holds_only_latest_update(make):
    """Client 7's conflicting round-0 update is superseded by its agreeing round-1 update, and
    client 2's conflicting round-1 update by its update in the current round: no external step."""
    agg = make()
    agg.aggregate(make_round(0, [7], [[0.0, -1.0]]))
    agg.aggregate(make_round(1, [7, 2], [[0.0, 1.0], [0.0, -3.0]]))
    s = agg.aggregate(make_round(2, [1, 2], U2, LOSS2)).numpy()
    np.testing.assert_allclose(s, 0.5 * unit([0.25, 0.75]), atol=1e-12)


# ---- what docs/ALGORITHMS.md §3 guarantees ------------------------------------------------------

def test_step_norm_is_mean_update_norm():
    for r in conflicting_rounds(torch.float64):
        s = create("fedfv", alpha=0.1, tau=0).aggregate(r)
        assert float(s.norm()) == pytest.approx(float(r.updates.mean(0).norm()), rel=1e-12)


def test_without_conflicts_fedfv_is_the_mean():
    rng = np.random.default_rng(1)
    agg = create("fedfv", alpha=0.0, tau=2)
    for t in range(4):
        r = make_round(t, rng.choice(50, 6, replace=False), rng.random((6, 20)))   # all dots > 0
        torch.testing.assert_close(agg.aggregate(r), r.updates.mean(0), rtol=1e-12, atol=0)


def test_two_clients_step_conflicts_with_neither():
    """m = 2, alpha = 0, tau = 0: g1 . u2 = 0 and g1 . u1 = ||u1||^2 - (u1.u2)^2/||u2||^2 >= 0
    (Cauchy-Schwarz), likewise for g2, so s . u_k >= 0 for both clients."""
    rng = np.random.default_rng(2)
    hits = 0
    for t in range(50):
        r = make_round(t, [0, 1], rng.standard_normal((2, 5)), rng.random(2))
        s = create("fedfv", alpha=0.0, tau=0).aggregate(r)
        hits += float(r.updates[0] @ r.updates[1]) < 0
        assert (r.updates @ s >= -1e-12).all()
    assert hits > 10


def test_step_orthogonal_to_last_external_conflict():
    """tau = 1: the conflict set is tested against the internal g (direction of the tau = 0 step);
    after projecting, s . g_con = 0."""
    rng = np.random.default_rng(3)
    hist = make_round(0, np.arange(10, 20), rng.standard_normal((10, 30)))
    cur = make_round(1, np.arange(5), rng.standard_normal((5, 30)) + 0.5)
    internal, full = create("fedfv", alpha=0.0, tau=0), create("fedfv", alpha=0.0, tau=1)
    for agg in (internal, full):
        agg.aggregate(hist)
    g = internal.aggregate(cur)
    H = hist.updates
    g_con = H[(H @ g) < 0].sum(0)
    assert float(g @ g_con) < -0.1                       # a real conflict to remove
    s = full.aggregate(cur)
    assert abs(float(s @ g_con)) < 1e-10 * float(s.norm() * g_con.norm())


def test_zero_updates_give_zero_step():
    r = make_round(0, [0, 1, 2], np.zeros((3, 4)))
    assert torch.equal(create("fedfv").aggregate(r), torch.zeros(4, dtype=torch.float64))
    assert torch.equal(DirectFedFV().aggregate(r), torch.zeros(4, dtype=torch.float64))


def test_row_order_does_not_matter():
    r = conflicting_rounds(torch.float64, num_rounds=1)[0]
    perm = np.random.default_rng(4).permutation(r.m)
    shuffled = make_round(0, r.client_ids[perm], r.updates[perm].numpy(), r.losses[perm].numpy())
    for order in ORDERS:
        a = create("fedfv", order=order, seed=1).aggregate(r)
        b = create("fedfv", order=order, seed=1).aggregate(shuffled)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ---- history ring ----------------------------------------------------------------------------

@pytest.mark.parametrize("tau,window,max_rounds", [(3, "paper", 3), (3, "flgo", 2), (1, "flgo", 0),
                                                   (0, "paper", 0)])
def test_history_is_bounded(tau, window, max_rounds):
    """K = 5000 clients, m = 10 per round, 40 rounds: storage stays O(tau m d), not O(K d)."""
    rng = np.random.default_rng(5)
    agg = create("fedfv", tau=tau, external_window=window)
    for t in range(40):
        ids = rng.choice(5000, 10, replace=False)
        agg.aggregate(make_round(t, ids, rng.standard_normal((10, 8)), dtype=torch.float32))
        assert agg.history_rows <= max_rounds * 10
    assert agg.history_rows == max_rounds * 10
    assert agg.state_dict()["history_updates"].shape[0] == max_rounds * 10


def test_full_participation_keeps_nothing_superseded():
    """Every client comes back each round, so each stored round is superseded by the next one."""
    agg = create("fedfv", tau=3)
    rng = np.random.default_rng(6)
    for t in range(10):
        agg.aggregate(make_round(t, np.arange(6), rng.standard_normal((6, 5))))
        assert agg.history_rows == 6


def test_history_survives_a_reused_gather_buffer():
    """The server may gather every round into the same buffer: history must hold copies."""
    rounds = conflicting_rounds(torch.float32, num_rounds=3)
    reference = create("fedfv", tau=2)
    expected = [reference.aggregate(r) for r in rounds]
    agg, buf = create("fedfv", tau=2), torch.empty(20, rounds[0].d)
    for r, want in zip(rounds, expected):
        view = buf[: r.m]
        view.copy_(r.updates)
        got = agg.aggregate(RoundUpdates(round=r.round, client_ids=r.client_ids, updates=view,
                                         losses=r.losses, num_samples=r.num_samples, lr=r.lr))
        assert torch.equal(got, want)


def test_rounds_must_increase():
    agg = create("fedfv")
    agg.aggregate(make_round(3, [0, 1], U2, LOSS2))
    with pytest.raises(ValueError, match="round 3"):
        agg.aggregate(make_round(3, [0, 1], U2, LOSS2))


@pytest.mark.parametrize("kw", [dict(alpha=1.0), dict(alpha=-0.1), dict(alpha="0.1"),
                                dict(tau=-1), dict(tau=1.5), dict(tau=True), dict(order="lossy"),
                                dict(external_window="fedlab"), dict(seed=-1)])
def test_bad_hyper_parameters(kw):
    with pytest.raises(ValueError):
        create("fedfv", **kw)
    with pytest.raises(ValueError):
        DirectFedFV(**kw)


# ---- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("via_hdf5", [False, True])
@pytest.mark.parametrize("window,order", [("paper", "loss"), ("flgo", "random")])
def test_state_dict_round_trip(tmp_path, via_hdf5, window, order):
    params = dict(alpha=0.1, tau=3, order=order, external_window=window, seed=2)
    rounds = conflicting_rounds(torch.float32, num_rounds=6)
    live = create("fedfv", **params)
    for r in rounds[:3]:
        live.aggregate(r)
    state = live.state_dict()
    for v in state.values():
        assert isinstance(v, (np.ndarray, int, float, str))
    if via_hdf5:
        state = h5_round_trip(state, tmp_path / "agg.h5")
    resumed = create("fedfv", **params)
    resumed.load_state_dict(state)
    for r in rounds[3:]:
        assert torch.equal(live.aggregate(r), resumed.aggregate(r))


def test_load_state_rejects_other_hyper_parameters():
    agg = create("fedfv", tau=2)
    agg.aggregate(make_round(0, [0, 1], U2, LOSS2))
    with pytest.raises(ValueError, match="tau"):
        create("fedfv", tau=3).load_state_dict(agg.state_dict())
    with pytest.raises(ValueError, match="missing"):
        create("fedfv", tau=2).load_state_dict({"tau": 2})
