"""FedFV's blocked projection recursion (mpifl.aggregators.fedfv_batched) against the GEMV loop
(fedfv.internal_coefficients) and the direct per-pair oracle (fedfv_direct), on random and
adversarial rounds (many conflicts, exact zeros and ties in the dot products, zero and duplicate
updates, norms over 12 orders of magnitude, ties in the order), and split over shard ranks under
real mpiexec.

Tolerance. The blocked solve adds the same products in another association, so it is not
bit-identical to the loop; a dot product within rounding of 0 may even be projected in one
and not in the other, which moves g_i by about the rounding itself (the projection is
``dots / ||u_j||``). Every step projects g_i onto a half-space, a 1-Lipschitz map, so the
differences are not amplified. Coefficients are therefore compared where they act, in the
updates' space: ``||(C_new - C_old)_i U|| = sqrt(dC_i G dC_i^T) <= 1e-11 ||u_i||`` (measured:
at most 1.0e-15 on these inputs, m <= 400, although on the {-1, 0, 1} inputs the two forms
take 267 different projection decisions at exact zeros; the loop's own rounding error is of
order m * eps times the coefficients' size). Steps of the whole rule: 1e-10 relative in
float64.

Run by pytest; ``mpiexec -n 3 python tests/mpi/test_fedfv_batched.py`` is the MPI part (its
test starts it).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from mpifl.aggregators import RoundUpdates, create
from mpifl.aggregators import fedfv as fedfv_mod
from mpifl.aggregators.fedfv import internal_coefficients, num_kept, projection_order
from mpifl.aggregators.fedfv_batched import (BATCHED_MIN_CLIENTS, coefficient_column_sums,
                                             po_coefficients, row_block)
from mpifl.aggregators.fedfv_direct import DirectFedFV

U_TOL = 1e-11          # coefficients, in the norm of the updates' space, relative to ||u_i||
STEP_TOL = 1e-10       # whole steps, float64, relative
OLD = 10**9            # batched_from that keeps the GEMV loop at any m


# ---- inputs ------------------------------------------------------------------------------------

def low_rank(m, rng, d=256, share=0.5, noise=0.3):
    """A shared direction plus low-rank conflicts and noise (the usual FL picture)."""
    z = rng.standard_normal((m, 6))
    z[:, 0] = share + 0.3 * z[:, 0]
    return z @ rng.standard_normal((6, d)) + noise * rng.standard_normal((m, d))


def many_conflicts(m, rng):
    """Independent Gaussian updates in d > m: about half of all dot products are negative,
    and C is dense (~45% non-zero)."""
    return rng.standard_normal((m, 2 * m))


def signs(m, rng):
    """Entries in {-1, 0, 1}, sparse: integer Gram, many dot products exactly 0 (the decision
    boundary ``dots < 0``), exact duplicates and exact opposites."""
    U = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=(m, 24))
    U[1::7] = U[0::7][: len(U[1::7])]         # duplicates
    U[2::7] = -U[0::7][: len(U[2::7])]        # opposites
    return U


def degenerate(m, rng):
    """Zero updates (G_jj = 0), orthogonal blocks (exact zeros in G) and norms from 1e-6 to 1e6."""
    U = low_rank(m, rng, d=40)
    U[::5] = 0.0
    U[1::9, :20] = 0.0
    U[2::9, 20:] = 0.0
    return U * np.logspace(-6, 6, m)[rng.permutation(m), None]


INPUTS = {"low_rank": low_rank, "many_conflicts": many_conflicts, "signs": signs,
          "degenerate": degenerate}


def draw(kind, m, seed):
    """A round's updates (m, d), losses with many ties (broken by client id) and client ids."""
    rng = np.random.default_rng(seed)
    U = INPUTS[kind](m, rng)
    return U, rng.integers(0, max(m // 4, 1), m).astype(np.float64), rng.permutation(10 * m)[:m]


def case(kind, m, alpha, seed):
    """(G, po, kept) of a round: Gram matrix, loss order with ties, kept clients."""
    U, losses, ids = draw(kind, m, seed)
    po = projection_order(ids, losses, "loss", 0, 0)
    kept = np.zeros(m, dtype=bool)
    kept[po[m - num_kept(m, alpha):]] = True
    return U @ U.T, po, kept


def u_space_error(dC, Gp, rows):
    """max_i ||dC_i U|| / ||u_i|| over rows with u_i != 0 (PO space)."""
    sq = np.einsum("ij,jk,ik->i", dC, Gp, dC).clip(min=0)
    norms = np.sqrt(np.diag(Gp)[rows])
    nz = norms > 0
    assert np.all(sq[~nz] == 0)               # a zero update never projects... nor is moved
    return float(np.max(np.sqrt(sq[nz]) / norms[nz], initial=0.0))


# ---- the solver against the loop ---------------------------------------------------------------

@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.parametrize("m,alpha", [(1, 0.0), (2, 0.0), (7, 0.5), (64, 0.1), (257, 0.0),
                                     (400, 0.3)])
@pytest.mark.parametrize("leaf", [1, 5, 48])
def test_coefficients_equal_the_loop(kind, m, alpha, leaf):
    G, po, kept = case(kind, m, alpha, seed=m + 7 * leaf)
    n_free = m - int(kept.sum())
    Gp = G[np.ix_(po, po)]
    C_old = internal_coefficients(G, po, kept)[np.ix_(po, po)]
    C_new = po_coefficients(np.ascontiguousarray(Gp), n_free, leaf=leaf)
    assert C_new.shape == (n_free, m)
    assert np.all(C_old[n_free:] == 0)                       # kept clients never project
    assert u_space_error(C_new - C_old[:n_free], Gp, np.arange(n_free)) <= U_TOL
    # where the two agree on a projection, the coefficient itself agrees to rounding
    both = (C_new != 0) & (C_old[:n_free] != 0)
    scale = np.abs(C_old).max(initial=1.0)
    assert np.abs(C_new - C_old[:n_free])[both].max(initial=0.0) <= 1e-12 * scale
    assert np.all(np.diagonal(C_new) == 0)                   # nobody projects on itself


def test_the_adversarial_inputs_are_adversarial():
    """Guards for the comparisons above: the cases must conflict a lot, and hit exact zeros."""
    G, po, kept = case("many_conflicts", 400, 0.0, 1)
    C = internal_coefficients(G, po, kept)
    assert (C != 0).mean() > 0.3
    G, po, kept = case("signs", 400, 0.0, 1)
    C = internal_coefficients(G, po, kept)
    assert (G == 0).mean() > 0.1 and (C != 0).mean() > 0.05
    # dot products within rounding of 0: the two forms decide differently on some pairs, so
    # the tolerance argument (not bit-identity) is what the comparisons above test
    Cp = C[np.ix_(po, po)]
    C_new = po_coefficients(np.ascontiguousarray(G[np.ix_(po, po)]), 400, leaf=5)
    assert ((C_new != 0) != (Cp != 0)).sum() > 0
    G, po, kept = case("degenerate", 257, 0.0, 1)
    assert (np.diag(G) == 0).sum() >= 50
    # ties in the order (equal losses) are present from m = 7 on
    for m, leaf in ((7, 1), (64, 48), (400, 5)):
        assert len(np.unique(draw("low_rank", m, m + 7 * leaf)[1])) < m


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 150])
def test_row_blocks_add_up_to_the_whole(shards):
    G, po, kept = case("many_conflicts", 140, 0.1, 3)     # 150 shards: some hold no rows
    n_free = 140 - int(kept.sum())
    blocks = [row_block(n_free, shards, j) for j in range(shards)]
    assert blocks[0][0] == 0 and blocks[-1][1] == n_free
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert max(hi - lo for lo, hi in blocks) - min(hi - lo for lo, hi in blocks) <= 1
    whole = coefficient_column_sums(G, po, n_free)
    parts = sum(coefficient_column_sums(G, po, n_free, lo, hi) for lo, hi in blocks)
    oracle = internal_coefficients(G, po, kept).sum(axis=0)
    scale = np.abs(oracle).max()
    assert np.abs(parts - whole).max() <= 1e-12 * scale
    assert np.abs(whole - oracle).max() <= 1e-12 * scale
    # a block's rows are the whole solve's rows
    Gp = np.ascontiguousarray(G[np.ix_(po, po)])
    lo, hi = blocks[len(blocks) // 2]
    full = po_coefficients(Gp, n_free)
    assert u_space_error(po_coefficients(Gp, n_free, lo, hi) - full[lo:hi], Gp,
                         np.arange(lo, hi)) <= U_TOL


def test_bad_row_blocks_are_refused():
    with pytest.raises(ValueError, match="lo <= hi"):
        po_coefficients(np.eye(4), 3, 2, 4)


# ---- the rule: automatic choice, oracles ----------------------------------------------------

def rounds(m, *, count=4, K=None, dtype=torch.float64, seed=0, kind="low_rank"):
    """Rounds of partial participation (clients come back, so history is superseded), with
    ties in the losses."""
    rng = np.random.default_rng(seed)
    K = K or 3 * m
    for t in range(count):
        U = INPUTS[kind](m, rng)
        losses = rng.integers(0, 5, m).astype(np.float32)
        yield RoundUpdates(round=t, client_ids=rng.choice(K, m, replace=False),
                           updates=torch.as_tensor(U, dtype=dtype), losses=losses,
                           num_samples=np.full(m, 10), lr=0.1)


def rel(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.mark.parametrize("m,alpha,tau,order,window,kind", [
    (12, 0.0, 0, "loss", "paper", "many_conflicts"),
    (40, 0.1, 1, "loss", "paper", "low_rank"),
    (40, 0.5, 2, "random", "flgo", "signs"),
    (60, 0.3, 3, "reverse", "paper", "many_conflicts"),
])
def test_batched_rule_equals_the_direct_oracle(m, alpha, tau, order, window, kind):
    params = dict(alpha=alpha, tau=tau, order=order, external_window=window, seed=3)
    batched, direct = create("fedfv", **params), DirectFedFV(**params)
    batched.batched_from = 1
    for r in rounds(m, kind=kind):
        assert rel(batched.aggregate(r), direct.aggregate(r)) <= STEP_TOL


@pytest.mark.parametrize("alpha,tau,order", [(0.1, 1, "loss"), (0.0, 2, "random"),
                                             (0.6, 0, "reverse")])
@pytest.mark.parametrize("kind", ["low_rank", "many_conflicts", "degenerate"])
def test_batched_rule_equals_the_loop_at_large_m(alpha, tau, order, kind):
    params = dict(alpha=alpha, tau=tau, order=order, seed=1)
    batched, loop = create("fedfv", **params), create("fedfv", **params)
    loop.batched_from = OLD
    for r in rounds(BATCHED_MIN_CLIENTS + 44, count=2, kind=kind):
        assert rel(batched.aggregate(r), loop.aggregate(r)) <= STEP_TOL


def test_the_choice_is_automatic_and_small_rounds_keep_the_loop(monkeypatch):
    """The main job (m = 10) and anything below the threshold run the loop, bit for bit;
    from the threshold on the blocked solve runs (and the loop does not)."""
    calls = []
    real = fedfv_mod.internal_coefficients
    monkeypatch.setattr(fedfv_mod, "internal_coefficients",
                        lambda *a: calls.append(len(a[1])) or real(*a))
    assert create("fedfv").batched_from == BATCHED_MIN_CLIENTS > 10
    for m in (10, BATCHED_MIN_CLIENTS - 1):
        default, loop = create("fedfv"), create("fedfv")
        loop.batched_from = OLD
        for r32 in rounds(m, count=2, dtype=torch.float32, seed=m):
            assert torch.equal(default.aggregate(r32), loop.aggregate(r32))
    assert calls == [10] * 4 + [BATCHED_MIN_CLIENTS - 1] * 4     # 2 rounds x 2 rules each
    calls.clear()
    r = next(rounds(BATCHED_MIN_CLIENTS))
    create("fedfv", tau=0).aggregate(r)
    assert calls == []


def test_float32_rounds_agree_with_the_loop():
    batched, loop = create("fedfv", tau=1), create("fedfv", tau=1)
    loop.batched_from = OLD
    for r in rounds(BATCHED_MIN_CLIENTS + 24, count=2, dtype=torch.float32,
                    kind="many_conflicts"):
        # same float64 recursion on the same float32-accumulated Gram; the step is float32
        assert rel(batched.aggregate(r), loop.aggregate(r)) <= 1e-6


def test_the_recursion_benchmark_times_both_forms_on_the_same_inputs():
    from mpifl.bench.aggregation import bench_fedfv_recursion, format_recursion

    rows = bench_fedfv_recursion([BATCHED_MIN_CLIENTS], d=64, repeats=1, threads=1)
    assert [(r["m"], r["conflicts"], r["shards"]) for r in rows] == [
        (BATCHED_MIN_CLIENTS, "few", 1), (BATCHED_MIN_CLIENTS, "many", 1)]
    for r in rows:
        assert r["rows"] == BATCHED_MIN_CLIENTS - num_kept(BATCHED_MIN_CLIENTS, 0.1)
        assert 0 < r["density"] < 1 and r["max_rel_diff"] <= 1e-12
        assert r["ratio"] == pytest.approx(r["loop_s"] / r["blocked_max_s"])
    assert rows[1]["density"] > 0.3 > rows[0]["density"]     # the two kinds differ as stated
    assert "max_rel_diff" in format_recursion(rows).splitlines()[0]

