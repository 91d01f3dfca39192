"""The gradient-history ring (mpifl.aggregators.history) and the three rules that use it.

The oracle part replays fixed random sequences of rounds through FedFV (tau in {0, 1, 3}, both
windows, two orders), FedLF and FedMDFG and compares with
``tests/data/history_oracle.npz`` (floats to 1e-6 relative, see :func:`_same`): the steps, diagnostics and mid-run ``state_dict`` recorded by
the rules as they were before the ring existed (commit 77789d9, each rule with its own history
code). It also loads those old-code checkpoints into the current rules and asserts that the
continuation is bit-identical and that the current ``state_dict`` writes the same keys, dtypes
and arrays. Regenerate only from a checkout of the old code::

    python3 -m tests.inprocess.test_history --record

The sequences run with one torch thread (the MPI ranks' setting): the Gram product then is
numpy's, as in the jobs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, create
from mpifl.aggregators.history import HistoryRing

ORACLE = Path(__file__).resolve().parents[1] / "data" / "history_oracle.npz"
RESUME_AFTER = 4          # the recorded checkpoint is taken after this many rounds
LR = 0.1


# ---- fixed random sequences of rounds ---------------------------------------------------------

def _round_numbers(rng, n):
    """Increasing round numbers with gaps (a window is by round number, not by call)."""
    return np.cumsum(rng.choice([1, 1, 1, 2], n)) - 1


def fedfv_cases():
    return [(f"fedfv-tau{tau}-{window}-{order}",
             {"alpha": alpha, "tau": tau, "order": order, "external_window": window, "seed": 3})
            for tau in (0, 1, 3) for window in ("paper", "flgo")
            for order, alpha in (("loss", 0.1), ("random", 0.4))]


def fedfv_rounds(seed, *, num_rounds=10, K=10, d=24):
    """Partial participation from K = 10 clients (clients come back often, so superseding
    matters), conflicting updates; every round gathered into the same float32 buffer, as the
    server does (history must copy)."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((3, d))
    buf = torch.empty(K, d, dtype=torch.float32)
    for t in _round_numbers(rng, num_rounds):
        m = int(rng.integers(2, 8))
        z = rng.standard_normal((m, 3))
        z[:, 0] = 0.3 + 0.3 * z[:, 0]
        buf[:m] = torch.as_tensor(z @ basis + 0.4 * rng.standard_normal((m, d)))
        losses = rng.random(m).astype(np.float32)
        yield RoundUpdates(round=int(t), client_ids=rng.choice(K, m, replace=False),
                           updates=buf[:m], losses=losses, num_samples=np.full(m, 10), lr=LR)


def fedlf_rounds(seed, *, num_rounds=12, K=12, d=20, layered=True):
    """m in 2..5 of K = 12 clients, so M > m and absent clients' history joins."""
    rng = np.random.default_rng(seed)
    layers = [slice(0, 6), slice(6, 7), slice(7, 15), slice(15, d)] if layered else None
    basis = rng.standard_normal((3, d))
    for t in _round_numbers(rng, num_rounds):
        m = int(rng.integers(2, 6))
        U = LR * (rng.standard_normal((m, 3)) @ basis + 0.5 * rng.standard_normal((m, d)))
        if t == 5:
            U[0, 6:7] = 0.0                     # a zero slice (left out of that layer's QP)
        losses = rng.uniform(0.2, 2.0, m).astype(np.float32)
        yield RoundUpdates(round=int(t), client_ids=rng.choice(K, m, replace=False),
                           updates=torch.as_tensor(U, dtype=torch.float32), losses=losses,
                           num_samples=np.full(m, 10), lr=LR, layers=layers)


class Quadratics:
    """K clients with losses ``0.5 (w - c_k)^T A_k (w - c_k) + b_k`` (FedMDFG's line search)."""

    def __init__(self, rng, K, d):
        B = rng.standard_normal((K, d, d)) / math.sqrt(d)
        self.A = B @ B.transpose(0, 2, 1) + 0.1 * np.eye(d)
        self.c = rng.standard_normal((K, d))
        self.b = rng.uniform(0.0, 2.0, K)

    def losses(self, ids, w):
        z = w[None, :] - self.c[ids]
        return (0.5 * np.einsum("ki,kij,kj->k", z, self.A[ids], z) + self.b[ids]).astype(
            np.float32)

    def grads(self, ids, w):
        return np.einsum("kij,kj->ki", self.A[ids], w[None, :] - self.c[ids])


def fedmdfg_run(agg, seed, *, start=0, stop=None, w_start=None, num_rounds=10, K=8, d=10):
    """Run FedMDFG on the quadratics; w advances by the returned steps. Rounds ``start ..
    stop - 1`` only (the others are still drawn, so a resumed run sees the same sequence).
    Returns the steps, the history ids and the weights before each round run."""
    rng = np.random.default_rng(seed)
    prob = Quadratics(rng, K, d)
    w = rng.standard_normal(d)
    if w_start is not None:
        w = np.array(w_start)
    steps, hist, ws = [], [], []
    for i, t in enumerate(_round_numbers(rng, num_rounds)):
        m = int(rng.integers(2, 7))
        ids = rng.choice(K, m, replace=False)
        if i < start or (stop is not None and i >= stop):
            continue
        U = LR * prob.grads(ids, w)
        if i == 3:
            U[:] = 0.0                      # no live client: history stays the last live round
        if i == 6:
            U[1] = 0.0                      # one client not live
        ws.append(w.copy())
        w_t = w.copy()
        r = RoundUpdates(round=int(t), client_ids=ids,
                         updates=torch.as_tensor(U, dtype=torch.float32),
                         losses=prob.losses(ids, w_t), num_samples=np.full(m, 10), lr=LR,
                         loss_at=lambda s, ids=ids, w_t=w_t: torch.as_tensor(
                             prob.losses(ids, w_t - s.double().numpy())))
        step = agg.aggregate(r)
        steps.append(step.numpy().copy())
        hist.append(np.asarray(agg.last_history_ids))
        w = w - step.double().numpy()
    return steps, hist, ws


# ---- running the cases ------------------------------------------------------------------------

def _padded(rows, width=16):
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def run_case(name, params, state=None, w_start=None):
    """Steps (and history ids) of one case; with ``state`` the rule is first loaded from it and
    only the rounds from RESUME_AFTER on are run. Returns (result dict, state after
    RESUME_AFTER rounds or None)."""
    rule = name.split("-")[0]
    agg = create(rule, **params)
    if state is not None:
        agg.load_state_dict(state)
    start = RESUME_AFTER if state is not None else 0
    mid = None
    if rule == "fedmdfg":
        steps, hist, ws = fedmdfg_run(agg, 0, start=start, w_start=w_start)
        out = {"steps": np.array(steps), "hist": _padded(hist)}
        if state is None:
            # rerun up to the checkpoint to capture the state there
            agg2 = create(rule, **params)
            fedmdfg_run(agg2, 0, stop=RESUME_AFTER)
            mid = agg2.state_dict()
            out["w_mid"] = ws[RESUME_AFTER]
        return out, mid
    rounds = (fedfv_rounds(1) if rule == "fedfv"
              else fedlf_rounds(2, layered=name.endswith("layers")))
    steps, hist, taus = [], [], []
    for i, r in enumerate(rounds):
        if i < start:
            continue
        steps.append(agg.aggregate(r).numpy().copy())
        if rule == "fedlf":
            hist.append(agg.last_history_ids)
            taus.append(agg.last_tau)
        if i + 1 == RESUME_AFTER and state is None:
            mid = agg.state_dict()
    out = {"steps": np.array(steps)}
    if rule == "fedlf":
        out["hist"], out["tau"] = _padded(hist), np.array(taus)
    return out, mid


CASES = fedfv_cases() + [("fedlf-layers", {}), ("fedlf-whole", {"zero_tol": 1e-8}),
                         ("fedmdfg", {}), ("fedmdfg-s2", {"theta": 5.0, "s": 2})]


def _state_to_npz(prefix, state):
    return {f"{prefix}/{k}": np.asarray(v) for k, v in state.items()}


def _npz_state(data, prefix):
    p = prefix + "/"
    return {k[len(p):]: data[k] for k in data.files if k.startswith(p)}


def record(path=ORACLE):
    """Write the oracle file (run with the OLD code only)."""
    torch.set_num_threads(1)
    arrays = {}
    for name, params in CASES:
        out, mid = run_case(name, params)
        for k, v in out.items():
            arrays[f"{name}/{k}"] = v
        arrays.update(_state_to_npz(f"{name}/state", mid))
        arrays.update({f"{name}/state_types/{k}": np.asarray(type(v).__name__)
                       for k, v in mid.items()})
    path.parent.mkdir(exist_ok=True)
    np.savez_compressed(path, **arrays)
    print(f"wrote {path}: {len(arrays)} arrays")


# ---- the oracle: the rules as they were before the ring -----------------------------------------

@pytest.fixture(scope="module")
def oracle():
    with np.load(ORACLE, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _same(value, want, key):
    """Equal to the recording: exactly for ids, counts and flags; for floats to 1e-6 relative,
    since the recording's last bits depend on the machine's BLAS kernels (bit-for-bit equality
    holds on the machine that recorded it, and the tolerance still catches any logic change)."""
    value, want = np.asarray(value), np.asarray(want)
    assert value.dtype == want.dtype and value.shape == want.shape, key
    if value.dtype.kind == "f":
        scale = float(np.nanmax(np.abs(want))) if want.size else 0.0
        np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-7 * max(scale, 1e-30),
                                   err_msg=key, equal_nan=True)
    else:
        np.testing.assert_array_equal(value, want, err_msg=key, strict=True)


def _old_state(oracle, name):
    p = f"{name}/state/"
    return {k[len(p):]: v for k, v in oracle.items() if k.startswith(p)}


def test_oracle_cases_exercise_the_history(oracle):
    """The recorded sequences are not trivial: history changes FedFV's steps, absent clients
    join FedLF's and FedMDFG's QPs, the checkpoints hold several rounds."""
    base = oracle["fedfv-tau0-paper-loss/steps"]
    for tau in (1, 3):
        assert not np.array_equal(oracle[f"fedfv-tau{tau}-paper-loss/steps"], base)
    assert (oracle["fedfv-tau3-paper-loss/state/history_latest"] == 0).any()   # superseded
    assert len(oracle["fedfv-tau3-paper-loss/state/history_sizes"]) > 1
    assert len(oracle["fedlf-layers/state/history_sizes"]) > 1
    for name in ("fedlf-layers", "fedmdfg"):
        assert (oracle[f"{name}/hist"] >= 0).sum() > 5
    assert oracle["fedmdfg/state/last_ids"].size > 0


@pytest.mark.parametrize("name,params", CASES, ids=[c[0] for c in CASES])
def test_steps_match_the_old_code(name, params, oracle, one_thread):
    out, mid = run_case(name, params)
    for key, value in out.items():
        _same(value, oracle[f"{name}/{key}"], key)
    old = _old_state(oracle, name)
    assert set(mid) == set(old), "state_dict keys changed"
    for key, value in mid.items():
        assert type(value).__name__ == str(oracle[f"{name}/state_types/{key}"]), key
        if isinstance(value, np.ndarray):
            _same(value, old[key], key)
        else:
            assert value == old[key].item(), key


@pytest.mark.parametrize("via_hdf5", [False, True])
@pytest.mark.parametrize("name,params", CASES, ids=[c[0] for c in CASES])
def test_old_checkpoint_resumes_bit_exactly(name, params, via_hdf5, oracle, one_thread,
                                            tmp_path):
    """A state_dict written by the old code, loaded into the current rule, continues with the
    old code's steps."""
    state = _old_state(oracle, name)
    if via_hdf5:
        from tests.helpers import h5_round_trip
        state = h5_round_trip({k: (v.item() if v.ndim == 0 else v) for k, v in state.items()},
                              tmp_path / "agg.h5")
    out, _ = run_case(name, params, state=state, w_start=oracle.get(f"{name}/w_mid"))
    for key, value in out.items():
        _same(value, oracle[f"{name}/{key}"][RESUME_AFTER:], key)


def test_fedfv_copies_each_round_into_a_dropped_block():
    """FedFV's no-allocation trick: with the same m every round and tau = 1 the dropped
    round's rows take the new round (one storage for the whole run), yet the history holds
    copies (the server overwrites its gather buffer)."""
    agg = create("fedfv", alpha=0.0, tau=1)
    rng = np.random.default_rng(0)
    buf = torch.empty(5, 8)
    ptrs = set()
    for t in range(6):
        buf.copy_(torch.as_tensor(rng.standard_normal((5, 8))))
        agg.aggregate(RoundUpdates(round=t, client_ids=np.arange(5) + 5 * t, updates=buf,
                                   losses=rng.random(5), num_samples=np.full(5, 10), lr=LR))
        (block,) = list(agg._ring)
        assert torch.equal(block.rows, buf) and block.rows.data_ptr() != buf.data_ptr()
        ptrs.add(block.rows.data_ptr())
    assert len(ptrs) == 1


# ---- the ring itself --------------------------------------------------------------------------

def _rows(rng, m, d=4):
    return torch.as_tensor(rng.standard_normal((m, d)), dtype=torch.float32)


def test_push_since_and_absent_keep_round_order():
    rng = np.random.default_rng(1)
    ring = HistoryRing("test")
    a, b, c = _rows(rng, 3), _rows(rng, 2), _rows(rng, 2)
    ring.push(0, [4, 1, 7], a, horizon=0)
    ring.push(2, [1, 9], b, horizon=0)
    ring.supersede(np.array([1, 5]))           # round 3 brings clients 1 and 5
    ring.push(3, [1, 5], c, horizon=0)
    assert [blk.round for blk in ring] == [0, 2, 3] and len(ring) == 3 and ring.num_rows == 7
    assert [blk.round for blk in ring.since(2)] == [2, 3]
    assert [blk.latest.tolist() for blk in ring] == [[True, False, True], [False, True],
                                                     [True, True]]
    sel = ring.absent(np.array([7, 2]))
    assert sel.ids.tolist() == [4, 9, 1, 5]
    assert torch.equal(sel.rows, torch.cat([a[:1], b[1:], c]))
    sel = ring.absent(np.array([7]), since=1)
    assert sel.ids.tolist() == [9, 1, 5] and torch.equal(sel.rows, torch.cat([b[1:], c]))
    ring.supersede(np.array([9]))              # round 2 has no latest row left: dropped
    ring.drop(0)
    assert [blk.round for blk in ring] == [0, 3]
    empty = ring.absent(np.array([1, 4, 5, 7]))
    assert len(empty) == 0 and empty.rows is None and empty.ids.dtype == np.int64


def test_drop_frees_old_rounds_and_fully_superseded_ones():
    rng = np.random.default_rng(2)
    ring = HistoryRing("test")
    for t, ids in enumerate([[0, 1], [2, 3], [4, 5], [6, 7]]):
        ring.push(t, ids, _rows(rng, 2), horizon=0)
    ring.supersede(np.array([2, 3, 4]))         # round 1 has no latest row left
    ring.drop(0)
    assert [blk.round for blk in ring] == [0, 2, 3]
    ring.push(5, [8], _rows(rng, 1), horizon=3)
    assert [blk.round for blk in ring] == [3, 5]
    ring.drop(6)
    assert len(ring) == 0 and ring.num_rows == 0


def test_supersede_free_removes_rows_and_scalars():
    rng = np.random.default_rng(3)
    ring = HistoryRing("test", scalars={"loss": np.float32})
    rows = _rows(rng, 3)
    ring.push(0, [4, 1, 7], rows, horizon=0, loss=[0.5, 1.5, 2.5])
    ring.push(1, [2], _rows(rng, 1), horizon=0, loss=[9.0])
    ring.supersede(np.array([1, 2]), free=True)
    first, second = list(ring)
    assert first.ids.tolist() == [4, 7] and torch.equal(first.rows, rows[[0, 2]])
    assert first.scalars["loss"].tolist() == [0.5, 2.5] and first.scalars["loss"].dtype == \
        np.float32
    assert len(second.ids) == 0 and ring.num_rows == 2
    ring.drop(0)                                 # the emptied block goes
    assert len(ring) == 1
    sel = ring.absent(np.array([4]))
    assert sel.ids.tolist() == [7] and sel.scalars["loss"].tolist() == [2.5]


def test_push_copy_reuses_a_dropped_block_and_otherwise_keeps_the_tensor():
    rng = np.random.default_rng(4)
    ring = HistoryRing("test")
    first = _rows(rng, 3)
    ring.push(0, [0, 1, 2], first, horizon=0)
    assert next(iter(ring)).rows is first                 # no copy asked: kept as it is
    src = _rows(rng, 3)
    ring.push(1, [3, 4, 5], src, horizon=1, copy=True)    # round 0 dies: its rows are reused
    (blk,) = list(ring)
    assert blk.rows.data_ptr() == first.data_ptr() and torch.equal(blk.rows, src)
    src.zero_()
    assert not torch.equal(blk.rows, src)                 # a copy, not the caller's buffer
    other = _rows(rng, 2)
    ring.push(2, [6, 7], other, horizon=2, copy=True)     # shape differs: a fresh copy
    (blk,) = list(ring)
    assert blk.rows.data_ptr() not in (other.data_ptr(), first.data_ptr())
    assert torch.equal(blk.rows, other)


def test_push_checks_rounds_and_scalars():
    ring = HistoryRing("test", scalars={"coef": np.float64})
    ring.push(3, [0], torch.zeros(1, 2), horizon=0, coef=[1.0])
    with pytest.raises(ValueError, match="round 3"):
        ring.push(3, [1], torch.zeros(1, 2), horizon=0, coef=[1.0])
    with pytest.raises(ValueError, match="scalars"):
        ring.push(4, [1], torch.zeros(1, 2), horizon=0)


def test_prepare_moves_rows_and_rejects_another_dimension():
    ring = HistoryRing("myrule")
    ring.push(0, [0, 1], torch.ones(2, 3, dtype=torch.float32), horizon=0)
    ring.prepare(3, torch.device("cpu"), torch.float64)
    assert next(iter(ring)).rows.dtype == torch.float64
    with pytest.raises(ValueError, match="myrule: update dimension changed from 3 to 4"):
        ring.prepare(4, torch.device("cpu"), torch.float64)


KEYS = {"rounds": "h_rounds", "sizes": "h_sizes", "ids": "h_ids", "latest": "h_latest",
        "rows": "h_rows", "loss": "h_loss"}


def _filled_ring(rng):
    ring = HistoryRing("test", scalars={"loss": np.float32})
    ring.push(2, [4, 1, 7], _rows(rng, 3), horizon=0, loss=[0.5, 1.5, 2.5])
    ring.supersede(np.array([1]))
    ring.push(5, [1, 3], _rows(rng, 2), horizon=0, loss=[3.5, 4.5])
    return ring


@pytest.mark.parametrize("via_hdf5", [False, True])
def test_state_dict_round_trip(tmp_path, via_hdf5):
    rng = np.random.default_rng(5)
    ring = _filled_ring(rng)
    state = ring.state_dict(**KEYS)
    assert set(state) == set(KEYS.values())
    assert {k: v.dtype for k, v in state.items()} == {
        "h_rounds": np.int64, "h_sizes": np.int64, "h_ids": np.int64, "h_latest": np.uint8,
        "h_rows": np.float32, "h_loss": np.float32}
    assert state["h_rows"].shape == (5, 4) and state["h_sizes"].tolist() == [3, 2]
    assert state["h_latest"].tolist() == [1, 0, 1, 1, 1]
    if via_hdf5:
        from tests.helpers import h5_round_trip
        state = h5_round_trip(state, tmp_path / "ring.h5")
    back = HistoryRing("test", scalars={"loss": np.float32})
    back.load_state_dict(state, **KEYS)
    for a, b in zip(ring, back, strict=True):
        assert a.round == b.round and np.array_equal(a.ids, b.ids)
        assert np.array_equal(a.latest, b.latest) and torch.equal(a.rows, b.rows)
        assert np.array_equal(a.scalars["loss"], b.scalars["loss"])


def test_empty_state_layout():
    state = HistoryRing("test").state_dict(ids="i", rows="r", rounds="t", sizes="s", latest="l")
    assert state["r"].shape == (0, 0) and state["r"].dtype == np.float32
    assert all(state[k].shape == (0,) for k in "itsl")
    back = HistoryRing("test")
    back.load_state_dict(state, ids="i", rows="r", rounds="t", sizes="s", latest="l")
    assert len(back) == 0


def test_one_round_layout_without_rounds_sizes_latest():
    """FedMDFG's layout: ids, rows and a scalar; one block of ``default_round``."""
    rng = np.random.default_rng(6)
    ring = HistoryRing("test", scalars={"coef": np.float64})
    ring.push(4, [3, 1], _rows(rng, 2), horizon=0, coef=[2.0, 3.0])
    keys = {"ids": "last_ids", "rows": "last_rows", "coef": "last_coef"}
    state = ring.state_dict(**keys)
    assert set(state) == {"last_ids", "last_rows", "last_coef"}
    back = HistoryRing("test", scalars={"coef": np.float64})
    back.load_state_dict(state, **keys, default_round=-1)
    (blk,) = list(back)
    assert blk.round == -1 and blk.ids.tolist() == [3, 1] and blk.latest.all()
    assert torch.equal(blk.rows, next(iter(ring)).rows)
    ring.push(6, [5], _rows(rng, 1), horizon=0, coef=[1.0])
    with pytest.raises(ValueError, match="rounds and sizes"):
        ring.state_dict(**keys)
    ring.supersede(np.array([5]))
    with pytest.raises(ValueError, match="latest"):
        ring.state_dict(ids="i", rows="r", rounds="t", sizes="s", coef="c")


@pytest.mark.parametrize("broken", ["h_sizes", "h_ids", "h_latest", "h_rows", "h_loss",
                                    "h_rounds"])
def test_load_rejects_inconsistent_arrays(broken):
    state = _filled_ring(np.random.default_rng(7)).state_dict(**KEYS)
    state[broken] = state[broken][:-1]
    with pytest.raises(ValueError, match="test state: history arrays have inconsistent"):
        HistoryRing("test", scalars={"loss": np.float32}).load_state_dict(state, **KEYS)


def test_load_rejects_missing_keys():
    state = _filled_ring(np.random.default_rng(8)).state_dict(**KEYS)
    del state["h_latest"]
    with pytest.raises(ValueError, match="missing.*h_latest"):
        HistoryRing("test", scalars={"loss": np.float32}).load_state_dict(state, **KEYS)


if __name__ == "__main__" and "--record" in sys.argv:
    record()
