"""The sharded server's damaged checkpoints on real ranks (mpiexec -n 3, ``server.shards = 3``):
a missing shard file falls back to the previous checkpoint and the resumed run equals the shared
world's uninterrupted one, and a damaged shard file ends every rank with one line naming it.
Real ranks, because each shard file is read by its own launched rank and a failure on one must
end them all (it would end the shared world too). The runs they start from come from the
real-rank tier's world (tests/world.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.store import checkpoint
from tests.helpers import write_fmnist_job
from tests.inprocess.test_resume import contents, run
from tests.inprocess.test_sharded_server import JOB, _run


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "sharded.toml", JOB)


#: the starts of the damaged-checkpoint tests (marked mpi: they change files, then resume)
NINE_P3 = _run("nine-p3", 3, "server.shards=3", "run.rounds=9", for_mpi=True)
SIX_P3 = _run("six-p3", 3, "server.shards=3", "run.rounds=6", for_mpi=True)
FULL_P3_MPI = _run("full-p3-mpi", 3, "server.shards=3", for_mpi=True)


def copied(world, run, dest: Path) -> Path:
    """A world run's results file and checkpoints, copied into ``dest`` to be changed."""
    src = world.file(run)
    shutil.copy2(src, dest / src.name)
    shutil.copytree(checkpoint.folder_for(src), checkpoint.folder_for(dest / src.name))
    return dest / src.name


@pytest.mark.mpi
def test_a_missing_shard_file_falls_back_to_the_previous_checkpoint(job, world, tmp_path):
    part = copied(world, NINE_P3, tmp_path)
    folder = checkpoint.folder_for(part)
    checkpoint.shard_path(folder, 9, 2).unlink()
    proc = run(3, "run", str(job), "--out", str(part), "--resume", "--set", "server.shards=3")
    assert "shard file of the checkpoint is missing" in proc.stderr
    assert "resuming after round 6" in proc.stderr
    want = contents(world.file(FULL_P3_MPI))
    got = contents(part)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.mpi
def test_a_damaged_shard_file_ends_every_rank_with_one_line(job, world, tmp_path):
    part = copied(world, SIX_P3, tmp_path)
    shard = checkpoint.shard_path(checkpoint.folder_for(part), 6, 1)
    with h5py.File(shard, "r") as f:
        offset = f["aggregator/history_updates"].id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[offset + 5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    before = part.read_bytes()
    proc = run(3, "run", str(job), "--out", str(part), "--resume", "--set", "server.shards=3",
               code=2)
    assert "Traceback" not in proc.stderr and str(shard) in proc.stderr
    assert "round-000006.h5" in proc.stderr  # how to go on: the checkpoint to remove
    assert part.read_bytes() == before
