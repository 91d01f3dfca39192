"""The aggregator registry, RoundUpdates validation and FedAvg (docs/ALGORITHMS.md §2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.aggregators import Aggregator, RoundUpdates, available, base, create, register
from mpifl.aggregators.fedavg import FedAvg
from mpifl.aggregators.gram import gram


def round_updates(m=4, d=6, **over):
    rng = np.random.default_rng(0)
    kw = dict(round=0, client_ids=np.arange(m) * 3,
              updates=rng.standard_normal((m, d)).astype(np.float32),
              losses=rng.random(m), num_samples=rng.integers(1, 50, m), lr=0.05)
    kw.update(over)
    return RoundUpdates(**kw)


# ---- registry --------------------------------------------------------------------------------

def test_available_lists_registered_rules():
    names = available()
    assert {"fedavg", "fedfv"} <= set(names)
    assert names == sorted(names)
    assert "fedfv_direct" not in names          # the oracle is not user-facing


def test_create_builds_the_named_rule():
    agg = create("fedavg", weighting="uniform", seed=3)
    assert isinstance(agg, FedAvg) and agg.name == "fedavg" and agg.seed == 3
    assert create("fedfv").name == "fedfv"


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'fedsgd'.*fedavg.*fedfv"):
        create("fedsgd")


def test_unknown_parameter_is_type_error():
    with pytest.raises(TypeError):
        create("fedfv", beta=0.1)
    with pytest.raises(TypeError):
        create("fedavg", tau=1)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed(seed):
    with pytest.raises(ValueError):
        create("fedavg", seed=seed)


def test_register_and_name_clash(monkeypatch):
    monkeypatch.setattr(base.RULES, "_entries", dict(base.RULES._entries))

    @register("half")
    class Half(Aggregator):
        def aggregate(self, r):
            return 0.5 * r.updates.sum(0)

    assert "half" in available() and Half.name == "half"
    r = round_updates()
    torch.testing.assert_close(create("half").aggregate(r), 0.5 * r.updates.sum(0))
    with pytest.raises(ValueError, match="already registered"):
        @register("fedavg")
        class Other(Aggregator):
            pass
    with pytest.raises(ValueError):
        register("")


def test_stateless_state_dict():
    agg = create("fedavg")
    assert agg.state_dict() == {}
    agg.load_state_dict({})
    with pytest.raises(ValueError):
        agg.load_state_dict({"history": np.zeros(3)})


# ---- FedAvg ----------------------------------------------------------------------------------

def test_fedavg_samples_weighting_matches_formula():
    r = round_updates(m=5, d=7)
    U, n = r.updates.double().numpy(), r.num_samples.numpy()
    expected = sum(n[k] * U[k] for k in range(5)) / n.sum()
    s = create("fedavg").aggregate(r)
    assert s.dtype == torch.float32 and s.shape == (7,)
    np.testing.assert_allclose(s.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fedavg_uniform_weighting_is_plain_mean():
    r = round_updates(m=5, d=7, num_samples=[1, 1000, 1, 1, 1])
    U = r.updates.double().numpy()
    s = create("fedavg", weighting="uniform").aggregate(r)
    np.testing.assert_allclose(s.numpy(), sum(U[k] for k in range(5)) / 5, rtol=1e-5, atol=1e-6)
    # and the sample weighting does follow the counts
    assert not np.allclose(create("fedavg").aggregate(r).numpy(), s.numpy(), atol=1e-3)


def test_fedavg_keeps_dtype_and_rejects_empty_samples():
    r = round_updates(updates=np.ones((4, 3)))             # float64 numpy stays float64
    assert create("fedavg").aggregate(r).dtype == torch.float64
    with pytest.raises(ValueError, match="no training samples"):
        create("fedavg").aggregate(round_updates(num_samples=np.zeros(4, dtype=int)))
    with pytest.raises(ValueError):
        create("fedavg", weighting="data")


# ---- RoundUpdates ----------------------------------------------------------------------------

def test_round_updates_converts_inputs():
    r = round_updates(client_ids=[4, 1, 2, 9], losses=[0.1, 0.2, 0.3, 0.4],
                      num_samples=[1, 2, 3, 4], lr=np.float32(0.5), round=np.int64(7),
                      layers=[slice(0, 2), slice(np.int64(2), 6)],
                      stats={"acc": [0.5, 0.6, 0.7, 0.8]})
    assert isinstance(r.client_ids, np.ndarray) and r.client_ids.dtype == np.int64
    assert isinstance(r.updates, torch.Tensor) and r.updates.dtype == torch.float32
    assert r.losses.dtype == torch.float32 and r.losses.device == r.updates.device
    assert r.num_samples.dtype == torch.int64
    assert r.round == 7 and isinstance(r.round, int) and r.lr == 0.5
    assert isinstance(r.stats["acc"], torch.Tensor) and (r.m, r.d) == (4, 6)


@pytest.mark.parametrize("over,match", [
    (dict(updates=np.zeros(6)), "2-D"),
    (dict(updates=np.zeros((0, 6))), "at least one"),
    (dict(updates=np.zeros((4, 6), dtype=np.int64)), "floating"),
    (dict(client_ids=[0, 1, 2]), "client_ids"),
    (dict(client_ids=[0, 1, 1, 2]), "distinct"),
    (dict(client_ids=[0.0, 1.0, 2.0, 3.0]), "client_ids"),
    (dict(losses=[0.1, 0.2]), "losses"),
    (dict(num_samples=[1.0, 2.0, 3.0, 4.0]), "integers"),
    (dict(num_samples=[1, -2, 3, 4]), ">= 0"),
    (dict(num_samples=[[1, 2, 3, 4]]), "num_samples"),
    (dict(lr=0.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(round=-1), "round"),
    (dict(round=True), "round"),
    (dict(layers=[slice(0, 7)]), "layers"),
    (dict(layers=[slice(0, 6, 2)]), "layers"),
    (dict(layers=[(0, 6)]), "layers"),
    (dict(stats={"acc": [0.1, 0.2]}), "stats"),
])
def test_round_updates_validation(over, match):
    with pytest.raises(ValueError, match=match):
        round_updates(**over)


def test_fedprox_aggregates_as_fedavg_and_asks_for_the_proximal_term():
    from mpifl.aggregators import rule

    u = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    r = RoundUpdates(round=0, client_ids=np.array([0, 1]), updates=u,
                     losses=torch.tensor([1.0, 1.0]), num_samples=np.array([1, 3]), lr=0.1)
    # sample weights 1/4 and 3/4: s = (0.25, 2.25)
    assert torch.allclose(create("fedprox", mu=0.3).aggregate(r), torch.tensor([0.25, 2.25]))
    assert rule("fedprox").client_options(rule("fedprox").Params(mu=0.3)) == {"prox_mu": 0.3}
    assert rule("fedavg").client_options(rule("fedavg").Params(weighting="samples")) == {}
    with pytest.raises(ValueError, match="fedprox: mu: input should be greater than or equal to 0"):
        create("fedprox", mu=-1.0)


@pytest.mark.parametrize("threads", [1, 2])  # numpy's syrk on one thread, else torch's GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gram_is_every_pairwise_dot_product(dtype, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    X = torch.randn(7, 3001, generator=torch.Generator().manual_seed(0), dtype=dtype)
    G = gram(X)
    assert G.shape == (7, 7) and G.dtype == np.float64
    want = np.array([[float(torch.dot(a.double(), b.double())) for b in X] for a in X])
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    np.testing.assert_allclose(G, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(G, G.T, rtol=tol, atol=tol)  # syrk computes one triangle
    # a column slice (FedLF's layers) and a tensor that requires grad
    part = X[:, 100:250]
    np.testing.assert_allclose(gram(part), (part.double() @ part.double().T).numpy(),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(gram(X.clone().requires_grad_()), want, rtol=tol, atol=tol)
