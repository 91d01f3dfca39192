"""Live loggers on rank 0 (mpifl.runtime.loggers): what each writes equals the results file,
logging changes no result, a failing logger is dropped while the run goes on, resume does not
log a round twice, and a bad or uninstallable logger is a one-line config error."""

from __future__ import annotations

import csv
import glob
import json
import logging
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.runtime.loggers import LOGGERS
from tests.helpers import small_fmnist_job, write_fmnist_job


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "tiny.toml", small_fmnist_job(
        "tiny", seed=0, rounds=4, eval_every=2, checkpoint_every=2,
        partition='partition = "shards"', algorithm="fedfv"))


@pytest.fixture(scope="module")
def plain(job) -> Path:
    out = job.parent / "plain.h5"
    assert main(["run", str(job), "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def logged(job) -> Path:
    out = job.parent / "logged.h5"
    assert main(["run", str(job), "--out", str(out), "--no-progress",
                 "--log", "csv", "--log", "tensorboard"]) == 0
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_logging_changes_no_result(plain, logged):
    with h5py.File(plain) as a, h5py.File(logged) as b:
        for key in ("model/global", "eval/client_accuracy", "rounds/train_loss", "rounds/selected"):
            np.testing.assert_array_equal(a[key][()], b[key][()], err_msg=key)


def test_csv_rows_equal_the_results_file(logged):
    rows = read_csv(logged.with_suffix(".log.csv"))
    with h5py.File(logged) as f:
        assert [int(r["round"]) for r in rows] == list(f["rounds/round"][()])
        np.testing.assert_array_equal([float(r["train_loss"]) for r in rows], f["rounds/train_loss"][()])
        evals = {int(r["round"]) + 1: float(r["eval/mean"]) for r in rows if r["eval/mean"]}
        assert evals == dict(zip(f["eval/round"][()].tolist(), f["eval/mean"][()].tolist()))


def test_tensorboard_events_hold_the_scalars(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logged.with_suffix(".tb")))
    acc.Reload()
    with h5py.File(logged) as f:
        mean = [(e.step, e.value) for e in acc.Scalars("eval/mean")]
        assert [s for s, _ in mean] == f["eval/round"][()].tolist()
        np.testing.assert_allclose([v for _, v in mean], f["eval/mean"][()], rtol=1e-6)
        loss = [e.value for e in acc.Scalars("train_loss")]
        np.testing.assert_allclose(loss, f["rounds/train_loss"][()], rtol=1e-6)


def test_wandb_offline_run_records_the_round_values(job, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB__SERVICE_WAIT", raising=False)  # the logger's own allowance
    out = job.parent / "wandb.h5"
    assert main(["run", str(job), "--out", str(out), "--no-progress", "--log", "wandb"]) == 0
    dropped = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage()]
    assert not dropped, dropped  # the logger ran to the end (not dropped: see SERVICE_WAIT_S)
    (record,) = glob.glob(str(out.with_suffix(".wandb") / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(record).read_bytes()  # protobuf records keep keys and JSON values as text
    with h5py.File(out) as f:
        values = [*f["eval/mean"][()], *f["rounds/train_loss"][()]]
    assert b"eval/mean" in data and all(json.dumps(float(v)).encode() in data for v in values)


class Broken:
    """A logger that fails on its second round."""

    def __init__(self, out, config, start):
        self.calls = 0

    def log_round(self, rnd, row, summary):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("disk on fire")

    def close(self):
        pass


@pytest.fixture
def broken_logger():
    LOGGERS.add("broken", Broken)
    yield
    LOGGERS._entries.pop("broken")


def test_a_failing_logger_warns_once_and_the_run_goes_on(job, plain, broken_logger, caplog):
    out = job.parent / "broken.h5"
    with caplog.at_level(logging.WARNING, logger="mpifl.loggers"):
        assert main(["run", str(job), "--out", str(out), "--no-progress",
                     "--log", "broken", "--log", "csv"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "mpifl.loggers"]
    assert len(warnings) == 1 and "'broken' failed" in warnings[0] and "disk on fire" in warnings[0]
    assert len(read_csv(out.with_suffix(".log.csv"))) == 4  # the other logger kept going
    with h5py.File(plain) as a, h5py.File(out) as b:
        np.testing.assert_array_equal(a["model/global"][()], b["model/global"][()])


def test_resume_logs_each_round_once(job, tmp_path):
    out = tmp_path / "r.h5"
    assert main(["run", str(job), "--out", str(out), "--no-progress", "--log", "csv"]) == 0
    (out.parent / "r.h5.ckpt" / "round-000004.h5").unlink()  # as if killed after round 3
    assert main(["resume", str(out), "--rounds", "6", "--no-progress"]) == 0
    rows = read_csv(out.with_suffix(".log.csv"))
    assert [int(r["round"]) for r in rows] == list(range(6))
    with h5py.File(out) as f:
        np.testing.assert_array_equal([float(r["train_loss"]) for r in rows], f["rounds/train_loss"][()])


def test_unknown_or_uninstalled_logger_is_a_config_error(job, tmp_path, capsys):
    class NeedsMissing(Broken):
        requires = ("no_such_package_mpifl", "nothing")

    LOGGERS.add("needs_missing", NeedsMissing)
    try:
        assert main(["run", str(job), "--out", str(tmp_path / "a.h5"), "--log", "tensorbord"]) == 2
        assert main(["run", str(job), "--out", str(tmp_path / "b.h5"), "--log", "needs_missing"]) == 2
    finally:
        LOGGERS._entries.pop("needs_missing")
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].endswith("unknown logger 'tensorbord' (did you mean 'tensorboard'?); known: "
                           "csv, needs_missing, tensorboard, wandb")
    assert "needs the no_such_package_mpifl package: pip install 'mpifl[nothing]'" in err[1]
    assert not list(tmp_path.iterdir())  # refused before anything was written
