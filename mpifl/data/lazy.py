"""A lazy federated population: K clients (K = 10^6 and more) of which only the clients asked
for are ever drawn, for the data sets whose clients can be drawn one at a time (they register
``lazy=``, :mod:`mpifl.data.registry`; today Synthetic(alpha, beta) of Li et al., "Federated
Optimization in Heterogeneous Networks" (FedProx), MLSys 2020, :mod:`mpifl.data.synthetic`).

What is lazy, what is not:

- **Held, O(K)**: the sample counts ``sizes``, ``num_train``, ``num_test``, (K,) int64 each:
  24 bytes a client (K = 10^6: 24 MB), what selection weights and FedAvg's weights read.
  Computing ``sizes`` for synthetic takes ~5 us a client (no sample is drawn,
  :func:`mpifl.data.synthetic.client_sizes`).
- **Drawn on demand**: the samples. :meth:`LazyPopulation.clients` builds a :class:`Window` of
  the given clients (float32 x, int64 y, each client's train/test indices as CSR arrays relative
  to the window), bit-identical to what the eager :class:`mpifl.data.FederatedData` of the same
  arguments holds for them: the same samples (the data set's per-client generator), the same
  train/test split and order (``default_rng([seed, k, SPLIT_TAG])`` permuting the client's
  samples, as :func:`mpifl.data.federated.split_clients` does). A bounded LRU cache of built
  clients (``cache_size``, default :data:`DEFAULT_CACHE_SIZE`) spares rebuilding clients used
  twice in a round (training, then evaluation); a window's own arrays are the caller's.
- **Whole windows at once** for a source that draws them (``ClientSource.fill_many``: Synthetic's
  counter generator, ``[data.params] generator = "counter"``): :meth:`LazyPopulation.clients`
  draws the window's clients together, on a given torch device (a worker's GPU), x and y then
  torch tensors on it, and splits them by the source's keyed order (``split_orders``, also the
  eager data's); the CSR indices stay numpy. Such a window bypasses the cache (a redraw costs
  what it would save, and device tensors would hold the device's memory); only
  :meth:`LazyPopulation.label_counts` builds and caches clients one by one. On the CPU the
  window equals the eager data bit for bit; on a GPU within float rounding (the source says
  how, :func:`mpifl.data.synthetic.counter_window`).
- **Not available lazily**: the full (K, C) ``label_counts()`` (it would draw every client's
  samples: K x ~240 draws); :meth:`LazyPopulation.label_counts` gives it for chosen clients
  only and returns None without them. ``sensitive`` is None (synthetic has no sensitive
  attribute).
- **Used by a run** with ``data.lazy = true``: every rank builds the population, and each
  request's clients (a worker's block of the round, of a sampled evaluation, a window of a
  streamed full evaluation) are drawn into a :class:`Window` that is the trainer's sample store
  for that call (:func:`mpifl.runtime.backends.client_rows`).

Only the ``natural`` partition (the data set's own clients) can be lazy: any other partition
needs every sample's label or group at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mpifl.core.blame import blame
from mpifl.core.errors import DataError
from mpifl.core.rng import SPLIT_TAG
from mpifl.data.compat import check_combination, lazy_datasets, lookup
from mpifl.data.federated import _check_args, _params, _split_counts
from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS, ClientSource, lazy_factory

__all__ = ["DEFAULT_CACHE_SIZE", "LazyPopulation", "Window", "load_population"]

#: Built clients kept by default: synthetic clients average ~57 KB (237 samples x 60 float32
#: + labels and indices), at most ~250 KB (1000 samples), so 256 clients hold <= 64 MB.
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class Window:
    """The samples of some clients, laid out like :class:`mpifl.data.FederatedData` but indexed
    from 0 within the window. Client j of the window is population client ``ids[j]``.

    Attributes:
        ids: (m,) int64 population client ids, in the order asked (repeats allowed).
        x: (n, *input_shape) float32 (or int64 token ids), the clients' samples, client j's at rows
            ``ptr[j]:ptr[j+1]`` in the order the data set draws them; a numpy array, or a torch
            tensor on the device a window was asked on (:meth:`LazyPopulation.clients`).
        y: (n,) int64 labels in 0..num_classes-1, or (n, T) int64 sequence targets (numpy or
            torch, as x).
        ptr: (m+1,) int64 offsets of each client's rows in x.
        train_ptr, train_idx: (m+1,) int64 CSR offsets and (sum of train sizes,) int64 row
            indices into x: client j's train samples, in the eager data's order.
        test_ptr, test_idx: the same for the local test splits.
    """

    ids: np.ndarray
    x: np.ndarray | Tensor
    y: np.ndarray | Tensor
    ptr: np.ndarray
    train_ptr: np.ndarray
    train_idx: np.ndarray
    test_ptr: np.ndarray
    test_idx: np.ndarray

    def train_indices(self, j: int) -> np.ndarray:
        """Window client j's train rows of x (a view, int64)."""
        return self.train_idx[self.train_ptr[j]:self.train_ptr[j + 1]]

    def test_indices(self, j: int) -> np.ndarray:
        """Window client j's test rows of x (a view, int64)."""
        return self.test_idx[self.test_ptr[j]:self.test_ptr[j + 1]]

    @property
    def nbytes(self) -> int:
        """Bytes of the window's arrays."""
        return sum(int(a.nbytes) for a in (self.ids, self.x, self.y, self.ptr, self.train_ptr,
                                           self.train_idx, self.test_ptr, self.test_idx))


@dataclass(frozen=True)
class _Client:
    """One built client (read-only arrays): x (n, ...) float32, y (n,) int64, and its train /
    test rows (int64, indices into its own x)."""

    x: np.ndarray
    y: np.ndarray
    train: np.ndarray
    test: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + self.y.nbytes + self.train.nbytes + self.test.nbytes


class LazyPopulation:
    """K clients whose sample counts are held and whose samples are drawn on demand.

    Reads like :class:`mpifl.data.FederatedData` where it can be lazy: ``name``,
    ``num_clients``, ``num_classes``, ``input_shape``, ``num_train``, ``num_test``,
    ``sensitive`` (None); the samples come from :meth:`clients`.

    Args:
        name: the data set's name.
        source: its clients (:class:`mpifl.data.registry.ClientSource`), every n_k >= 2.
        seed: the experiment seed; keys the per-client train/test split.
        fractions: ``(train_fraction,)`` (the rest is test) or ``(train, test)``, as
            :func:`mpifl.data.federated.split_clients` takes them.
        cache_size: built clients kept (least recently used dropped first); 0: none.
    """

    sensitive = None  # no lazy data set has a sensitive attribute yet
    lazy = True  # the runtime draws each request's clients (mpifl.runtime.backends.client_rows)
    label_dtype = np.dtype(np.int64)  # class labels (lazy sources fill int64 y)

    def __init__(self, name: str, source: ClientSource, seed: int, fractions: Sequence[float],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if int(cache_size) != cache_size or cache_size < 0:
            raise DataError(f"cache_size must be a non-negative integer, got {cache_size}")
        self.name, self.seed, self.cache_size = name, int(seed), int(cache_size)
        self.num_classes = int(source.num_classes)
        self.input_shape = tuple(int(d) for d in source.input_shape)
        self.target_shape = tuple(int(d) for d in source.target_shape)
        self.x_dtype = np.dtype(source.x_dtype)
        self.vocab_size = None if source.vocab_size is None else int(source.vocab_size)
        if self.x_dtype not in (np.float32, np.int64) or (
                (self.x_dtype == np.int64) != (self.vocab_size is not None)):
            raise DataError(f"data set '{name}': a ClientSource fills float32 features, or "
                            f"int64 token ids with vocab_size set (got {self.x_dtype}, "
                            f"vocab_size={self.vocab_size})")
        self.sizes = _checked_sizes(name, source.sizes)
        self.num_train, self.num_test = _split_sizes(self.sizes, tuple(fractions))
        self._fill = source.fill
        self._fill_many, self._split_orders = source.fill_many, source.split_orders
        self._cache: OrderedDict[int, _Client] = OrderedDict()

    @property
    def num_clients(self) -> int:
        """K, the number of clients."""
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes held: the (K,) count vectors and the cached clients."""
        held = self.sizes.nbytes + self.num_train.nbytes + self.num_test.nbytes
        return held + sum(c.nbytes for c in self._cache.values())

    @property
    def device_windows(self) -> bool:
        """Whether :meth:`clients` draws a window at once on a device (the source's
        ``fill_many``), so a caller should say where (``device=``)."""
        return self._fill_many is not None

    @property
    def cached(self) -> int:
        """How many built clients the cache holds now (<= cache_size)."""
        return len(self._cache)

    def clients(self, ids: Sequence[int] | np.ndarray,
                device: torch.device | str | None = None) -> Window:
        """The :class:`Window` of clients ``ids`` (any order, repeats allowed), built from the
        cache or drawn; its arrays are new (writing to them changes no cached client).

        Args:
            device: for a source that draws whole windows (:attr:`device_windows`), the torch
                device to draw on: x and y are then tensors there; None: numpy arrays (drawn
                on the CPU, at once too). Ignored by other sources (numpy arrays).

        Raises:
            DataError: ids that are not integers in 0..K-1.
        """
        ids = self._ids(ids)
        if self._fill_many is not None:
            return self._drawn(ids, device)
        built = [self._client(int(k)) for k in ids]
        ptr = _offsets([len(c.y) for c in built])
        x = np.empty((int(ptr[-1]), *self.input_shape), dtype=self.x_dtype)
        y = np.empty((int(ptr[-1]), *self.target_shape), dtype=np.int64)
        for c, lo, hi in zip(built, ptr[:-1], ptr[1:]):
            x[lo:hi], y[lo:hi] = c.x, c.y
        train_ptr, train_idx = _shifted([c.train for c in built], ptr)
        test_ptr, test_idx = _shifted([c.test for c in built], ptr)
        return Window(ids, x, y, ptr, train_ptr, train_idx, test_ptr, test_idx)

    def _drawn(self, ids: np.ndarray, device: torch.device | str | None) -> Window:
        """The window of ``ids`` drawn at once by the source's ``fill_many`` and split by its
        ``split_orders`` (the eager split's order), on ``device`` (None: the CPU, numpy)."""
        assert self._fill_many is not None and self._split_orders is not None
        dev = torch.device("cpu" if device is None else device)
        x, y, ptr = self._fill_many(ids, dev)
        order = self._split_orders(ids, dev).cpu().numpy()
        # each client's order cut as _build cuts it: its first n_train, then the next n_test
        n_train, n_test = self.num_train[ids], self.num_test[ids]
        sizes = np.diff(ptr)
        seg = np.repeat(np.arange(len(ids)), sizes)
        pos = np.arange(len(order)) - ptr[:-1][seg]  # place within the client's order
        rows = order + ptr[:-1][seg]
        train = rows[pos < n_train[seg]]
        test = rows[(pos >= n_train[seg]) & (pos < (n_train + n_test)[seg])]
        rest = (ptr, _offsets(n_train), train, _offsets(n_test), test)
        if device is None:
            return Window(ids, x.numpy(), y.numpy(), *rest)
        return Window(ids, x, y, *rest)

    def label_counts(self, ids: Sequence[int] | np.ndarray | None = None) -> np.ndarray | None:
        """(m, C) int64: clients ``ids``' training samples per label (rows in the order of ids,
        as the eager ``label_counts()[ids]``); None without ids, since the full (K, C) table
        would draw every client's samples."""
        if ids is None or self.target_shape:  # sequence targets: no per-sample label
            return None
        ids = self._ids(ids)
        out = np.zeros((len(ids), self.num_classes), dtype=np.int64)
        for j, k in enumerate(ids):
            c = self._client(int(k))
            out[j] = np.bincount(c.y[c.train], minlength=self.num_classes)
        return out

    def _ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 \
                or arr.max() >= self.num_clients:
            raise DataError(f"client ids must be a 1-D array of integers in "
                            f"0..{self.num_clients - 1}")
        return arr.astype(np.int64)

    def _client(self, k: int) -> _Client:
        """Client k, from the cache (refreshed as most recent) or built (and cached)."""
        hit = self._cache.get(k)
        if hit is not None:
            self._cache.move_to_end(k)
            return hit
        built = self._build(k)
        if self.cache_size:
            self._cache[k] = built
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return built

    def _build(self, k: int) -> _Client:
        """Draw client k and split it as :func:`mpifl.data.federated.split_clients` does: a
        permutation of its samples by ``default_rng([seed, k, SPLIT_TAG])``, cut into train
        then test (or by the source's ``split_orders``, which the eager split uses too). The
        permutation depends only on n_k and the generator, so permuting the
        local rows 0..n_k-1 gives the eager indices minus the client's offset."""
        n = int(self.sizes[k])
        x = np.empty((n, *self.input_shape), dtype=self.x_dtype)
        y = np.empty((n, *self.target_shape), dtype=np.int64)
        self._fill(k, x, y)
        if n and (y.min() < 0 or y.max() >= self.num_classes):
            raise DataError(f"data set '{self.name}': client {k}'s labels are outside "
                            f"0..{self.num_classes - 1}")
        if n and self.vocab_size is not None and (x.min() < 0 or x.max() >= self.vocab_size):
            raise DataError(f"data set '{self.name}': client {k}'s token ids are outside "
                            f"0..{self.vocab_size - 1}")
        if self._split_orders is not None:  # the source's own keyed order
            perm = self._split_orders(np.array([k]), torch.device("cpu")).numpy()
        else:
            perm = np.random.default_rng([self.seed, k, SPLIT_TAG]).permutation(
                np.arange(n, dtype=np.int64))
        n_train, n_test = int(self.num_train[k]), int(self.num_test[k])
        parts = (x, y, perm[:n_train].copy(), perm[n_train:n_train + n_test].copy())
        for a in parts:
            a.setflags(write=False)  # shared by every window and label count that reads it
        return _Client(*parts)


def _checked_sizes(name: str, sizes: Any) -> np.ndarray:
    """The source's (K,) sizes as int64, each >= 2 (a train and a test sample, as
    :func:`mpifl.data.federated._check_sizes` demands of the eager split)."""
    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or sizes.dtype.kind not in "iu":
        raise DataError(f"data set '{name}': its client sizes must be (K,) integers, got "
                        f"{sizes.shape} {sizes.dtype}")
    small = np.flatnonzero(sizes < 2)
    if len(small):
        k = int(small[0])
        raise DataError(f"data set '{name}' has {len(small)} client(s) with fewer than 2 "
                        f"samples (client {k} has {sizes[k]}), so they cannot have both a "
                        f"train and a test sample")
    return sizes.astype(np.int64, copy=False)


def _split_sizes(sizes: np.ndarray, fractions: tuple[float, ...]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(K,) int64 train and test sizes: the eager split's own :func:`_split_counts`, called once
    per distinct n_k (synthetic has at most 951) rather than K times. searchsorted, not
    ``unique(return_inverse=True)``: one (K,) temporary instead of three."""
    values = np.unique(sizes)
    counts = np.array([_split_counts(int(n), fractions) for n in values],
                      dtype=np.int64).reshape(-1, 2)
    where = np.searchsorted(values, sizes)
    return counts[where, 0], counts[where, 1]


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    """(m+1,) int64 CSR offsets of pieces of the given lengths."""
    ptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    return ptr


def _shifted(pieces: list[np.ndarray], starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets, flat indices) of per-client local indices, each moved to its client's
    first row ``starts[j]`` in the window."""
    ptr = _offsets([len(p) for p in pieces])
    if not pieces:
        return ptr, np.zeros(0, dtype=np.int64)
    flat = np.concatenate(pieces)
    flat += np.repeat(starts[:-1], np.diff(ptr))
    return ptr, flat


def load_population(
    dataset: str,
    *,
    partition: str = "natural",
    num_clients: int,
    seed: int,
    train_fraction: float = 0.8,
    data_root: str | None = None,
    dataset_params: Mapping[str, Any] | None = None,
    partition_params: Mapping[str, Any] | None = None,
    cache_size: int = DEFAULT_CACHE_SIZE,
) -> LazyPopulation:
    """The lazy counterpart of :func:`mpifl.data.load_federated`, with the same arguments (and
    the same checks and one-line errors), for a data set that declares ``lazy=``: client k's
    window equals the eager data's client k bit for bit.

    Args:
        cache_size: built clients kept between calls (:class:`LazyPopulation`).

    Raises:
        DataError: a data set that cannot be lazy (its name and the ones that can), a partition
            other than ``natural``, and whatever :func:`load_federated` refuses.
    """
    _check_args(dataset, partition, num_clients, seed, train_fraction)
    loader = DATASET_LOADERS.get(dataset)
    factory = lazy_factory(loader)
    if factory is None:
        raise DataError(f"data set '{dataset}' cannot be loaded lazily (lazy: "
                        f"{', '.join(lazy_datasets()) or 'none'}); load it with load_federated")
    dp = _params(DATASET_LOADERS, dataset, dataset_params, "data.params")
    pp = _params(PARTITIONERS, partition, partition_params, "data.partition_params")
    check_combination(dataset, partition, pp, num_clients)
    if lookup(PARTITIONERS, partition) is not lookup(PARTITIONERS, "natural"):
        raise DataError(f"a lazy population is split by its own clients (partition 'natural'), "
                        f"got partition '{partition}'")
    with blame([("data set", dataset, factory)], "load"):
        source = factory(seed=seed, data_root=data_root, num_clients=num_clients, **dp)
    if not isinstance(source, ClientSource) or len(source.sizes) != num_clients:
        raise DataError(f"data set '{dataset}': its lazy= factory must return a ClientSource "
                        f"of {num_clients} clients")
    return LazyPopulation(dataset, source, seed, (train_fraction,), cache_size)
