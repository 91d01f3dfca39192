"""Readers of TensorFlow Federated's h5 files (``tff.simulation.datasets``, the files its
``load_data`` downloads from https://storage.googleapis.com/tff-datasets-public/ and extracts):
Federated EMNIST, Shakespeare, StackOverflow and FedCIFAR100, one client per writer / role /
user, each drawn on demand (a :class:`mpifl.data.registry.ClientSource` that opens the files and
reads one client's group when asked; sizes from the h5 dataset shapes).

Layout: ``examples/<client_id>/<feature>``, one row per example. Features: EMNIST ``pixels``
(n, 28, 28) float32 in [0, 1] (1.0 the background) and ``label`` (n,) int in 0..61; CIFAR-100
``image`` (n, 32, 32, 3) uint8, ``label`` (fine, 0..99) and ``coarse_label`` (0..19);
Shakespeare ``snippets`` (n,) byte strings; StackOverflow ``tokens`` (n,) byte strings of
space-separated words (and ``title``, ``tags``, ... unused).

Clients: the train file's clients in the order h5py lists them (by name, as HDF5 stores group
members), then the test file's clients not in it. EMNIST, Shakespeare and StackOverflow hold a
client's train and test examples under one id in the two files: its samples are its train rows
then its test rows (mpifl splits each client itself, ``data.train_fraction``). FedCIFAR100's
test file holds 100 other clients (ids "0".."99" again): they are clients 500..599. Clients with
fewer than 2 samples are skipped; K clients are the first K left.

Preprocessing (TFF's baselines, ``tff.simulation.baselines``; Reddi et al., "Adaptive Federated
Optimization", ICLR 2021):

- Shakespeare: each snippet's bytes map to :data:`CHAR_VOCAB` ids 1..86 (0 PAD, 87 out of
  vocabulary, 88 begin, 89 end: 90 ids), ``[BOS] chars [EOS]`` padded with PAD to a multiple of
  81 and cut into rows of 81; x = row[:80], y = row[1:] (``char_prediction_preprocessing``).
- StackOverflow: the first ``sequence_length`` (20) words of ``tokens`` split on ' ', words
  1..V in the vocabulary's order, V+1 out of vocabulary, V+2 begin, V+3 end (V+4 ids); the row
  ``[BOS] words [EOS if fewer than 20 words]`` padded with PAD to 21; x = row[:20], y = row[1:]
  (``word_prediction_preprocessing``). Vocabulary: the first V words of TFF's
  ``stackoverflow.word_count`` (most frequent first) when the folder holds it, else the V most
  frequent words of the K clients loaded (ties: byte order).
- EMNIST: x (n, 1, 28, 28) as stored. CIFAR-100: x (n, 3, 32, 32) = image / 255, or each image
  standardised to mean 0 and std 1 (``tf.image.per_image_standardization``) with
  ``normalise = "per_image"``; the random crops of the baselines are not applied.

Checksums: TFF publishes the SHA-256 of the tarballs (:data:`TARBALLS`), not of the h5 files in
them. When a tarball lies in the folder (``tf.keras.utils.get_file`` keeps it next to the files
it extracts) it is verified once per process; the h5 files are checked for their layout only:
every feature's dtype class, rank and row shape (:func:`dataset`), the features of one example
of equal row counts, EMNIST pixels finite, and the sizes the files declare against memory
(:mod:`mpifl.data.bounds`) before they are read; one-line :class:`DataError` naming the file
and the client.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from mpifl.core.errors import DataError
from mpifl.data.bounds import check_memory
from mpifl.data.registry import PAD

__all__ = ["CHAR_VOCAB", "KINDS", "SO_SEQUENCE_LENGTH", "TARBALLS", "ClientIndex", "H5Part",
           "H5Source", "char_rows", "cifar100", "dataset", "declared_bytes", "emnist", "feature",
           "finite", "open_h5", "rows_of", "shakespeare", "shakespeare_chunks", "stackoverflow",
           "stackoverflow_vocabulary", "verify_tarballs", "where", "word_rows", "write_rows"]

#: TFF's Shakespeare characters (``char_prediction_preprocessing.CHAR_VOCAB``), ids 1..86.
CHAR_VOCAB = ('dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]!%)'
              '-159\r')
CHAR_OOV, CHAR_BOS, CHAR_EOS = len(CHAR_VOCAB) + 1, len(CHAR_VOCAB) + 2, len(CHAR_VOCAB) + 3
CHAR_IDS = len(CHAR_VOCAB) + 4
SHAKESPEARE_SEQUENCE_LENGTH = 80
SO_SEQUENCE_LENGTH = 20
_BYTE_TABLE = np.full(256, CHAR_OOV, dtype=np.int64)
_BYTE_TABLE[[ord(c) for c in CHAR_VOCAB]] = np.arange(1, len(CHAR_VOCAB) + 1)

#: data set -> (tarball, its SHA-256 as TFF's ``load_data`` pins it)
TARBALLS: dict[str, tuple[tuple[str, str], ...]] = {
    "tff_emnist": (("fed_emnist.tar.bz2",
                    "fe1ed5a502cea3a952eb105920bff8cffb32836b5173cb18a57a32c3606f3ea0"),),
    "tff_shakespeare": (("shakespeare.tar.bz2",
                         "0285be9906cb5f268092eee4edeeacfc2af4574f2941f7cc2f08a321d7f5c707"),),
    "tff_stackoverflow": (
        ("stackoverflow.tar.bz2",
         "99eca2f8b8327a09e5fc123979df2d237acbc5e52322f6d86bf523ee47b961a2"),
        ("stackoverflow.word_count.tar.bz2",
         "1dc00256d6e527c54b9756d968118378ae14e6692c0b3b6cad470cdd3f0c519c")),
    "tff_cifar100": (("fed_cifar100.tar.bz2",
                      "e8575e22c038ecef1ce6c7d492d7abee7da13b1e1ba9b70a7fc18531ba7590de"),),
}
_VERIFIED: set[tuple[str, int, int]] = set()


def verify_tarballs(name: str, folder: Path) -> None:
    """SHA-256 of the tarballs of ``name`` present in ``folder`` (absent ones are skipped),
    each file hashed once per process (keyed by path, size and modification time).

    Raises:
        DataError: a tarball whose digest differs from the published one.
    """
    for fname, digest in TARBALLS.get(name, ()):
        path = folder / fname
        if not path.is_file():
            continue
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in _VERIFIED:
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != digest:
            raise DataError(f"{path}: sha256 {h.hexdigest()}, TFF publishes {digest}; the file "
                            f"is damaged or not TFF's: download it again")
        _VERIFIED.add(key)


# --------------------------------------------------------------------------- h5 clients

@dataclass(frozen=True)
class H5Part:
    """One h5 file's group of clients: ``path`` and the group holding one subgroup a client
    (``"examples"`` in TFF's files, the partition name in FLAIR's)."""

    path: Path
    group: str


@contextmanager
def open_h5(path: Path) -> Iterator[h5py.File]:
    """``path`` opened read-only; DataError (one line) when it is not a readable HDF5 file."""
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"cannot read {path}: not a readable HDF5 file ({exc}); replace it with "
                        f"the published file") from None
    with f:
        yield f


def _group(f: h5py.File, part: H5Part) -> h5py.Group:
    g = f.get(part.group)
    if not isinstance(g, h5py.Group):
        raise DataError(f"{part.path} has no group '/{part.group}' of clients: not the published "
                        f"layout")
    return g


class ClientIndex:
    """The clients of some :class:`H5Part` s: each a list of ``(part, key)`` in part order.

    Args:
        parts: the files' client groups, in order (train first).
        pooled: one client per id over all parts (its rows part after part); False: every
            part's clients are distinct clients, part after part.
    """

    def __init__(self, parts: Sequence[H5Part], pooled: bool) -> None:
        self.parts = tuple(parts)
        order: dict[object, list[tuple[int, str]]] = {}
        for i, part in enumerate(self.parts):
            with open_h5(part.path) as f:
                for key in _group(f, part).keys():
                    order.setdefault(key if pooled else (i, key), []).append((i, key))
        self.clients = list(order.values())

    @contextmanager
    def opened(self) -> Iterator[list[h5py.Group]]:
        """Every part's client group, the files open."""
        with ExitStack() as stack:
            yield [_group(stack.enter_context(open_h5(p.path)), p) for p in self.parts]

    def groups(self, roots: list[h5py.Group], client: list[tuple[int, str]]
               ) -> list[h5py.Group]:
        """The h5 groups of one client (train first)."""
        out = []
        for i, key in client:
            g = roots[i].get(key)
            if not isinstance(g, h5py.Group):
                raise DataError(f"{self.parts[i].path}: '/{self.parts[i].group}/{key}' is not a "
                                f"group of features")
            out.append(g)
        return out

    def select(self, name: str, num_clients: int, size: Callable[[list[h5py.Group]], int],
               cap: int | None = None, row_bytes: float = 0.0
               ) -> tuple[list[list[tuple[int, str]]], np.ndarray]:
        """The first ``num_clients`` clients of at least 2 samples and their (K,) int64 sizes
        (``size`` of their groups, at most ``cap``), reading only their shapes.

        Args:
            row_bytes: bytes one sample takes once converted (its x and y rows): a client's
                ``n * row_bytes`` is checked against :func:`mpifl.data.bounds.memory_bound`.
        Raises:
            DataError: fewer such clients than asked for; a client whose samples would not fit
                in memory (naming its file and id).
        """
        picked: list[list[tuple[int, str]]] = []
        sizes: list[int] = []
        with self.opened() as roots:
            for client in self.clients:
                if len(picked) == num_clients:
                    break
                groups = self.groups(roots, client)
                n = size(groups)
                n = n if cap is None else min(n, cap)
                if n >= 2 and row_bytes:
                    check_memory(n * row_bytes, f"{where(groups[0])}: its {n:,} samples")
                if n >= 2:
                    picked.append(client)
                    sizes.append(n)
        if len(picked) < num_clients:
            raise DataError(f"data set '{name}' has {len(picked)} clients with at least 2 "
                            f"samples, data.num_clients is {num_clients}")
        return picked, np.asarray(sizes, dtype=np.int64)


def where(g: h5py.Group) -> str:
    """``"<file>: client '<id>'"``: a client's group named in a refusal."""
    return f"{g.file.filename}: client {g.name.rsplit('/', 1)[-1]!r}"


#: dtype classes a feature may be asked to have: (its test, its name in a refusal)
KINDS: dict[str, tuple[Callable[[np.dtype], bool], str]] = {
    "float": (lambda t: t.kind == "f", "floats"),
    "integer": (lambda t: t.kind in "iu", "integers"),
    "uint8": (lambda t: t == np.uint8, "uint8"),
    "string": (lambda t: t.kind == "S" or h5py.check_string_dtype(t) is not None, "strings"),
}
#: bytes a variable-length string takes once read (a Python bytes object and its pointer): a
#: floor, its characters come on top
_OBJECT_BYTES = 48


def dataset(g: h5py.Group, key: str, inner: tuple[int, ...] | None = None,
            kind: str | None = None) -> h5py.Dataset:
    """Feature ``key`` of one group, its declared shape and dtype checked, nothing read.

    Args:
        inner: the expected shape of one row (``()``: a 1-D dataset), None for any.
        kind: a key of :data:`KINDS` the dtype must be, None for any.
    Raises:
        DataError: a missing feature, rows of another shape, another dtype (one line naming
            the file and the client).
    """
    d = g.get(key)
    if not isinstance(d, h5py.Dataset) or d.ndim < 1 or (
            inner is not None and tuple(d.shape[1:]) != inner):
        want = "" if inner is None else f" of rows {inner}"
        got = f" (it is {d.shape})" if isinstance(d, h5py.Dataset) else ""
        raise DataError(f"{where(g)}: '{g.name}/{key}' is missing or not a dataset{want}{got}: "
                        f"not the published layout")
    if kind is not None and not KINDS[kind][0](d.dtype):
        raise DataError(f"{where(g)}: '{g.name}/{key}' must hold {KINDS[kind][1]}, not "
                        f"{d.dtype}: not the published layout")
    return d


def declared_bytes(d: h5py.Dataset) -> float:
    """Bytes ``d[()]`` will take, from its shape and dtype (nothing read)."""
    item = _OBJECT_BYTES if d.dtype.kind == "O" else d.dtype.itemsize
    return float(np.prod(d.shape, dtype=np.float64)) * item


def feature(groups: list[h5py.Group], key: str, inner: tuple[int, ...] | None = None,
            kind: str | None = None) -> np.ndarray:
    """Feature ``key`` of a client's groups, concatenated (train first); the declared sizes are
    checked against :func:`mpifl.data.bounds.memory_bound` before anything is read.

    Args:
        inner, kind: the expected row shape and dtype class (:func:`dataset`).
    Raises:
        DataError: a group without the feature, rows of another shape or dtype, more rows
            than memory holds.
    """
    sets = [dataset(g, key, inner, kind) for g in groups]
    rows = sum(int(d.shape[0]) for d in sets)
    inner_shape = f" of {sets[0].shape[1:]}" if sets[0].ndim > 1 else ""
    check_memory(sum(declared_bytes(d) for d in sets),
                 f"{where(groups[0])}: '{key}' of {rows:,} rows{inner_shape}")
    out = [d[()] for d in sets]
    return np.concatenate(out) if len(out) > 1 else out[0]


def rows_of(key: str, *same: str) -> Callable[[list[h5py.Group]], int]:
    """A client's sample count: the rows of feature ``key`` (its shape, nothing read).

    Args:
        same: features that hold one row an example too: each group's must have as many rows
            as its ``key`` (else the examples' rows would be paired wrongly).
    """
    def size(groups: list[h5py.Group]) -> int:
        n = 0
        for g in groups:
            rows = int(dataset(g, key).shape[0])
            for other in same:
                m = int(dataset(g, other).shape[0])
                if m != rows:
                    raise DataError(f"{where(g)}: '{g.name}/{other}' has {m} rows, "
                                    f"'{g.name}/{key}' {rows}: one row an example in each")
            n += rows
        return n
    return size


def as_bytes(values: np.ndarray) -> list[bytes]:
    """h5 strings (variable-length bytes or str, or fixed-length ``S``) as bytes.

    Raises:
        UnicodeEncodeError: a str that is not valid Unicode (a lone surrogate).
    """
    return [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values.reshape(-1)]


# --------------------------------------------------------------------------- text rows

def shakespeare_chunks(snippet: bytes, length: int = SHAKESPEARE_SEQUENCE_LENGTH) -> int:
    """Rows of ``length + 1`` tokens one snippet gives (``[BOS] bytes [EOS]`` padded)."""
    return -(-(len(snippet) + 2) // (length + 1))


def char_rows(snippets: list[bytes], length: int = SHAKESPEARE_SEQUENCE_LENGTH) -> np.ndarray:
    """(n, length + 1) int64 rows of the snippets, as TFF's ``to_tokens_and_pad`` cuts them:
    each snippet ``[BOS] ids [EOS]`` padded with PAD to a multiple of ``length + 1``."""
    out = []
    for s in snippets:
        tokens = np.concatenate([[CHAR_BOS], _BYTE_TABLE[np.frombuffer(s, np.uint8)],
                                 [CHAR_EOS]]).astype(np.int64)
        padded = np.full(shakespeare_chunks(s, length) * (length + 1), PAD, dtype=np.int64)
        padded[:len(tokens)] = tokens
        out.append(padded.reshape(-1, length + 1))
    return np.concatenate(out) if out else np.zeros((0, length + 1), dtype=np.int64)


def _words(sentence: bytes) -> list[bytes]:
    return sentence.split(b" ") if sentence else []


def word_rows(sentences: list[bytes], vocab: dict[bytes, int],
              length: int = SO_SEQUENCE_LENGTH) -> np.ndarray:
    """(n, length + 1) int64 rows as TFF's ``build_to_ids_fn`` makes them: ``[BOS]`` then the
    ids of the first ``length`` words (words 1..V, V+1 out of vocabulary), ``[EOS]`` if fewer
    than ``length`` words, PAD after."""
    v = len(vocab)
    oov, bos, eos = v + 1, v + 2, v + 3
    out = np.full((len(sentences), length + 1), PAD, dtype=np.int64)
    out[:, 0] = bos
    for i, s in enumerate(sentences):
        ids = [vocab.get(w, oov) for w in _words(s)[:length]]
        if len(ids) < length:
            ids.append(eos)
        out[i, 1:1 + len(ids)] = ids
    return out


def stackoverflow_vocabulary(folder: Path, vocab_size: int,
                             sentences: Callable[[], Iterator[list[bytes]]]) -> dict[bytes, int]:
    """Word -> id (1..V): the first ``vocab_size`` words of ``folder/stackoverflow.word_count``
    (TFF's file: ``word count`` lines, most frequent first) when present, else the most frequent
    words of ``sentences()`` (ties: byte order).

    Raises:
        DataError: a word-count file with a line that is not ``word count``.
    """
    path = folder / "stackoverflow.word_count"
    if path.is_file():
        words: list[bytes] = []
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                parts = line.split()
                if len(parts) != 2 or not parts[1].isdigit():
                    raise DataError(f"{path}: line {n} is not 'word count'")
                words.append(parts[0])
                if len(words) == vocab_size:
                    break
    else:
        counts: Counter[bytes] = Counter()
        for batch in sentences():
            for s in batch:
                counts.update(_words(s))
        words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
                 [:vocab_size]]
    return {w: i + 1 for i, w in enumerate(words)}


# --------------------------------------------------------------------------- client sources

Convert = Callable[[list[h5py.Group], np.ndarray, np.ndarray], None]
#: the selected clients, each its ``(part, key)`` groups (:meth:`ClientIndex.select`)
Clients = list[list[tuple[int, str]]]


@dataclass(frozen=True)
class H5Source:
    """Client k's rows on demand: opens the files, reads its groups, ``convert(groups, x, y)``
    writes its first ``len(x)`` samples."""

    index: ClientIndex
    clients: list[list[tuple[int, str]]]
    convert: Convert

    def fill(self, k: int, x: np.ndarray, y: np.ndarray) -> None:
        with self.index.opened() as roots:
            self.convert(self.index.groups(roots, self.clients[k]), x, y)


def _parts(folder: Path, stem: str) -> list[H5Part]:
    return [H5Part(folder / f"{stem}_{split}.h5", "examples") for split in ("train", "test")]


def write_rows(dest: np.ndarray, src: np.ndarray, what: str, groups: list[h5py.Group]) -> None:
    """dest[:] = the first len(dest) rows of src (a client capped to fewer samples)."""
    if len(src) < len(dest):
        raise DataError(f"{groups[0].file.filename}: '{groups[0].name}' has {len(src)} {what}, "
                        f"fewer than when the clients were counted: the file changed")
    dest[:] = src[:len(dest)]


def _labels(groups: list[h5py.Group], key: str, classes: int) -> np.ndarray:
    """(n,) int64 labels of a client's groups, checked to be in 0..classes-1."""
    y = feature(groups, key, (), "integer")
    if y.size and (y.min() < 0 or y.max() >= classes):
        raise DataError(f"{where(groups[0])}: '{groups[0].name}/{key}' must hold integer "
                        f"labels in 0..{classes - 1} (found {y.min()}..{y.max()})")
    return y.astype(np.int64)


def finite(groups: list[h5py.Group], key: str, x: np.ndarray) -> np.ndarray:
    """``x`` (feature ``key`` of a client's groups) when every value is finite."""
    bad = np.flatnonzero(~np.isfinite(x).all(axis=tuple(range(1, x.ndim))))
    if len(bad):
        raise DataError(f"{where(groups[0])}: '{key}' holds NaN or infinite values (row "
                        f"{bad[0]} of {len(x)}, train rows first)")
    return x


#: bytes a sample takes while its client is converted (the rows read, their float32 or int64
#: conversion, the x and y they are written to), for the memory check of a client's samples
_EMNIST_ROW = 2 * (28 * 28 * 4 + 8)
_CIFAR_ROW = 3 * 32 * 32 * (1 + 4 + 4) + 2 * 8


def _token_row(length: int) -> int:
    return (length + 1) * 8 + 2 * length * 8


def emnist(folder: Path, num_clients: int) -> tuple[ClientIndex, Clients, np.ndarray, Convert]:
    """Federated EMNIST (62 classes): x (n, 1, 28, 28) float32, y (n,) int64.

    Raises:
        DataError: (when a client is read) pixels that are not finite floats of rows (28, 28),
            labels outside 0..61, pixels and labels of different row counts.
    """
    index = ClientIndex(_parts(folder, "fed_emnist"), pooled=True)
    clients, sizes = index.select("tff_emnist", num_clients, rows_of("label", "pixels"),
                                  row_bytes=_EMNIST_ROW)

    def convert(groups: list[h5py.Group], x: np.ndarray, y: np.ndarray) -> None:
        with np.errstate(over="ignore"):  # a value beyond float32 becomes inf: refused next
            px = feature(groups, "pixels", (28, 28), "float").astype(np.float32, copy=False)
        write_rows(x[:, 0], finite(groups, "pixels", px), "rows", groups)
        write_rows(y, _labels(groups, "label", 62), "rows", groups)
    return index, clients, sizes, convert


def _per_image(x: np.ndarray) -> np.ndarray:
    """``tf.image.per_image_standardization``: (x - mean) / max(std, 1 / sqrt(pixels))."""
    flat = x.reshape(len(x), -1)
    mean = flat.mean(axis=1, dtype=np.float64)
    std = np.maximum(flat.std(axis=1, dtype=np.float64), 1.0 / np.sqrt(flat.shape[1]))
    return ((flat - mean[:, None]) / std[:, None]).astype(np.float32).reshape(x.shape)


def cifar100(folder: Path, num_clients: int, label: str, normalise: str
             ) -> tuple[ClientIndex, Clients, np.ndarray, Convert]:
    """FedCIFAR100: x (n, 3, 32, 32) float32, y (n,) int64 fine (100) or coarse (20) labels."""
    index = ClientIndex(_parts(folder, "fed_cifar100"), pooled=False)
    key, classes = ("label", 100) if label == "fine" else ("coarse_label", 20)
    clients, sizes = index.select("tff_cifar100", num_clients, rows_of(key, "image"),
                                  row_bytes=_CIFAR_ROW)

    def convert(groups: list[h5py.Group], x: np.ndarray, y: np.ndarray) -> None:
        img = feature(groups, "image", (32, 32, 3), "uint8")
        xf = np.multiply(img.transpose(0, 3, 1, 2), np.float32(1 / 255), dtype=np.float32)
        write_rows(x, _per_image(xf) if normalise == "per_image" else xf, "images", groups)
        write_rows(y, _labels(groups, key, classes), "images", groups)
    return index, clients, sizes, convert


def _strings(groups: list[h5py.Group], key: str) -> list[bytes]:
    """Feature ``key`` of a client's groups: (n,) strings, as bytes."""
    try:
        return as_bytes(feature(groups, key, (), "string"))
    except UnicodeEncodeError as exc:
        raise DataError(f"{where(groups[0])}: '{key}' holds a string that is not valid Unicode "
                        f"({exc.reason} at character {exc.start})") from None


def shakespeare(folder: Path, num_clients: int) -> tuple[ClientIndex, Clients, np.ndarray, Convert]:
    """TFF Shakespeare: x, y (n, 80) int64 (90 ids), n the 81-token rows of the snippets."""
    index = ClientIndex(_parts(folder, "shakespeare"), pooled=True)

    def size(groups: list[h5py.Group]) -> int:
        return sum(shakespeare_chunks(s) for s in _strings(groups, "snippets"))

    clients, sizes = index.select("tff_shakespeare", num_clients, size,
                                  row_bytes=_token_row(SHAKESPEARE_SEQUENCE_LENGTH))

    def convert(groups: list[h5py.Group], x: np.ndarray, y: np.ndarray) -> None:
        rows = char_rows(_strings(groups, "snippets"))
        write_rows(x, rows[:, :-1], "rows", groups)
        write_rows(y, rows[:, 1:], "rows", groups)
    return index, clients, sizes, convert


def stackoverflow(folder: Path, num_clients: int, vocab_size: int, sequence_length: int,
                  max_client_samples: int | None
                  ) -> tuple[ClientIndex, Clients, np.ndarray, Convert, int]:
    """TFF StackOverflow: x, y (n, T) int64 (V + 4 ids), one row a sentence (a client's first
    ``max_client_samples`` sentences, train first, when set). Returns also the id count."""
    index = ClientIndex(_parts(folder, "stackoverflow"), pooled=True)
    clients, sizes = index.select("tff_stackoverflow", num_clients, rows_of("tokens"),
                                  cap=max_client_samples,
                                  row_bytes=_token_row(sequence_length))

    def sentences() -> Iterator[list[bytes]]:
        with index.opened() as roots:
            for client, n in zip(clients, sizes):
                yield _strings(index.groups(roots, client), "tokens")[:n]

    vocab = stackoverflow_vocabulary(folder, vocab_size, sentences)

    def convert(groups: list[h5py.Group], x: np.ndarray, y: np.ndarray) -> None:
        rows = word_rows(_strings(groups, "tokens")[:len(x)], vocab, sequence_length)
        write_rows(x, rows[:, :-1], "sentences", groups)
        write_rows(y, rows[:, 1:], "sentences", groups)
    return index, clients, sizes, convert, len(vocab) + 4
