"""VmapTrainer against a plain per-client loop (the oracle): local SGD, losses and evaluation."""

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpifl.clients.interface import TrainOptions
from mpifl.clients import VmapTrainer, batch_order, client_minibatches
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model
from tests.helpers import train

ATOL = 1e-5


# --------------------------------------------------------------------------- the oracle


def oracle_train(model, x, y, w, *, round, lr, client_ids, sample_idx, epochs, batch_size,
                 momentum=0.0, weight_decay=0.0, seed=0, prox_mu=0.0, minibatch_order="pcg64"):
    """Obviously correct local training: one client at a time, torch.optim.SGD,
    docs/ALGORITHMS.md §1 (with FedProx's proximal term ``(mu/2)||w_k - w||^2`` added to the loss
    when prox_mu > 0)."""
    updates, losses = [], []
    for cid, idx in zip(client_ids, sample_idx):
        net = copy.deepcopy(model)
        vector_to_parameters(w.clone(), net.parameters())
        with torch.no_grad():
            losses.append(F.cross_entropy(net(x[idx]), y[idx]))
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        for pos in client_minibatches(seed, round, cid, len(idx), epochs, batch_size,
                                      order=minibatch_order):
            batch = idx[pos]
            opt.zero_grad()
            loss = F.cross_entropy(net(x[batch]), y[batch])
            if prox_mu:
                loss = loss + prox_mu / 2 * (parameters_to_vector(net.parameters()) - w).pow(2).sum()
            loss.backward()
            opt.step()
        updates.append(w - parameters_to_vector(net.parameters()).detach())
    return torch.stack(updates), torch.stack(losses)


def oracle_evaluate(model, x, y, w, sample_idx):
    net = copy.deepcopy(model)
    vector_to_parameters(w.clone(), net.parameters())
    acc, loss = [], []
    with torch.no_grad():
        for idx in sample_idx:
            out = net(x[idx])
            acc.append((out.argmax(-1) == y[idx]).double().mean().item())
            loss.append(F.cross_entropy(out, y[idx]).item())
    return np.array(acc), np.array(loss)


# --------------------------------------------------------------------------- fixtures


def make_data(n, shape, classes, seed=0):
    """Samples with learnable labels (a random linear teacher), so losses move when training."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    teacher = torch.randn(int(np.prod(shape)), classes, generator=g)
    y = (x.reshape(n, -1) @ teacher).argmax(-1)
    return x, y


def split(sizes, seed=0):
    """Disjoint, shuffled index arrays of the given sizes into a store of sum(sizes) samples."""
    perm = np.random.default_rng(seed).permutation(sum(sizes))
    return np.split(perm, np.cumsum(sizes)[:-1])


def setup(model_name="mlp", shape=(12,), classes=4, sizes=(20, 20, 20), output="logits", seed=0):
    model = build_model(model_name, shape, classes, hidden=(16, 8), output=output, seed=seed)
    layout = ParamLayout.from_module(model)
    x, y = make_data(sum(sizes), shape, classes, seed=seed)
    return model, layout, x, y, split(sizes, seed=seed)


def run_both(model, layout, x, y, idx, *, client_ids=None, round=3, lr=0.1, **kw):
    client_ids = np.arange(len(idx)) * 7 + 2 if client_ids is None else client_ids
    w = layout.flatten_module(model)
    budget = kw.pop("memory_budget_mb", 1024.0)
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(memory_budget_mb=budget, **kw))
    got = train(trainer, w, round, lr, client_ids, idx)
    want = oracle_train(model, x, y, w, round=round, lr=lr, client_ids=client_ids,
                        sample_idx=idx, **kw)
    return got, want, trainer, w


def assert_same(got, want):
    (u, l), (u_ref, l_ref) = got, want
    assert u.dtype == torch.float32 and l.dtype == torch.float32
    assert u.shape == u_ref.shape and l.shape == l_ref.shape
    # The comparison must not be vacuous: training moved the parameters.
    assert u_ref.abs().max() > 1e-3
    torch.testing.assert_close(u, u_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(l, l_ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- batch order


def test_client_minibatches_cover_each_epoch_in_batch_order():
    batches = list(client_minibatches(1, 2, 3, 23, 2, 10))
    assert [len(b) for b in batches] == [10, 10, 3, 10, 10, 3]
    for epoch in range(2):
        got = np.concatenate(batches[3 * epoch:3 * epoch + 3])
        assert np.array_equal(got, batch_order(1, 2, 3, epoch, 23))
    full = list(client_minibatches(1, 2, 3, 5, 3, 0))
    assert len(full) == 3 and all(np.array_equal(b, np.arange(5)) for b in full)


def test_batch_order_is_a_keyed_permutation():
    a = batch_order(1, 2, 3, 4, 50)
    assert a.dtype == np.int64 and sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, batch_order(1, 2, 3, 4, 50))
    assert np.array_equal(a, np.random.default_rng([1, 2, 3, 4]).permutation(50))
    for other in [(0, 2, 3, 4), (1, 0, 3, 4), (1, 2, 0, 4), (1, 2, 3, 0)]:
        assert not np.array_equal(a, batch_order(*other, 50))


# --------------------------------------------------------------------------- training vs oracle


def test_full_batch_single_epoch_is_one_gradient_step():
    model, layout, x, y, idx = setup(sizes=(13, 29, 40))
    got, want, _, w = run_both(model, layout, x, y, idx, epochs=1, batch_size=0, lr=0.3)
    assert_same(got, want)
    # docs/ALGORITHMS.md §1: with B = 0, E = 1 the update is exactly lr * grad F_k(w).
    for k, ix in enumerate(idx):
        net = copy.deepcopy(model)
        vector_to_parameters(w.clone(), net.parameters())
        grads = torch.autograd.grad(F.cross_entropy(net(x[ix]), y[ix]), list(net.parameters()))
        torch.testing.assert_close(got[0][k], 0.3 * torch.cat([g.reshape(-1) for g in grads]),
                                   atol=1e-6, rtol=0)


def test_minibatches_two_epochs():
    model, layout, x, y, idx = setup(sizes=(30, 30, 30, 30))
    assert_same(*run_both(model, layout, x, y, idx, epochs=2, batch_size=8)[:2])


def test_momentum_and_weight_decay_with_masked_steps():
    # Unequal sizes: the small clients sit out steps while momentum and decay are active.
    model, layout, x, y, idx = setup(sizes=(9, 25, 41))
    assert_same(*run_both(model, layout, x, y, idx, epochs=2, batch_size=8, momentum=0.9,
                          weight_decay=1e-2, lr=0.05)[:2])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fedprox_proximal_term(momentum):
    model, layout, x, y, idx = setup(sizes=(9, 25, 41))
    got, want, _, _ = run_both(model, layout, x, y, idx, epochs=3, batch_size=8, lr=0.2,
                               momentum=momentum, prox_mu=0.5)
    assert_same(got, want)
    plain = run_both(model, layout, x, y, idx, epochs=3, batch_size=8, lr=0.2, momentum=momentum)[0]
    # the proximal pull shrinks the updates (it cannot be a no-op)
    assert got[0].norm() < 0.95 * plain[0].norm()


@pytest.mark.parametrize(("batch_size", "weight_decay"), [(0, 0.0), (10, 0.0), (10, 0.05), (64, 0.05)])
def test_very_unequal_sample_counts(batch_size, weight_decay):
    # Without momentum, weight decay alone would move a client at its padded (masked) steps.
    model, layout, x, y, idx = setup(sizes=(3, 17, 50, 101))
    assert_same(*run_both(model, layout, x, y, idx, epochs=2, batch_size=batch_size,
                          weight_decay=weight_decay)[:2])


def test_steps_drop_columns_that_are_padding_in_every_client():
    # sizes 12 and 7, B = 5, E = 2: steps of (5, 5, 2, 5, 5, 2) and (5, 2, 5, 2) real samples;
    # only the last step is padding beyond 2 columns in both clients
    model, layout, x, y, idx = setup(sizes=(12, 7))
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=5))
    plan = trainer._plan(0, np.array([0, 1]), np.array([12, 7]))
    assert plan.weights.shape == (2, 6, 5) and plan.steps.tolist() == [6, 4]
    assert plan.real.tolist() == [[5, 5, 2, 5, 5, 2], [5, 2, 5, 2, 0, 0]]
    assert plan.widths.tolist() == [5, 5, 5, 5, 5, 2]
    assert plan.real.tolist() == plan.weights.sum(2).int().tolist()
    # the trimmed steps give the per-client oracle's updates
    assert_same(*run_both(model, layout, x, y, idx, epochs=2, batch_size=5)[:2])


def test_softmax_output_double_softmax():
    model, layout, x, y, idx = setup(sizes=(15, 40), output="softmax")
    got, want, _, _ = run_both(model, layout, x, y, idx, epochs=2, batch_size=7, lr=0.5)
    assert_same(got, want)
    # Really the double softmax: the pre-training loss stays above the minimum CE of probs.
    assert (got[1] > 1.0 - torch.log(torch.tensor(1.0 + 3 * np.exp(-1.0)))).all()


def test_tiny_cnn_mnist():
    model, layout, x, y, idx = setup("cnn_mnist", shape=(1, 28, 28), classes=10, sizes=(5, 9, 12))
    assert_same(*run_both(model, layout, x, y, idx, epochs=1, batch_size=4, lr=0.05)[:2])


def test_small_memory_budget_forces_chunks_with_same_answer():
    model, layout, x, y, idx = setup(sizes=(3, 17, 50, 101, 20, 20))
    kw = dict(epochs=2, batch_size=16, momentum=0.5)
    got, want, _, w = run_both(model, layout, x, y, idx, **kw)
    assert_same(got, want)
    small = VmapTrainer(model, layout, x, y, TrainOptions(memory_budget_mb=0.06, **kw))
    sizes = np.array([len(i) for i in idx])
    chunks = small.plan_chunks(sizes)
    assert 2 < len(chunks) < len(idx)  # several chunks, some holding more than one client
    assert sorted(np.concatenate(chunks).tolist()) == list(range(len(idx)))
    chunked = train(small, w, 3, 0.1, np.arange(len(idx)) * 7 + 2, idx)
    torch.testing.assert_close(chunked[0], got[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked[1], got[1], atol=1e-6, rtol=0)


def test_deterministic_and_keyed_by_round():
    model, layout, x, y, idx = setup(sizes=(20, 33))
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=6, seed=5))
    w = layout.flatten_module(model)
    a, _ = train(trainer, w, 4, 0.1, np.array([0, 1]), idx)
    b, _ = train(trainer, w, 4, 0.1, np.array([0, 1]), idx)
    c, _ = train(trainer, w, 5, 0.1, np.array([0, 1]), idx)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c, atol=1e-4)  # another round, another minibatch order


def test_client_order_and_company_do_not_change_an_update():
    model, layout, x, y, idx = setup(sizes=(3, 17, 50, 101))
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=10, momentum=0.9))
    w = layout.flatten_module(model)
    ids = np.array([4, 9, 1, 6])
    u, l = train(trainer, w, 2, 0.1, ids, idx)
    perm = np.array([2, 0, 3, 1])
    u_p, l_p = train(trainer, w, 2, 0.1, ids[perm], [idx[i] for i in perm])
    torch.testing.assert_close(u_p, u[perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(l_p, l[perm], atol=1e-6, rtol=0)
    alone, _ = train(trainer, w, 2, 0.1, ids[1:2], idx[1:2])
    torch.testing.assert_close(alone[0], u[1], atol=1e-6, rtol=0)


def test_train_rejects_bad_input():
    model, layout, x, y, idx = setup(sizes=(5, 5))
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=0))
    w = layout.flatten_module(model)
    with pytest.raises(ValueError):
        train(trainer, w, 0, 0.1, np.array([0, 1]), [idx[0], np.array([], dtype=np.int64)])
    with pytest.raises(ValueError):
        train(trainer, w[:-1], 0, 0.1, np.array([0, 1]), idx)
    with pytest.raises(ValueError):
        train(trainer, w, 0, 0.1, np.array([0]), idx)
    other = ParamLayout.from_module(build_model("logreg", (12,), 4))
    with pytest.raises(ValueError):
        VmapTrainer(model, other, x, y, TrainOptions(epochs=1, batch_size=0))


# --------------------------------------------------------------------------- evaluation


def test_evaluate_matches_per_client_loop():
    model, layout, x, y, idx = setup(sizes=(1, 7, 30, 64), output="softmax")
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=0,
                                                            memory_budget_mb=0.01))
    w = layout.flatten_module(model) + 0.3 * torch.randn(layout.d, generator=torch.Generator().manual_seed(2))
    acc, loss = trainer.evaluate(w, idx)
    acc_ref, loss_ref = oracle_evaluate(model, x, y, w, idx)
    assert acc.dtype == np.float64 and loss.dtype == np.float64
    np.testing.assert_allclose(acc, acc_ref, atol=1e-12)
    np.testing.assert_allclose(loss, loss_ref, atol=1e-5)
    assert len(set(acc.tolist())) > 1  # clients really differ
    acc_e, loss_e = trainer.evaluate(w, [idx[0], np.array([], dtype=np.int64)])
    assert np.isnan(acc_e[1]) and np.isnan(loss_e[1]) and acc_e[0] == acc[0]


# --------------------------------------------------------------------------- the batched MLP path

def test_stacked_mlp_path_equals_the_vmapped_path():
    """The MLP family trains through mpifl.clients.stacked; vmap(grad) is its oracle."""
    from torch.func import grad, grad_and_value, vmap

    model, layout, x, y, idx = setup(sizes=(23, 7, 40, 1))
    kw = dict(epochs=2, batch_size=6, momentum=0.9, weight_decay=0.01, prox_mu=0.1)
    fast = VmapTrainer(model, layout, x, y, TrainOptions(**kw))
    slow = VmapTrainer(model, layout, x, y, TrainOptions(**kw))
    assert isinstance(fast._step_grad, functools.partial)  # the batched path was chosen
    slow._step_grad = vmap(grad(slow._minibatch_loss))
    slow._step_grad_value = vmap(grad_and_value(slow._minibatch_loss))
    w = layout.flatten_module(model)
    ids = np.array([3, 1, 8, 5])
    (u, l), (u_ref, l_ref) = train(fast, w, 2, 0.1, ids, idx), train(slow, w, 2, 0.1, ids, idx)
    assert u_ref.abs().max() > 1e-3
    torch.testing.assert_close(u, u_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l, l_ref, atol=1e-6, rtol=1e-5)


def test_stacked_path_only_where_it_applies():
    from mpifl.clients import UGATrainer
    from mpifl.clients.stacked import stacked_forward

    for name, output, applies in (("mlp", "logits", True), ("logreg", "logits", True),
                                  ("mlp", "softmax", False), ("cnn_mnist", "logits", False)):
        shape = (1, 28, 28) if name == "cnn_mnist" else (12,)
        model = build_model(name, shape, 4, hidden=(16, 8), output=output, seed=0)
        assert (stacked_forward(model) is not None) == applies, (name, output)
    model, layout, x, y, _ = setup()
    uga = UGATrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=5))
    assert not isinstance(uga._step_grad, functools.partial)  # keep-trace needs vmap(grad)
