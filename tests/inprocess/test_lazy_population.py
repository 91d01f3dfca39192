"""A lazy population (the data layer): K = 10^6 Synthetic(1, 1) clients
without their samples in memory, each client's window bit-identical to the eager data.

The eager :func:`mpifl.data.load_federated` is the oracle: every client's samples, labels and
train/test indices (in order) must be the same, mapped through the window's offsets.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import numpy as np
import pytest

from mpifl.core.errors import DataError
from mpifl.core.rng import SYNTHETIC_TAG
from mpifl.data import LazyPopulation, load_federated, load_population
from mpifl.data.registry import (CLIENTS, DATASET_LOADERS, LABELS, ClientSource, DataPool,
                                 register_dataset)
from mpifl.data.synthetic import _client_rng, _num_samples, _pcg64_states, client_sizes

# (seed, alpha, beta, K, train_fraction)
CASES = [(0, 1.0, 1.0, 50, 0.8), (3, 0.5, 0.5, 1000, 0.8), (7, 0.0, 0.0, 50, 0.7),
         (2**33 + 5, 1.0, 1.0, 50, 0.8)]


def _both(seed, alpha, beta, k, fraction, **kw):
    params = {"alpha": alpha, "beta": beta}
    eager = load_federated("synthetic", partition="natural", num_clients=k, seed=seed,
                           train_fraction=fraction, dataset_params=params)
    lazy = load_population("synthetic", num_clients=k, seed=seed, train_fraction=fraction,
                           dataset_params=params, **kw)
    return eager, lazy


@pytest.mark.parametrize("case", CASES, ids=[f"s{c[0]}-a{c[1]}-K{c[3]}" for c in CASES])
def test_every_window_equals_the_eager_clients(case):
    eager, lazy = _both(*case)
    assert lazy.num_clients == eager.num_clients
    assert (lazy.num_classes, lazy.input_shape, lazy.sensitive) == (10, (60,), None)
    np.testing.assert_array_equal(lazy.num_train, eager.num_train)
    np.testing.assert_array_equal(lazy.num_test, eager.num_test)
    assert lazy.num_train.dtype == lazy.num_test.dtype == np.int64
    # natural partition: client k's rows of the eager pool are offsets[k]:offsets[k+1]
    offsets = np.concatenate([[0], np.cumsum(lazy.sizes)])
    assert offsets[-1] == len(eager.x)
    # every client, in a shuffled order with a repeat, in one window
    ids = np.random.default_rng(0).permutation(lazy.num_clients)
    ids = np.concatenate([ids, ids[:3]])
    w = lazy.clients(ids)
    assert w.x.dtype == np.float32 and w.y.dtype == np.int64
    assert len(w.x) == len(w.y) == w.ptr[-1] == lazy.sizes[ids].sum()
    for j, k in enumerate(ids):
        lo, hi = offsets[k], offsets[k + 1]
        rows = slice(w.ptr[j], w.ptr[j + 1])
        # bit for bit: compare the float32 bit patterns, not values
        np.testing.assert_array_equal(w.x[rows].view(np.uint32), eager.x[lo:hi].view(np.uint32))
        np.testing.assert_array_equal(w.y[rows], eager.y[lo:hi])
        np.testing.assert_array_equal(w.train_indices(j) - w.ptr[j], eager.train_indices(k) - lo)
        np.testing.assert_array_equal(w.test_indices(j) - w.ptr[j], eager.test_indices(k) - lo)
    np.testing.assert_array_equal(lazy.label_counts(ids), eager.label_counts()[ids])
    assert lazy.label_counts() is None  # the full table would draw every client


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32 + 5, 2**70 + 3])
def test_fast_seeding_equals_numpy_generators(seed):
    """client_sizes hashes SeedSequence itself; numpy's own generators are the oracle, at low
    and high client ids (one 32-bit word each) and seeds of one, two and three words."""
    ks = np.array([0, 1, 2, 99, 12345, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=np.uint32)
    for k, (state, inc) in zip(ks.tolist(), _pcg64_states(seed, ks)):
        ref = np.random.PCG64(np.random.SeedSequence([seed, SYNTHETIC_TAG, k])).state["state"]
        assert (state, inc) == (ref["state"], ref["inc"]), k
    fast = client_sizes(300, seed, chunk=64)  # several chunks, one partial
    slow = [_num_samples(_client_rng(seed, k)) for k in range(300)]
    np.testing.assert_array_equal(fast, slow)


def test_cache_is_bounded_least_recently_used_and_spares_rebuilds():
    lazy = load_population("synthetic", num_clients=40, seed=1, cache_size=5)
    fill, built = lazy._fill, []
    lazy._fill = lambda k, x, y: (built.append(k), fill(k, x, y))
    first = lazy.clients(range(5))
    assert built == [0, 1, 2, 3, 4] and lazy.cached == 5
    again = lazy.clients(range(5))  # all cached: nothing rebuilt, same values
    assert built == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(first.x, again.x)
    lazy.clients([0])       # 0 most recent, so 1 is now the least recent
    lazy.clients([7])       # evicts 1
    lazy.clients([0, 2])    # cached
    lazy.clients([1])       # rebuilt
    assert built == [0, 1, 2, 3, 4, 7, 1] and lazy.cached == 5
    lazy.clients(range(10, 30))
    assert lazy.cached == 5
    assert lazy.nbytes <= 24 * 40 + 5 * lazy.sizes.max() * (60 * 4 + 8 + 8)
    # a window is the caller's: writing to it changes no cached client
    w = lazy.clients([29])
    w.x[:] = 0
    assert lazy.clients([29]).x.any()
    none = load_population("synthetic", num_clients=40, seed=1, cache_size=0)
    none.clients(range(10))
    assert none.cached == 0 and none.nbytes == 24 * 40


def test_refusals_are_one_line():
    with pytest.raises(DataError, match="cannot be loaded lazily .*synthetic") as err:
        load_population("mnist", partition="iid", num_clients=10, seed=0)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError):
        load_population("synthetic", partition="iid", num_clients=10, seed=0)
    with pytest.raises(DataError, match="data.params"):
        load_population("synthetic", num_clients=10, seed=0, dataset_params={"gamma": 1})
    lazy = load_population("synthetic", num_clients=10, seed=0)
    for bad in ([10], [-1], [[1, 2]], [0.5]):
        with pytest.raises(DataError, match="client ids"):
            lazy.clients(bad)
    with pytest.raises(DataError, match="cache_size"):
        load_population("synthetic", num_clients=10, seed=0, cache_size=-1)
    assert len(lazy.clients([]).x) == 0


def test_a_plugin_declares_lazy_only_with_its_own_clients(monkeypatch):
    monkeypatch.setattr(DATASET_LOADERS, "_entries", dict(DATASET_LOADERS._entries))

    @register_dataset("lazy_test_pool", provides=(LABELS, CLIENTS))
    def pool(*, seed, data_root=None, num_clients):
        return DataPool(np.zeros((2 * num_clients, 3), np.float32),
                        np.zeros(2 * num_clients, np.int64), 2,
                        client_sizes=np.full(num_clients, 2))

    with pytest.raises(DataError, match="cannot be loaded lazily"):
        load_population("lazy_test_pool", num_clients=3, seed=0)
    with pytest.raises(ValueError, match="lazy="):
        register_dataset("lazy_test_bad", provides=(LABELS,), lazy=lambda **kw: None)


def _traced(num_clients: int) -> tuple[int, int]:
    """(bytes still held by a population of K clients, peak bytes while building it)."""
    gc.collect()
    tracemalloc.start()
    try:
        lazy = load_population("synthetic", num_clients=num_clients, seed=1)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(lazy, LazyPopulation)
    return held, peak


@pytest.mark.slow
def test_memory_grows_by_a_few_bytes_a_client():
    """Measured slopes, not timings: the arrays held (K = 1e4, 1e5, 1e6) and, traced by
    tracemalloc (20x slower, so smaller K), everything held and the peak while building.
    Eager, K = 1e6 would hold ~2.4e8 samples x 256 bytes (x, y, one index: ~60 GB)."""
    held = {}
    for k in (10**4, 10**5, 10**6):
        t0 = time.perf_counter()
        lazy = load_population("synthetic", num_clients=k, seed=1)
        built_s = time.perf_counter() - t0
        arrays = [v for v in vars(lazy).values() if isinstance(v, np.ndarray)]
        assert lazy.nbytes == sum(a.nbytes for a in arrays)  # nbytes hides no array
        held[k] = lazy.nbytes
    slope = (held[10**6] - held[10**4]) / (10**6 - 10**4)
    print(f"\narrays held: {held} bytes, slope {slope:.1f} bytes/client")
    assert slope < 64
    t0 = time.perf_counter()
    w = lazy.clients(np.random.default_rng(0).choice(10**6, 10_000, replace=False))
    window_s = time.perf_counter() - t0
    print(f"K = 1e6 built in {built_s:.2f} s; a window of 10,000 clients "
          f"({len(w.x):,} samples, {w.nbytes / 2**20:.0f} MiB) in {window_s:.2f} s")
    assert lazy.cached == lazy.cache_size  # the window's clients went through the bounded cache

    # The two phases of construction, traced apart. The sizes: the output and O(chunk)
    # temporaries (tracemalloc slows this Python loop 20x, hence K <= 4e4) ...
    load_population("synthetic", num_clients=100, seed=1)  # first-call allocations out of the way
    (held_a, peak_a), (held_b, peak_b) = _traced(10**4), _traced(4 * 10**4)
    traced_slope, peak_slope = (held_b - held_a) / 30_000, (peak_b - peak_a) / 30_000
    print(f"traced, whole construction: held slope {traced_slope:.1f}, peak slope "
          f"{peak_slope:.1f} bytes/client (peak {peak_b / 2**20:.1f} MiB at K = 4e4)")
    assert traced_slope < 64 and peak_slope < 64
    # ... and the vectorised train/test counts from given sizes, traced up to K = 1e6
    peaks = {k: _traced_split(lazy.sizes[:k]) for k in (10**4, 10**6)}
    split_slope = (peaks[10**6] - peaks[10**4]) / (10**6 - 10**4)
    print(f"traced, train/test counts from the sizes: peak slope {split_slope:.1f} bytes/client")
    assert split_slope < 64


def _traced_split(sizes: np.ndarray) -> int:
    """Peak bytes of a population's construction from already drawn sizes."""
    source = ClientSource(sizes, 10, (60,), lambda k, x, y: None)
    gc.collect()
    tracemalloc.start()
    try:
        LazyPopulation("synthetic", source, 1, (0.8,))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
