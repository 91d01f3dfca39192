"""FedMeta (Yao et al. 2019, docs/ALGORITHMS.md §6): the meta set, the meta step against a plain
autograd computation, the fedmeta aggregator, and the [uga] / [fedmeta] / server.meta config
keys."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import vector_to_parameters

from mpifl.aggregators import RoundUpdates, create, rule
from mpifl.experiment.config import load_config
from mpifl.data.federated import FederatedData
from mpifl.core.errors import ConfigError
from mpifl.clients.meta import MetaStep, meta_indices
from mpifl.experiment.assemble import Parts, meta_step_for
from mpifl.experiment.plan import make_plan
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model, get_loss, model_traits


def make_fed(sizes=(30, 50, 20), n_test=5, features=6, classes=3, sensitive=None, seed=0):
    """A FederatedData over random samples: client k gets sizes[k] train and n_test test rows."""
    rng = np.random.default_rng(seed)
    k = len(sizes)
    n = sum(sizes) + k * n_test
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    perm = rng.permutation(n)
    train_idx, test_idx = perm[:sum(sizes)], perm[sum(sizes):]
    train_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    test_ptr = np.arange(k + 1, dtype=np.int64) * n_test
    sens = None if sensitive is None else np.asarray(sensitive(rng, n), dtype=np.int64)
    return FederatedData("toy", x, y, classes, (features,), train_ptr, train_idx.astype(np.int64),
                         test_ptr, test_idx.astype(np.int64), sensitive=sens)


def model_of(fed):
    model = build_model("mlp", fed.input_shape, fed.num_classes, hidden=(5,), seed=1)
    return model, ParamLayout.from_module(model)


# --------------------------------------------------------------------------- the meta set


def test_iid_meta_set_size_pool_and_determinism():
    fed = make_fed()
    idx = meta_indices(fed, seed=3, size=40)
    assert idx.dtype == np.int64 and idx.shape == (40,) and len(np.unique(idx)) == 40
    assert np.all(np.diff(idx) > 0)  # sorted
    assert set(idx.tolist()) <= set(fed.train_idx.tolist())  # never a test sample
    assert np.array_equal(idx, meta_indices(fed, seed=3, size=40))
    assert not np.array_equal(idx, meta_indices(fed, seed=4, size=40))
    whole = meta_indices(fed, seed=0, size=100)  # the whole pool
    assert np.array_equal(whole, np.sort(fed.train_idx))
    with pytest.raises(ConfigError, match="meta_size"):
        meta_indices(fed, seed=0, size=101)


def test_group_balanced_meta_set():
    # group 1 is rare (about 20 % of the samples)
    fed = make_fed(sensitive=lambda rng, n: (rng.random(n) < 0.2).astype(int))
    pool_groups = fed.sensitive[fed.train_idx]
    assert (pool_groups == 1).sum() < 0.35 * len(pool_groups)
    idx = meta_indices(fed, seed=1, size=20, sampling="group_balanced")
    assert len(np.unique(idx)) == 20 and set(idx.tolist()) <= set(fed.train_idx.tolist())
    assert np.bincount(fed.sensitive[idx]).tolist() == [10, 10]
    assert np.array_equal(idx, meta_indices(fed, seed=1, size=20, sampling="group_balanced"))
    rare = int((pool_groups == 1).sum())
    with pytest.raises(ConfigError, match="group 1"):
        meta_indices(fed, seed=1, size=2 * (rare + 1), sampling="group_balanced")
    with pytest.raises(ConfigError, match="multiple"):
        meta_indices(fed, seed=1, size=21, sampling="group_balanced")
    with pytest.raises(ConfigError, match="sensitive"):
        meta_indices(make_fed(), seed=1, size=20, sampling="group_balanced")


# --------------------------------------------------------------------------- the meta step


def oracle_meta(model, fed, idx, w, eta):
    """w - eta * grad of the mean CE on the meta samples: plain module, loss.backward()."""
    net = copy.deepcopy(model)
    vector_to_parameters(w.clone(), net.parameters())
    loss = F.cross_entropy(net(torch.from_numpy(fed.x[idx])), torch.from_numpy(fed.y[idx]))
    loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    return w - eta * g, g


def test_apply_is_one_gradient_step_on_the_meta_set():
    fed = make_fed()
    model, layout = model_of(fed)
    meta = MetaStep(fed, model, layout, seed=2, meta_size=25, eta_meta=0.3)
    w = layout.flatten_module(model) + 0.1 * torch.randn(
        layout.d, generator=torch.Generator().manual_seed(0))
    want, g = oracle_meta(model, fed, meta.indices, w, 0.3)
    assert g.norm() > 1e-2
    got = meta.apply(w)
    assert got.shape == (layout.d,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(meta.gradient(w), g, atol=1e-6, rtol=0)
    assert torch.equal(w, layout.flatten_module(model) + 0.1 * torch.randn(
        layout.d, generator=torch.Generator().manual_seed(0)))  # w itself is untouched
    # the step lowers the meta loss for a small eta
    small = MetaStep(fed, model, layout, seed=2, meta_size=25, eta_meta=0.01)
    assert small.loss(small.apply(w)) < small.loss(w)
    with pytest.raises(ValueError):
        meta.apply(w[:-1])


def test_from_config_and_bad_parameters():
    fed = make_fed()
    model, layout = model_of(fed)
    cfg = load_config(None, ["run.seed=5", "fedmeta.meta_size=12", "fedmeta.eta_meta=0.05",
                             "server.meta=true"])
    meta = meta_step_for(make_plan(cfg), Parts(fed, model, layout, layout.flatten_module(model), get_loss("cross_entropy"), model_traits(model, fed.input_shape)))
    assert meta.meta_size == 12 and meta.eta_meta == 0.05 and meta.meta_sampling == "iid"
    assert np.array_equal(meta.indices, meta_indices(fed, seed=5, size=12))
    for bad in (dict(eta_meta=0.0), dict(eta_meta=float("nan")), dict(meta_size=0),
                dict(meta_sampling="stratified")):
        kw = dict(seed=0, meta_size=10, eta_meta=0.1) | bad
        with pytest.raises(ValueError):
            MetaStep(fed, model, layout, **kw)
    other = ParamLayout.from_module(build_model("logreg", fed.input_shape, fed.num_classes))
    with pytest.raises(ValueError):
        MetaStep(fed, model, other, seed=0, meta_size=10, eta_meta=0.1)


# --------------------------------------------------------------------------- the fedmeta rule


def test_fedmeta_aggregates_like_fedavg_and_asks_for_the_meta_step():
    cls = rule("fedmeta")
    assert cls.needs.meta_step is True and cls.name == "fedmeta"
    assert rule("fedavg").needs.meta_step is False
    assert rule("uga").needs.meta_step is False
    u = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = RoundUpdates(round=2, client_ids=np.arange(4), updates=u, losses=np.zeros(4),
                     num_samples=np.array([5, 1, 8, 2]), lr=0.1)
    step = create("fedmeta", eta_meta=0.2, meta_size=10, meta_sampling="iid").aggregate(r)
    torch.testing.assert_close(step, create("fedavg").aggregate(r), atol=0, rtol=0)
    assert create("fedmeta").state_dict() == {}
    with pytest.raises(ValueError):
        create("fedmeta", eta_meta=-1.0)


# --------------------------------------------------------------------------- configuration


def test_config_tables():
    cfg = load_config(None)
    assert cfg.uga.eta_g == 1.0 and cfg.uga.max_traced_clients is None
    assert cfg.fedmeta.meta_sampling == "iid" and cfg.server.meta is False
    assert make_plan(cfg).meta is None
    cfg = load_config(None, ["server.algorithm=uga", "uga.eta_g=0.5", "server.meta=true"])
    params = cfg.algorithm_params()
    assert params == {"eta_g": 0.5, "max_traced_clients": None}
    assert create("uga", **params).eta_g == 0.5  # the table is the constructor's keywords
    assert make_plan(cfg).meta is not None
    # (the server routes client_options to UGATrainer; config's check of them against the
    # trainer's signature is the lead's wiring, so the table is validated under another rule)
    table = load_config(None, ["uga.max_traced_clients=4"]).uga
    params = table.model_dump()
    assert rule("uga").client_options(table) == {"max_traced_clients": 4}
    assert create("uga", **params).max_traced_clients == 4
    cfg = load_config(None, ["server.algorithm=fedmeta", "fedmeta.meta_size=7"])
    assert make_plan(cfg).meta is not None and create("fedmeta", **cfg.algorithm_params()).meta_size == 7
    # a group-balanced meta set is only refused where it would be used
    load_config(None, ["fedmeta.meta_sampling=group_balanced"])
    load_config(None, ["data.dataset=adult", "data.partition=iid", "server.algorithm=fedmeta",
                       "fedmeta.meta_sampling=group_balanced"])
    for bad in (["uga.eta_g=0"], ["uga.eta_g=-1.0"], ["uga.max_traced_clients=0"],
                ["uga.eta"], ["fedmeta.eta_meta=0"], ["fedmeta.meta_size=0"],
                ["fedmeta.meta_sampling=stratified"], ["server.meta=1"],
                ["server.algorithm=fedmeta", "fedmeta.meta_sampling=group_balanced"],
                ["server.meta=true", "fedmeta.meta_sampling=group_balanced"]):
        with pytest.raises(ConfigError):
            load_config(None, [b if "=" in b else b + "=1" for b in bad])


@pytest.mark.parametrize("name", ["uga-fmnist", "fedmeta-fmnist"])
def test_jobs_load_and_switch_algorithms(name):
    from pathlib import Path

    job = Path(__file__).resolve().parents[2] / "jobs" / f"{name}.toml"
    cfg = load_config(job)
    assert cfg.client.epochs == 5 and cfg.data.partition != "iid"
    for algo in ("fedavg", "fedfv", "qfedavg", "drfl", "fedmgda_plus", "fedprox", "uga", "fedmeta"):
        load_config(job, [f"server.algorithm={algo}"])
