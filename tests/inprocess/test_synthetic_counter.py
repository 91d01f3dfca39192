"""Synthetic(alpha, beta)'s counter generator (``[data.params] generator = "counter"``,
:mod:`mpifl.data.synthetic`): the vectorised torch draw against a scalar numpy oracle of the
same keyed values, eager == lazy bit for bit on the CPU (samples, labels, split), the law's
statistics, and a short lazy run in one process.
"""

from __future__ import annotations

import contextlib
import math

import h5py
import numpy as np
import pytest
import torch

from mpifl.clients.interface import TrainerWrapper

from mpifl.core.counter import key_np, key_torch, values_int64, values_np, values_torch
from mpifl.core.rng import SYNTHETIC_COUNTER_TAG
from mpifl.data import load_federated, load_population
from mpifl.data.synthetic import (_CLIENT_NORMALS, _FEATURE_STD, LOG_MEAN, LOG_SIGMA,
                                  MAX_SAMPLES_PER_CLIENT, MIN_SAMPLES_PER_CLIENT, NUM_CLASSES,
                                  NUM_FEATURES, STREAM_CLIENT, STREAM_SAMPLES, STREAM_SIZE,
                                  counter_orders, counter_sizes, counter_window,
                                  expected_samples_per_client)
from mpifl.runtime import backends

COUNTER = {"generator": "counter"}


def _oracle_normal(key: tuple[int, ...], i: int) -> float:
    """Normal i of a key, one at a time: Box-Muller of the uniforms of values 2(i//2) and
    2(i//2)+1, cos for even i and sin for odd i."""
    h1, h2 = key_np(*key)
    p = 2 * (i // 2)
    u1, u2 = ((float(values_np(h1, h2, np.uint64(c))) + 0.5) / 2**32 for c in (p, p + 1))
    r, theta = math.sqrt(-2.0 * math.log(u1)), 2.0 * math.pi * u2
    return r * (math.cos(theta) if i % 2 == 0 else math.sin(theta))


def _oracle_client(seed, k, alpha, beta):
    """Client k drawn by the law, a loop over scalars (numpy's hash, Python's math)."""
    z0 = _oracle_normal((seed, SYNTHETIC_COUNTER_TAG, k, STREAM_SIZE), 0)
    n = min(math.floor(math.exp(LOG_MEAN + LOG_SIGMA * z0)),
            MAX_SAMPLES_PER_CLIENT - MIN_SAMPLES_PER_CLIENT) + MIN_SAMPLES_PER_CLIENT
    z = [_oracle_normal((seed, SYNTHETIC_COUNTER_TAG, k, STREAM_CLIENT), i)
         for i in range(_CLIENT_NORMALS)]
    u, b_mean = alpha * z[0], beta * z[1]
    w = np.array([[u + z[2 + f * NUM_CLASSES + c] for c in range(NUM_CLASSES)]
                  for f in range(NUM_FEATURES)], dtype=np.float32)
    cut = 2 + NUM_FEATURES * NUM_CLASSES
    b = np.array([u + z[cut + c] for c in range(NUM_CLASSES)], dtype=np.float32)
    v = np.array([b_mean + z[cut + NUM_CLASSES + f] for f in range(NUM_FEATURES)],
                 dtype=np.float32)
    key = (seed, SYNTHETIC_COUNTER_TAG, k, STREAM_SAMPLES)
    x = np.array([[np.float32(_oracle_normal(key, i * NUM_FEATURES + f)) * _FEATURE_STD[f] + v[f]
                   for f in range(NUM_FEATURES)] for i in range(n)], dtype=np.float32)
    logits = x.astype(np.float64) @ w.astype(np.float64) + b
    return n, x, logits


def test_the_cpu_hash_equals_the_counter_oracle():
    """The CPU's uint32 hash (values_torch) and torch's int64 one (values_int64, the GPU's)
    are the oracle's integers."""
    k = torch.tensor([0, 1, 7, 2**31 + 3])
    h1, h2 = key_torch(3, SYNTHETIC_COUNTER_TAG, k, STREAM_SAMPLES)
    counter = torch.arange(0, 2**32, 2**32 // 977)
    ref = values_np(*key_np(3, SYNTHETIC_COUNTER_TAG, k.numpy()[:, None], STREAM_SAMPLES),
                    counter.numpy()).astype(np.int64)
    np.testing.assert_array_equal(values_torch(h1[:, None], h2[:, None], counter).numpy(), ref)
    np.testing.assert_array_equal(values_int64(h1[:, None], h2[:, None], counter).numpy(), ref)


@pytest.mark.parametrize("seed,alpha,beta", [(0, 1.0, 1.0), (2**33 + 5, 0.5, 0.0)])
def test_a_window_equals_the_scalar_oracle(seed, alpha, beta):
    """Sizes exact; features within float32 rounding (the oracle's log and cos are Python's,
    the draw's torch's: they may differ in the last float64 ulp); a label equal unless its two
    best logits are a near-tie."""
    sizes = counter_sizes(40, seed)
    ks = [int(k) for k in np.argsort(sizes, kind="stable")[:2]]  # two small clients, quick
    x, y, ptr = counter_window(np.array(ks[::-1] + ks), sizes[ks[::-1] + ks], seed=seed,
                               alpha=alpha, beta=beta)
    for j, k in enumerate(ks[::-1] + ks):
        n, ox, logits = _oracle_client(seed, k, alpha, beta)
        assert n == sizes[k] == ptr[j + 1] - ptr[j]
        rows = slice(ptr[j], ptr[j + 1])
        np.testing.assert_allclose(x[rows].numpy(), ox, rtol=2e-7, atol=2e-7)
        top2 = np.sort(logits, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4
        assert clear.mean() > 0.99
        np.testing.assert_array_equal(y[rows].numpy()[clear], logits.argmax(1)[clear])


CASES = [(0, 1.0, 1.0, 60, 0.8), (3, 0.5, 0.5, 400, 0.7), (2**33 + 5, 0.0, 0.0, 30, 0.8)]


@pytest.mark.parametrize("case", CASES, ids=[f"s{c[0]}-a{c[1]}-K{c[3]}" for c in CASES])
def test_eager_equals_every_lazy_window_bit_for_bit(case):
    seed, alpha, beta, k, fraction = case
    params = {"alpha": alpha, "beta": beta, **COUNTER}
    eager = load_federated("synthetic", partition="natural", num_clients=k, seed=seed,
                           train_fraction=fraction, dataset_params=params)
    lazy = load_population("synthetic", num_clients=k, seed=seed, train_fraction=fraction,
                           dataset_params=params)
    assert lazy.device_windows
    offsets = np.concatenate([[0], np.cumsum(lazy.sizes)])
    assert offsets[-1] == len(eager.x)
    np.testing.assert_array_equal(lazy.num_train, eager.num_train)
    ids = np.random.default_rng(1).permutation(k)
    ids = np.concatenate([ids, ids[:3]])
    for w in (lazy.clients(ids), lazy.clients(ids, "cpu")):  # numpy, then torch tensors
        x, y = (w.x, w.y) if isinstance(w.x, np.ndarray) else (w.x.numpy(), w.y.numpy())
        assert x.dtype == np.float32 and y.dtype == np.int64
        for j, c in enumerate(ids):
            lo, hi = offsets[c], offsets[c + 1]
            rows = slice(w.ptr[j], w.ptr[j + 1])
            np.testing.assert_array_equal(x[rows].view(np.uint32), eager.x[lo:hi].view(np.uint32))
            np.testing.assert_array_equal(y[rows], eager.y[lo:hi])
            np.testing.assert_array_equal(w.train_indices(j) - w.ptr[j],
                                          eager.train_indices(c) - lo)
            np.testing.assert_array_equal(w.test_indices(j) - w.ptr[j],
                                          eager.test_indices(c) - lo)
    # label counts build clients one at a time (fill and the split of one client)
    np.testing.assert_array_equal(lazy.label_counts(ids), eager.label_counts()[ids])
    assert lazy.cached == min(k, lazy.cache_size)


def test_the_split_is_a_keyed_permutation_and_not_pcg64s():
    sizes = np.array([5, 1000, 50])
    order = counter_orders(np.array([4, 9, 4]), sizes, seed=2).numpy()
    parts = np.split(order, np.cumsum(sizes)[:-1])
    for p, n in zip(parts, sizes):
        np.testing.assert_array_equal(np.sort(p), np.arange(n))
    assert not np.array_equal(parts[1], np.arange(1000))
    pcg = load_federated("synthetic", partition="natural", num_clients=5, seed=2)
    ctr = load_federated("synthetic", partition="natural", num_clients=5, seed=2,
                         dataset_params=COUNTER)
    assert not np.array_equal(pcg.x[:50], ctr.x[:50])  # another generator, other data


def test_the_law_statistics():
    """Loose bounds, several standard errors wide, on what the law fixes: E[n_k] (the capped
    lognormal's mean, ~236.8) and P(n_k = 1000) from K = 20,000 sizes; within-client feature
    variances j^-1.2 and the between-client variance of feature means (1 + beta^2) from a window
    of 300 clients; every label present."""
    sizes = counter_sizes(20_000, 4)
    assert sizes.min() >= 50 and sizes.max() == 1000
    se = sizes.std() / math.sqrt(len(sizes))
    assert abs(sizes.mean() - expected_samples_per_client()) < 4 * se
    p_cap = 0.5 * math.erfc((math.log(950) - LOG_MEAN) / (LOG_SIGMA * math.sqrt(2)))
    assert abs((sizes == 1000).mean() - p_cap) < 4 * math.sqrt(p_cap * (1 - p_cap) / 20_000)

    ids = np.arange(300)
    x, y, ptr = counter_window(ids, sizes[ids], seed=4, alpha=1.0, beta=1.0)
    x = x.double().numpy()
    seg = np.repeat(ids, np.diff(ptr))
    means = np.stack([np.bincount(seg, x[:, f]) for f in range(NUM_FEATURES)], 1) / np.diff(
        ptr)[:, None]
    resid = x - means[seg]
    within = (resid**2).sum(0) / (len(x) - len(ids))
    target = np.arange(1, NUM_FEATURES + 1) ** -1.2
    # each variance from ~70,000 residuals: relative standard error sqrt(2 / 70,000) ~ 0.5 %
    np.testing.assert_allclose(within, target, rtol=0.05)
    between = means.var(0, ddof=1).mean()  # v_kj ~ N(B_k, 1), B_k ~ N(0, 1): 2 (+ j^-1.2 / n)
    assert 1.4 < between < 2.8
    assert set(np.unique(y.numpy())) == set(range(NUM_CLASSES))


def test_pcg64_stays_the_default():
    lazy = load_population("synthetic", num_clients=20, seed=0)
    assert not lazy.device_windows
    w = lazy.clients([3])
    assert isinstance(w.x, np.ndarray)


from tests.inprocess.test_lazy_run import assert_same_results, run  # noqa: E402 -- its job: 60 clients, 3 rounds

#: the same job, lazy and eager, on the counter generator (one process each, the shared world)
COUNTER_RUNS = {kind: run(f"counter-{kind}", *lazy, "data.params.generator=counter")
                for kind, lazy in (("lazy", ["data.lazy=true"]), ("eager", []))}


def test_a_lazy_counter_run_in_one_process(world):
    """A short run on a lazy counter population equals the eager run of the same config (the
    windows staged in the trainer as CPU tensors; every trained value the same bits)."""
    lazy, eager = world.file(COUNTER_RUNS["lazy"]), world.file(COUNTER_RUNS["eager"])
    assert_same_results(lazy, eager)
    with h5py.File(lazy, "r") as f:
        assert '"counter"' in str(f.attrs["config"])  # the --set reached the data set


def test_client_rows_stages_a_window_drawn_on_the_trainers_device():
    """client_rows asks the population for a window on the trainer's device, found through a
    wrapper, and the trainer's samples get torch tensors."""
    staged = []

    class Trainer:
        device = torch.device("cpu")
        x = torch.empty(0, NUM_FEATURES)

        def samples(self, x, y):
            staged.append((x, y))
            return contextlib.nullcontext()

    lazy = load_population("synthetic", num_clients=30, seed=0, dataset_params=COUNTER)
    ids = np.array([4, 2, 9])
    with backends.client_rows(lazy, ids, TrainerWrapper(Trainer())) as (train, test):
        (x, y), = staged
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        assert len(x) == lazy.sizes[ids].sum() and len(train) == len(test) == 3
        np.testing.assert_array_equal(x.numpy(), lazy.clients(ids).x)
