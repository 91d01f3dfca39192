"""The federated benchmarks in the formats as published, registered as mpifl data sets, each
split by its own clients (``data.partition = "natural"``; K = ``data.num_clients`` takes the
first K clients in the files' order, see each reader):

================== ===================== =========================================== ==========
name               reader                pool (per client k)                         lazy
================== ===================== =========================================== ==========
leaf_femnist       :mod:`.leaf`          x (n, 1, 28, 28) float32, y 62 classes      no
leaf_shakespeare   :mod:`.leaf`          x (n, 80) int64 (81 ids), y next char (81)  no
leaf_sent140       :mod:`.leaf`          x (n, 25) int64 word ids, y 0/1             no
leaf_synthetic     :mod:`.leaf`          x (n, 60) float32, y C classes (from data)  no
tff_emnist         :mod:`.tff`           x (n, 1, 28, 28) float32, y 62 classes      yes
tff_shakespeare    :mod:`.tff`           x, y (n, 80) int64 (90 ids), next chars     yes
tff_stackoverflow  :mod:`.tff`           x, y (n, 20) int64 (10,004 ids), next words yes
tff_cifar100       :mod:`.tff`           x (n, 3, 32, 32) float32, y 100 (or 20)     yes
flair              :mod:`.flair`         x (n, 3, 256, 256) float32, y (n, 17) multi no
================== ===================== =========================================== ==========

Folders under a data root (:data:`FILES`, :mod:`mpifl.data.roots`): ``leaf/data/<set>/data``
(LEAF's own output, a clone of LEAF in the root), ``tff/`` (TFF's tarballs extracted),
``flair/`` (``flair_federated.hdf5``). A lazy set's eager pool is its lazy clients drawn in order (the
same ``fill``), so they are equal bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from mpifl.core.params import Params
from mpifl.data import flair as F
from mpifl.data import leaf as L
from mpifl.data import tff as T
from mpifl.data.bounds import check_memory
from mpifl.data.registry import (CLIENTS, LABELS, ClientSource, DataPool, DataShape, NoParams,
                                 register_dataset)
from mpifl.data.roots import DatasetLayout, find_dataset_dir, register_files

__all__ = ["FlairParams", "LeafSent140Params", "LeafSyntheticParams", "PUBLISHED",
           "TffCifar100Params", "TffStackOverflowParams", "drawn_pool"]

INT32_MAX = 2**31 - 1
#: Sizes for the memory budget (mean samples a client: LEAF, Caldas et al. 2018, Table 1;
#: TFF's dataset documentation; Song et al., FLAIR, 2022), at the default parameters.
SHAPES = {
    "leaf_femnist": DataShape((1, 28, 28), 62, samples_per_client=805_263 / 3_550),
    "leaf_shakespeare": DataShape((80,), 81, samples_per_client=4_226_158 / 1_129,
                                  vocab_size=81),
    "leaf_sent140": DataShape((25,), 2, samples_per_client=1_600_498 / 660_120,
                              vocab_size=10_002),
    "leaf_synthetic": DataShape((60,), 5, samples_per_client=107_553 / 1_000),
    "tff_emnist": DataShape((1, 28, 28), 62, samples_per_client=(671_585 + 77_483) / 3_400),
    # ~4.2 M characters in rows of 81 over 715 roles
    "tff_shakespeare": DataShape((80,), 90, samples_per_client=73.0, vocab_size=90,
                                 target_shape=(80,)),
    "tff_stackoverflow": DataShape((20,), 10_004, samples_per_client=(135_818_730 + 16_586_035)
                                   / 342_477, vocab_size=10_004, target_shape=(20,)),
    "tff_cifar100": DataShape((3, 32, 32), 100, samples_per_client=100.0),
    "flair": DataShape((3, 256, 256), 17, samples_per_client=429_078 / 51_414,
                       target_shape=(17,)),
}
PUBLISHED = ("leaf_femnist", "leaf_shakespeare", "leaf_sent140", "leaf_synthetic", "tff_emnist",
             "tff_shakespeare", "tff_stackoverflow", "tff_cifar100", "flair")

_LEAF_URL = "https://github.com/TalwalkarLab/leaf"
_TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"


def _leaf(name: str) -> DatasetLayout:
    """LEAF's own output folder ``leaf/data/<name>/data`` (a clone of LEAF in the data root)."""
    return DatasetLayout(
        f"leaf/data/{name}/data", (), alternatives=(("all_data/*.json",),
                                                    ("train/*.json", "test/*.json")),
        source=f"clone {_LEAF_URL} into the data root and run its ./preprocess.sh in "
               f"leaf/data/{name} (all_data/ is enough)")


def _tff(files: tuple[str, ...], tarballs: str) -> DatasetLayout:
    """The h5 files of TFF's tarballs, extracted into ``tff/``."""
    return DatasetLayout("tff", files, source=f"download {tarballs} from {_TFF_URL} and "
                                              f"extract them there (tar -xjf)")


#: Their folders and files under a data root (:func:`mpifl.data.roots.find_dataset_dir`).
FILES = {
    "leaf_femnist": _leaf("femnist"),
    "leaf_shakespeare": _leaf("shakespeare"),
    "leaf_sent140": _leaf("sent140"),
    "leaf_synthetic": _leaf("synthetic"),
    "tff_emnist": _tff(("fed_emnist_train.h5", "fed_emnist_test.h5"), "fed_emnist.tar.bz2"),
    "tff_shakespeare": _tff(("shakespeare_train.h5", "shakespeare_test.h5"),
                            "shakespeare.tar.bz2"),
    "tff_stackoverflow": _tff(("stackoverflow_train.h5", "stackoverflow_test.h5"),
                              "stackoverflow.tar.bz2 (and stackoverflow.word_count.tar.bz2 for "
                              "TFF's vocabulary)"),
    "tff_cifar100": _tff(("fed_cifar100_train.h5", "fed_cifar100_test.h5"),
                         "fed_cifar100.tar.bz2"),
    "flair": DatasetLayout(
        "flair", ("flair_federated.hdf5",),
        source="make it with apple/pfl-research's `python -m dataset.flair.download_preprocess "
               "--output_file flair_federated.hdf5` (benchmarks/dataset/flair)"),
}
for _name in PUBLISHED:
    register_files(_name, FILES[_name])


def drawn_pool(source: ClientSource, y_dtype: type[np.generic] = np.int64,
               target_shape: tuple[int, ...] | None = None, name: str = "") -> DataPool:
    """Every client of ``source`` filled in order into one pool (``client_sizes`` set).

    Raises:
        DataError: the pool would not fit in memory (:func:`mpifl.data.bounds.memory_bound`;
            the sizes come from the files, the memory budget knew only the published means).
    """
    sizes = np.asarray(source.sizes, dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    row = (np.prod(source.input_shape, dtype=np.float64) * np.dtype(source.x_dtype).itemsize
           + np.prod(target_shape or source.target_shape, dtype=np.float64)
           * np.dtype(y_dtype).itemsize)
    check_memory(float(ptr[-1]) * row, f"data set '{name}': the {int(ptr[-1]):,} samples of its "
                                       f"{len(sizes):,} clients",
                 "use fewer clients (data.num_clients) or, where the set has it, data.lazy = "
                 "true (a few clients held at a time)")
    x = np.empty((int(ptr[-1]), *source.input_shape), dtype=source.x_dtype)
    y = np.empty((int(ptr[-1]), *(target_shape or source.target_shape)), dtype=y_dtype)
    for k in range(len(sizes)):
        source.fill(k, x[ptr[k]:ptr[k + 1]], y[ptr[k]:ptr[k + 1]])
    return DataPool(x, y, source.num_classes, client_sizes=sizes, vocab_size=source.vocab_size)


# --------------------------------------------------------------------------- LEAF

@register_dataset("leaf_femnist", params=NoParams, provides=(LABELS, CLIENTS),
                  shape=SHAPES["leaf_femnist"])
def leaf_femnist(*, seed: int, data_root: str | None = None, num_clients: int) -> DataPool:
    """LEAF FEMNIST's first K writers (:func:`mpifl.data.leaf.read_femnist`)."""
    x, y, sizes = L.read_femnist(find_dataset_dir("leaf_femnist", data_root), num_clients)
    return DataPool(x, y, L.FEMNIST_CLASSES, client_sizes=sizes)


@register_dataset("leaf_shakespeare", params=NoParams, provides=(LABELS, CLIENTS),
                  shape=SHAPES["leaf_shakespeare"])
def leaf_shakespeare(*, seed: int, data_root: str | None = None, num_clients: int) -> DataPool:
    """LEAF Shakespeare's first K roles (:func:`mpifl.data.leaf.read_shakespeare`)."""
    x, y, sizes = L.read_shakespeare(find_dataset_dir("leaf_shakespeare", data_root),
                                     num_clients)
    ids = len(L.ALL_LETTERS) + 1
    return DataPool(x, y, ids, client_sizes=sizes, vocab_size=ids)


class LeafSent140Params(Params):
    """``leaf_sent140``: the word vocabulary and the tweet length."""

    vocab_size: int = Field(10_000, ge=1, le=INT32_MAX)
    """V, the whole set's most frequent words kept (every file is counted, so the vocabulary
    does not depend on K): ids 2..V+1, 1 out of vocabulary, 0 PAD; fewer ids when the data have
    fewer distinct words."""
    max_length: int = Field(25, ge=1, le=4096)
    """Words a tweet keeps (split on whitespace, the rest cut), padded with PAD (0) to this
    length: x is (n, max_length) int64."""


@register_dataset("leaf_sent140", params=LeafSent140Params, provides=(LABELS, CLIENTS),
                  shape=SHAPES["leaf_sent140"])
def leaf_sent140(*, seed: int, data_root: str | None = None, num_clients: int,
                 vocab_size: int, max_length: int) -> DataPool:
    """LEAF Sent140's first K users (:func:`mpifl.data.leaf.read_sent140`)."""
    x, y, sizes, ids = L.read_sent140(find_dataset_dir("leaf_sent140", data_root), num_clients,
                                      vocab_size, max_length)
    return DataPool(x, y, 2, client_sizes=sizes, vocab_size=ids)


class LeafSyntheticParams(Params):
    """``leaf_synthetic``: its number of classes."""

    num_classes: int | None = Field(None, ge=2, le=INT32_MAX)
    """C, the number of classes (LEAF's generator's --num-classes): labels must lie in
    0..C-1 and only the files that the K clients need are read. Not set: the largest label in
    the whole set + 1 (every file is read)."""


@register_dataset("leaf_synthetic", params=LeafSyntheticParams, provides=(LABELS, CLIENTS),
                  shape=SHAPES["leaf_synthetic"])
def leaf_synthetic(*, seed: int, data_root: str | None = None, num_clients: int,
                   num_classes: int | None) -> DataPool:
    """LEAF Synthetic's first K tasks (:func:`mpifl.data.leaf.read_synthetic`)."""
    x, y, sizes, classes = L.read_synthetic(find_dataset_dir("leaf_synthetic", data_root),
                                            num_clients, num_classes)
    return DataPool(x, y, classes, client_sizes=sizes)


# --------------------------------------------------------------------------- TFF

def _tff_folder(name: str, data_root: str | None) -> Path:
    folder = find_dataset_dir(name, data_root)
    T.verify_tarballs(name, folder)
    return folder


#: what the readers of :mod:`mpifl.data.tff` return: the index, the clients, their sizes,
#: ``convert``; StackOverflow's also its id count
_Built = tuple[T.ClientIndex, T.Clients, np.ndarray, T.Convert]


def _source(built: _Built | tuple[T.ClientIndex, T.Clients, np.ndarray, T.Convert, int],
            num_classes: int, input_shape: tuple[int, ...], **kw: Any) -> ClientSource:
    index, clients, sizes, convert = built[:4]
    return ClientSource(sizes, num_classes, input_shape, T.H5Source(index, clients, convert).fill,
                        **kw)


def _eager(lazy: Callable[..., ClientSource], name: str) -> Callable[..., DataPool]:
    """The eager loader of a lazy set: its clients drawn in order (equal bit for bit)."""
    @functools.wraps(lazy)  # its signature too (load_federated passes num_clients by it)
    def load(**kwargs: Any) -> DataPool:
        return drawn_pool(lazy(**kwargs), name=name)
    load.__doc__ = f"Every client of :func:`{lazy.__name__}` in one pool."
    return load


def tff_emnist_clients(*, seed: int, data_root: str | None = None,
                       num_clients: int) -> ClientSource:
    """TFF Federated EMNIST's first K writers (:func:`mpifl.data.tff.emnist`)."""
    built = T.emnist(_tff_folder("tff_emnist", data_root), num_clients)
    return _source(built, 62, (1, 28, 28))


def tff_shakespeare_clients(*, seed: int, data_root: str | None = None,
                            num_clients: int) -> ClientSource:
    """TFF Shakespeare's first K roles (:func:`mpifl.data.tff.shakespeare`)."""
    built = T.shakespeare(_tff_folder("tff_shakespeare", data_root), num_clients)
    t = T.SHAKESPEARE_SEQUENCE_LENGTH
    return _source(built, T.CHAR_IDS, (t,), x_dtype=np.int64, target_shape=(t,),
                   vocab_size=T.CHAR_IDS)


class TffStackOverflowParams(Params):
    """``tff_stackoverflow``: vocabulary, sentence length, sentences a user."""

    vocab_size: int = Field(10_000, ge=1, le=INT32_MAX)
    """V, the words kept: the first V of stackoverflow.word_count (TFF's file, most frequent
    first) when present, else the most frequent of the chosen users' sentences; ids 1..V
    words, V+1 out of vocabulary, V+2 BOS, V+3 EOS, 0 PAD (TFF's baseline, Reddi et al. 2021:
    10,000)."""
    sequence_length: int = Field(20, ge=1, le=4096)
    """T, words a sentence keeps: a row is BOS, its first T words, EOS if fewer, PAD after
    (TFF's build_to_ids_fn); x its first T tokens, y the next token at each position (TFF's
    baseline: 20)."""
    max_client_samples: int | None = Field(None, ge=2, le=INT32_MAX)
    """A user's first sentences kept (its train rows first); not set: all of them
    (pfl-research's benchmark: 64)."""


def tff_stackoverflow_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                              vocab_size: int, sequence_length: int,
                              max_client_samples: int | None) -> ClientSource:
    """TFF StackOverflow's first K users (:func:`mpifl.data.tff.stackoverflow`)."""
    built = T.stackoverflow(_tff_folder("tff_stackoverflow", data_root), num_clients, vocab_size,
                            sequence_length, max_client_samples)
    ids = built[4]
    return _source(built, ids, (sequence_length,), x_dtype=np.int64,
                   target_shape=(sequence_length,), vocab_size=ids)


class TffCifar100Params(Params):
    """``tff_cifar100``: labels and normalisation."""

    label: Literal["fine", "coarse"] = "fine"
    """``"fine"``: the 100 CIFAR-100 classes; ``"coarse"``: the 20 superclasses (the file's
    coarse_label)."""
    normalise: Literal["scale", "per_image"] = "scale"
    """``"scale"``: pixels / 255, in [0, 1]; ``"per_image"``: each image (of pixels / 255) to
    mean 0 and standard deviation 1 (TF's per_image_standardization: the std at least
    1/sqrt(3072))."""


def tff_cifar100_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                         label: str, normalise: str) -> ClientSource:
    """TFF FedCIFAR100's first K clients (500 train, then 100 test; :func:`mpifl.data.tff.
    cifar100`)."""
    built = T.cifar100(_tff_folder("tff_cifar100", data_root), num_clients, label, normalise)
    return _source(built, 100 if label == "fine" else 20, (3, 32, 32))


for _name, _lazy, _params, _tags in (
        ("tff_emnist", tff_emnist_clients, NoParams, (LABELS, CLIENTS)),
        ("tff_shakespeare", tff_shakespeare_clients, NoParams, (CLIENTS,)),
        ("tff_stackoverflow", tff_stackoverflow_clients, TffStackOverflowParams, (CLIENTS,)),
        ("tff_cifar100", tff_cifar100_clients, TffCifar100Params, (LABELS, CLIENTS))):
    _load = _eager(_lazy, _name)
    _load.__name__ = _load.__qualname__ = _name
    register_dataset(_name, params=_params, provides=_tags, lazy=_lazy,
                     shape=SHAPES[_name])(_load)


# --------------------------------------------------------------------------- FLAIR

FlairPartition = Literal["train", "val", "test"]
FLAIR_PARTITIONS: tuple[FlairPartition, ...] = ("train", "val", "test")


class FlairParams(Params):
    """``flair``: partitions read and label taxonomy."""

    partitions: list[FlairPartition] = Field(default_factory=lambda: list(FLAIR_PARTITIONS),
                                             min_length=1)
    """The file's partitions ("train", "val", "test": disjoint users) whose users are the
    clients, in this order; the clients are the first K users with at least 2 images."""
    fine_grained: bool = False
    """FLAIR's label taxonomy (Song et al., NeurIPS 2022): false, the 17 coarse labels; true,
    the 1,628 fine-grained ones. The targets are (n, C) float32 multi-hot either way."""


@register_dataset("flair", params=FlairParams, provides=(CLIENTS,),
                  shape=SHAPES["flair"])
def flair(*, seed: int, data_root: str | None = None, num_clients: int,
          partitions: list[str], fine_grained: bool) -> DataPool:
    """FLAIR's first K users (:func:`mpifl.data.flair.flair`): float32 multi-hot targets (n, C),
    trained with ``loss = "multilabel_bce"``; eager only (a lazy population's targets are
    int64 today)."""
    index, clients, sizes, convert, shape, classes = F.flair(
        find_dataset_dir("flair", data_root), num_clients, partitions, fine_grained)
    source = ClientSource(sizes, classes, shape, T.H5Source(index, clients, convert).fill)
    return drawn_pool(source, np.float32, (classes,), name="flair")
