"""The client-level metrics of the q-FFL and FedProx reproductions (jobs/repro/qffl-synthetic.toml,
jobs/repro/fedprox-synthetic.toml): worst/best 10%, the variance of the clients' accuracies and
the oscillation of the global loss. Made-up arrays only; no published figure is used here."""

from __future__ import annotations

import numpy as np
import pytest

from mpifl.core.errors import OutputError
from mpifl.report.reproductions import FigureRow, order_verdicts, Measured, run_metric


def results(acc: np.ndarray, loss: np.ndarray | None = None, num_test=None) -> dict:
    acc = np.asarray(acc, dtype=np.float64)
    ev = {"round": np.arange(len(acc)), "mean": acc.mean(axis=1), "client_accuracy": acc,
          "client_loss": np.ones_like(acc) if loss is None else np.asarray(loss, dtype=float)}
    clients = {} if num_test is None else {"num_test": np.asarray(num_test)}
    return {"eval": ev, "rounds": {}, "clients": clients}


def test_worst_and_best_tenth_and_variance_over_the_last_evaluations():
    first = np.linspace(0.0, 0.95, 20)           # 20 clients: a tenth is 2
    last = np.linspace(0.1, 1.0, 20)
    res = results(np.stack([first, last]))
    assert run_metric(res, "worst10", 1) == pytest.approx(100 * (0.1 + last[1]) / 2)
    assert run_metric(res, "best10", 1) == pytest.approx(100 * (last[-2] + 1.0) / 2)
    assert run_metric(res, "var", 1) == pytest.approx(np.var(100 * last))
    both = (np.var(100 * first) + np.var(100 * last)) / 2
    assert run_metric(res, "var", 2) == pytest.approx(both)


def test_fewer_than_ten_clients_take_the_single_extreme_client():
    res = results([[0.2, 0.9, 0.5]])
    assert run_metric(res, "worst10", 3) == pytest.approx(20.0)
    assert run_metric(res, "best10", 3) == pytest.approx(90.0)


def test_loss_oscillation_is_relative_and_sample_weighted_over_the_second_half():
    acc = np.zeros((6, 2))
    steady = np.array([[3.0, 3.0], [2.0, 2.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert run_metric(results(acc, steady), "loss_osc", 3) == pytest.approx(0.0)
    # client 0 has 3 test samples, client 1 one: L = (3 l0 + l1) / 4
    zigzag = np.array([[9, 9], [9, 9], [9, 9], [1.0, 5.0], [2.0, 1.0], [1.0, 5.0]])
    curve = np.array([2.0, 1.75, 2.0])
    expected = 100 * np.mean(np.abs(np.diff(curve))) / curve.mean()
    assert run_metric(results(acc, zigzag, [3, 1]), "loss_osc", 3) == pytest.approx(expected)


def test_loss_oscillation_needs_three_evaluations():
    with pytest.raises(OutputError):
        run_metric(results(np.zeros((2, 2))), "loss_osc", 3)
    assert run_metric(results(np.zeros((3, 2))), "loss_osc", 3) == 0.0


def test_new_metrics_are_accepted_by_the_figures_file_and_rank_in_claims():
    rows = [FigureRow(suite="s", section="x", method=m, metric="loss_osc", claim="c", rank=r)
            for m, r in (("FedProx", 1), ("FedAvg", 2))]
    stable, shaky = Measured(values=[1.0, 2.0]), Measured(values=[5.0, 6.0])
    assert order_verdicts(rows, [stable, shaky]) == {"c": "reproduced"}
    assert order_verdicts(rows, [shaky, stable]) == {"c": "not reproduced"}
    for metric in ("worst10", "best10", "var"):
        FigureRow(suite="s", section="x", method="m", metric=metric)
