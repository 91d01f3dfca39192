"""A disk that fills, or fails, during a run: every write of results,
checkpoints, live logs and exports ends in one line naming the path, keeps the last good state
and leaves no temporary file; every rank exits 2 (no segfault, no h5py noise), and once space
is freed `mpifl resume` ends with the model of an uninterrupted run, bit for bit. A live logger
that cannot write is switched off with one warning and the run goes on.

Real ranks (mpiexec -n 3) on real Fashion-MNIST; the uninterrupted run they are compared with
comes from the shared MPI world (tests/world.py); the disk is a real small tmpfs filled from
outside (as root; skipped otherwise); the I/O error is a real EIO from a loop-mounted ext2
whose device is shrunk under it (skipped where loop devices cannot be set up). The tests that
start mpiexec themselves are in tests/mpi/test_full_disk.py.
"""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from mpifl.core.errors import OutputError
from mpifl.runtime.loggers import LoggerSet
from mpifl.store.results import read_results
from tests.helpers import fill_disk, small_fmnist_job, write_fmnist_job
from tests.inprocess.test_reliability import mpifl, tmpfs  # noqa: F401
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


#: a finished run to export (tests/mpi/test_full_disk.py declares the oracle of its resumed runs)
FINISHED = _whole("full-disk-finished", for_mpi=False)


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".tmp-" in p.name or ".preflight-" in p.name]


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
