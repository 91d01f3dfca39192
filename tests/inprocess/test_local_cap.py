"""``client.max_local_steps``: a cap on each client's local SGD steps a round, the same in the
vmapped (stacked) and the per-client loop trainers.

The oracle of a capped round is a plain torch SGD loop over the first K minibatches of the
uncapped schedule (``list(client_minibatches(...))[:K]``), so the cap's own code paths
(:func:`mpifl.clients.minibatches.capped_steps`, the capped schedule, the islice of the loop)
are checked against a computation that does not use them. An unset cap is today's training:
the same bits as a cap no client reaches.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpifl.clients import LoopTrainer, VmapTrainer, client_minibatches
from mpifl.clients.interface import TrainOptions
from mpifl.clients.minibatches import capped_steps, minibatch_schedule
from mpifl.core.errors import ConfigError
from mpifl.core.layout import ParamLayout, model_state
from mpifl.experiment.config import config_diff, config_from_json, load_config
from mpifl.experiment.plan import make_plan
from mpifl.models import build_model

SIZES = (3, 17, 40, 23)  # one client below a minibatch, others of several epochs' steps
IDS = np.array([4, 9, 1, 12])


def data(sizes=SIZES, shape=(6,), classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, *shape, generator=g)
    y = (x.reshape(n, -1) @ torch.randn(int(np.prod(shape)), classes, generator=g)).argmax(-1)
    perm = np.random.default_rng(seed).permutation(n)
    return x, y, np.split(perm, np.cumsum(sizes)[:-1])


def model(shape=(6,), classes=3):
    return build_model("mlp", shape, classes, hidden=(8,), seed=1)


def oracle(net0, x, y, w, idx, cid, *, rnd, lr, epochs, batch_size, cap, momentum=0.0):
    """(update, first-epoch mean training loss, samples visited) of one client: plain SGD on
    the first ``cap`` minibatches of the uncapped schedule."""
    net = copy.deepcopy(net0)
    vector_to_parameters(w.clone(), net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    batches = list(client_minibatches(0, rnd, cid, len(idx), epochs, batch_size))
    per_epoch = len(batches) // epochs
    taken = batches[:cap] if cap is not None else batches
    loss_sum, first_n, seen = 0.0, 0, 0
    for step, pos in enumerate(taken):
        opt.zero_grad()
        loss = F.cross_entropy(net(x[idx[pos]]), y[idx[pos]])
        if step < per_epoch:
            loss_sum += float(loss.detach()) * len(pos)
            first_n += len(pos)
        loss.backward()
        opt.step()
        seen += len(pos)
    return w - parameters_to_vector(net.parameters()).detach(), loss_sum / first_n, seen


def direct_steps(n, epochs, batch_size, cap):
    """A client's steps, counted by hand: ceil(n/B) an epoch (1 for B = 0), E epochs, then
    the cap."""
    per_epoch = 1 if batch_size == 0 else math.ceil(n / batch_size)
    return per_epoch * epochs if cap is None else min(per_epoch * epochs, cap)


def trainers(net, x, y, **options):
    layout = ParamLayout.from_module(net)
    opts = TrainOptions(**options)
    return {"vmap": VmapTrainer(net, layout, x, y, opts),
            "loop": LoopTrainer(net, ParamLayout.from_module(net), x, y, opts)}


# --------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("order", ["pcg64", "counter"])
@pytest.mark.parametrize("epochs, batch_size, cap", [(3, 5, 4), (2, 5, 1), (1, 0, 1), (2, 7, 50)])
def test_a_capped_schedule_is_the_first_steps_of_the_uncapped_one(order, epochs, batch_size, cap):
    sizes = np.array(SIZES)
    full = minibatch_schedule(7, 2, IDS, sizes, epochs, batch_size, order=order)
    capped = minibatch_schedule(7, 2, IDS, sizes, epochs, batch_size, order=order, max_steps=cap)
    want = np.array([direct_steps(n, epochs, batch_size, cap) for n in SIZES])
    np.testing.assert_array_equal(capped.steps, want)
    np.testing.assert_array_equal(capped_steps(sizes, epochs, batch_size, cap), want)
    T = capped.rows.shape[1]
    assert T == want.max()
    # each client's first steps: the same rows and weights as the uncapped plan's
    for i, k in enumerate(want):
        assert torch.equal(capped.weights[i, :k], full.weights[i, :k, :capped.weights.shape[2]])
        real = capped.weights[i, :k].bool()
        assert torch.equal(capped.rows[i, :k][real], full.rows[i, :k, :real.shape[1]][real])
        assert capped.weights[i, k:].sum() == 0  # nothing real past its cap
        # the per-client loop's minibatches: the first k of the uncapped ones
        loop = list(client_minibatches(7, 2, int(IDS[i]), SIZES[i], epochs, batch_size,
                                       order=order, max_steps=cap))
        every = list(client_minibatches(7, 2, int(IDS[i]), SIZES[i], epochs, batch_size,
                                        order=order))
        assert len(loop) == k and all(np.array_equal(a, b) for a, b in zip(loop, every))


# --------------------------------------------------------------------------- the trainers


@pytest.mark.parametrize("pretrain", [True, False])
@pytest.mark.parametrize("epochs, batch_size, cap", [(2, 4, 3), (3, 10, 5), (3, 0, 2)])
def test_both_trainers_take_exactly_the_cap_and_equal_the_oracle(epochs, batch_size, cap,
                                                                 pretrain):
    net = model()
    x, y, idx = data()
    w = parameters_to_vector(net.parameters()).detach()
    rnd, lr = 5, 0.2
    want = [oracle(net, x, y, w, i, int(c), rnd=rnd, lr=lr, epochs=epochs,
                   batch_size=batch_size, cap=cap) for i, c in zip(idx, IDS)]
    uncapped = [oracle(net, x, y, w, i, int(c), rnd=rnd, lr=lr, epochs=epochs,
                       batch_size=batch_size, cap=None) for i, c in zip(idx, IDS)]
    # the cap bites: some client would have trained longer
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(want, uncapped))
    for name, trainer in trainers(net, x, y, epochs=epochs, batch_size=batch_size,
                                  max_local_steps=cap, pretrain_losses=pretrain).items():
        seen: list[int] = []
        if name == "loop":  # every forward in train mode is one step: count its samples
            trainer.net.register_forward_hook(lambda m, inp, out, seen=seen:
                                              seen.append(len(inp[0])))
        updates, losses, _ = trainer.run_round(w, rnd, lr, IDS, idx)
        torch.testing.assert_close(updates, torch.stack([u for u, _, _ in want]), atol=1e-5,
                                   rtol=0, msg=name)
        if not pretrain:  # the first epoch's loss over the samples it trained on
            torch.testing.assert_close(losses.double(), torch.tensor([l for _, l, _ in want],
                                       dtype=torch.float64), atol=1e-5, rtol=0, msg=name)
        if name == "loop":
            steps = [direct_steps(len(i), epochs, batch_size, cap) for i in idx]
            assert len(seen) == sum(steps)
            assert sum(seen) == sum(s for _, _, s in want)


def test_the_vmapped_trainer_steps_until_the_largest_capped_client():
    net = model()
    x, y, idx = data()
    trainer = VmapTrainer(net, ParamLayout.from_module(net), x, y,
                          TrainOptions(epochs=3, batch_size=4, max_local_steps=6))
    calls = []
    step = trainer._step_grad
    trainer._step_grad = lambda *a: calls.append(1) or step(*a)
    trainer.run_round(parameters_to_vector(net.parameters()).detach(), 0, 0.1, IDS, idx)
    assert len(calls) == max(direct_steps(len(i), 3, 4, 6) for i in idx) == 6
    assert trainer._steps(40) == 6 and trainer._steps(3) == 3  # the memory plan's steps


@pytest.mark.parametrize("pretrain", [True, False])
def test_an_unset_cap_is_todays_training_bit_for_bit(pretrain):
    """None trains exactly as before the cap existed: the same bits as a cap that no client
    reaches (which takes every step of the round through the capped code paths)."""
    net = model()
    x, y, idx = data()
    w = parameters_to_vector(net.parameters()).detach()
    most = max(direct_steps(len(i), 2, 5, None) for i in idx)
    for cls in (VmapTrainer, LoopTrainer):
        out = {}
        for cap in (None, most):
            t = cls(net, ParamLayout.from_module(net), x, y,
                    TrainOptions(epochs=2, batch_size=5, momentum=0.5, max_local_steps=cap,
                                 pretrain_losses=pretrain))
            out[cap] = t.run_round(w, 1, 0.1, IDS, idx)[:2]
        for a, b in zip(out[None], out[most]):
            assert torch.equal(a, b), cls.__name__
        assert out[None][0].abs().max() > 1e-3  # training moved the parameters


def test_the_loop_trainer_caps_a_model_with_buffers():
    """BatchNorm's running statistics come back in the update: they move once per step, so a
    capped update differs from an uncapped one, and equals one SGD loop of K steps."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                              torch.nn.Linear(8, 3))
    x, y, idx = data()
    layout = ParamLayout.from_module(net)
    w = layout.flatten_module(net)
    t = LoopTrainer(net, layout, x, y, TrainOptions(epochs=2, batch_size=4, max_local_steps=2))
    updates, _, _ = t.run_round(w, 0, 0.1, IDS[2:3], idx[2:3])
    ref = copy.deepcopy(net).train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for pos in list(client_minibatches(0, 0, int(IDS[2]), len(idx[2]), 2, 4))[:2]:
        opt.zero_grad()
        F.cross_entropy(ref(x[idx[2][pos]]), y[idx[2][pos]]).backward()
        opt.step()
    want = w - torch.cat([v.detach().reshape(-1).float() for _, v in model_state(ref)])
    torch.testing.assert_close(updates[0], want, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- the config


def test_the_config_key_is_validated_recorded_and_planned():
    cfg = load_config(None, ["client.max_local_steps=12"])
    assert cfg.client.max_local_steps == 12
    assert load_config(None, []).client.max_local_steps is None  # unset: no cap
    # stored with the run (resume reads this JSON), and a changed cap is a changed config
    stored = config_from_json(cfg.to_json())
    assert stored.client.max_local_steps == 12
    assert json.loads(cfg.to_json())["client"]["max_local_steps"] == 12
    assert config_diff(stored, load_config(None, ["client.max_local_steps=13"])) == [
        "client.max_local_steps: 12 -> 13"]
    assert make_plan(cfg).trainer.options["max_local_steps"] == 12
    for bad, message in (("0", "greater than or equal to 1"), ("2.5", "valid integer"),
                         ("true", "valid integer")):
        with pytest.raises(ConfigError, match=f"client.max_local_steps: .*{message}"):
            load_config(None, [f"client.max_local_steps={bad}"])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_local_steps"):
            TrainOptions(epochs=1, batch_size=5, max_local_steps=bad)


@pytest.mark.parametrize("epochs, batch_size, cap", [(1, 4, None), (3, 4, 2), (3, 4, 7),
                                                      (2, 5, 100), (3, 0, 2), (2, 0, None)])
def test_trained_samples_count_the_capped_minibatches(epochs, batch_size, cap):
    """The simulated clock's local work: the samples of the steps a client takes, counted
    from the minibatches themselves."""
    from mpifl.clients.minibatches import trained_samples

    sizes = np.array([1, 3, 4, 9, 13, 20])
    want = [sum(len(b) for b in client_minibatches(0, 1, k, int(n), epochs, batch_size,
                                                   max_steps=cap))
            for k, n in enumerate(sizes)]
    np.testing.assert_array_equal(trained_samples(sizes, epochs, batch_size, cap), want)


def test_the_clock_times_a_capped_round_by_its_steps():
    """With the cap a client's simulated round trains its capped steps' samples, not E
    epochs: the clock's round time is the system model's for that work."""
    from mpifl.clients.minibatches import trained_samples
    from mpifl.clients.system import SystemModel, SystemParams
    from mpifl.runtime.clock import Clock

    sizes = np.array([40, 80, 120, 160] * 5)
    system = SystemModel(SystemParams(enabled=True), 3, len(sizes), 1_000_000)
    work = trained_samples(sizes, 4, 8, 3)
    capped = Clock(system, sizes, 4, seed=3, work=work).round(0, 5, "uniform")
    full = Clock(system, sizes, 4, seed=3).round(0, 5, "uniform")
    ids = capped.selected
    np.testing.assert_array_equal(ids, full.selected)
    want = system.round_seconds(ids, work[ids], 1)
    np.testing.assert_allclose(capped.busy, want, rtol=1e-12)  # always available: all finish
    assert (capped.busy < full.busy).all()  # 24 samples, not 4 epochs of 40..160
