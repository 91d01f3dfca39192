"""Data sets and partitions by name: one registry each, for mpifl's own entries
(:mod:`mpifl.data.builtin`) and the users' alike.

A **data set** is a loader ``(*, seed, data_root, **params) -> DataPool | FederatedData``
registered with :func:`register_dataset`: either the pool of examples that a partition then
splits over the clients (and each client's samples into local train/test), or a finished
federated split. A loader whose signature names ``num_clients`` also gets K (Synthetic(alpha,
beta) draws one generator per client).

A **partition** is ``(labels, num_clients, rng, **context) -> list of K index arrays`` (or a
:class:`Partitioned`) registered with :func:`register_partition`. Of the context ``num_classes``,
``sensitive`` and ``pool`` (the :class:`DataPool`) it receives those its signature names (all of
them if it takes ``**kwargs``), plus its parameters; ``rng`` is keyed by ``(seed,
PARTITION_TAG)`` so the split depends only on the seed.

Each entry may declare a ``Params`` class (:class:`mpifl.core.params.Params`, as rules do): the
config's ``[data.params]`` (data set) or ``[data.partition_params]`` (partition), validated with
one-line errors, defaults filled in; an entry without one gets its table as keyword arguments
unchecked. A data set declares what its pool ``provides`` and a partition what it ``needs``
(:data:`LABELS`, :data:`SENSITIVE`, :data:`RAW`, :data:`CLIENTS`); :mod:`mpifl.data.compat`
checks the pairs, for the config and :func:`mpifl.data.load_federated` alike.

A data set declares its sizes with ``shape=`` (:class:`DataShape`: N, one sample's shape, the
classes), which the memory budget (:mod:`mpifl.experiment.budget`) reads before anything
loads; a data set read from files declares them beside it (:func:`mpifl.data.roots.
register_files`).

A data set whose clients can be drawn one at a time also declares ``lazy=``: a factory of the
:class:`ClientSource` that :func:`mpifl.data.lazy.load_population` builds a lazy population
from (K = 10^6 clients without holding their samples). Synthetic declares one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch

from mpifl.core.errors import DataError
from mpifl.core.params import Params
from mpifl.core.tokens import PAD  # the padding id of every token data set
from mpifl.core.registry import Registry

__all__ = ["CLIENTS", "DATASET_LOADERS", "LABELS", "NoParams", "PAD", "PARTITIONERS", "RAW",
           "SENSITIVE",
           "ClientSource", "DataPool", "DataShape", "Partitioned", "call_partition", "data_shape",
           "lazy_factory",
           "params_class", "register_dataset", "register_partition"]

#: What a data set's pool provides and a partition may need:
LABELS = "labels"        # integer class labels (not regression targets)
SENSITIVE = "sensitive"  # a sensitive-group id per sample (DataPool.sensitive)
RAW = "raw"              # the raw uint8 images besides the normalised x (DataPool.raw)
CLIENTS = "clients"      # the data set's own clients (DataPool.client_sizes); such a data set
#                          goes only with a partition that needs them
TAGS = (LABELS, SENSITIVE, RAW, CLIENTS)

#: a registered loader or partition: the decorators return it unchanged
F = TypeVar("F", bound=Callable[..., Any])


class NoParams(Params):
    """The parameters of an entry that takes none: any key is refused."""


@dataclass
class DataPool:
    """The examples of a data set before it is split over clients.

    Attributes:
        x: (N, *input_shape) float32 features, already normalised as the model expects; or
            (N, T) int64 token ids in ``0 .. vocab_size - 1`` (text: characters or words, id
            :data:`PAD` = 0 the padding), with ``vocab_size`` set.
        y: (N,) int64 labels in ``0 .. num_classes - 1``; or (N, T) int64 sequence targets (the
            next token at every position, :data:`PAD` where there is none: the
            ``token_cross_entropy`` loss skips those positions), num_classes then the
            vocabulary the model predicts over; or, for a regression task (``[model] loss =
            "mse"``), (N,) or (N, T) float32 targets, split by a partition that does not read
            labels (``iid`` or the user's own).
        num_classes: C >= 2 classes; for float targets, their number T >= 1 (the model's output
            width).
        vocab_size: V >= 2 for token inputs (the model's embedding rows; a factory whose
            signature names ``vocab_size`` gets it), None for float features.
        sensitive: optional (N,) int64 sensitive-group ids (for demographic parity and the other
            group-fairness metrics, mFairFL, the ``group_skew`` partition); None without one.
        raw: optional (N, *input_shape) uint8, the images before normalisation, for a partition
            that normalises its own subset (``one_class_per_client``).
        client_sizes: optional (K,) int64: the samples come grouped by the data set's own
            clients, client k holding the next ``client_sizes[k]`` rows (the ``natural``
            partition); such a pool goes only with a partition that takes its clients.
        standardise: optional (F,) bool over the columns of a 2-D x: these are standardised
            after the split with the mean and std of the training pool (the union of the
            clients' train splits), so no test sample leaks into the features.
        split_orders: optional, with ``client_sizes``: ``split_orders(sizes)`` gives the
            (sum n_k,) int64 order in which each client's samples are split into train and
            test (a permutation of range(n_k), one client after another), replacing
            ``default_rng([seed, k, SPLIT_TAG])`` (:func:`mpifl.data.federated.split_clients`);
            a lazy source of the same data must split the same way
            (:class:`ClientSource` ``split_orders``). None: the default.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    sensitive: np.ndarray | None = None
    raw: np.ndarray | None = None
    client_sizes: np.ndarray | None = None
    standardise: np.ndarray | None = None
    vocab_size: int | None = None
    split_orders: Callable[[np.ndarray], np.ndarray] | None = None

    def provides(self) -> frozenset[str]:
        """The tags (:data:`TAGS`) this pool offers a partition."""
        labels = self.y.dtype.kind in "iu" and self.y.ndim == 1  # not sequence targets
        has = {LABELS: labels, SENSITIVE: self.sensitive is not None,
               RAW: self.raw is not None, CLIENTS: self.client_sizes is not None}
        return frozenset(tag for tag, yes in has.items() if yes)

    def check(self, name: str) -> DataPool:
        """This pool with its dtypes and shapes checked (float32 x, int64 y / sensitive,
        labels in range, the optional arrays fitting x).

        Raises:
            DataError: one line naming the data set and what is wrong.
        """
        x, y = self._inputs(name), np.asarray(self.y)
        if y.dtype.kind == "f":  # regression targets
            width = 1 if y.ndim == 1 else (y.shape[1] if y.ndim == 2 else 0)
            if y.dtype != np.float32 or len(y) != len(x) or width != int(self.num_classes):
                raise DataError(f"data set '{name}': float targets must be ({len(x)},) or "
                                f"({len(x)}, num_classes) float32, got {y.shape} {y.dtype} with "
                                f"num_classes={self.num_classes}")
            if not np.isfinite(y).all():
                raise DataError(f"data set '{name}': the targets have NaN or infinite values")
        else:
            if y.dtype.kind not in "iu" or len(y) != len(x) or y.ndim not in (1, 2):
                raise DataError(f"data set '{name}': y must be ({len(x)},) integer labels or "
                                f"({len(x)}, T) integer sequence targets, got {y.shape} {y.dtype}")
            if int(self.num_classes) < 2 or (y.size and (y.min() < 0
                                                         or y.max() >= self.num_classes)):
                raise DataError(f"data set '{name}': labels must lie in 0..num_classes-1 with "
                                f"num_classes >= 2 (num_classes={self.num_classes})")
            y = y.astype(np.int64)
        vocab = None if self.vocab_size is None else int(self.vocab_size)
        return replace(self, x=x, y=y, num_classes=int(self.num_classes), vocab_size=vocab,
                       sensitive=self._sensitive(name, y), **self._extras(name, x))

    def _inputs(self, name: str) -> np.ndarray:
        """x checked: (N, ...) float32 features, or (N, T) int64 token ids below vocab_size."""
        x = np.asarray(self.x)
        if x.dtype.kind in "iu":
            v = self.vocab_size
            if x.ndim != 2 or v is None or int(v) < 2:
                raise DataError(f"data set '{name}': token inputs must be (N, T) integers with "
                                f"vocab_size >= 2, got {x.shape} {x.dtype}, vocab_size={v}")
            if x.size and (x.min() < 0 or x.max() >= int(v)):
                raise DataError(f"data set '{name}': token ids must lie in 0..vocab_size-1 "
                                f"(vocab_size={v}, found {x.min()}..{x.max()})")
            return x.astype(np.int64, copy=False)
        if x.dtype != np.float32 or x.ndim < 2:
            raise DataError(f"data set '{name}': x must be (N, ...) float32 features or (N, T) "
                            f"int64 token ids, got {x.shape} {x.dtype}")
        if self.vocab_size is not None:
            raise DataError(f"data set '{name}': vocab_size is for token inputs, x is float32")
        return x

    def _sensitive(self, name: str, y: np.ndarray) -> np.ndarray | None:
        s = self.sensitive
        if s is not None:
            s = np.asarray(s)
            if s.shape != y.shape[:1] or s.dtype.kind not in "iu" or (len(s) and s.min() < 0):
                raise DataError(f"data set '{name}': sensitive must be ({len(y)},) non-negative "
                                f"integers, got {s.shape} {s.dtype}")
            s = s.astype(np.int64)
        return s

    def _extras(self, name: str, x: np.ndarray) -> dict[str, Any]:
        """raw, client_sizes and standardise, checked against x."""
        raw, sizes, cols = self.raw, self.client_sizes, self.standardise
        if raw is not None and (raw.dtype != np.uint8 or raw.shape != x.shape):
            raise DataError(f"data set '{name}': raw must be {x.shape} uint8, got {raw.shape} "
                            f"{raw.dtype}")
        if sizes is not None:
            sizes = np.asarray(sizes)
            if sizes.ndim != 1 or sizes.dtype.kind not in "iu" or sizes.sum() != len(x) \
                    or (len(sizes) and sizes.min() < 0):
                raise DataError(f"data set '{name}': client_sizes must be non-negative integers "
                                f"summing to the {len(x)} samples")
            sizes = sizes.astype(np.int64)
        if cols is not None:
            cols = np.asarray(cols)
            if cols.dtype != bool or x.ndim != 2 or cols.shape != x.shape[1:]:
                raise DataError(f"data set '{name}': standardise must be ({x.shape[-1]},) bool "
                                f"over the columns of a 2-D x")
        return dict(raw=raw, client_sizes=sizes, standardise=cols)


@dataclass(frozen=True)
class DataShape:
    """What a data set holds, declared once at registration (``register_dataset(shape=)``) so
    that the memory budget (:mod:`mpifl.experiment.budget`) sizes a run before anything loads.

    Attributes:
        input_shape: one sample's input, e.g. (1, 28, 28), or (T,) token ids.
        num_classes: C (labels), or the vocabulary predicted over (sequence targets).
        samples: N of a fixed pool (e.g. the files' examples), or None when the set is sized
            by its clients: then ``samples_per_client`` x K.
        samples_per_client: E[n_k], the mean client size of a set drawn per client.
        vocab_size: V for token inputs (int64 ids), None for float32 features.
        target_shape: () one label a sample, (T,) sequence targets.
        copies: float32 copies of the inputs the loader holds at its peak (e.g. 1.25 for a
            float32 pool converted from uint8 images, 2 for a pool standardised into a copy).
        key: the config key a budget refusal names: ``"data.dataset"`` for a set its files
            bound, ``"data.num_clients"`` for one generated per client (its N, an expectation,
            grows with K).
    """

    input_shape: tuple[int, ...]
    num_classes: int
    samples: int | None = None
    samples_per_client: float | None = None
    vocab_size: int | None = None
    target_shape: tuple[int, ...] = ()
    copies: float = 1.0
    key: str = "data.dataset"

    def num_samples(self, num_clients: int) -> float:
        """N for K clients."""
        return float(self.samples if self.samples is not None
                     else num_clients * (self.samples_per_client or 0.0))

    def sample_bytes(self) -> float:
        """Bytes a sample holds: its inputs (int64 ids or float32 features) and targets."""
        x = math.prod(self.input_shape) * (8.0 if self.vocab_size else 4.0 * self.copies)
        return x + 8.0 * math.prod(self.target_shape)


@dataclass(frozen=True)
class ClientSource:
    """A data set's clients, each drawn on demand: what a lazy data set's ``lazy=`` factory
    returns (``(*, seed, data_root, num_clients, **params) -> ClientSource``, called like its
    loader). Client k's samples must equal rows ``sum(sizes[:k]) : sum(sizes[:k+1])`` of the
    pool its eager loader returns (the ``natural`` partition), bit for bit.

    Attributes:
        sizes: (K,) int64 samples per client n_k (>= 0).
        num_classes: C >= 2 (labels are int64 in 0..C-1).
        input_shape: one sample's shape, e.g. (60,).
        fill: ``fill(k, x, y)`` writes client k's samples into x (n_k, *input_shape) of
            ``x_dtype`` and y (n_k, *target_shape) int64 (views of a larger buffer allowed).
        x_dtype: float32 features, or int64 token ids (then ``vocab_size`` is set).
        target_shape: () for one label a sample, (T,) for sequence targets.
        vocab_size: V for token inputs, else None.
        fill_many: optional ``fill_many(ids, device) -> (x, y, ptr)``: the clients ``ids``
            ((m,) int64) drawn at once as torch tensors on ``device``, x (n, *input_shape) and
            y (n, *target_shape) int64, client j's rows at ``ptr[j]:ptr[j+1]`` ((m+1,) int64
            numpy), each client's rows what ``fill`` writes (on a CPU bit for bit; the source
            says how close on another device). None: the population fills client by client.
        split_orders: optional ``split_orders(ids, device)``: the (sum n_k,) int64 tensor of
            each client's train/test order (a permutation of range(n_k), one after another),
            replacing ``default_rng([seed, k, SPLIT_TAG])``; the eager split must use the same
            (Synthetic's counter generator, :mod:`mpifl.data.synthetic`). None: the default.
    """

    sizes: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    fill: Callable[[int, np.ndarray, np.ndarray], None]
    x_dtype: type[np.generic] = np.float32
    target_shape: tuple[int, ...] = ()
    vocab_size: int | None = None
    fill_many: Callable[[np.ndarray, torch.device], tuple[torch.Tensor, torch.Tensor,
                                                          np.ndarray]] | None = None
    split_orders: Callable[[np.ndarray, torch.device], torch.Tensor] | None = None


@dataclass
class Partitioned:
    """What a partition returns when it does more than cut the pool.

    Attributes:
        parts: K int64 index arrays into ``pool`` (or into the pool it was given).
        pool: a new pool the parts index, built from the given one (a subset, re-normalised,
            relabelled); None: the given pool.
        fractions: the clients' ``(train, test)`` split fractions (the rest is held out),
            replacing ``(train_fraction,)``; None: ``data.train_fraction``.
    """

    parts: list[np.ndarray]
    pool: DataPool | None = None
    fractions: tuple[float, ...] | None = None


def _check_callable(name: str, fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"{name!r} must be a function, got {fn!r}")
    declared = getattr(fn, "Params", None)
    if declared is not None and not (isinstance(declared, type) and issubclass(declared, Params)):
        raise TypeError(f"{name!r}: its Params must subclass mpifl.core.params.Params")


#: Data set loaders by name: mpifl's own (:mod:`mpifl.data.builtin`) and plugins.
DATASET_LOADERS: Registry[Callable[..., Any]] = Registry("data set", _check_callable)
#: Partitions by name: mpifl's own (:mod:`mpifl.data.builtin`) and plugins.
PARTITIONERS: Registry[Callable[..., Any]] = Registry("partition", _check_callable)


def _tags(tags: Iterable[str], what: str) -> frozenset[str]:
    out = frozenset(tags)
    if not out <= set(TAGS):
        raise ValueError(f"{what}: unknown tags {sorted(out - set(TAGS))}; known: {TAGS}")
    return out


def register_dataset(name: str, *, params: type[Params] | None = None,
                     provides: Iterable[str] | None = None,
                     lazy: Callable[..., ClientSource] | None = None,
                     shape: DataShape | None = None) -> Callable[[F], F]:
    """Decorator: register a data set loader as ``data.dataset = "<name>"``.

    Args:
        params: its ``Params`` (the ``[data.params]`` table); None: the table's keys are passed
            through unchecked.
        provides: the :data:`TAGS` its pool has, checked against a partition's needs before
            anything is loaded; None: known only once loaded (from the pool).
        lazy: the factory of its :class:`ClientSource` (same keywords as the loader, with
            ``num_clients``) if its clients can be drawn one at a time; such a data set must
            provide :data:`CLIENTS` (its lazy population is its own clients' split).
        shape: its sizes (:class:`DataShape`), read by the memory budget before loading;
            None: unknown until loaded (the budget counts its data as 0).

    Raises:
        ValueError: the name is taken by another loader, empty, or contains ':'; unknown tags.
        TypeError: ``params`` is not a :class:`mpifl.core.params.Params` subclass.
    """
    declared = None if provides is None else _tags(provides, f"data set {name!r}")
    if lazy is not None and (not callable(lazy) or CLIENTS not in (declared or ())):
        raise ValueError(f"data set {name!r}: lazy= must be a function and the data set must "
                         f"declare provides=({CLIENTS!r}, ...)")

    return _declaring(DATASET_LOADERS, name, {"Params": params, "provides": declared,
                                              "lazy": lazy, "shape": shape})


def register_partition(name: str, *, params: type[Params] | None = None,
                       needs: Iterable[str] = ()) -> Callable[[F], F]:
    """Decorator: register a partition as ``data.partition = "<name>"``.

    Args:
        params: its ``Params`` (the ``[data.partition_params]`` table); None: the table's keys
            are passed through unchecked.
        needs: the :data:`TAGS` a data set must provide for it (e.g. :data:`LABELS` for a
            split by class label).

    Raises:
        ValueError: the name is taken by another partition, empty, or contains ':'; unknown tags.
        TypeError: ``params`` is not a :class:`mpifl.core.params.Params` subclass.
    """
    wanted = _tags(needs, f"partition {name!r}")

    return _declaring(PARTITIONERS, name, {"Params": params, "needs": wanted})


def _declaring(registry: Registry[Any], name: str, declarations: dict[str, Any]
               ) -> Callable[[F], F]:
    """The decorator that registers a function as ``name`` carrying its ``declarations`` (the
    non-None ones, as attributes read back by params_class, data_shape and compat)."""

    def deco(fn: F) -> F:
        for attr, value in declarations.items():
            if value is not None:
                setattr(fn, attr, value)
        registry.register(name)(fn)
        return fn

    return deco


def params_class(entry: object) -> type[Params] | None:
    """The ``Params`` an entry declares, or None."""
    return getattr(entry, "Params", None)


def data_shape(entry: object) -> DataShape | None:
    """The :class:`DataShape` a data set declares (``shape=``), or None."""
    return getattr(entry, "shape", None)


def lazy_factory(entry: object) -> Callable[..., ClientSource] | None:
    """The :class:`ClientSource` factory a data set declares (``lazy=``), or None."""
    return getattr(entry, "lazy", None)


def call_partition(name: str, pool: DataPool, num_clients: int, rng: np.random.Generator,
                   params: dict[str, Any] | None = None) -> Partitioned:
    """Run partition ``name`` on ``pool`` with the context its signature names plus ``params``
    (already validated by its Params, if it has one).

    Raises:
        DataError: unknown partition, parameters it does not take, or a result that is not
            K integer index arrays into its pool.
    """
    try:
        fn = PARTITIONERS.get(name)
    except LookupError as exc:
        raise DataError(f"data.partition: {exc}") from None
    sig = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
    context = dict(num_classes=pool.num_classes, sensitive=pool.sensitive, pool=pool)
    kwargs = {k: v for k, v in context.items() if takes_all or k in sig}
    try:
        out = fn(pool.y, num_clients, rng, **kwargs, **(params or {}))
    except TypeError as exc:
        if params_class(fn) is not None:  # validated keywords: a bug, not a user's mistake
            raise
        raise DataError(f"partition '{name}': {exc}") from None
    if not isinstance(out, Partitioned):
        try:
            out = Partitioned(list(out))
        except TypeError:
            raise DataError(f"partition '{name}' must return K index arrays or a Partitioned, "
                            f"got {type(out).__name__}") from None
    result = out
    n = len((result.pool or pool).y)
    if len(result.parts) != num_clients:
        raise DataError(f"partition '{name}' returned {len(result.parts)} clients, expected "
                        f"{num_clients}")
    parts = [np.asarray(p) for p in result.parts]
    for p in parts:
        if p.ndim != 1 or p.dtype.kind not in "iu" or (p.size and (p.min() < 0 or p.max() >= n)):
            raise DataError(f"partition '{name}' must return 1-D integer index arrays into the "
                            f"{n} samples")
    return replace(result, parts=[p.astype(np.int64) for p in parts])
