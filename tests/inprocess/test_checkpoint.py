"""Checkpoint files: atomic writes, integrity checks, fallback to the previous valid one."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from mpifl.store import checkpoint, sealed
from mpifl.store.checkpoint import Checkpoint
from mpifl.core.errors import OutputError
from mpifl.store.results import MetricHistory, MetricSet

ROW = {"round": 0, "num_clients": 3, "train_loss": 1.5, "lr": 0.1, "conflicts_model": 1,
       "dropped": 0, "rejected": 0, "bytes_moved": 10, "time_broadcast": 0.1, "time_train": 0.2,
       "time_gather": 0.0, "time_aggregate": 0.01, "time_eval": 0.0, "time_checkpoint": 0.02,
       "peak_rss_server_mb": 512.0, "peak_rss_worker_mb": 600.0,
       "conflicts_layer": np.array([1, 0])}
SUMMARY = {"mean": 0.5, "weighted_mean": 0.5, "std": 0.1, "worst5": 0.1, "best5": 0.9, "cf": 0.3,
           "fair_angle": 0.2}


def make(rounds_done: int, d: int = 5000) -> Checkpoint:
    h = MetricHistory(MetricSet(num_clients=4, num_layers=2))
    for t in range(rounds_done):
        h.add_round({**ROW, "round": t})
    h.add_eval(rounds_done, np.array([0.1, 0.2, 0.3, 0.4]), np.ones(4), SUMMARY)
    rng = np.random.default_rng(rounds_done)
    state = {"alpha": 0.1, "tau": 2, "order": "loss", "flag": True, "seed": np.int64(7),
             "history_updates": rng.standard_normal((3, d)).astype(np.float32),
             "history_ids": np.array([4, 1, 9])}
    return Checkpoint(rounds_done, rng.standard_normal(d).astype(np.float32), state, h,
                      '{"run": {}}', 3, None)


def test_round_trip_keeps_types_and_values(tmp_path):
    ck = make(3)
    path = checkpoint.save(tmp_path, ck)
    assert path.name == "round-000003.h5"
    back = checkpoint.read(path)
    assert back.round == 3 and back.world_size == 3 and back.config_json == '{"run": {}}'
    assert np.array_equal(back.w, ck.w) and back.w.dtype == np.float32
    assert back.aggregator["alpha"] == 0.1 and type(back.aggregator["alpha"]) is float
    assert back.aggregator["tau"] == 2 and type(back.aggregator["tau"]) is int
    assert back.aggregator["order"] == "loss" and back.aggregator["flag"] is True
    assert back.aggregator["seed"] == 7 and type(back.aggregator["seed"]) is int
    assert np.array_equal(back.aggregator["history_updates"], ck.aggregator["history_updates"])
    assert back.history.rounds["round"] == [0, 1, 2]
    assert np.array_equal(back.history.rounds["conflicts_layer"], [[1, 0]] * 3)
    assert np.array_equal(back.history.accuracy[0], [0.1, 0.2, 0.3, 0.4])


def test_only_the_newest_two_are_kept_and_no_temp_files_remain(tmp_path):
    for r in (1, 2, 3, 4):
        checkpoint.save(tmp_path, make(r, d=10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000003.h5", "round-000004.h5"]
    assert checkpoint.load_latest(tmp_path).round == 4


def _model_offset(path) -> tuple[int, int]:
    with h5py.File(path, "r") as f:
        ds = f["model/global"]
        return ds.id.get_offset(), ds.id.get_storage_size()


@pytest.mark.parametrize("seed", range(5))
def test_flipped_bytes_are_detected_and_the_previous_checkpoint_is_used(tmp_path, seed):
    checkpoint.save(tmp_path, make(2))
    newest = checkpoint.save(tmp_path, make(4))
    offset, size = _model_offset(newest)
    raw = bytearray(newest.read_bytes())
    pos = offset + int(np.random.default_rng(seed).integers(size))
    raw[pos] ^= 0xFF
    newest.write_bytes(bytes(raw))
    with pytest.raises(OutputError, match="checksum mismatch"):
        checkpoint.read(newest)
    assert checkpoint.load_latest(tmp_path).round == 2


def test_truncated_checkpoint_falls_back(tmp_path):
    checkpoint.save(tmp_path, make(2))
    newest = checkpoint.save(tmp_path, make(4))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.raises(OutputError, match="unreadable checkpoint"):
        checkpoint.read(newest)
    assert checkpoint.load_latest(tmp_path).round == 2


def test_all_damaged_is_an_error_and_none_is_none(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None
    only = checkpoint.save(tmp_path, make(2))
    only.write_bytes(b"garbage")
    with pytest.raises(OutputError, match="no valid checkpoint"):
        checkpoint.load_latest(tmp_path)


def test_foreign_file_and_unknown_schema_are_refused(tmp_path):
    foreign = tmp_path / "round-000001.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = 1
    with pytest.raises(OutputError, match="not an mpifl checkpoint"):
        checkpoint.read(foreign)
    path = checkpoint.save(tmp_path, make(2))
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 99
    sealed.seal(path)  # a valid file of another version (an edit without re-sealing is damage)
    with pytest.raises(OutputError, match="schema version 99"):
        checkpoint.read(path)


def test_state_that_cannot_be_stored_without_pickle_is_refused(tmp_path):
    ck = make(1)
    ck.aggregator["bad"] = {"a": 1}
    with pytest.raises(TypeError, match="only numpy arrays and scalars"):
        checkpoint.save(tmp_path, ck)


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot mount a small tmpfs (root needed): {proc.stderr}"
    try:
        folder = mnt / "run.h5.ckpt"
        checkpoint.save(folder, make(1, d=10))
        with pytest.raises(OutputError, match="cannot write checkpoint"):
            checkpoint.save(folder, make(2, d=200_000))  # 800 KB of parameters: disk full
        assert [p.name for p in folder.iterdir()] == ["round-000001.h5"]
        assert checkpoint.load_latest(folder).round == 1
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_the_digest_reads_large_datasets_in_slabs_with_the_same_result(tmp_path, monkeypatch):
    """A rule state of GBs (FedFV's history at 10,000 clients a round) is digested a slab of
    rows at a time; the digest is the one of the whole array read at once (the oracle)."""
    import hashlib

    import h5py

    from mpifl.store import checkpoint as ck

    rows = np.random.default_rng(0).standard_normal((1000, 37)).astype(np.float32)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("aggregator/history_updates", data=rows)
        f.create_dataset("aggregator/tau", data=np.int64(2))  # a scalar dataset
        whole = ck._digest(f)
        monkeypatch.setattr(ck, "DIGEST_SLAB_BYTES", 1000)  # 6 rows a slab, a short last one
        assert ck._digest(f) == whole
        h = hashlib.sha256()  # the oracle: every dataset read whole, in visiting order
        h.update(f"aggregator/history_updates:{rows.dtype.str}:{rows.shape}".encode())
        h.update(rows)
        h.update(f"aggregator/tau:{np.dtype(np.int64).str}:(1,)".encode())
        h.update(np.ascontiguousarray(np.int64(2)))
        assert whole == h.hexdigest()
