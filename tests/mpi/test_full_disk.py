"""A disk that fills, or fails, during a run on real MPI ranks (mpiexec -n 3 and -n 2): every
rank exits 2 with one line naming the path, the last good state is kept with no temporary file,
and once space is freed `mpifl resume` ends with the model of the shared world's uninterrupted
run, bit for bit. Real ranks, because the failure must end every launched rank cleanly (no
segfault, no h5py noise, no hang). The disk is a real small tmpfs filled from outside (as root;
skipped otherwise); the I/O error is a real EIO from a loop-mounted ext2 whose device is shrunk
under it (skipped where loop devices cannot be set up).
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.locking import lock_path
from mpifl.store import checkpoint
from mpifl.store.results import read_results
from tests.helpers import fill_disk
from tests.inprocess.test_full_disk import FILL_AFTER, NOISE, ROUNDS, _whole, temporaries
from tests.inprocess.test_full_disk import job  # noqa: F401 (a fixture)
from tests.inprocess.test_reliability import ENV, cmd, error_line, model_of, mpifl
from tests.inprocess.test_reliability import tmpfs  # noqa: F401 (a fixture)

#: the oracle of the resumed runs (the real-rank tier's world: tests/world.py)
REFERENCE = _whole("full-disk-ref", for_mpi=True)


def rows_in(path: Path) -> int:
    try:
        with h5py.File(path, "r") as f:
            return len(f["rounds/round"])
    except (OSError, KeyError):
        return -1


def clean_failure(proc: subprocess.CompletedProcess, folder: Path) -> str:
    """Status 2, one ``mpifl: error:`` line naming a path in ``folder``, nothing else."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    for noise in NOISE:
        assert noise not in out, out[-3000:]
    line = error_line(proc.stderr)
    assert "cannot write" in line and f"{folder}/" in line, line
    return line


def run_and_fill(job: Path, out: Path, leave: int, *args: str) -> subprocess.CompletedProcess:
    """Run on 3 ranks; once the results file has FILL_AFTER rounds, fill its disk from outside
    up to ``leave`` free bytes."""
    proc = subprocess.Popen(cmd(3, "run", job, "--out", out, *args), env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while proc.poll() is None and rows_in(out) < FILL_AFTER and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the disk was filled"
    fill_disk(out.parent, leave)
    stdout, stderr = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.mpi
@pytest.mark.parametrize("leave,what", [(0, "results file|checkpoint"), (45_000, "checkpoint")],
                         ids=["next-write", "during-checkpoint"])
def test_a_disk_filled_during_the_run_ends_cleanly_and_resumes_exactly(job, world, tmpfs,
                                                                       leave, what):
    """0 bytes left: the next write fails (a results write or the next checkpoint); 45 KB
    left: results rewrites (~25 KB) still fit, a checkpoint (~50 KB) fails half-written."""
    reference = world.file(REFERENCE)
    mnt = tmpfs("3m")
    out = mnt / "run.h5"
    proc = run_and_fill(job, out, leave, "--log", "csv")
    line = clean_failure(proc, mnt)
    assert re.search(rf"cannot write ({what}) {re.escape(str(mnt))}/\S+: No space left on "
                     "device", line), line
    assert not temporaries(mnt) and not lock_path(out).exists()
    res = read_results(out)  # verified: the last complete write, every row up to it
    done = len(res["rounds"]["round"])
    assert FILL_AFTER <= done < ROUNDS and res["attrs"]["status"] == "running"
    np.testing.assert_array_equal(res["rounds"]["round"], np.arange(done))
    ckpt = checkpoint.load_latest(checkpoint.folder_for(out))  # the newest valid one
    assert FILL_AFTER // 3 * 3 <= ckpt.round <= done  # checkpoint_every = 3
    warnings = [x for x in proc.stderr.splitlines() if "logger 'csv'" in x]
    assert len(warnings) <= 1 and all(str(out.with_suffix(".log.csv")) in x for x in warnings)

    subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)  # space freed
    mpifl(3, "resume", out, timeout=300)
    np.testing.assert_array_equal(model_of(out), model_of(reference))
    res, ref = read_results(out), read_results(reference)
    np.testing.assert_array_equal(res["rounds"]["train_loss"], ref["rounds"]["train_loss"])
    np.testing.assert_array_equal(res["eval"]["client_accuracy"], ref["eval"]["client_accuracy"])
    with open(out.with_suffix(".log.csv"), newline="") as f:
        logged = list(csv.DictReader(f))  # whole rows only, each round once
    assert [int(r["round"]) for r in logged] == list(range(ROUNDS))
    assert all(None not in r and all(v is not None for v in r.values()) for r in logged)
    assert not temporaries(mnt)


@pytest.mark.mpi
@pytest.mark.parametrize("leave", [0, 12_000], ids=["empty", "almost-full"])
def test_a_disk_full_at_start_fails_in_one_line_naming_the_path(job, tmpfs, leave):
    """0 bytes: not even the run lock fits; 12 KB: the lock fits, the first results file not."""
    mnt = tmpfs("1m")
    fill_disk(mnt, leave)
    before = sorted(p.name for p in mnt.iterdir())
    out = mnt / "run.h5"
    proc = mpifl(2, "run", job, "--out", out, "--log", "csv", code=None, timeout=300)
    line = clean_failure(proc, mnt)
    assert "No space left on device" in line, line
    assert sorted(p.name for p in mnt.iterdir()) == before  # nothing left behind


# -- a real EIO --------------------------------------------------------------------------------

@pytest.fixture
def shrinking_disk(tmp_path):
    """An ext2 file system on a loop device; ``shrink()`` cuts the device to 2 MB under it, so
    that writes past that fail with EIO (root and loop devices needed; skipped otherwise)."""
    img, mnt = tmp_path / "disk.img", tmp_path / "ext2"
    mnt.mkdir()
    steps = [["truncate", "-s", "32M", str(img)],
             ["mke2fs", "-q", "-t", "ext2", "-b", "4096", "-N", "64", "-F", str(img)]]
    for step in steps:
        if shutil.which(step[0]) is None or subprocess.run(step, capture_output=True).returncode:
            pytest.skip(f"cannot make an ext2 image ({step[0]})")
    loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True)
    if loop.returncode:
        pytest.skip(f"no loop device: {loop.stderr.strip()}")
    dev = loop.stdout.strip()
    try:
        mounted = subprocess.run(["mount", "-o", "errors=continue", dev, str(mnt)],
                                 capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount a loop device: {mounted.stderr.strip()}")

        def shrink() -> None:
            subprocess.run(["truncate", "-s", "2M", str(img)], check=True)
            subprocess.run(["losetup", "-c", dev], check=True)

        yield mnt, shrink
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@pytest.mark.mpi
def test_an_io_error_during_the_run_ends_every_rank_in_one_line(job, shrinking_disk):
    mnt, shrink = shrinking_disk
    out = mnt / "run.h5"
    proc = subprocess.Popen(cmd(3, "run", job, "--out", out), env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while proc.poll() is None and rows_in(out) < FILL_AFTER and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the device was shrunk"
    shrink()
    stdout, stderr = proc.communicate(timeout=240)
    line = clean_failure(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                         mnt)
    # the kernel's errno as it comes: EIO from writeback (at fsync), or what ext2 returns when
    # its own metadata is past the end of the device
    assert re.search(r": (Input/output error|Cannot allocate memory|No space left on device"
                     r"|Read-only file system)$", line), line
    assert not temporaries(mnt) and not lock_path(out).exists()
