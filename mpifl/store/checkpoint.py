"""Checkpoints: everything a run needs to continue bit-for-bit, in plain HDF5 (no pickle).

A run ``RUN.h5`` keeps its checkpoints in the folder ``RUN.h5.ckpt/`` as ``round-NNNNNN.h5``
(NNNNNN = rounds completed). Each is written to a temporary name, fsynced, renamed, and the
folder fsynced; the previous one is kept, so a ``kill -9`` at any instant leaves at least one
complete checkpoint. A SHA-256 of the whole file in its HDF5 user block
(:mod:`mpifl.store.sealed`) is verified before HDF5 reads it, and a SHA-256 over every dataset
and attribute, stored as the root attribute ``digest``, is checked too (older checkpoints have
only this one): flipped bytes, damaged HDF5 metadata and truncation are reported on load and the
previous checkpoint is used. Stale ``.tmp-PID`` files of killed writers are removed on save.

Layout of a checkpoint::

    /                   attrs: kind="mpifl-checkpoint", schema_version, config (JSON),
                               round (rounds completed = next round to run), world_size, digest
    /model/global       (d,) float32 global parameters after ``round`` rounds
    /aggregator/<key>   the aggregator's ``state_dict()``: arrays as datasets, scalars as attrs
    /history/...        the metric history so far (see :class:`mpifl.store.MetricHistory`)

Workers hold no state between rounds (every random draw is keyed by seed, round and client),
so rank 0's checkpoint is the whole state of the job.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpifl.core.errors import OutputError
from mpifl.core.locking import clean_stale_temporaries
from mpifl.store.results import READABLE_VERSIONS, SCHEMA_VERSION, MetricHistory
from mpifl.store.sealed import open_verified, write_atomic

log = logging.getLogger("mpifl.store.checkpoint")

KIND = "mpifl-checkpoint"
KEEP = 2
_NAME = re.compile(r"^round-(\d{6,})\.h5$")


@dataclass
class Checkpoint:
    round: int  # rounds completed; the next round to run
    w: np.ndarray  # (d,) float32
    aggregator: dict[str, Any]
    history: MetricHistory
    config_json: str
    world_size: int
    path: Path


def folder_for(results: Path) -> Path:
    """The checkpoint folder of a results file: ``RUN.h5`` -> ``RUN.h5.ckpt``."""
    return results.with_name(results.name + ".ckpt")


def save(folder: Path, ckpt: Checkpoint) -> Path:
    """Write a checkpoint atomically and keep only the newest :data:`KEEP`.

    Raises:
        OutputError: the folder or file cannot be written (e.g. a full disk); the previous
            checkpoints are untouched.
    """
    final = folder / f"round-{ckpt.round:06d}.h5"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write checkpoint {final}: {exc.strerror or exc}") from None
    clean_stale_temporaries(folder)  # left by a writer killed mid-write
    write_atomic(final, lambda f: _write(f, ckpt), "checkpoint")
    for old in _listed(folder)[KEEP:]:
        old.unlink(missing_ok=True)
    return final


def load_latest(folder: Path) -> Checkpoint | None:
    """The newest checkpoint in ``folder`` that passes its integrity check, or None if none exist.

    Damaged checkpoints are skipped with a warning naming the problem.

    Raises:
        OutputError: checkpoints exist but none is valid.
    """
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder}: is not a checkpoint folder (a file is in its place)")
    paths = _listed(folder)
    problems = []
    for path in paths:
        try:
            return read(path)
        except OutputError as exc:
            log.warning("skipping damaged checkpoint: %s", exc)
            problems.append(str(exc))
    if paths:
        raise OutputError(f"no valid checkpoint in {folder}: " + "; ".join(problems))
    return None


def read(path: Path) -> Checkpoint:
    """Read and verify one checkpoint.

    Raises:
        OutputError: unreadable, truncated, digest mismatch, foreign file, unknown schema.
    """
    fileobj, _sealed = open_verified(path, "checkpoint")
    try:
        with fileobj, h5py.File(fileobj, "r") as f:
            if f.attrs.get("kind") != KIND:
                raise OutputError(f"{path}: not an mpifl checkpoint")
            version = int(f.attrs.get("schema_version", -1))
            if version not in READABLE_VERSIONS:
                raise OutputError(f"{path}: checkpoint schema version {version} is not supported "
                                  f"(this mpifl reads {', '.join(map(str, READABLE_VERSIONS))})")
            if f.attrs.get("digest") != _digest(f):
                raise OutputError(f"{path}: checksum mismatch (the file is damaged)")
            return Checkpoint(
                round=int(f.attrs["round"]), w=f["model/global"][()],
                aggregator=_read_state(f["aggregator"]),
                history=MetricHistory.from_group(f["history"], version),
                config_json=str(f.attrs["config"]), world_size=int(f.attrs["world_size"]),
                path=path)
    except OutputError:
        raise
    except Exception as exc:  # damaged HDF5 metadata shows up as many exception types
        first = (str(exc).splitlines() or [""])[0]
        raise OutputError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {first})") from None


def _write(f: h5py.File, ckpt: Checkpoint) -> None:
    f.attrs["kind"] = KIND
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["config"] = ckpt.config_json
    f.attrs["round"] = ckpt.round
    f.attrs["world_size"] = ckpt.world_size
    f.create_dataset("model/global", data=np.asarray(ckpt.w, dtype=np.float32))
    _write_state(f.create_group("aggregator"), ckpt.aggregator)
    ckpt.history.to_group(f.create_group("history"))
    f.attrs["digest"] = _digest(f)


def _write_state(group: h5py.Group, state: dict[str, Any]) -> None:
    """Arrays become datasets; int, float, bool and str scalars become typed attributes."""
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            group.create_dataset(key, data=value)
        elif isinstance(value, (bool, int, float, str, np.generic)):
            group.attrs[key] = value
            group.attrs[f"__type__{key}"] = type(value.item() if isinstance(value, np.generic)
                                                else value).__name__
        else:
            raise TypeError(f"aggregator state '{key}' is a {type(value).__name__}; "
                            "only numpy arrays and scalars can be checkpointed")


def _read_state(group: h5py.Group) -> dict[str, Any]:
    casts = {"bool": bool, "int": int, "float": float, "str": str}
    state: dict[str, Any] = {k: group[k][()] for k in group}
    for key, value in group.attrs.items():
        if not key.startswith("__type__"):
            state[key] = casts[group.attrs[f"__type__{key}"]](
                value.item() if isinstance(value, np.generic) else value)
    return state


def _digest(f: h5py.File) -> str:
    """SHA-256 over every dataset (name, dtype, shape, bytes) and attribute, but ``digest``."""
    h = hashlib.sha256()

    def attrs(name: str, obj) -> None:
        for key in sorted(obj.attrs):
            if key != "digest":
                h.update(f"{name}@{key}={obj.attrs[key]!r}".encode())

    def visit(name: str, obj) -> None:
        attrs(name, obj)
        if isinstance(obj, h5py.Dataset):
            data = np.ascontiguousarray(obj[()])
            h.update(f"{name}:{data.dtype.str}:{data.shape}".encode())
            h.update(data)  # the contiguous buffer itself: no tobytes() copy

    attrs("/", f)
    f.visititems(visit)
    return h.hexdigest()


def _listed(folder: Path) -> list[Path]:
    """Complete checkpoint files, newest first (temporary files are ignored)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]
