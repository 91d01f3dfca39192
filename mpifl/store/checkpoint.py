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
    /history/...        the metric history so far (see :class:`mpifl.store.MetricHistory`); its
                        datasets of 64 KiB or more (the (E, K) per-client evaluations) chunked
                        and deflate-compressed as in results files (docs/RESULTS.md, "Storage"):
                        storage only, the values (and ``digest``, taken over them) are the same

Workers hold no state between rounds (every random draw is keyed by seed, round and client),
so rank 0's checkpoint is the whole state of the job, except on a sharded server
(``server.shards = P > 1``): there shard j first writes the column block ``[lo_j, hi_j)`` of the
rule's d-sized state (its ``sharded_state`` keys) to ``round-NNNNNN.shard-J.h5``
(:func:`save_shard`, sealed and digested the same way), and rank 0's file then lists them::

    /                   attrs: ... shards (P)
    /shards/bounds      (P + 1,) int64 column block bounds
    /shards/digests     (P,) the shard files' ``digest`` attributes (so a shard file from
                        another checkpoint or a damaged one is refused on load)
    /aggregator/<key>   the state keys that are not sharded (scalars, per-client vectors)

A shard file: attrs kind="mpifl-checkpoint-shard", round, shard, shards, lo, hi, d, digest;
``/aggregator/<key>`` (N, hi - lo) float32 blocks. :func:`state_block` reads any column range
back, from the shard files of any P or from an unsharded checkpoint's full arrays, so a run can
resume with another number of shards.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpifl.core.errors import OutputError
from mpifl.core.locking import clean_stale_temporaries
from mpifl.store.results import READABLE_VERSIONS, SCHEMA_VERSION, MetricHistory
from mpifl.store.sealed import open_verified, reason, write_atomic

log = logging.getLogger("mpifl.store.checkpoint")

KIND = "mpifl-checkpoint"
SHARD_KIND = "mpifl-checkpoint-shard"
KEEP = 2
_NAME = re.compile(r"^round-(\d{6,})\.h5$")
_SHARD_NAME = re.compile(r"^round-(\d{6,})\.shard-(\d+)\.h5$")


@dataclass
class Checkpoint:
    round: int  # rounds completed; the next round to run
    w: np.ndarray  # (d,) float32
    aggregator: dict[str, Any]
    history: MetricHistory
    config_json: str
    world_size: int
    path: Path
    #: sharded server: (P + 1,) int64 column block bounds and the P shard files' digests
    shard_bounds: np.ndarray | None = None
    shard_digests: list[str] | None = None
    #: state kept per client by the server outside the rule (FedBN's local BatchNorm
    #: coordinates, ``model.batchnorm = "local"``): name -> array; empty when none
    client_state: dict[str, Any] = field(default_factory=dict)
    #: state of the server's own stages after the rule (the server optimizer's moments,
    #: ``optimizer_m``, ``optimizer_v``): name -> array; empty when none
    server_state: dict[str, Any] = field(default_factory=dict)

    @property
    def shards(self) -> int:
        """P, the number of shard files (1: the state is all in this file)."""
        return 1 if self.shard_bounds is None else len(self.shard_bounds) - 1


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
        raise OutputError(f"cannot write checkpoint {final}: {reason(exc)}") from None
    clean_stale_temporaries(folder)  # left by a writer killed mid-write
    if ckpt.shard_bounds is not None:
        ckpt.shard_digests = _shard_digests(folder, ckpt.round, len(ckpt.shard_bounds) - 1)
    write_atomic(final, lambda f: _write(f, ckpt), "checkpoint")
    try:  # the new checkpoint is complete: older ones left behind by an I/O error do no harm
        listed = _listed(folder)
        for old in listed[KEEP:]:
            _remove(old)
        kept = {int(m.group(1)) for p in listed[:KEEP] if (m := _NAME.match(p.name))}
        for path in folder.iterdir():  # shard files of dropped checkpoints, or of refused ones
            if (m := _SHARD_NAME.match(path.name)) and int(m.group(1)) not in kept:
                _remove(path)
    except OSError as exc:
        log.warning("cannot list old checkpoints in %s to remove them: %s", folder, reason(exc))
    return final


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove the old checkpoint %s: %s", path, reason(exc))


def shard_path(folder: Path, rounds_done: int, index: int) -> Path:
    """Shard ``index``'s file of the checkpoint after ``rounds_done`` rounds."""
    return folder / f"round-{rounds_done:06d}.shard-{index}.h5"


def save_shard(folder: Path, rounds_done: int, index: int, size: int, lo: int, hi: int, d: int,
               state: dict[str, np.ndarray]) -> Path:
    """Write shard ``index`` of ``size``'s blocks of the rule's sharded state atomically.

    Call it on every shard before rank 0's :func:`save` of the same round, which lists them.

    Args:
        lo, hi: the shard's column block of the d parameters.
        state: key -> (N, hi - lo) float32 array (N = 0 rows may come as (0, 0)).

    Raises:
        OutputError: the folder or file cannot be written.
    """
    final = shard_path(folder, rounds_done, index)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write checkpoint {final}: {reason(exc)}") from None

    def write(f: h5py.File) -> None:
        f.attrs.update(kind=SHARD_KIND, schema_version=SCHEMA_VERSION, round=rounds_done,
                       shard=index, shards=size, lo=lo, hi=hi, d=d)
        group = f.create_group("aggregator")
        for key, value in state.items():
            group.create_dataset(key, data=np.asarray(value))
        f.attrs["digest"] = _digest(f)

    write_atomic(final, write, "checkpoint")
    return final


def _shard_digests(folder: Path, rounds_done: int, size: int) -> list[str]:
    """The ``digest`` attributes of the P shard files of a checkpoint being saved.

    Raises:
        OutputError: a shard file is missing or unreadable (the checkpoint is not written).
    """
    return [_open_shard(shard_path(folder, rounds_done, j), rounds_done, j, None, full=False)[1]
            for j in range(size)]


def _open_shard(path: Path, rounds_done: int, index: int, digest: str | None,
                read: bool = False, full: bool = True) -> tuple[dict[str, Any], str]:
    """Check a shard file: kind, round, index, and its ``digest`` attribute against
    ``digest`` when given; with ``full`` also its seal and its digest against its content
    (which reads the whole file). Returns its attrs (with ``read``, its datasets under "data")
    and its digest attribute.

    Raises:
        OutputError: missing, damaged, or not that checkpoint's shard ``index``.
    """
    if not path.is_file():
        raise OutputError(f"{path}: shard file of the checkpoint is missing")
    try:
        fileobj = open_verified(path, "checkpoint")[0] if full else open(path, "rb")
        with fileobj, h5py.File(fileobj, "r") as f:
            attrs = {k: f.attrs[k] for k in f.attrs}
            if (attrs.get("kind") != SHARD_KIND or int(attrs.get("round", -1)) != rounds_done
                    or int(attrs.get("shard", -1)) != index):
                raise OutputError(f"{path}: not shard {index} of the checkpoint after round "
                                  f"{rounds_done}")
            own = str(attrs.get("digest"))
            if (full and own != _digest(f)) or (digest is not None and own != digest):
                raise OutputError(f"{path}: checksum mismatch (the shard file is damaged or "
                                  "from another checkpoint)")
            if read:
                attrs["data"] = {k: f["aggregator"][k][()] for k in f["aggregator"]}
            return attrs, own
    except OutputError:
        raise
    except Exception as exc:  # noqa: BLE001 -- damaged HDF5 raises many types
        first = (str(exc).splitlines() or [""])[0]
        raise OutputError(f"{path}: unreadable checkpoint shard ({type(exc).__name__}: "
                          f"{first})") from None


def state_block(ckpt: Checkpoint, keys: tuple[str, ...] | list[str], lo: int,
                hi: int) -> dict[str, np.ndarray]:
    """Columns ``[lo, hi)`` of the sharded state keys of a checkpoint, whatever its P.

    Args:
        keys: the rule's ``sharded_state`` keys (each an (N, d) array when whole).

    Returns:
        key -> (N, hi - lo) array, assembled from the shard files that overlap the range (an
        unsharded checkpoint's full arrays are sliced).

    Raises:
        OutputError: a shard file is missing, damaged or does not match the checkpoint.
    """
    if ckpt.shard_bounds is None:
        return {k: _columns(np.asarray(ckpt.aggregator[k]), 0, lo, hi) for k in keys}
    bounds = ckpt.shard_bounds
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    assert ckpt.shard_digests is not None  # written with the bounds
    for j in range(ckpt.shards):
        a, b = max(lo, int(bounds[j])), min(hi, int(bounds[j + 1]))
        if a >= b and not (lo == hi and j == 0):
            continue
        try:
            attrs, _ = _open_shard(shard_path(ckpt.path.parent, ckpt.round, j), ckpt.round, j,
                                   ckpt.shard_digests[j], read=True)
        except OutputError as exc:
            raise OutputError(f"{exc}; remove {ckpt.path} to resume from the checkpoint "
                              "before it") from None
        for k in keys:
            parts[k].append(_columns(attrs["data"][k], int(bounds[j]), a, max(a, b)))
    return {k: np.concatenate(v, axis=1) if len(v) > 1 else v[0] for k, v in parts.items()}


def _columns(rows: np.ndarray, offset: int, a: int, b: int) -> np.ndarray:
    """Columns [a, b) of ``rows`` whose first column is parameter ``offset``; no rows stay
    (0, b - a) whatever their stored width."""
    if rows.shape[0] == 0:
        return np.zeros((0, b - a), dtype=rows.dtype)
    return rows[:, a - offset:b - offset]


def aggregator_state(ckpt: Checkpoint, keys: tuple[str, ...] | list[str],
                     d: int) -> dict[str, Any]:
    """The rule's whole ``state_dict`` from a checkpoint (shard files joined when it has
    them), for an unsharded server.

    Raises:
        OutputError: a shard file is missing, damaged or does not match the checkpoint.
    """
    if ckpt.shard_bounds is None:
        return ckpt.aggregator
    return {**ckpt.aggregator, **state_block(ckpt, keys, 0, d)}


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


def read(path: Path, verify_shards: bool = True) -> Checkpoint:
    """Read and verify one checkpoint.

    Args:
        verify_shards: also check that every shard file it lists is there and is the one it
            lists (attributes only: reading P files of d-sized state on one rank would undo
            the sharding); :func:`state_block` verifies the content of the ones it reads.

    Raises:
        OutputError: unreadable, truncated, digest mismatch, foreign file, unknown schema, a
            missing or damaged shard file.
    """
    ckpt = _read(path)
    if verify_shards and ckpt.shard_bounds is not None and ckpt.shard_digests is not None:
        for j, digest in enumerate(ckpt.shard_digests):
            _open_shard(shard_path(path.parent, ckpt.round, j), ckpt.round, j, digest,
                        full=False)
    return ckpt


def _read(path: Path) -> Checkpoint:
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
                path=path, **_shards_of(f),
                client_state=_read_state(f["client_state"]) if "client_state" in f else {},
                server_state=_read_state(f["server_state"]) if "server_state" in f else {})
    except OutputError:
        raise
    except Exception as exc:  # noqa: BLE001 -- damaged HDF5 raises many types
        first = (str(exc).splitlines() or [""])[0]
        raise OutputError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {first})") from None


def _shards_of(f: h5py.File) -> dict[str, Any]:
    if "shards" not in f:
        return {}
    return {"shard_bounds": f["shards/bounds"][()].astype(np.int64),
            "shard_digests": [d.decode() if isinstance(d, bytes) else str(d)
                              for d in f["shards/digests"][()]]}


def _write(f: h5py.File, ckpt: Checkpoint) -> None:
    f.attrs["kind"] = KIND
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["config"] = ckpt.config_json
    f.attrs["round"] = ckpt.round
    f.attrs["world_size"] = ckpt.world_size
    f.create_dataset("model/global", data=np.asarray(ckpt.w, dtype=np.float32))
    _write_state(f.create_group("aggregator"), ckpt.aggregator)
    if ckpt.client_state:
        _write_state(f.create_group("client_state"), ckpt.client_state)
    if ckpt.server_state:
        _write_state(f.create_group("server_state"), ckpt.server_state)
    ckpt.history.to_group(f.create_group("history"))
    if ckpt.shard_bounds is not None:
        f.attrs["shards"] = ckpt.shards
        f.create_dataset("shards/bounds", data=np.asarray(ckpt.shard_bounds, dtype=np.int64))
        f.create_dataset("shards/digests", data=np.array(ckpt.shard_digests, dtype="S64"))
    f.attrs["digest"] = _digest(f)


def state_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` written as a checkpoint writes a rule's state and read back (an in-memory
    HDF5 file): what a resumed run's rule gets. Raises TypeError for a value a checkpoint
    cannot hold."""
    import io

    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        _write_state(f.create_group("aggregator"), state)
    with h5py.File(buf, "r") as f:
        return _read_state(f["aggregator"])


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

    def attrs(name: str, obj: Any) -> None:
        for key in sorted(obj.attrs):
            if key != "digest":
                h.update(f"{name}@{key}={obj.attrs[key]!r}".encode())

    def visit(name: str, obj: Any) -> None:
        attrs(name, obj)
        if not isinstance(obj, h5py.Dataset):
            return
        if obj.ndim == 0 or obj.dtype.kind == "O" or obj.nbytes <= DIGEST_SLAB_BYTES:
            data = np.ascontiguousarray(obj[()])
            h.update(f"{name}:{data.dtype.str}:{data.shape}".encode())
            h.update(data.data)  # the contiguous buffer itself: no tobytes() copy
            return
        h.update(f"{name}:{obj.dtype.str}:{obj.shape}".encode())  # as the array's own
        rows = max(1, DIGEST_SLAB_BYTES // (obj.nbytes // obj.shape[0] or 1))
        for lo in range(0, obj.shape[0], rows):  # the same C-order bytes, a slab at a time
            h.update(np.ascontiguousarray(obj[lo:lo + rows]).data)

    attrs("/", f)
    f.visititems(visit)
    return h.hexdigest()


#: Bytes of a dataset the digest reads at once: a large rule state (FedFV's history of
#: 10,000 clients a round: GBs) is never read back whole.
DIGEST_SLAB_BYTES = 64 * 2**20


def _listed(folder: Path) -> list[Path]:
    """Complete checkpoint files, newest first (temporary files are ignored)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]
