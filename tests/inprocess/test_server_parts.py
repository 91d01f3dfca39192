"""Pure pieces of the round: metrics (docs/ALGORITHMS.md §10), client sampling
(docs/ALGORITHMS.md §1), rank blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpifl.runtime.comm import split_by_samples
from mpifl.metrics.summary import client_summary, count_conflicts, count_layer_conflicts
from mpifl.runtime.server import eval_due, select_clients


def test_client_summary_by_hand():
    acc = np.array([0.5, 1.0, 0.75, 0.25])
    s = client_summary(acc, np.array([10, 30, 20, 40]))
    assert s["mean"] == pytest.approx(0.625)
    assert s["weighted_mean"] == pytest.approx((5 + 30 + 15 + 10) / 100)
    # population std of [0.5, 1, 0.75, 0.25] (a fraction): sqrt(mean of [.125^2, .375^2, ...])
    assert s["std"] == pytest.approx(math.sqrt((2 * 0.125**2 + 2 * 0.375**2) / 4))
    assert s["worst5"] == 0.25 and s["best5"] == 1.0  # max(1, floor(0.05*4)) = 1 client
    cos = acc.sum() / (np.linalg.norm(acc) * 2)
    assert s["fair_angle"] == pytest.approx(math.acos(cos))


def test_worst5_averages_the_lowest_five_percent():
    acc = np.linspace(0, 1, 100)  # 100 clients -> 5 lowest, 5 highest
    s = client_summary(acc, np.ones(100))
    assert s["worst5"] == pytest.approx(acc[:5].mean()) and s["best5"] == pytest.approx(acc[-5:].mean())
    assert client_summary(np.full(7, 0.8), np.ones(7))["fair_angle"] == pytest.approx(0, abs=1e-7)


def test_count_conflicts():
    u = torch.tensor([[1.0, 0.0], [-1.0, 0.1], [0.0, 1.0], [-0.1, -1.0]])
    assert count_conflicts(u, torch.tensor([1.0, 0.0])) == 2


def test_count_layer_conflicts():
    # layer 0 = coords 0:2, layer 1 = coord 2; step (1, 1, -1)
    u = torch.tensor([[1.0, 1.0, 1.0], [-3.0, 1.0, -1.0], [0.0, 0.0, 0.0]])
    lc = count_layer_conflicts(u, torch.tensor([1.0, 1.0, -1.0]), [slice(0, 2), slice(2, 3)])
    assert lc.tolist() == [1, 1]  # client 1 in layer 0 (-3+1 < 0), client 0 in layer 1 (-1 < 0)


def test_select_clients_is_keyed_sorted_and_without_replacement():
    n = np.arange(1, 1001)
    a = select_clients(7, 3, n, 50, "uniform")
    assert np.array_equal(a, select_clients(7, 3, n, 50, "uniform"))
    assert not np.array_equal(a, select_clients(7, 4, n, 50, "uniform"))
    assert len(np.unique(a)) == 50 and np.all(np.diff(a) > 0) and a.dtype == np.int64
    assert np.array_equal(select_clients(7, 3, n, 50, "all"), np.arange(1000))


def test_weighted_sampling_prefers_large_clients():
    n = np.array([1] * 90 + [1000] * 10)
    hits = np.concatenate([select_clients(0, t, n, 5, "weighted") for t in range(200)])
    assert np.mean(hits >= 90) > 0.8  # the 10 large clients hold ~99% of the samples


def test_split_by_samples_balances_contiguous_blocks():
    b = split_by_samples(np.array([10, 10, 10, 10, 10, 10]), 3)
    assert list(b) == [0, 2, 4, 6]
    b = split_by_samples(np.array([100, 1, 1, 1, 1]), 2)
    assert list(b) == [0, 1, 5]
    b = split_by_samples(np.array([5]), 3)  # more ranks than clients: empty blocks are fine
    assert b[0] == 0 and b[-1] == 1 and np.all(np.diff(b) >= 0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = rng.integers(1, 500, size=rng.integers(1, 40))
        parts = int(rng.integers(1, 6))
        b = split_by_samples(n, parts)
        assert len(b) == parts + 1 and b[0] == 0 and b[-1] == len(n) and np.all(np.diff(b) >= 0)
        loads = [n[b[i]:b[i + 1]].sum() for i in range(parts)]
        assert max(loads) <= n.sum() / parts + n.max()  # within one client of perfect balance


def test_eval_schedule():
    assert [r for r in range(10) if eval_due(r, 10, 4)] == [3, 7, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accepted_rejects_non_finite_and_too_large_updates(dtype):
    from mpifl.clients.faults import accepted

    U = torch.randn(6, 1000, dtype=dtype, generator=torch.Generator().manual_seed(1))
    U[1, 7], U[2, 999], U[3, 0] = float("nan"), float("inf"), float("-inf")
    U[4] *= 100.0                                   # finite but long
    U[5] = torch.finfo(dtype).max                   # finite extremes are finite
    U[5, ::2] = -torch.finfo(dtype).max
    assert accepted(U, None).tolist() == [True, False, False, False, True, True]
    limit = float(torch.linalg.vector_norm(U[0])) * 10
    assert accepted(U, limit).tolist() == [True, False, False, False, False, False]
