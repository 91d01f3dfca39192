"""Where datasets live on disk: the search order of data roots and each dataset's folder.

A dataset is found in the first root, in this order, whose dataset folder holds all its files:

1. the ``data_root`` argument (``data.data_root`` in a config),
2. ``$MPIFL_DATA``,
3. ``~/.cache/mpifl/data`` (where ``mpifl data fetch`` puts downloads),
4. ``/usr/share/datasets`` (Debian's ``dataset-fashion-mnist`` installs there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpifl.core.errors import DataError

SYSTEM_ROOT = Path("/usr/share/datasets")


@dataclass(frozen=True)
class DatasetLayout:
    """The folder of a dataset under a data root and the files it must hold.

    ``gz_ok``: each file may also be present gzip-compressed as ``<name>.gz`` (IDX files).
    """

    subdir: str
    files: tuple[str, ...]
    gz_ok: bool = False


_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

LAYOUTS: dict[str, DatasetLayout] = {
    "fashion_mnist": DatasetLayout("fashion-mnist", _IDX_FILES, gz_ok=True),
    "mnist": DatasetLayout("mnist", _IDX_FILES, gz_ok=True),
    "cifar10": DatasetLayout(
        "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
    ),
    "cifar100": DatasetLayout("cifar-100-python", ("train", "test")),
}


def default_cache_root() -> Path:
    """``~/.cache/mpifl/data`` (follows ``$HOME``): the default download folder."""
    return Path.home() / ".cache" / "mpifl" / "data"


def candidate_roots(data_root: str | os.PathLike | None = None) -> list[Path]:
    """The data roots to search, in order, without duplicates (see the module docstring)."""
    raw = [data_root, os.environ.get("MPIFL_DATA") or None, default_cache_root(), SYSTEM_ROOT]
    roots: list[Path] = []
    for r in raw:
        if r is None or str(r) == "":
            continue
        p = Path(r).expanduser()
        if p not in roots:
            roots.append(p)
    return roots


def locate_file(folder: Path, name: str, gz_ok: bool) -> Path | None:
    """``folder/name``, else ``folder/name.gz`` when ``gz_ok``; ``None`` if neither is a file."""
    for cand in (name, name + ".gz") if gz_ok else (name,):
        if (folder / cand).is_file():
            return folder / cand
    return None


def _how_to_get(name: str) -> str:
    hint = f"get it with `mpifl data fetch {name}`"
    if name == "fashion_mnist":
        hint += " or `apt-get install dataset-fashion-mnist`"
    return hint + ", or set $MPIFL_DATA / data.data_root to a folder that holds it"


def find_dataset_dir(name: str, data_root: str | os.PathLike | None = None) -> Path:
    """The folder of dataset ``name`` (a key of :data:`LAYOUTS`) in the first root that has it.

    Raises:
        DataError: no root holds all the dataset's files; the message lists every folder tried
            and how to get the data.
    """
    if name not in LAYOUTS:
        raise DataError(f"dataset '{name}' is not read from disk (known: {', '.join(LAYOUTS)})")
    layout = LAYOUTS[name]
    tried = []
    for root in candidate_roots(data_root):
        folder = root / layout.subdir
        if all(locate_file(folder, f, layout.gz_ok) for f in layout.files):
            return folder
        tried.append(str(folder))
    wanted = ", ".join(f + ("[.gz]" if layout.gz_ok else "") for f in layout.files)
    raise DataError(
        f"dataset '{name}' not found: no folder holds all of {wanted}; tried "
        f"{', '.join(tried)}; {_how_to_get(name)}"
    )
