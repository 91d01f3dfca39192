"""Compute only what the round needs: rules declare ``needs.losses``; without it the
trainer skips the pre-training forward pass and reports the first epoch's training loss.
Rules that read the losses get exactly (bit for bit) the pre-training pass's values, as before."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpifl import aggregators
from mpifl.clients.interface import TrainOptions
from mpifl.clients import TRAINERS, VmapTrainer, client_minibatches
from mpifl.core.layout import ParamLayout
from mpifl.experiment.plan import _trainer_plan
from mpifl.experiment.config import load_config
from mpifl.models import build_model
from tests.helpers import train

MAIN_JOB = Path(__file__).resolve().parents[2] / "jobs" / "fmnist-fedfv.toml"
ATOL = 1e-5  # as tests/inprocess/test_training.py

#: the built-in rules that read RoundUpdates.losses (their trainer must measure them first)
READ_LOSSES = {"afl", "drfl", "fedfv", "fedlf", "fedmdfg", "mfairfl", "qfedavg"}


def setup(sizes, shape=(12,), classes=4, seed=0):
    """An MLP and learnable data (a random linear teacher), split into clients of ``sizes``."""
    model = build_model("mlp", shape, classes, hidden=(16, 8), output="logits", seed=seed)
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, *shape, generator=g)
    y = (x.reshape(n, -1) @ torch.randn(int(np.prod(shape)), classes, generator=g)).argmax(-1)
    perm = np.random.default_rng(seed).permutation(n)
    return model, ParamLayout.from_module(model), x, y, np.split(perm, np.cumsum(sizes)[:-1])


def oracle(model, x, y, w, *, round, lr, client_ids, sample_idx, epochs, batch_size,
           momentum=0.0, weight_decay=0.0, seed=0, prox_mu=0.0):
    """Per client, one at a time with torch.optim.SGD (as tests/inprocess/test_training.py's oracle): the
    updates, and the mean over its samples of the minibatch CE of epoch 0, each minibatch's
    loss taken at the parameters before its step."""
    out, updates = [], []
    for cid, idx in zip(client_ids, sample_idx):
        net = copy.deepcopy(model)
        vector_to_parameters(w.clone(), net.parameters())
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        total, n = 0.0, len(idx)
        per_epoch = 1 if batch_size == 0 else -(-n // batch_size)
        for step, pos in enumerate(client_minibatches(seed, round, cid, n, epochs, batch_size)):
            batch = idx[pos]
            opt.zero_grad()
            ce = F.cross_entropy(net(x[batch]), y[batch])
            if step < per_epoch:
                total += ce.item() * len(batch)
            loss = ce
            if prox_mu:
                loss = loss + prox_mu / 2 * (parameters_to_vector(net.parameters()) - w).pow(2).sum()
            loss.backward()
            opt.step()
        out.append(total / n)
        updates.append(w - parameters_to_vector(net.parameters()).detach())
    return torch.stack(updates), torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("kw", [
    dict(epochs=1, batch_size=8),
    dict(epochs=2, batch_size=7, momentum=0.9, weight_decay=1e-3),
    dict(epochs=3, batch_size=5, prox_mu=0.1),
    dict(epochs=2, batch_size=0),
])
def test_training_pass_loss_matches_per_client_oracle(kw):
    model, layout, x, y, idx = setup(sizes=(23, 9, 40, 16))
    w = layout.flatten_module(model)
    ids = np.array([3, 11, 5, 0])
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(pretrain_losses=False, **kw))
    u, loss = train(trainer, w, 4, 0.1, ids, idx)
    u_ref, l_ref = oracle(model, x, y, w, round=4, lr=0.1, client_ids=ids, sample_idx=idx, **kw)
    assert u_ref.abs().max() > 1e-3
    torch.testing.assert_close(u, u_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(loss, l_ref, atol=ATOL, rtol=0)


def test_full_batch_training_loss_is_the_pre_training_loss():
    model, layout, x, y, idx = setup(sizes=(20, 7, 33))
    w = layout.flatten_module(model)
    ids = np.arange(3)
    _, before = train(VmapTrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=0)),
        w, 0, 0.1, ids, idx)
    _, during = train(VmapTrainer(model, layout, x, y, TrainOptions(
        epochs=2, batch_size=0, pretrain_losses=False)), w, 0, 0.1, ids, idx)
    torch.testing.assert_close(during, before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", [1024.0, 0.01])  # one chunk, and a chunk per client
def test_losses_for_rules_that_need_them_are_the_pre_training_pass_bit_for_bit(budget):
    """The default (what loss-based rules get): losses are exactly the forward pass of w before
    training (the same kernel as ``evaluate``), and the updates do not depend on the option."""
    model, layout, x, y, idx = setup(sizes=(23, 9, 40, 16))
    w = layout.flatten_module(model)
    ids = np.array([3, 11, 5, 0])
    kw = dict(epochs=2, batch_size=6, momentum=0.5, memory_budget_mb=budget)
    default = VmapTrainer(model, layout, x, y, TrainOptions(**kw))
    u, loss = train(default, w, 2, 0.1, ids, idx)
    want = default._client_stats(default._check_w(w), idx)[0].float()
    assert torch.equal(loss, want)
    assert torch.equal(loss, torch.from_numpy(default.evaluate(w, idx)[1]).float())
    u2, _ = train(VmapTrainer(model, layout, x, y, TrainOptions(pretrain_losses=False, **kw)),
        w, 2, 0.1, ids, idx)
    assert torch.equal(u, u2)


def test_report_accuracy_keeps_the_pre_training_pass():
    """FedFa's train_accuracy is measured with the pre-training pass: asking for it keeps that
    pass (and its losses) even without pretrain_losses."""
    model, layout, x, y, idx = setup(sizes=(23, 9, 40))
    w = layout.flatten_module(model)
    t = VmapTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=5, report_accuracy=True,
                                                      pretrain_losses=False))
    _, loss, stats = t.run_round(w, 0, 0.1, np.arange(3), idx)
    acc, want = t.evaluate(w, idx)
    assert torch.equal(loss, torch.from_numpy(want).float())
    assert torch.equal(stats["train_accuracy"].view(-1), torch.from_numpy(acc).float())


def test_rules_declare_needs_losses():
    for name in aggregators.available():  # (plugins' rules are another module's business)
        if not aggregators.rule(name).__module__.startswith("mpifl."):
            continue
        assert aggregators.rule(name).needs.losses == (name in READ_LOSSES), name


@pytest.mark.parametrize("name", sorted(aggregators.available()))
def test_trainer_options_skip_the_pass_only_for_rules_that_need_no_losses(name):
    base = load_config(MAIN_JOB)  # the rule swapped in without the cross-field checks
    cfg = base.model_copy(update={"server": base.server.model_copy(update={"algorithm": name})})
    rule = aggregators.rule(name)
    plan = _trainer_plan(cfg, rule)  # the options do not depend on the data
    cls, options = plan.cls, plan.options
    assert cls is TRAINERS[rule.needs.trainer]
    if rule.needs.losses:  # exactly the options of before: nothing new reaches the trainer
        assert "pretrain_losses" not in options
    else:
        assert options["pretrain_losses"] is False


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedmgda_plus", "fedmeta"])
def test_rules_without_needs_losses_ignore_the_losses(name):
    g = torch.Generator().manual_seed(0)
    steps = []
    for losses in (torch.rand(5, generator=g), torch.full((5,), float("nan"))):
        r = aggregators.RoundUpdates(round=0, client_ids=np.arange(5),
                                     updates=torch.randn(5, 30, generator=torch.Generator().manual_seed(1)),
                                     losses=losses, num_samples=torch.arange(1, 6), lr=0.1)
        steps.append(aggregators.create(name).aggregate(r))
    assert torch.equal(steps[0], steps[1])
