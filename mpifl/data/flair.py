"""Reader of FLAIR (Song et al., "FLAIR: Federated Learning Annotated Image Repository",
NeurIPS 2022 Datasets and Benchmarks) in the h5 file that apple/pfl-research's
``benchmarks/dataset/flair/download_preprocess.py`` writes (``flair_federated.hdf5``), one client
per Flickr user.

Layout (pfl-research): ``/<partition>/<user_id>/images`` (n, H, W, 3) uint8 (256 x 256),
``labels_row`` (uint16 image index within the user) and ``labels_col`` (uint8 label index) the
coarse labels as sparse coordinates, ``fine_grained_labels_row`` / ``_col`` the same for the
fine-grained taxonomy, ``image_ids``; ``/metadata/label_mapping`` and
``/metadata/fine_grained_label_mapping`` JSON objects label -> index (17 coarse labels, 1,628
fine-grained). Partitions ``train``, ``val``, ``test`` hold disjoint users.

FLAIR is **multi-label**: an image has one or more labels. The reader yields float32 multi-hot
targets (n, C), as pfl-research's ``get_multi_hot_targets`` does, trained with the multi-label
loss ``loss = "multilabel_bce"`` (binary cross-entropy per label; accuracy the share of labels
predicted right, :mod:`mpifl.models.losses`); it provides no integer labels (no label-based
partition, no group metrics).

Clients: the users of the chosen partitions (``train``, ``val``, ``test`` by default) in
h5py's order (by name), a user's rows pooled over partitions; users with fewer than 2 images
are skipped; K clients are the first K. x (n, 3, H, W) float32 = images / 255. pfl-research
publishes no checksum of its output (it is made on the user's machine from the Hugging Face
``apple/flair`` set); the file is checked for its layout only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpifl.core.errors import DataError
from mpifl.data.bounds import check_memory
from mpifl.data.tff import (ClientIndex, Clients, Convert, H5Part, dataset, declared_bytes,
                            feature, open_h5, where, write_rows)

__all__ = ["FLAIR_FILE", "flair", "label_count"]

FLAIR_FILE = "flair_federated.hdf5"


def label_count(path: Path, fine_grained: bool) -> int:
    """C: the number of labels in the file's label mapping.

    Raises:
        DataError: a missing or unreadable mapping, or one whose indices are not 0..C-1.
    """
    key = "/metadata/fine_grained_label_mapping" if fine_grained else "/metadata/label_mapping"
    with open_h5(path) as f:
        d = f.get(key)
        if isinstance(d, h5py.Dataset):
            check_memory(declared_bytes(d), f"{path}: '{key}' of shape {d.shape}")
        # whatever the file holds: json.loads refuses all but a string (TypeError)
        raw: Any = d[()] if isinstance(d, h5py.Dataset) else None
    try:
        mapping = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        # the indices are the targets' columns: 0..C-1, each once
        ok = isinstance(mapping, dict) and len(mapping) >= 2 and sorted(
            v for v in mapping.values() if type(v) is int) == list(range(len(mapping)))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise DataError(f"{path}: '{key}' must be a JSON object label -> index 0..C-1, each "
                        f"index once (pfl-research's download_preprocess.py writes it)")
    return len(mapping)


def _multi_hot(groups: list[h5py.Group], prefix: str, classes: int) -> np.ndarray:
    """(n, C) float32 multi-hot targets of a user's groups, group after group."""
    out = []
    for g in groups:
        n = int(g["images"].shape[0])
        rows = feature([g], f"{prefix}_row", (), "integer").astype(np.int64)
        cols = feature([g], f"{prefix}_col", (), "integer").astype(np.int64)
        if rows.shape != cols.shape or (rows.size and (rows.min() < 0 or rows.max() >= n
                                                       or cols.min() < 0
                                                       or cols.max() >= classes)):
            raise DataError(f"{where(g)}: '{g.name}/{prefix}_row/_col' must be image "
                            f"indices < {n} and label indices < {classes} of equal length")
        vec = np.zeros((n, classes), dtype=np.float32)
        vec[rows, cols] = 1.0
        out.append(vec)
    return np.concatenate(out)


def _images(classes: int) -> Callable[[list[h5py.Group]], int]:
    """A user's image count, its ``images`` checked to be (n, H, W, 3) uint8 (the same H, W in
    every group) and its conversion to fit in memory, from the shapes (nothing read): per image
    the uint8 pixels read, their float32 copy and the float32 x written, two (C,) float32
    targets."""
    def size(groups: list[h5py.Group]) -> int:
        sets = [dataset(g, "images", kind="uint8") for g in groups]
        for g, d in zip(groups, sets):
            if d.ndim != 4 or d.shape[3] != 3 or d.shape[1:] != sets[0].shape[1:]:
                raise DataError(f"{where(g)}: '{g.name}/images' must be (n, H, W, 3) uint8 with "
                                f"one H, W, got {d.shape}")
        n = sum(int(d.shape[0]) for d in sets)
        pixels = float(np.prod(sets[0].shape[1:], dtype=np.float64))
        check_memory(n * (pixels * (1 + 4 + 4) + 2 * 4 * classes),
                     f"{where(groups[0])}: {n:,} images of {sets[0].shape[1:]}")
        return n
    return size


def flair(folder: Path, num_clients: int, partitions: Sequence[str], fine_grained: bool
          ) -> tuple[ClientIndex, Clients, np.ndarray, Convert, tuple[int, ...], int]:
    """FLAIR's users: (index, clients, sizes, convert, input shape (3, H, W), C).

    ``convert(groups, x, y)`` writes x (n, 3, H, W) float32 and y (n, C) float32 multi-hot.

    Raises:
        DataError: a missing or malformed mapping (:func:`label_count`), images that are not
            (n, H, W, 3) uint8 of one size, a user whose images would not fit in memory (from
            the declared shapes, before reading), label coordinates out of range.
    """
    path = folder / FLAIR_FILE
    classes = label_count(path, fine_grained)
    index = ClientIndex([H5Part(path, p) for p in partitions], pooled=True)
    clients, sizes = index.select("flair", num_clients, _images(classes))
    with index.opened() as roots:
        shape = index.groups(roots, clients[0])[0]["images"].shape[1:] if clients else (0, 0, 3)
    prefix = "fine_grained_labels" if fine_grained else "labels"

    def convert(groups: list[h5py.Group], x: np.ndarray, y: np.ndarray) -> None:
        img = feature(groups, "images", tuple(shape), "uint8")
        xf = np.multiply(img.transpose(0, 3, 1, 2), np.float32(1 / 255), dtype=np.float32)
        write_rows(x, xf, "images", groups)
        write_rows(y, _multi_hot(groups, prefix, classes), "images", groups)
    return index, clients, sizes, convert, (3, int(shape[0]), int(shape[1])), classes
