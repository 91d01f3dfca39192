"""UGA (Yao et al. 2019, docs/ALGORITHMS.md §6): UGATrainer against central finite differences of
``w -> L(h_k(w); D_k)`` and against a plain per-client keep-trace autograd loop (the oracle);
the UGA aggregator against its formula."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from mpifl.aggregators import RoundUpdates, create, rule
from mpifl.clients.interface import TrainOptions
from mpifl.clients import VmapTrainer, batch_order
from mpifl.clients.uga import UGATrainer
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model
from tests.helpers import train



def make_data(n, shape, classes, seed=0):
    """Samples with learnable labels (a random linear teacher)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    teacher = torch.randn(int(np.prod(shape)), classes, generator=g)
    return x, (x.reshape(n, -1) @ teacher).argmax(-1)


def split(sizes, seed=0):
    """Disjoint, shuffled index arrays of the given sizes into a store of sum(sizes) samples."""
    perm = np.random.default_rng(seed).permutation(sum(sizes))
    return np.split(perm, np.cumsum(sizes)[:-1])

# --------------------------------------------------------------------------- the oracle


def local_trace(model, layout, x, y, w, *, round, lr, cid, idx, epochs, batch_size, momentum=0.0,
                weight_decay=0.0, seed=0, create_graph=False):
    """h_k(w) of docs/ALGORITHMS.md §6, one client, plain autograd: the first E-1 epochs of §1's SGD
    (torch.optim.SGD's rule written out out-of-place, so the trace stays differentiable)."""
    if not w.requires_grad:  # a plain evaluation of h_k (the minibatch gradients need a graph)
        w = w.detach().requires_grad_(True)
    p = list(layout.unflatten(w).values())
    n, size = len(idx), (len(idx) if batch_size == 0 else batch_size)
    buf = None
    for epoch in range(epochs - 1):
        order = np.arange(n) if batch_size == 0 else batch_order(seed, round, cid, epoch, n)
        for start in range(0, n, size):
            batch = idx[order[start:start + size]]
            loss = F.cross_entropy(functional_call(model, dict(zip(layout.names, p)), (x[batch],)),
                                   y[batch])
            gs = torch.autograd.grad(loss, p, create_graph=create_graph)
            gs = [g + weight_decay * q for g, q in zip(gs, p)]
            if momentum:
                buf = gs if buf is None else [momentum * b + g for b, g in zip(buf, gs)]
                gs = buf
            p = [q - lr * g for q, g in zip(p, gs)]
    return p


def composite_loss(model, layout, x, y, w, idx, **kw):
    """L(h_k(w); D_k): mean cross-entropy of the traced local model on the whole split."""
    p = local_trace(model, layout, x, y, w, idx=idx, **kw)
    return F.cross_entropy(functional_call(model, dict(zip(layout.names, p)), (x[idx],)), y[idx])


def oracle_uga(model, layout, x, y, w, *, client_ids, sample_idx, **kw):
    """Keep-trace gradient descent, one client at a time: build the whole trace with
    create_graph=True and differentiate L(h_k(w)) with respect to w by plain autograd."""
    grads, losses = [], []
    for cid, idx in zip(client_ids, sample_idx):
        w0 = w.clone().requires_grad_(True)
        with torch.no_grad():
            losses.append(F.cross_entropy(functional_call(model, layout.unflatten(w), (x[idx],)),
                                          y[idx]))
        loss = composite_loss(model, layout, x, y, w0, idx, cid=cid, create_graph=True, **kw)
        (g,) = torch.autograd.grad(loss, w0)
        grads.append(g)
    return torch.stack(grads), torch.stack(losses)


# --------------------------------------------------------------------------- fixtures


def setup(model_name="mlp", shape=(12,), classes=4, sizes=(20, 20, 20), seed=0, hidden=(16, 8)):
    model = build_model(model_name, shape, classes, hidden=hidden, seed=seed)
    layout = ParamLayout.from_module(model)
    x, y = make_data(sum(sizes), shape, classes, seed=seed)
    w = layout.flatten_module(model) + 0.1 * torch.randn(
        layout.d, generator=torch.Generator().manual_seed(seed + 1))
    return model, layout, x, y, split(sizes, seed=seed), w


def run_both(model, layout, x, y, idx, w, *, round=3, lr=0.2, budget=1024.0, **kw):
    ids = np.arange(len(idx)) * 5 + 1
    trainer = UGATrainer(model, layout, x, y, TrainOptions(memory_budget_mb=budget, **kw))
    got = train(trainer, w, round, lr, ids, idx)
    want = oracle_uga(model, layout, x, y, w, round=round, lr=lr, client_ids=ids,
                      sample_idx=idx, **kw)
    return got, want, trainer


def assert_close(got, want, atol=1e-5):
    (g, l), (g_ref, l_ref) = got, want
    assert g.dtype == torch.float32 and l.dtype == torch.float32
    assert g.shape == g_ref.shape and l.shape == l_ref.shape
    assert g_ref.abs().max() > 1e-2  # not vacuous
    torch.testing.assert_close(g, g_ref.float(), atol=atol, rtol=0)
    torch.testing.assert_close(l, l_ref.float(), atol=atol, rtol=0)


# --------------------------------------------------------------------------- finite differences


def test_gradient_matches_central_finite_differences_float64():
    """docs/ALGORITHMS.md §6 (UGA, Yao et al. 2019): g_k = ∇_w L(h_k(w); D_k), checked against
    central differences of the composite loss on a tiny logistic regression (4 -> 3), 2 clients,
    E = 3, B = 2, float64."""
    model, layout, x, y, idx, w = setup("logreg", shape=(4,), classes=3, sizes=(5, 8))
    x, w = x.double(), w.double()
    kw = dict(round=2, lr=0.5, epochs=3, batch_size=2, seed=7)
    ids = np.array([3, 11])
    trainer = UGATrainer(model, layout, x, y, TrainOptions(epochs=3, batch_size=2, seed=7))
    grads, _ = train(trainer, w, 2, 0.5, ids, idx)
    assert grads.dtype == torch.float64 and grads.shape == (2, layout.d)
    # the traced steps really move the model and change the gradient: it is not the plain one
    plain, _ = train(UGATrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=2)),
        w, 2, 0.5, ids, idx)
    assert (grads - plain).norm() > 0.1 * plain.norm()
    eps = 1e-6
    rng = np.random.default_rng(0)
    for k, (cid, ix) in enumerate(zip(ids, idx)):
        def f(v):
            return composite_loss(model, layout, x, y, v, ix, cid=cid, **kw).item()
        # every coordinate (d = 15) ...
        fd = torch.tensor([(f(w + eps * e) - f(w - eps * e)) / (2 * eps)
                           for e in torch.eye(layout.d, dtype=torch.float64)])
        rel = (grads[k] - fd).norm() / fd.norm()
        assert rel < 1e-4, (k, rel.item())
        # ... and a few random directions
        for _ in range(3):
            u = torch.as_tensor(rng.standard_normal(layout.d))
            u /= u.norm()
            dd = (f(w + eps * u) - f(w - eps * u)) / (2 * eps)
            assert abs(grads[k] @ u - dd) < 1e-4 * max(grads[k].norm().item(), 1e-3)


# --------------------------------------------------------------------------- against the oracle


def test_matches_keep_trace_oracle_minibatches():
    # unequal sizes: padded minibatches and masked steps in the trace
    model, layout, x, y, idx, w = setup(sizes=(9, 25, 41))
    assert_close(*run_both(model, layout, x, y, idx, w, epochs=3, batch_size=8)[:2])


def test_run_round_the_workers_entry_point_is_the_oracle():
    """``run_round``, the workers' entry point (mpifl/runtime/worker.py, backends.py), gives
    the oracle's keep-trace gradients and losses, and no extra statistics."""
    model, layout, x, y, idx, w = setup(sizes=(9, 25, 41))
    ids = np.arange(len(idx)) * 5 + 1
    trainer = UGATrainer(model, layout, x, y, TrainOptions(epochs=3, batch_size=8,
                                                           memory_budget_mb=1024.0))
    updates, losses, stats = trainer.run_round(w, 3, 0.2, ids, idx)
    want = oracle_uga(model, layout, x, y, w, round=3, lr=0.2, client_ids=ids, sample_idx=idx,
                      epochs=3, batch_size=8)
    assert stats == {}
    assert_close((updates, losses), want)


def test_matches_oracle_momentum_weight_decay():
    model, layout, x, y, idx, w = setup(sizes=(7, 19, 30))
    assert_close(*run_both(model, layout, x, y, idx, w, epochs=2, batch_size=6, momentum=0.9,
                           weight_decay=0.01, lr=0.1)[:2])


def test_matches_oracle_full_batch():
    model, layout, x, y, idx, w = setup(sizes=(13, 29))
    assert_close(*run_both(model, layout, x, y, idx, w, epochs=4, batch_size=0, lr=0.3)[:2])


def test_single_epoch_is_the_plain_gradient():
    """E = 1: nothing is traced, g_k = ∇L(w^t; D_k); it is also VmapTrainer's B = 0, E = 1
    update divided by lr, and losses equal VmapTrainer's."""
    model, layout, x, y, idx, w = setup(sizes=(13, 29, 40))
    (g, l), want, trainer = run_both(model, layout, x, y, idx, w, epochs=1, batch_size=8)
    assert_close((g, l), want)
    assert trainer.traced_steps(40) == 0
    for k, ix in enumerate(idx):
        w0 = w.clone().requires_grad_(True)
        loss = F.cross_entropy(functional_call(model, layout.unflatten(w0), (x[ix],)), y[ix])
        (ref,) = torch.autograd.grad(loss, w0)
        torch.testing.assert_close(g[k], ref, atol=1e-6, rtol=0)
    u, l_sgd = train(VmapTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=0)),
        w, 3, 0.5, np.arange(3) * 5 + 1, idx)
    torch.testing.assert_close(g, u / 0.5, atol=1e-5, rtol=0)
    torch.testing.assert_close(l, l_sgd, atol=1e-6, rtol=0)


def test_traced_epochs_follow_vmap_trainer():
    """The trace h_k runs exactly VmapTrainer's first E-1 epochs: its end point is
    VmapTrainer's (E-1)-epoch model."""
    model, layout, x, y, idx, w = setup(sizes=(9, 25))
    ids = np.array([4, 8])
    u, _ = train(VmapTrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=8,
                                                               momentum=0.5)),
        w, 1, 0.2, ids, idx)
    for k, (cid, ix) in enumerate(zip(ids, idx)):
        p = local_trace(model, layout, x, y, w, round=1, lr=0.2, cid=cid, idx=ix, epochs=3,
                        batch_size=8, momentum=0.5)
        torch.testing.assert_close(torch.cat([q.detach().reshape(-1) for q in p]), w - u[k],
                                   atol=1e-6, rtol=0)


def test_small_budget_chunks_and_cap_give_the_same_answer():
    model, layout, x, y, idx, w = setup(sizes=(3, 17, 50, 33, 20, 20))
    kw = dict(epochs=3, batch_size=10)
    (g, l), want, big = run_both(model, layout, x, y, idx, w, **kw)
    assert_close((g, l), want)
    sizes = np.array([len(i) for i in idx])
    assert len(big.plan_chunks(sizes)) == 1
    small = UGATrainer(model, layout, x, y, TrainOptions(memory_budget_mb=0.2, **kw))
    chunks = small.plan_chunks(sizes)
    assert 2 < len(chunks) < len(idx)  # several chunks, some holding more than one client
    assert sorted(np.concatenate(chunks).tolist()) == list(range(len(idx)))
    g2, l2 = train(small, w, 3, 0.2, np.arange(len(idx)) * 5 + 1, idx)
    torch.testing.assert_close(g2, g, atol=1e-6, rtol=0)
    torch.testing.assert_close(l2, l, atol=1e-6, rtol=0)
    capped = UGATrainer(model, layout, x, y, TrainOptions(**kw), max_traced_clients=2)
    assert max(len(c) for c in capped.plan_chunks(sizes)) == 2
    g3, _ = train(capped, w, 3, 0.2, np.arange(len(idx)) * 5 + 1, idx)
    torch.testing.assert_close(g3, g, atol=1e-6, rtol=0)


def test_memory_estimate_grows_with_traced_steps():
    model, layout, x, y, _, _ = setup(sizes=(60,))
    est = {e: UGATrainer(model, layout, x, y, TrainOptions(epochs=e, batch_size=10))
           for e in (1, 2, 3, 5)}
    assert [est[e].traced_steps(60) for e in (1, 2, 3, 5)] == [0, 6, 12, 24]
    size = {e: t._client_bytes(60, 60) for e, t in est.items()}
    # linear in the traced steps, each of which keeps at least its parameters
    assert size[5] - size[3] == 2 * (size[3] - size[2]) == 2 * (size[2] - size[1])
    assert size[2] - size[1] > 6 * 4 * layout.d


def test_client_order_and_company_do_not_change_a_gradient():
    model, layout, x, y, idx, w = setup(sizes=(3, 17, 50, 31))
    trainer = UGATrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=10, momentum=0.9))
    ids = np.array([4, 9, 1, 6])
    g, _ = train(trainer, w, 2, 0.1, ids, idx)
    perm = np.array([2, 0, 3, 1])
    g_p, _ = train(trainer, w, 2, 0.1, ids[perm], [idx[i] for i in perm])
    torch.testing.assert_close(g_p, g[perm], atol=1e-6, rtol=0)
    alone, _ = train(trainer, w, 2, 0.1, ids[1:2], idx[1:2])
    torch.testing.assert_close(alone[0], g[1], atol=1e-6, rtol=0)


def test_gathered_samples_path_gives_the_same_answer():
    """The path taken when the sample store is on another device than the computation (CUDA):
    the chunk's samples are moved first and indexed by position."""

    class Gathering(UGATrainer):
        def _store_on_device(self):
            return False

    model, layout, x, y, idx, w = setup(sizes=(9, 25, 14))
    kw = dict(epochs=3, batch_size=8, momentum=0.5)
    ids = np.array([3, 0, 8])
    g, l = train(UGATrainer(model, layout, x, y, TrainOptions(**kw)), w, 1, 0.2, ids, idx)
    g2, l2 = train(Gathering(model, layout, x, y, TrainOptions(**kw)), w, 1, 0.2, ids, idx)
    torch.testing.assert_close(g2, g, atol=1e-6, rtol=0)
    torch.testing.assert_close(l2, l, atol=0, rtol=0)


def test_rejects_bad_input():
    model, layout, x, y, idx, w = setup(sizes=(5, 5))
    trainer = UGATrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=0))
    with pytest.raises(ValueError):
        train(trainer, w, 0, 0.1, np.array([0, 1]), [idx[0], np.array([], dtype=np.int64)])
    with pytest.raises(ValueError):
        train(trainer, w[:-1], 0, 0.1, np.array([0, 1]), idx)
    with pytest.raises(ValueError):
        UGATrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=0, prox_mu=0.1))
    with pytest.raises(ValueError):
        UGATrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=0), max_traced_clients=0)
    # run_round returns gradients and no statistics: it has no training accuracies to report
    with pytest.raises(ValueError, match="training accuracies"):
        UGATrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=0, report_accuracy=True))


def test_evaluate_is_vmap_trainers():
    model, layout, x, y, idx, w = setup(sizes=(7, 30))
    a = UGATrainer(model, layout, x, y, TrainOptions(epochs=3, batch_size=5)).evaluate(w, idx)
    b = VmapTrainer(model, layout, x, y, TrainOptions(epochs=3, batch_size=5)).evaluate(w, idx)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# --------------------------------------------------------------------------- the aggregator


def round_of(grads, n, lr=0.1):
    grads = torch.as_tensor(grads, dtype=torch.float64)
    return RoundUpdates(round=0, client_ids=np.arange(len(n)), updates=grads,
                        losses=np.zeros(len(n)), num_samples=np.array(n), lr=lr)


def test_aggregator_formula_and_registry():
    cls = rule("uga")
    assert cls.needs.trainer == "uga" and cls.name == "uga"
    g = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    n = np.array([3, 10, 1, 6, 30])
    step = create("uga", eta_g=0.7, seed=2).aggregate(round_of(g, n))
    want = 0.7 * (torch.as_tensor(n / n.sum()) @ g)
    assert step.dtype == torch.float64 and step.shape == (7,)
    torch.testing.assert_close(step, want, atol=1e-12, rtol=0)
    # the learning rate of the round plays no part: rows are gradients
    torch.testing.assert_close(create("uga", eta_g=0.7).aggregate(round_of(g, n, lr=3.0)), want)


def test_aggregator_two_clients_two_dims():
    # w^{t+1} = w^t - eta_g * (1/4 * g_1 + 3/4 * g_2)
    step = create("uga", eta_g=2.0).aggregate(round_of([[1.0, 0.0], [0.0, -4.0]], [10, 30]))
    torch.testing.assert_close(step, torch.tensor([0.5, -6.0], dtype=torch.float64))


def test_aggregator_options_and_errors():
    assert rule("uga").client_options(rule("uga").Params(eta_g=1.0, max_traced_clients=None)) == {}
    assert rule("uga").client_options(rule("uga").Params(eta_g=1.0, max_traced_clients=3)) == {"max_traced_clients": 3}
    agg = create("uga", eta_g=1.0, max_traced_clients=3)
    assert agg.state_dict() == {}
    agg.load_state_dict({})
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            create("uga", eta_g=bad)
    with pytest.raises(ValueError):
        create("uga", max_traced_clients=0)
    with pytest.raises(ValueError):
        create("uga").aggregate(round_of([[1.0], [2.0]], [0, 0]))
