"""One mpifl on every rank, on real ranks: an MPMD launch whose rank 0 runs this install and
ranks 1-2 a copy of the package tree (a real second install under tmp_path, put first by
PYTHONPATH) ends with status 2 on every rank and one line naming both groups, before anything is
written. Real mpiexec ranks, because the check compares what each launched process imports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpifl.core.version import __version__
from mpifl.runtime.installs import PACKAGE
from tests.helpers import mpiexec, small_fmnist_job, write_fmnist_job


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "installs.toml", small_fmnist_job(
        "installs", seed=1, rounds=1, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg"))


@pytest.mark.mpi
def test_ranks_with_another_install_end_the_run_on_every_rank(job, tmp_path):
    """MPMD: rank 0 runs this install, ranks 1-2 a copy of the package (a real second
    install). Every rank exits 2, one line names both groups, nothing is written."""
    copy = tmp_path / "copy"
    shutil.copytree(PACKAGE, copy / "mpifl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "run.h5"
    # each rank's own exit status, as its shell sees it
    report = '"$@"; s=$?; echo "rank $PMI_RANK exit $s" >&2; exit $s'
    rank = ["sh", "-c", report, "sh", sys.executable, "-m", "mpifl", "run", str(job), "--out",
            str(out), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    # the working folder (first on sys.path with -m) holds no mpifl
    proc = subprocess.run([mpiexec(), "-n", "1", *rank, ":", "-n", "2", "env",
                           f"PYTHONPATH={copy}", *rank], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl:")]
    python = f"(python {sys.executable} {sys.version.split()[0]}, mpifl {__version__})"
    assert lines == [f"mpifl: error: ranks run different mpifl installs: rank 0 {PACKAGE} "
                     f"{python}; ranks 1-2 {copy / 'mpifl'} {python}; start every rank with the "
                     'same interpreter and environment, e.g. mpiexec -n 3 "$(command -v python)" '
                     '-m mpifl ... (docs/guides/running.md "Which mpifl each rank runs")'
                     ], proc.stderr[-3000:]
    assert sorted(line for line in proc.stderr.splitlines() if " exit " in line) == [
        "rank 0 exit 2", "rank 1 exit 2", "rank 2 exit 2"]
    assert not out.exists() and not Path(f"{out}.ckpt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
