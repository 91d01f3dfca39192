"""The keyed minibatch schedule: the counter-based generator (mpifl/core/counter.py) against its
numpy oracle, and the vectorised chunk plan (mpifl/clients/minibatches.py) against a direct
per-client loop, for both ``client.minibatch_order`` generators; then training with the
counter order against the per-client oracle and the loop trainer."""

import numpy as np
import pytest
import torch

from mpifl.clients import LoopTrainer, VmapTrainer
from mpifl.clients.interface import TrainOptions
from mpifl.clients.minibatches import batch_order, client_minibatches, minibatch_schedule
from mpifl.core import counter
from tests.helpers import train
from tests.inprocess.test_training import assert_same, run_both, setup

# --------------------------------------------------------------------------- counter generator


def test_torch_mix_and_keys_equal_the_numpy_oracle_bit_for_bit():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, 200_000, dtype=np.uint64)
    words[:4] = [0, 1, 2**31, 2**32 - 1]  # the edges of the word
    got = counter.mix_torch(torch.from_numpy(words.astype(np.int64))).numpy()
    assert np.array_equal(got, counter.mix_np(words).astype(np.int64))
    # keys of large words (both 32-bit halves folded) and broadcasting
    big = rng.integers(0, 2**63 - 1, (50, 1), dtype=np.int64)
    small = np.arange(7, dtype=np.int64)[None, :]
    h1, h2 = counter.key_np(3, big.astype(np.uint64), small.astype(np.uint64))
    t1, t2 = counter.key_torch(3, torch.from_numpy(big), torch.from_numpy(small))
    assert t1.shape == (50, 7)
    assert np.array_equal(t1.numpy(), h1.astype(np.int64))
    assert np.array_equal(t2.numpy(), h2.astype(np.int64))


def test_the_cpu_values_and_the_device_arithmetic_equal_the_numpy_oracle():
    h1, h2 = counter.key_np(4, np.arange(30, dtype=np.uint64)[:, None])
    j = np.arange(2**32 - 500, 2**32 + 500, dtype=np.uint64)[None, :] % np.uint64(2**32)
    want = counter.values_np(h1, h2, j).astype(np.int64)
    args = [torch.from_numpy(a.astype(np.int64)) for a in (h1, h2, j)]
    assert np.array_equal(counter.values_torch(*args).numpy(), want)  # numpy's uint32 path
    assert np.array_equal(counter.values_int64(*args).numpy(), want)  # what a GPU runs


def test_mix_is_a_bijection_and_the_values_of_a_key_are_distinct():
    # lowbias32 is a bijection of 32-bit words: no two of 2^20 inputs collide
    x = np.arange(2**20, dtype=np.uint64) * np.uint64(4093)
    assert len(np.unique(counter.mix_np(x))) == len(x)
    h1, h2 = counter.key_np(1, 2, 3)
    assert len(np.unique(counter.values_np(h1, h2, np.arange(100_000)))) == 100_000


def test_counter_orders_are_keyed_permutations():
    a = counter.order_np(50, 1, 2, 3)
    assert a.dtype == np.int64 and sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, counter.order_np(50, 1, 2, 3))
    for other in [(0, 2, 3), (1, 0, 3), (1, 2, 0), (1, 2, 3, 0), (1, 2, 3 + 2**32)]:
        assert not np.array_equal(a, counter.order_np(50, *other))


def test_counter_order_places_each_sample_uniformly():
    # 4,000 keys x 8 positions: the count of sample j at position p is Binomial(4000, 1/8);
    # a biased hash (e.g. the identity) leaves most samples where they were
    n, keys = 8, 4000
    counts = np.zeros((n, n))
    for k in range(keys):
        counts[np.arange(n), np.argsort(counter.order_np(n, 7, k))] += 1
    expected = keys / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 120, chi2  # 49 degrees of freedom: P(chi2 > 120) < 1e-7


def test_device_orders_equal_the_per_key_oracle_one_after_another():
    sizes = torch.tensor([[10, 4, 1], [3, 0, 7]])
    ids = torch.tensor([[3], [2**40 + 5]])
    epochs = torch.tensor([[0, 1, 2]])
    got = counter.orders_torch([9, ids, epochs], sizes)
    want = [counter.order_np(int(sizes[i, e]), 9, int(ids[i, 0]), e)
            for i in range(2) for e in range(3)]
    assert got.tolist() == np.concatenate(want).tolist()


# --------------------------------------------------------------------------- the chunk plan


def loop_schedule(seed, rnd, client_ids, sizes, epochs, batch_size, tag=None, order="pcg64"):
    """The plan built client by client, epoch by epoch (what the trainer did before its plan
    was vectorised): the oracle of minibatch_schedule."""
    bp = int(sizes.max()) if batch_size == 0 else min(batch_size, int(sizes.max()))
    steps = np.array([epochs * (1 if batch_size == 0 else -(-n // batch_size)) for n in sizes])
    rows = np.full((len(sizes), int(steps.max()), bp), -1, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for i, (cid, n, start) in enumerate(zip(client_ids, sizes, starts)):
        per_epoch = steps[i] // epochs
        for epoch in range(epochs):
            perm = (np.arange(n) if batch_size == 0
                    else batch_order(seed, rnd, cid, epoch, n, tag, order))
            padded = np.full(per_epoch * bp, -1, dtype=np.int64)
            padded[:n] = perm + start
            rows[i, epoch * per_epoch:(epoch + 1) * per_epoch] = padded.reshape(per_epoch, bp)
    weights = (rows >= 0).astype(np.float32)
    return np.where(rows >= 0, rows, starts[:, None, None]), weights, steps


CASES = [((12, 7), 2, 5), ((3, 17, 50, 101), 2, 10), ((3, 17, 50), 1, 0), ((9, 25, 41), 3, 64),
         ((1,), 2, 1), ((30, 30, 30), 2, 8), ((5, 200, 6), 1, 7)]


@pytest.mark.parametrize("order", ["pcg64", "counter"])
@pytest.mark.parametrize(("sizes", "epochs", "batch_size"), CASES)
def test_plan_equals_the_per_client_loop(order, sizes, epochs, batch_size):
    sizes = np.array(sizes, dtype=np.int64)
    ids = np.arange(len(sizes), dtype=np.int64) * 11 + 3
    for tag in (None, 0x6D706164):
        plan = minibatch_schedule(4, 6, ids, sizes, epochs, batch_size, tag, order)
        rows, weights, steps = loop_schedule(4, 6, ids, sizes, epochs, batch_size, tag, order)
        assert np.array_equal(plan.rows.numpy(), rows)
        assert np.array_equal(plan.weights.numpy(), weights)
        assert np.array_equal(plan.steps, steps)
        assert np.array_equal(plan.real, weights.sum(axis=2).astype(np.int64))
        assert np.array_equal(plan.widths, np.maximum((weights > 0).sum(2).max(0), 1))


def test_the_two_generators_give_different_orders_of_the_same_minibatch_shapes():
    sizes = np.array([40, 23])
    a = minibatch_schedule(0, 1, np.array([5, 6]), sizes, 2, 8, order="pcg64")
    b = minibatch_schedule(0, 1, np.array([5, 6]), sizes, 2, 8, order="counter")
    assert torch.equal(a.weights, b.weights) and np.array_equal(a.steps, b.steps)
    assert not torch.equal(a.rows, b.rows)
    # each epoch of each client still visits every one of its samples once
    for i, (start, n) in enumerate([(0, 40), (40, 23)]):
        for epoch in range(2):
            got = b.rows[i, epoch * (-(-n // 8)):(epoch + 1) * (-(-n // 8))]
            real = b.weights[i, epoch * (-(-n // 8)):(epoch + 1) * (-(-n // 8))] > 0
            assert sorted(got[real].tolist()) == list(range(start, start + n))


def test_client_minibatches_follow_the_counter_order():
    got = np.concatenate(list(client_minibatches(1, 2, 3, 23, 1, 10, order="counter")))
    assert np.array_equal(got, batch_order(1, 2, 3, 0, 23, order="counter"))
    with pytest.raises(ValueError, match="minibatch order"):
        batch_order(1, 2, 3, 0, 23, order="mt19937")


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize(("epochs", "batch_size", "momentum"), [(2, 8, 0.0), (3, 5, 0.9)])
def test_vmap_training_with_the_counter_order_equals_the_oracle(epochs, batch_size, momentum):
    model, layout, x, y, idx = setup(sizes=(9, 25, 41))
    got, want, _, _ = run_both(model, layout, x, y, idx, epochs=epochs, batch_size=batch_size,
                               momentum=momentum, minibatch_order="counter")
    assert_same(got, want)
    pcg = run_both(model, layout, x, y, idx, epochs=epochs, batch_size=batch_size,
                   momentum=momentum)[0]
    assert not torch.allclose(got[0], pcg[0], atol=1e-4)  # the order really changed


def test_loop_trainer_takes_the_same_counter_minibatches():
    model, layout, x, y, idx = setup(sizes=(9, 25, 41))
    options = TrainOptions(epochs=2, batch_size=6, minibatch_order="counter")
    w = layout.flatten_module(model)
    ids = np.array([4, 8, 15])
    vm = train(VmapTrainer(model, layout, x, y, options), w, 2, 0.1, ids, idx)
    lp = train(LoopTrainer(model, layout, x, y, options), w, 2, 0.1, ids, idx)
    torch.testing.assert_close(vm[0], lp[0], atol=1e-5, rtol=0)
