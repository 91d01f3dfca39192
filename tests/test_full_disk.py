"""A disk that fills, or fails, during a run: every write of results,
checkpoints, live logs and exports ends in one line naming the path, keeps the last good state
and leaves no temporary file; every rank exits 2 (no segfault, no h5py noise), and once space
is freed `mpifl resume` ends with the model of an uninterrupted run, bit for bit. A live logger
that cannot write is switched off with one warning and the run goes on.

Real ranks (mpiexec -n 3) on real Fashion-MNIST; the uninterrupted run they are compared with
comes from the shared MPI world (tests/world.py); the disk is a real small tmpfs filled from
outside (as root; skipped otherwise); the I/O error is a real EIO from a loop-mounted ext2
whose device is shrunk under it (skipped where loop devices cannot be set up).
"""

from __future__ import annotations

import csv
import logging
import re
import shutil
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.errors import OutputError
from mpifl.core.locking import lock_path
from mpifl.runtime.loggers import LoggerSet
from mpifl.store import checkpoint
from mpifl.store.results import read_results
from tests.helpers import fill_disk, small_fmnist_job, write_fmnist_job
from tests.test_reliability import ENV, cmd, error_line, model_of, mpifl, tmpfs  # noqa: F401
from tests.world import world_run

ROUNDS = 12
FILL_AFTER = 4  # rounds in the results file when the disk is filled
NOISE = ("Traceback", "Segmentation", "signal 11", "decrement id ref count", "Exception ignored",
         "BAD TERMINATION", "KILLED BY SIGNAL")


JOB = small_fmnist_job("full", seed=5, rounds=ROUNDS, eval_every=2, checkpoint_every=3,
                       partition='partition = "shards"', algorithm="fedfv")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "full.toml", JOB)


def _whole(name: str, for_mpi: bool):
    """The job, uninterrupted, on 3 ranks of the shared world."""
    return world_run(name, ["run", "{dir}/full-disk.toml", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress"], files={"full-disk.toml": JOB}, for_mpi=for_mpi)


#: the oracle of the resumed runs (the mpi tier), and a finished run to export (the other)
REFERENCE = _whole("full-disk-ref", for_mpi=True)
FINISHED = _whole("full-disk-finished", for_mpi=False)


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


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".tmp-" in p.name or ".preflight-" in p.name]


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


@pytest.mark.slow
def test_a_logger_that_cannot_write_is_switched_off_and_the_run_goes_on(job, tmpfs, tmp_path):
    """TensorBoard's folder on a full disk (a symbolic link), the results on a good one."""
    pytest.importorskip("tensorboard")
    mnt = tmpfs("256k")
    out = tmp_path / "run.h5"
    (mnt / "tb").mkdir()
    out.with_suffix(".tb").symlink_to(mnt / "tb")
    fill_disk(mnt)
    proc = mpifl(1, "run", job, "--out", out, "--log", "tensorboard", "--log", "csv",
                 timeout=300)
    for noise in NOISE:
        assert noise not in proc.stderr, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if "WARNING" in x and "logger" in x]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert (f"logger 'tensorboard' cannot write {out.with_suffix('.tb')}: No space left on "
            "device; it is switched off and the run goes on") in warnings[0]
    res = read_results(out)
    assert res["attrs"]["status"] == "complete" and len(res["rounds"]["round"]) == ROUNDS
    with open(out.with_suffix(".log.csv"), newline="") as f:  # the other logger went on
        assert len(list(csv.DictReader(f))) == ROUNDS


ROW = {"round": 0, "num_clients": 3, "train_loss": 1.5, "lr": 0.1, "time_train": 0.2}


@pytest.mark.parametrize("when", ["at-start", "mid-run"])
def test_the_csv_logger_on_a_full_disk_warns_once_keeps_whole_rows(tmpfs, caplog, when):
    mnt = tmpfs("256k")
    out = mnt / "run.h5"
    if when == "at-start":
        fill_disk(mnt)
    with caplog.at_level(logging.WARNING, logger="mpifl.loggers"):
        loggers = LoggerSet(["csv"], out, {}, 0)
        for rnd in range(3000):  # ~60 KB of rows: past the last free page
            if rnd == 5 and when == "mid-run":
                fill_disk(mnt)
            loggers.log_round(rnd, {**ROW, "round": rnd}, {"mean": 0.5} if rnd % 2 else None)
        loggers.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "mpifl.loggers"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"logger 'csv' cannot write {out.with_suffix('.log.csv')}: "
                                  "No space left on device; it is switched off")
    assert not loggers.active and not temporaries(mnt)
    with open(out.with_suffix(".log.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == list(range(len(rows)))  # whole rows, in order
    assert all(None not in r and r["train_loss"] == "1.5" for r in rows)
    assert (len(rows) >= 5) == (when == "mid-run")


def test_an_export_to_a_full_disk_fails_in_one_line_and_keeps_nothing(world, tmpfs):
    from mpifl.report.export import export

    finished = world.file(FINISHED)
    mnt = tmpfs("256k")
    fill_disk(mnt)
    with pytest.raises(OutputError) as err:
        export([str(finished)], mnt / "tables", "csv")
    message = str(err.value)
    assert re.fullmatch(rf"cannot write export table {re.escape(str(mnt))}/tables/\w+\.csv: No "
                        "space left on device", message), message
    assert not temporaries(mnt) and not list((mnt / "tables").iterdir())


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


@pytest.mark.parametrize("error", ["EIO", "EDQUOT", "ENOSPC", "KeyboardInterrupt"])
def test_a_failed_write_inside_hdf5_never_reaches_hdf5(tmp_path, monkeypatch, capfd, error):
    """Any errno (and a second Ctrl-C) in the middle of HDF5's writes: one error naming the
    file after HDF5 has closed it cleanly, no temporary, the previous file intact."""
    import errno
    import os

    from mpifl.store import sealed

    path = tmp_path / "r.h5"
    sealed.write_atomic(path, lambda f: f.create_dataset("x", data=np.arange(10)), "results file")
    before = path.read_bytes()
    calls, real = [], os.pwrite

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            if error == "KeyboardInterrupt":
                raise KeyboardInterrupt
            raise OSError(getattr(errno, error), os.strerror(getattr(errno, error)))
        return real(fd, data, offset)

    def fill(f):
        for i in range(20):
            f.create_dataset(f"d{i}", data=np.arange(20_000.0) + i)
            f.attrs[f"a{i}"] = "x" * 500
        assert f["d0"][5] == 5.0  # HDF5 reads back what it wrote, failed or not

    monkeypatch.setattr(os, "pwrite", failing)
    if error == "KeyboardInterrupt":
        with pytest.raises(KeyboardInterrupt):
            sealed.write_atomic(path, fill, "results file")
    else:
        with pytest.raises(OutputError) as err:
            sealed.write_atomic(path, fill, "results file")
        text = os.strerror(getattr(errno, error))
        assert str(err.value) == f"cannot write results file {path}: {text}"
    monkeypatch.undo()
    assert len(calls) >= 3 and path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.h5"]
    import gc

    gc.collect()  # h5py objects released: nothing for HDF5 to complain about
    captured = capfd.readouterr()
    assert "decrement" not in captured.err and "Traceback" not in captured.err, captured.err
