"""analysis/run_profile.py on real runs: the phase table, the PNG, sweep folders, bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inprocess.test_run import SMALL
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "analysis" / "run_profile.py"

#: a folder laid out like a sweep's, in the shared world (tests/world.py): two real runs
#: (K = 12, m = 5 on 3 ranks and m = 3 in one) under run-profile/runs/
JOB = {"run-profile.toml": SMALL.replace("rounds = 4", "rounds = 2")}
M5 = world_run("run-profile-m5", ["run", "{dir}/run-profile.toml", "--out",
                                  "{dir}/run-profile/runs/m5.h5", "--no-progress"], files=JOB)
M3 = world_run("run-profile-m3", ["run", "{dir}/run-profile.toml", "--out",
                                  "{dir}/run-profile/runs/m3.h5", "--no-progress",
                                  "--set", "server.clients_per_round=3"], ranks=1, files=JOB)


@pytest.fixture(scope="module")
def sweep_dir(world) -> Path:
    world.file(M3, "run-profile/runs/m3.h5")  # both ran to the end
    return world.file(M5, "run-profile/runs/m5.h5").parents[1]


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
