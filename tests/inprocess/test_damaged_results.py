"""A damaged results file is never hidden: every command that reads results
names it (path and reason) in one ``mpifl: error:`` line with exit status 2. Summaries (``mpifl
report`` of files, folders and sweep folders, ``mpifl run --seeds``, ``mpifl reproduce
--report-only``, ``mpifl sweep --dry-run`` / ``--print-args``) still show the intact runs and
count the damaged one as damaged, never as complete or not run; readers that need every file
(``mpifl export``, ``mpifl plot``, :func:`mpifl.load`) refuse. Real commands in subprocesses on a
real two-seed sweep of a tiny Fashion-MNIST job (one rank, two rounds).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import small_fmnist_job, write_fmnist_job

pytestmark = pytest.mark.slow  # whole runs in every module fixture: left out of make check

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
GOOD, BAD = "runs/fedavg_seed0.h5", "runs/fedavg_seed1.h5"


def mpifl(*args, code: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mpifl", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=300)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def error_line(proc: subprocess.CompletedProcess, *damaged: tuple[Path, str]) -> str:
    """The one ``mpifl: error:`` line, last on stderr, naming every damaged file and reason
    (``reason``: how the reason in parentheses starts)."""
    lines = [x for x in proc.stderr.splitlines() if x.startswith("mpifl: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith(lines[0])
    assert lines[0].startswith(f"mpifl: error: {len(damaged)} damaged results file(s): ")
    for path, reason in damaged:
        assert f"{path} ({reason}" in lines[0], lines[0]
    return lines[0]


def flip(path: Path) -> Path:
    """Flip 8 bytes in the middle of the file."""
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 8] = bytes(b ^ 0xFF for b in raw[mid:mid + 8])
    path.write_bytes(bytes(raw))
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "dmg.toml", small_fmnist_job(
        "dmg", seed=0, rounds=2, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg"))


@pytest.fixture(scope="module")
def sweep(job, tmp_path_factory) -> Path:
    """A finished ``mpifl run JOB --seeds 0-1`` folder (index, two runs), copied by the tests."""
    out = tmp_path_factory.mktemp("built") / "seeds"
    proc = mpifl("run", job, "--seeds", "0-1", "--out", out, code=0)
    assert "| fedavg | - | 2/2 | 2 |" in proc.stdout  # intact: every run counted, exit 0
    return out


@pytest.fixture
def damaged(sweep, tmp_path) -> Path:
    """A copy of the sweep whose seed-1 results file has 8 bytes flipped."""
    folder = tmp_path / "seeds"
    shutil.copytree(sweep, folder)
    flip(folder / BAD)
    return folder


def test_report_of_a_sweep_folder_counts_the_damaged_run(damaged):
    proc = mpifl("report", damaged, code=2)
    error_line(proc, (damaged / BAD, "checksum mismatch"))
    assert "| fedavg | - | 1/2 (1 damaged) | 2 |" in proc.stdout, proc.stdout
    assert f"- {damaged / BAD}: checksum mismatch" in proc.stdout
    written = (damaged / "report.md").read_text()
    assert "1/2 (1 damaged)" in written and f"{damaged / BAD}: checksum mismatch" in written
    (row,) = csv.DictReader((damaged / "report.csv").open())
    assert (row["seeds"], row["complete"], row["damaged"]) == ("2", "1", "1")
    proc = mpifl("report", damaged, "--json", code=2)
    (group,) = json.loads(proc.stdout)
    assert (group["seeds"], group["complete"], group["damaged"]) == (2, 1, 1)
    assert group["damaged_runs"] == [{"path": str(damaged / BAD), "reason": "checksum mismatch"}]
    error_line(proc, (damaged / BAD, "checksum mismatch"))


def test_report_of_files_and_of_a_folder_shows_the_intact_run(damaged):
    proc = mpifl("report", damaged / GOOD, damaged / BAD, code=2)
    error_line(proc, (damaged / BAD, "checksum mismatch"))
    assert proc.stdout.splitlines()[0].split() == ["metric", "fedavg_seed0"], proc.stdout
    assert f"- {damaged / BAD}: checksum mismatch" in proc.stdout
    proc = mpifl("report", damaged / "runs", "--json", code=2)  # a folder of results files
    error_line(proc, (damaged / "runs" / "fedavg_seed1.h5", "checksum mismatch"))
    out = json.loads(proc.stdout)
    assert [r["run"] for r in out["runs"]] == ["fedavg_seed0"]
    assert out["damaged"] == [{"path": str(damaged / BAD), "reason": "checksum mismatch"}]


def test_export_plot_and_load_refuse_naming_the_file(damaged, tmp_path):
    proc = mpifl("export", damaged, "--csv", tmp_path / "tables", code=2)  # a sweep folder
    error_line(proc, (damaged / BAD, "checksum mismatch"))
    assert not (tmp_path / "tables").exists()
    proc = mpifl("plot", "curves", damaged / GOOD, damaged / BAD, "--out", tmp_path / "f.png",
                 code=2)  # results files
    error_line(proc, (damaged / BAD, "checksum mismatch"))
    assert not (tmp_path / "f.png").exists()
    import mpifl as api
    from mpifl.store.results import DamagedResults

    with pytest.raises(DamagedResults) as err:
        api.load(damaged)
    assert err.value.damaged == [(damaged / BAD, "checksum mismatch")]
    assert str(err.value) == f"1 damaged results file(s): {damaged / BAD} (checksum mismatch)"


def test_sweep_dry_run_and_print_args_list_it_as_damaged(damaged):
    proc = mpifl("sweep", damaged / "seeds.toml", "--out", damaged, "--dry-run", code=2)
    error_line(proc, (damaged / BAD, "checksum mismatch"))
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["fedavg_seed0", "complete"]
    assert lines[1].split()[:2] == ["fedavg_seed1", "damaged"]
    assert "(damaged results file: checksum mismatch)" in lines[1]
    assert "2 runs: 1 complete, 1 damaged" in proc.stdout
    proc = mpifl("sweep", damaged / "seeds.toml", "--out", damaged, "--print-args", code=2)
    assert proc.stdout == ""  # nothing to start: the damaged run is not run again over its file
    error_line(proc, (damaged / BAD, "checksum mismatch"))


def test_seeds_again_reports_the_others_and_leaves_the_damaged_file(damaged, job):
    before = (damaged / BAD).read_bytes()
    proc = mpifl("run", job, "--seeds", "0-1", "--out", damaged, code=2)
    error_line(proc, (damaged / BAD, "checksum mismatch"))
    assert "| fedavg | - | 1/2 (1 damaged) | 2 |" in proc.stdout, proc.stdout
    assert "starting 0" in proc.stderr and (damaged / BAD).read_bytes() == before


def test_reproduce_report_only_counts_it_as_damaged_not_as_not_run(damaged, tmp_path):
    suites, out = tmp_path / "suites", tmp_path / "out"
    suites.mkdir()
    out.mkdir()
    shutil.copy(damaged / "seeds.toml", suites / "tiny.toml")
    damaged.rename(out / "tiny")
    (suites / "figures.toml").write_text(
        '[[row]]\nsuite = "tiny"\nsection = "Tiny"\nmethod = "FedAvg"\n'
        'select = {"server.algorithm" = "fedavg"}\nmetric = "mean"\nvalue = 20.0\n')
    doc = tmp_path / "R.md"
    proc = mpifl("reproduce", "--suites", suites, "--out", out, "--doc", doc, "--report-only",
                 code=2)
    error_line(proc, (out / "tiny" / BAD, "checksum mismatch"))
    assert "1 damaged results file(s), left out." in proc.stdout
    text = doc.read_text()
    row = next(x for x in text.splitlines() if x.startswith("| FedAvg | mean |"))
    assert "| 1 (+1 damaged) |" in row and "not done" not in row and "not run" not in row, row
    assert f"- `{out / 'tiny' / BAD}`: checksum mismatch" in text
    flip(out / "tiny" / GOOD)  # every seed damaged: the verdict says so
    proc = mpifl("reproduce", "--suites", suites, "--out", out, "--doc", doc, "--report-only",
                 code=2)
    error_line(proc, (out / "tiny" / BAD, "checksum mismatch"),
               (out / "tiny" / GOOD, "checksum mismatch"))
    row = next(x for x in doc.read_text().splitlines() if x.startswith("| FedAvg | mean |"))
    assert row.endswith("| 0 (+2 damaged) | - | - | damaged |"), row


def test_empty_missing_and_non_hdf5_files_are_named(sweep, tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    shutil.copy(sweep / GOOD, folder / "good.h5")
    (folder / "empty.h5").write_bytes(b"")
    raw = (sweep / GOOD).read_bytes()
    (folder / "half.h5").write_bytes(raw[:len(raw) // 2])
    (folder / "notes.h5").write_text("not results\n")
    expected = ((folder / "empty.h5", "empty: 0 bytes)"),
                (folder / "half.h5", f"truncated: {len(raw) // 2 - 512} of {len(raw) - 512} "),
                (folder / "notes.h5", "not an HDF5 file, so not an mpifl results file)"))
    proc = mpifl("report", folder, code=2)
    error_line(proc, *expected)
    assert proc.stdout.splitlines()[0].split() == ["metric", "good"]
    missing = tmp_path / "missing.h5"  # not there: named as such, not as damaged, nothing read
    proc = mpifl("report", folder, missing, code=2)
    assert proc.stderr.startswith(f"mpifl: error: no such file: {missing} (") and not proc.stdout
    error_line(mpifl("export", folder / "good.h5", folder / "empty.h5", folder / "half.h5",
                     folder / "notes.h5", "--csv", tmp_path / "t", code=2), *expected)
    # a sweep whose seed-1 file was truncated to nothing
    copy = tmp_path / "seeds"
    shutil.copytree(sweep, copy)
    (copy / BAD).write_bytes(b"")
    proc = mpifl("report", copy, code=2)
    error_line(proc, (copy / BAD, "empty: 0 bytes)"))
    assert "| fedavg | - | 1/2 (1 damaged) | 2 |" in proc.stdout
