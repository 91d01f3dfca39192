"""The image data sets read from their official files: each one's every fact in its
:data:`IMAGES` entry (its sizes for the memory budget, its reader, its folder and files under a
data root, where ``mpifl data fetch`` downloads them and their checksums), registered as
``data.dataset = "<name>"`` with :func:`mpifl.data.registry.register_dataset`.

Normalisation: (Fashion-)MNIST pixels / 255; CIFAR / 255 then per-channel standardisation with
the pool's mean and std. The pool keeps the raw uint8 images (``RAW``) for a partition that
normalises its own subset (``one_class_per_client``).

Files (:mod:`mpifl.data.roots`, :mod:`mpifl.data.fetch`): ``fashion-mnist/`` and ``mnist/`` hold
the four IDX files (gzip or not); the CIFAR tarballs are extracted to ``cifar-10-batches-py/``
and ``cifar-100-python/``. The MD5 sums are those the data sets' authors publish (the same
values torchvision pins).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl.core.errors import DataError
from mpifl.data.cifar import load_cifar10_pool, load_cifar100_pool
from mpifl.data.idx import load_idx_pool
from mpifl.data.registry import LABELS, RAW, DataPool, DataShape, NoParams, register_dataset
from mpifl.data.roots import DatasetLayout, Source, find_dataset_dir, register_files

__all__ = ["IMAGES", "ImageSet"]


@dataclass(frozen=True)
class ImageSet:
    """One image data set.

    Attributes:
        shape: its train+test pool (:class:`DataShape`; a float32 copy of uint8 images:
            ``copies=1.25``).
        read: ``read(folder)`` -> (N, channels, H, W) uint8 images and (N,) int64 labels.
        per_channel: standardise each channel with the pool's mean and std (after / 255).
        layout: its folder under a data root and the files it must hold.
        source: where ``mpifl data fetch`` downloads them, with their checksums.
    """

    shape: DataShape
    read: Callable[..., tuple[np.ndarray, np.ndarray]]
    per_channel: bool
    layout: DatasetLayout
    source: Source


def _idx_images(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_idx_pool(folder)
    return x[:, None], y  # add the channel axis: (N, 1, 28, 28)


_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
              "t10k-labels-idx1-ubyte")


def _idx_source(base_url: str, md5s: tuple[str, str, str, str]) -> Source:
    return Source(base_url, tuple((f"{f}.gz", m) for f, m in zip(_IDX_FILES, md5s)))


_KRIZHEVSKY = "https://www.cs.toronto.edu/~kriz/"

IMAGES: dict[str, ImageSet] = {
    "fashion_mnist": ImageSet(
        DataShape((1, 28, 28), 10, samples=70_000, copies=1.25), _idx_images, False,
        DatasetLayout("fashion-mnist", _IDX_FILES, gz_ok=True,
                      elsewhere="`apt-get install dataset-fashion-mnist`"),
        _idx_source("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                    ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe",
                     "bef4ecab320f06d8554ea6380940ec79", "bb300cfdad3c16e7a12a480ee83cd310"))),
    "mnist": ImageSet(
        DataShape((1, 28, 28), 10, samples=70_000, copies=1.25), _idx_images, False,
        DatasetLayout("mnist", _IDX_FILES, gz_ok=True),
        _idx_source("https://ossci-datasets.s3.amazonaws.com/mnist/",
                    ("f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432",
                     "9fb629c4189551a2d022fa330f9573f3", "ec29112dd5afa0611ce80d1b7f02629c"))),
    "cifar10": ImageSet(
        DataShape((3, 32, 32), 10, samples=60_000, copies=1.25), load_cifar10_pool, True,
        DatasetLayout("cifar-10-batches-py",
                      tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)),
        Source(_KRIZHEVSKY, (("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),),
               archive=True)),
    "cifar100": ImageSet(
        DataShape((3, 32, 32), 100, samples=60_000, copies=1.25), load_cifar100_pool, True,
        DatasetLayout("cifar-100-python", ("train", "test")),
        Source(_KRIZHEVSKY, (("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),),
               archive=True)),
}


def _scale(x: np.ndarray) -> np.ndarray:
    """uint8 pixels to float32 in [0, 1]."""
    return np.multiply(x, np.float32(1 / 255), dtype=np.float32)


def _standardise_channels(x: np.ndarray) -> np.ndarray:
    """In place: per channel, subtract the pool's mean and divide by its std (CIFAR)."""
    for c in range(x.shape[1]):
        mean = x[:, c].mean(dtype=np.float64)
        std = x[:, c].std(dtype=np.float64)
        x[:, c] -= np.float32(mean)
        x[:, c] /= np.float32(std if std > 0 else 1.0)
    return x


def _image_loader(name: str) -> Callable[..., DataPool]:
    spec = IMAGES[name]
    classes = spec.shape.num_classes

    def load(*, seed: int, data_root: str | None = None) -> DataPool:
        """The pooled train+test images: x (N, channels, H, W) float32 normalised, raw uint8."""
        folder = find_dataset_dir(name, data_root)
        raw, y = spec.read(folder)
        if len(y) and (y.min() < 0 or y.max() >= classes):
            raise DataError(f"{folder}: labels outside 0..{classes - 1} (found {y.min()}.."
                            f"{y.max()})")
        x = _scale(raw)
        if spec.per_channel:
            _standardise_channels(x)
        return DataPool(x, y, classes, raw=raw)

    load.__qualname__ = load.__name__ = f"load_{name}"
    return load


for _name, _spec in IMAGES.items():
    register_files(_name, _spec.layout, _spec.source)
    register_dataset(_name, params=NoParams, provides=(LABELS, RAW), shape=_spec.shape)(
        _image_loader(_name))
