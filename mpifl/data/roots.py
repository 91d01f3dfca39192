"""Where datasets live on disk: the data roots searched and each dataset's folder, which the
dataset's own module declares (:func:`register_files`, with where ``mpifl data fetch`` gets its
files when it does).

A root the user names is the only one searched, and must hold the dataset:

1. the ``data_root`` argument (``data.data_root`` in a config), else
2. ``$MPIFL_DATA``.

A named root that does not exist, or whose dataset folder lacks a file, is an error naming the
root, the setting and what is missing there, never a fall-back to another root (the run would
read other data than the one asked for). With neither set, the dataset is found in the first
of the default roots whose folder holds all its files:

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
    ``alternatives``: besides ``files``, the folder must hold every entry of one of these
    groups; an entry may be a glob pattern (``all_data/*.json``: at least one match).
    ``source``: where to get the files, for the "not found" message (sets not fetched by
    ``mpifl data fetch``).
    ``elsewhere``: another way to get them besides ``mpifl data fetch``, for that message
    (e.g. a distribution's package).
    """

    subdir: str
    files: tuple[str, ...]
    gz_ok: bool = False
    alternatives: tuple[tuple[str, ...], ...] = ()
    source: str = ""
    elsewhere: str = ""


@dataclass(frozen=True)
class Source:
    """Where a dataset's files come from (``mpifl data fetch``, :mod:`mpifl.data.fetch`): base
    URL, (file name, hex digest) pairs, tarball or not, and the digest's hash algorithm (a
    :mod:`hashlib` name)."""

    base_url: str
    files: tuple[tuple[str, str], ...]
    archive: bool = False  # True: one tarball, extracted into the root
    algorithm: str = "md5"


#: Each dataset read from a data root: its folder and files, registered by the dataset's own
#: module (:func:`register_files`; :mod:`mpifl.data.images`, :mod:`mpifl.data.published`).
LAYOUTS: dict[str, DatasetLayout] = {}
#: Those that ``mpifl data fetch`` downloads: where from, with their checksums.
SOURCES: dict[str, Source] = {}


def register_files(name: str, layout: DatasetLayout, source: Source | None = None) -> None:
    """Declare where dataset ``name``'s files live under a data root (:func:`find_dataset_dir`)
    and, with ``source``, where ``mpifl data fetch`` downloads them.

    Raises:
        ValueError: ``name`` already declares other files.
    """
    old = LAYOUTS.get(name)
    if old is not None and (old, SOURCES.get(name)) != (layout, source):
        raise ValueError(f"dataset {name!r} already declares its files ({old.subdir}/)")
    LAYOUTS[name] = layout
    if source is not None:
        SOURCES[name] = source


def default_cache_root() -> Path:
    """``~/.cache/mpifl/data`` (follows ``$HOME``): the default download folder."""
    return Path.home() / ".cache" / "mpifl" / "data"


def named_root(data_root: str | os.PathLike[str] | None = None) -> tuple[Path, str] | None:
    """The root the user named and the setting that named it: ``data_root``
    (``"data.data_root"``), else ``$MPIFL_DATA``; None when neither is set (or empty)."""
    if data_root is not None and str(data_root) != "":
        return Path(data_root).expanduser(), "data.data_root"
    env = os.environ.get("MPIFL_DATA")
    if env:
        return Path(env).expanduser(), "$MPIFL_DATA"
    return None


def candidate_roots(data_root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The data roots to search, in order (see the module docstring): the named root alone,
    else the default roots."""
    named = named_root(data_root)
    if named is not None:
        return [named[0]]
    return list(dict.fromkeys([default_cache_root(), SYSTEM_ROOT]))


def find_folder(name: str, layout: DatasetLayout, data_root: str | os.PathLike[str] | None,
                get_it: str) -> Path:
    """The folder of dataset ``name`` (``layout``) in the roots of :func:`candidate_roots`.

    Args:
        get_it: how to get the data, for the error message (e.g. "get it with ...").

    Raises:
        DataError: one line: a named root that does not exist, or lacks files (named), or no
            default root that holds all of them (every folder tried listed).
    """
    named = named_root(data_root)
    if named is not None:
        return _in_named_root(name, layout, *named)
    tried = []
    for root in candidate_roots():
        folder = root / layout.subdir
        if not _missing(folder, layout):
            return folder
        tried.append(str(folder))
    wanted = _wanted(layout)
    raise DataError(f"dataset '{name}' not found: no folder holds all of {wanted}; tried "
                    f"{', '.join(tried)}; {get_it}, or set $MPIFL_DATA / data.data_root to a "
                    f"folder that holds {layout.subdir}/")


def _wanted(layout: DatasetLayout) -> str:
    """The files ``layout`` asks for, as a message names them."""
    out = ", ".join(f + ("[.gz]" if layout.gz_ok else "") for f in layout.files)
    if layout.alternatives:
        out += (", " if out else "") + " or ".join(" + ".join(g) for g in layout.alternatives)
    return out


def _in_named_root(name: str, layout: DatasetLayout, root: Path, setting: str) -> Path:
    folder = root / layout.subdir
    put = layout.source or f"`mpifl data fetch {name} --root {root}` puts the files there"
    after = named_root(None) if setting == "data.data_root" else None  # $MPIFL_DATA's turn
    unset = (f"or unset {setting} to use $MPIFL_DATA ({after[0]})" if after else
             f"or unset {setting} to search {default_cache_root()} and {SYSTEM_ROOT}")
    if not root.is_dir():
        raise DataError(f"dataset '{name}' not found: {setting} is {root}, which does not "
                        f"exist (so neither does {folder}); set {setting} to the folder that "
                        f"holds {layout.subdir}/ ({put}), {unset}")
    missing = _missing(folder, layout)
    if missing:
        where = f"{folder} lacks {', '.join(missing)}" if folder.is_dir() else \
            f"{root} has no folder {layout.subdir}/ (of {_wanted(layout)})"
        get = layout.source or f"`mpifl data fetch {name} --root {root}`"
        raise DataError(f"dataset '{name}' not found in {setting} {root}: {where}; put its files "
                        f"in {folder} ({get}), {unset}")
    return folder


def _missing(folder: Path, layout: DatasetLayout) -> list[str]:
    """The files of ``layout`` that ``folder`` lacks (``name[.gz]`` where gzip is accepted;
    for ``alternatives``, all of them joined by "or" unless one group is complete)."""
    out = [f + ("[.gz]" if layout.gz_ok else "") for f in layout.files
           if locate_file(folder, f, layout.gz_ok) is None]
    if layout.alternatives and not any(
            all(_present(folder, f) for f in group) for group in layout.alternatives):
        out.append(" or ".join(" + ".join(g) for g in layout.alternatives))
    return out


def _present(folder: Path, entry: str) -> bool:
    """A file ``folder/entry``, or at least one file matching the glob pattern ``entry``."""
    if any(c in entry for c in "*?["):
        return folder.is_dir() and any(p.is_file() for p in folder.glob(entry))
    return (folder / entry).is_file()


def locate_file(folder: Path, name: str, gz_ok: bool) -> Path | None:
    """``folder/name``, else ``folder/name.gz`` when ``gz_ok``; ``None`` if neither is a file."""
    for cand in (name, name + ".gz") if gz_ok else (name,):
        if (folder / cand).is_file():
            return folder / cand
    return None


def _how_to_get(name: str) -> str:
    layout = LAYOUTS[name]
    if layout.source:
        return layout.source
    hint = f"get it with `mpifl data fetch {name}`"
    if layout.elsewhere:
        hint += f" or {layout.elsewhere}"
    return hint


def find_dataset_dir(name: str, data_root: str | os.PathLike[str] | None = None) -> Path:
    """The folder of dataset ``name`` (a key of :data:`LAYOUTS`): in the named root, else in
    the first default root that has it (the module docstring).

    Raises:
        DataError: an unknown name; a named root that does not exist or lacks the dataset's
            files (named); no default root holding them all (every folder tried listed, and
            how to get the data).
    """
    if name not in LAYOUTS:
        raise DataError(f"dataset '{name}' is not read from disk (known: {', '.join(LAYOUTS)})")
    return find_folder(name, LAYOUTS[name], data_root, _how_to_get(name))
