"""Readers of the LEAF benchmark's JSON files (Caldas et al., "LEAF: A Benchmark for Federated
Settings", arXiv:1812.01097, 2018; https://github.com/TalwalkarLab/leaf): FEMNIST, Shakespeare,
Sent140 and Synthetic, one client per writer / speaking role / Twitter user / task.

Files: LEAF's ``preprocess.sh`` writes ``data/<set>/data/all_data/all_data_<i>.json`` (every
user, unsplit) and, with ``-t sample``, ``train/*.json`` and ``test/*.json`` (each user's samples
split by LEAF). Each file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x":
[...], "y": [...]}}}``. When ``all_data/`` is there it is read (the original, unsplit); else each
user's ``train/`` rows then ``test/`` rows are pooled, so the client's samples are the same as
with ``all_data/`` and mpifl splits them itself (``data.train_fraction``), not by LEAF's split.

Order: files by name (numbers compared as numbers: ``all_data_2`` before ``all_data_10``), users
in each file's ``users`` order (split files: every user of ``train/`` first, then users found
only in ``test/``). Users with fewer than 2 samples are skipped (a client needs a train and a
test sample); K clients are the first K users left. With ``all_data/``, files are read only
until K users are found (FEMNIST's 35 files hold 2.5 GB of JSON), except where the whole set is
needed (Sent140's vocabulary, Synthetic's classes).

LEAF publishes no checksums; the files are checked for the format only (one-line
:class:`DataError` naming the file, the user and what is wrong): a user listed twice, features
that are not finite, labels out of range, text that is not Unicode or not in the alphabet, a
file too large to parse in memory (:mod:`mpifl.data.bounds`), Synthetic classes inferred from
a label beyond the set's samples.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.core.errors import DataError
from mpifl.data.bounds import check_memory
from mpifl.data.registry import PAD

__all__ = ["ALL_LETTERS", "SENT140_OOV", "leaf_files", "read_femnist", "read_sent140",
           "read_shakespeare", "read_synthetic", "read_users", "sent140_vocabulary"]

#: LEAF's Shakespeare alphabet (leaf/models/utils/language_utils.py), 80 characters; a
#: character's id is its index + 1 (0 is :data:`PAD`), so the vocabulary has 81 ids.
ALL_LETTERS = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}")
#: Sent140 ids: 0 PAD, 1 out of vocabulary, then the words (2 .. vocab_size + 1).
SENT140_OOV = 1
FEMNIST_CLASSES = 62
#: the largest label read when the number of classes comes from the data (``num_classes``
#: is at most 2^31 - 1, :class:`mpifl.data.published.LeafSyntheticParams`)
MAX_LABEL = 2**31 - 2
_SHAKESPEARE_TABLE = np.full(128, -1, dtype=np.int64)
_SHAKESPEARE_TABLE[[ord(c) for c in ALL_LETTERS]] = np.arange(1, len(ALL_LETTERS) + 1)

#: (x, y) of one user, converted from the JSON lists
Rows = tuple[Any, Any]


def _natural_key(path: Path) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def leaf_files(folder: Path) -> list[list[Path]]:
    """The JSON files to read, in order: ``[all_data files]``, else ``[train files, test
    files]``.

    Raises:
        DataError: neither ``all_data/*.json`` nor both ``train/*.json`` and ``test/*.json``.
    """
    def listing(sub: str) -> list[Path]:
        return sorted((p for p in (folder / sub).glob("*.json") if p.is_file()), key=_natural_key)

    if listing("all_data"):
        return [listing("all_data")]
    train, test = listing("train"), listing("test")
    if train and test:
        return [train, test]
    raise DataError(f"{folder} holds no LEAF JSON files: expected all_data/*.json, or train/*.json "
                    f"and test/*.json (LEAF's preprocess.sh writes them)")


#: bytes of Python objects a byte of LEAF's JSON can become once parsed (a number like
#: ``1.0, `` is 5 bytes of text and a 24-byte float with an 8-byte pointer): the estimate that
#: keeps a file far larger than memory from being parsed at all
JSON_EXPANSION = 8


def _load_json(path: Path) -> dict[str, Any]:
    """One LEAF file, its keys checked (its size against the memory bound first)."""
    try:
        check_memory(path.stat().st_size * JSON_EXPANSION,
                     f"{path}: {path.stat().st_size:,} bytes of JSON once parsed")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read LEAF file {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("users"), list) \
            or not isinstance(doc.get("user_data"), dict):
        raise DataError(f"{path} is not a LEAF file: expected a JSON object with 'users' (a list) "
                        f"and 'user_data' (an object)")
    return doc


def _user_rows(path: Path, doc: dict[str, Any], user: Any) -> tuple[list[Any], list[Any]]:
    # JSON's keys are strings: another id (a list, a number) names no user's data
    data = doc["user_data"].get(user) if isinstance(user, str) else None
    if not isinstance(data, dict) or not isinstance(data.get("x"), list) \
            or not isinstance(data.get("y"), list) or len(data["x"]) != len(data["y"]):
        raise DataError(f"{path}: user_data[{user!r}] must hold lists 'x' and 'y' of equal "
                        f"length")
    return data["x"], data["y"]


def read_users(folder: Path, convert: Callable[[str, list[Any], list[Any]], Rows],
               enough: int | None = None) -> list[tuple[str, list[Rows]]]:
    """Every user's rows, in the order of the module docstring: ``(user, [(x, y), ...])``, one
    ``(x, y)`` per file the user appears in (train before test), each ``convert(where, x, y)``
    of the JSON lists, ``where`` naming the file and the user for its refusals (converted file
    by file, so the JSON of one file at most is held).

    Args:
        enough: with ``all_data/``, stop after the file in which this many users of at least 2
            samples have been seen; None reads every file.
    Raises:
        DataError: missing or malformed files (:func:`leaf_files`, bad JSON, missing keys), a
            file larger than memory holds once parsed, a user listed twice (in one file's
            ``users`` or in two files of ``all_data/``, or of ``train/``, or of ``test/``: its
            samples would be read twice).
    """
    groups = leaf_files(folder)
    users: dict[str, list[Rows]] = {}
    counted = 0
    for files in groups:
        seen: dict[str, Path] = {}  # a user is in train/ and in test/ once each, no more
        for path in files:
            doc = _load_json(path)
            for user in doc["users"]:
                x, y = _user_rows(path, doc, user)
                if str(user) in seen:
                    also = "" if seen[str(user)] == path else f" (and in {seen[str(user)]})"
                    raise DataError(f"{path}: user {user!r} is listed twice{also}: its samples "
                                    f"would be read twice; LEAF lists each user once")
                seen[str(user)] = path
                rows = users.setdefault(str(user), [])
                counted += len(rows) == 0 and len(x) >= 2
                rows.append(convert(f"{path}: user {user!r}", x, y))
            del doc
            if enough is not None and len(groups) == 1 and counted >= enough:
                return list(users.items())
    return list(users.items())


def _pick(name: str, users: list[tuple[str, list[Rows]]], num_clients: int
          ) -> list[list[Rows]]:
    """The first ``num_clients`` users holding at least 2 samples."""
    kept = [rows for _, rows in users if sum(len(r[1]) for r in rows) >= 2]
    if len(kept) < num_clients:
        raise DataError(f"data set '{name}' has {len(kept)} users with at least 2 samples, "
                        f"data.num_clients is {num_clients}")
    return kept[:num_clients]


def _stack(picked: list[list[Rows]], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The picked users' rows concatenated: x, y, and (K,) int64 sizes.

    Raises:
        DataError: the concatenated pool would not fit in memory beside the rows.
    """
    flat = [r for rows in picked for r in rows]
    sizes = np.array([sum(len(r[1]) for r in rows) for rows in picked], dtype=np.int64)
    check_memory(sum(r[0].nbytes + r[1].nbytes for r in flat),
                 f"data set '{name}': the {int(sizes.sum()):,} samples of its {len(picked):,} "
                 f"users", "use fewer clients (data.num_clients)")
    return np.concatenate([r[0] for r in flat]), np.concatenate([r[1] for r in flat]), sizes


def _int_labels(where: str, y: list[Any], classes: int | None) -> np.ndarray:
    """(n,) int64 labels, checked to be integers in 0..classes-1 (without classes: in
    0..:data:`MAX_LABEL`, the largest a configured ``num_classes`` allows)."""
    try:
        arr = np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError):
        arr = np.full(1, np.nan)
    top = MAX_LABEL if classes is None else classes - 1
    if arr.ndim != 1 or (arr.size and (not np.isfinite(arr).all() or (arr != np.round(arr)).any()
                                       or arr.min() < 0 or arr.max() > top)):
        raise DataError(f"{where}: labels 'y' must be integers in 0..{top}")
    return arr.astype(np.int64)


def _float_rows(where: str, x: list[Any], width: int) -> np.ndarray:
    """(n, width) float32 of the JSON feature lists."""
    try:
        with np.errstate(over="ignore"):  # a value beyond float32 becomes inf: refused below
            arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        arr = np.zeros((0, 0), dtype=np.float32)
    if len(x) == 0:
        return np.zeros((0, width), dtype=np.float32)
    if arr.ndim != 2 or arr.shape[1] != width or not np.isfinite(arr).all():
        raise DataError(f"{where}: each 'x' must be a list of {width} finite numbers")
    return arr


# --------------------------------------------------------------------------- the four sets

def read_femnist(folder: Path, num_clients: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FEMNIST (62 classes: digits, upper- then lower-case letters; one client a writer).

    Returns:
        x (N, 1, 28, 28) float32 pixels as LEAF stores them (in [0, 1], 1.0 the background),
        y (N,) int64 in 0..61, sizes (K,) int64.
    """
    def convert(where: str, x: list[Any], y: list[Any]) -> Rows:
        return _float_rows(where, x, 784).reshape(-1, 1, 28, 28), \
            _int_labels(where, y, FEMNIST_CLASSES)

    users = read_users(folder, convert, enough=num_clients)
    return _stack(_pick("leaf_femnist", users, num_clients), "leaf_femnist")


def _char_ids(where: str, text: str) -> np.ndarray:
    """int64 ids (1..80) of the characters of ``text``; DataError outside LEAF's alphabet or
    for text that is not valid Unicode (a lone surrogate, which JSON's ``\\ud800`` escape can
    write)."""
    try:
        raw = text.encode("utf-32-le")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: the text is not valid Unicode ({exc.reason}: "
                        f"{text[exc.start]!r} at character {exc.start})") from None
    codes = np.frombuffer(raw, dtype=np.uint32).astype(np.int64)
    ids = _SHAKESPEARE_TABLE[np.minimum(codes, 127)]
    bad = np.flatnonzero((codes > 127) | (ids < 0))
    if len(bad):
        raise DataError(f"{where}: character {text[bad[0]]!r} is not in LEAF's 80-character "
                        f"alphabet (leaf/models/utils/language_utils.py ALL_LETTERS)")
    return ids


def read_shakespeare(folder: Path, num_clients: int, sequence_length: int = 80
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shakespeare next-character prediction (one client a speaking role).

    Returns:
        x (N, sequence_length) int64 character ids 1..80 (index in :data:`ALL_LETTERS` + 1),
        y (N,) int64 the next character's id, sizes (K,) int64. The vocabulary (and the number
        of classes) is 81: :data:`PAD` = 0 and the 80 characters.
    Raises:
        DataError: an ``x`` that is not a string of ``sequence_length`` characters, a ``y``
            that is not one character, a character outside the alphabet.
    """
    def convert(where: str, x: list[Any], y: list[Any]) -> Rows:
        if not all(isinstance(s, str) and len(s) == sequence_length for s in x) or \
                not all(isinstance(c, str) and len(c) == 1 for c in y):
            raise DataError(f"{where}: each 'x' must be a string of {sequence_length} characters "
                            f"and each 'y' one character")
        ids = _char_ids(where, "".join(x)).reshape(len(x), sequence_length)
        return ids, _char_ids(where, "".join(y))

    users = read_users(folder, convert, enough=num_clients)
    return _stack(_pick("leaf_shakespeare", users, num_clients), "leaf_shakespeare")


def _tweet(where: str, row: Any) -> str:
    if not isinstance(row, list) or len(row) < 5 or not isinstance(row[4], str):
        raise DataError(f"{where}: each Sent140 'x' must be a list whose 5th entry is the tweet "
                        f"text")
    return row[4]


def sent140_vocabulary(words: Counter[str], vocab_size: int) -> dict[str, int]:
    """The ``vocab_size`` most frequent words (ties: alphabetical) -> ids 2, 3, ... (0 PAD, 1
    out of vocabulary)."""
    ranked = sorted(words.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab_size]
    return {w: i + 2 for i, (w, _) in enumerate(ranked)}


def read_sent140(folder: Path, num_clients: int, vocab_size: int = 10_000, max_length: int = 25
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Sent140 sentiment (one client a Twitter user): tweets split on whitespace, words mapped
    to ids of a vocabulary of the whole set's ``vocab_size`` most frequent words (every file is
    read, so it does not depend on K), cut to ``max_length`` words, padded with :data:`PAD`.

    Returns:
        x (N, max_length) int64 ids (0 PAD, 1 out of vocabulary, 2.. words), y (N,) int64 in
        {0, 1}, sizes (K,) int64, and the number of ids V = vocab_size + 2 (fewer when the data
        have fewer distinct words).
    """
    def convert(where: str, x: list[Any], y: list[Any]) -> Rows:
        return [_tweet(where, row).split() for row in x], _int_labels(where, y, 2)

    users = read_users(folder, convert)
    vocab = sent140_vocabulary(Counter(w for _, rows in users for r in rows for t in r[0]
                                       for w in t), vocab_size)
    picked = _pick("leaf_sent140", users, num_clients)
    for rows in picked:
        for j, (tweets, y) in enumerate(rows):
            ids = np.full((len(tweets), max_length), PAD, dtype=np.int64)
            for i, words in enumerate(tweets):
                cut = [vocab.get(w, SENT140_OOV) for w in words[:max_length]]
                ids[i, :len(cut)] = cut
            rows[j] = (ids, y)
    x, y, sizes = _stack(picked, "leaf_sent140")
    return x, y, sizes, len(vocab) + 2


def read_synthetic(folder: Path, num_clients: int, num_classes: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """LEAF's Synthetic (one client a task): x (N, 60) float32, y (N,) int64.

    Args:
        num_classes: C; None: the largest label in the whole set + 1 (every file is read).
    Returns:
        x, y, sizes (K,) int64, C.
    Raises:
        DataError: with ``num_classes`` None, a largest label that makes C larger than the
            whole set's number of samples (classes that no sample has: the labels are not
            the class indices 0..C-1 LEAF's generator writes), or a (K, C) table of label
            counts that would not fit in memory.
    """
    largest: list[tuple[int, str]] = [(-1, "")]  # the largest label and where it is

    def convert(where: str, x: list[Any], y: list[Any]) -> Rows:
        width = len(x[0]) if x and isinstance(x[0], list) else 60
        labels = _int_labels(where, y, num_classes)
        if labels.size and labels.max() > largest[0][0]:
            largest[0] = (int(labels.max()), where)
        return _float_rows(where, x, width), labels

    users = read_users(folder, convert, enough=num_clients if num_classes else None)
    widths = {r[0].shape[1] for _, rows in users for r in rows if len(r[0])}
    if len(widths) > 1:
        raise DataError(f"{folder}: Synthetic users have features of different widths "
                        f"{sorted(widths)}")
    classes = num_classes or 1 + max(largest[0][0], 1)
    if num_classes is None:
        samples = sum(len(r[1]) for _, rows in users for r in rows)
        top, where = largest[0]
        if top >= 0 and classes > samples:
            raise DataError(f"{where}: label {top} makes C = {classes} classes (the largest "
                            f"label + 1), more than the {samples:,} samples of the whole set, "
                            f"so most classes would have no sample; fix the file or set "
                            f"[data.params] num_classes")
        check_memory(8.0 * classes * num_clients,
                     f"{where}: label {top}: the (K, C) = ({num_clients}, {classes}) label counts",
                     "fix the file or set [data.params] num_classes")
    x, y, sizes = _stack(_pick("leaf_synthetic", users, num_clients), "leaf_synthetic")
    return x, y, sizes, max(classes, 2)

