"""Group and client fairness metrics (docs/ALGORITHMS.md §4, §10): a hand-made table with
hand-computed values, the differentiable surrogates against the hard metrics, gradients, vmap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.metrics.fairness import (ap_violation, cf_violation, constraint_values, dp_violation,
                            eo_violation, group_gaps, group_violations, num_constraints,
                            positive_probability)

# A hand-made table of 10 people: group A, true label Y, prediction ŷ.
#
#   row  A  Y  ŷ   error
#    0   0  1  1
#    1   0  1  0     x
#    2   0  0  0
#    3   0  0  1     x
#    4   1  1  1
#    5   1  1  1
#    6   1  0  0
#    7   1  0  1     x
#    8   1  1  1
#    9   1  0  0
A = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
Y = np.array([1, 1, 0, 0, 1, 1, 0, 0, 1, 0])
P = np.array([1, 0, 0, 1, 1, 1, 0, 1, 1, 0])

# DP: P(ŷ=1) = 6/10 = 0.6; group 0: 2/4 = 0.5 (gap 0.1); group 1: 4/6 = 2/3 (gap 1/15).
DP = 0.1
# EO: Y=1 rows 0,1,4,5,8: P(ŷ=1|Y=1) = 4/5 = 0.8; group 0 rows 0,1: 1/2 (gap 0.3);
#     group 1 rows 4,5,8: 3/3 = 1 (gap 0.2).
#     Y=0 rows 2,3,6,7,9: P(ŷ=1|Y=0) = 2/5 = 0.4; group 0 rows 2,3: 1/2 (gap 0.1);
#     group 1 rows 6,7,9: 1/3 (gap 1/15).
EO = 0.3
EO_GAPS = [0.1, 0.3, 1 / 15, 0.2]           # (a0,y0), (a0,y1), (a1,y0), (a1,y1)
# AP: errors at rows 1, 3, 7: overall 3/10 = 0.3; group 0: 2/4 = 0.5 (gap 0.2);
#     group 1: 1/6 (gap |1/6 - 0.3| = 2/15).
AP = 0.2


def test_hand_made_table():
    assert dp_violation(P, A) == pytest.approx(DP, abs=1e-12)
    assert eo_violation(P, Y, A) == pytest.approx(EO, abs=1e-12)
    assert ap_violation(P, Y, A) == pytest.approx(AP, abs=1e-12)
    assert group_violations(P, Y, A) == pytest.approx({"dp": DP, "eo": EO, "ap": AP}, abs=1e-12)


def test_cf_violation_by_hand():
    # mean accuracy 0.75; the gaps are 0.15, 0.05, 0.05, 0.15
    assert cf_violation([0.9, 0.7, 0.8, 0.6]) == pytest.approx(0.15, abs=1e-12)
    assert cf_violation([0.5]) == 0.0
    with pytest.raises(ValueError):
        cf_violation([])


def test_perfectly_fair_and_one_group():
    assert dp_violation([1, 0, 1, 0], [0, 0, 1, 1]) == 0.0
    assert dp_violation([1, 0, 1], [0, 0, 0]) == 0.0              # one group: no gap
    assert eo_violation([1, 0], [1, 1], [0, 1]) == 0.5            # only Y=1: 1 and 0 vs 0.5
    assert eo_violation([1, 1], [0, 1], [0, 1]) == 0.0            # each cell alone in its Y


def test_hard_metric_errors():
    with pytest.raises(ValueError, match="0/1"):
        dp_violation([0.5, 1], [0, 1])
    with pytest.raises(ValueError, match="same non-empty"):
        dp_violation([], [])
    with pytest.raises(ValueError, match="integer ids"):
        dp_violation([1, 0], [-1, 0])
    with pytest.raises(ValueError, match="labels"):
        eo_violation([1, 0], [1], [0, 1])


def tensors(dtype=torch.float64):
    return (torch.tensor(P, dtype=dtype), torch.tensor(Y), torch.tensor(A))


def test_surrogates_equal_hard_metrics_on_01_probabilities():
    prob, y, a = tensors()
    dp = group_gaps("dp", prob, y, a, 2)
    eo = group_gaps("eo", prob, y, a, 2)
    ap = group_gaps("ap", prob, y, a, 2, losses=(prob != y).to(torch.float64))  # 0-1 loss
    assert dp.tolist() == pytest.approx([0.1, 1 / 15], abs=1e-12)
    assert eo.tolist() == pytest.approx(EO_GAPS, abs=1e-12)
    assert ap.tolist() == pytest.approx([0.2, 2 / 15], abs=1e-12)
    assert float(dp.max()) == pytest.approx(DP, abs=1e-12)
    assert float(eo.max()) == pytest.approx(EO, abs=1e-12)
    assert float(ap.max()) == pytest.approx(AP, abs=1e-12)


def test_surrogates_equal_hard_metrics_random():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n, g = int(rng.integers(1, 40)), int(rng.integers(1, 4))
        p, y, a = (rng.integers(0, 2, n), rng.integers(0, 2, n), rng.integers(0, g, n))
        pt = torch.tensor(p, dtype=torch.float64)
        yt, at = torch.tensor(y), torch.tensor(a)
        assert float(group_gaps("dp", pt, yt, at, g).max()) == pytest.approx(
            dp_violation(p, a), abs=1e-12)
        assert float(group_gaps("eo", pt, yt, at, g).max()) == pytest.approx(
            eo_violation(p, y, a), abs=1e-12)
        err = (pt != yt).to(torch.float64)
        assert float(group_gaps("ap", pt, yt, at, g, losses=err).max()) == pytest.approx(
            ap_violation(p, y, a), abs=1e-12)


def test_constraints_shapes_eps_and_weights():
    prob, y, a = tensors()
    c = constraint_values("eo", prob, y, a, 2, eps=0.05)
    assert c.shape == (num_constraints("eo", 2),) == (4,)
    assert c.tolist() == pytest.approx([v - 0.05 for v in EO_GAPS], abs=1e-12)
    assert num_constraints("dp", 3) == 3
    # weight 0 removes rows: dropping rows 4..9 leaves group 0 alone, so no gap at all
    w = torch.tensor([1.0] * 4 + [0.0] * 6, dtype=torch.float64)
    assert group_gaps("dp", prob, y, a, 2, weight=w).tolist() == [0.0, 0.0]
    # an empty group (id 2 never occurs) has gap 0
    assert group_gaps("dp", prob, y, a, 3)[2].item() == 0.0
    with pytest.raises(ValueError, match="losses"):
        group_gaps("ap", prob, y, a, 2)
    with pytest.raises(ValueError, match="notion"):
        group_gaps("xx", prob, y, a, 2)


def test_gradients_flow():
    torch.manual_seed(0)
    logits = torch.randn(10, 2, dtype=torch.float64, requires_grad=True)
    _, y, a = tensors()
    prob = positive_probability(logits)
    losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    total = sum(group_gaps(n, prob, y, a, 2, losses=losses).sum() for n in ("dp", "eo", "ap"))
    (grad,) = torch.autograd.grad(total, logits)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # the DP gap's gradient against a finite difference
    w = torch.randn(10, 2, dtype=torch.float64)

    def f(t):
        return float(group_gaps("dp", positive_probability(logits.detach() + t * w), y, a, 2)[0])

    gap = group_gaps("dp", positive_probability(logits), y, a, 2)[0]
    (g,) = torch.autograd.grad(gap, logits)
    fd = (f(1e-6) - f(-1e-6)) / 2e-6
    assert float((g * w).sum()) == pytest.approx(fd, rel=1e-6)


def test_surrogate_runs_under_vmap():
    prob, y, a = tensors()
    batch = torch.stack([prob, 1 - prob])                       # two "clients"
    out = torch.func.vmap(lambda p: group_gaps("eo", p, y, a, 2))(batch)
    assert out.shape == (2, 4)
    assert out[0].tolist() == pytest.approx(EO_GAPS, abs=1e-12)


def test_positive_probability():
    logits = torch.tensor([[0.0, 0.0], [0.0, 100.0]])
    assert positive_probability(logits).tolist() == pytest.approx([0.5, 1.0])
    assert positive_probability(torch.tensor([0.0])).tolist() == [0.5]
    with pytest.raises(ValueError):
        positive_probability(torch.zeros(2, 3))
