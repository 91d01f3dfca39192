"""analysis/run_profile.py on real runs: the phase table, the PNG, sweep folders, bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import write_fmnist_job
from tests.test_run import SMALL, run_mpifl

pytestmark = pytest.mark.mpi  # starts mpiexec: one at a time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "analysis" / "run_profile.py"


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """A folder laid out like a sweep's: two real runs (K = 12, m = 5 and m = 3) under runs/."""
    job = write_fmnist_job(tmp_path_factory, "profile.toml", SMALL.replace("rounds = 4", "rounds = 2"))
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "runs").mkdir()
    run_mpifl(3, job, folder / "runs" / "m5.h5", "--no-progress")
    run_mpifl(1, job, folder / "runs" / "m3.h5", "--no-progress", "--set", "server.clients_per_round=3")
    return folder


def profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_table_and_plot_of_a_sweep_folder(sweep_dir, tmp_path):
    png = tmp_path / "p.png"
    proc = profile(str(sweep_dir), "--out", str(png))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "aggregate" in lines[0] and "MPI %" in lines[0]
    m3, m5 = lines[2].split(), lines[3].split()  # sorted by K then m
    assert m3[:4] == ["m3", "12", "3", "1"] and m5[:4] == ["m5", "12", "5", "3"]
    assert float(m3[-3]) == 0.0 and float(m5[-3]) > 0.0  # MB moved: none in one process
    assert 0.0 <= float(m5[-4]) <= 100.0  # the MPI share of the round, in percent
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_one_file_and_bad_paths(sweep_dir, tmp_path):
    one = profile(str(sweep_dir / "runs" / "m5.h5"), "--out", str(tmp_path / "one.png"))
    assert one.returncode == 0 and len(one.stdout.splitlines()) == 4
    for bad in (tmp_path / "missing.h5", tmp_path):
        proc = profile(str(bad), "--out", str(tmp_path / "x.png"))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        assert proc.stderr.startswith("run_profile: error: ") and "Traceback" not in proc.stderr
    text = tmp_path / "notes.h5"
    shutil.copy(SCRIPT, text)  # not HDF5
    proc = profile(str(text), "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "cannot read as HDF5" in proc.stderr
