"""One mpifl on every rank (mpifl.runtime.installs): ranks that import mpifl from different
places end the run on every rank with status 2 and one line naming the ranks and paths, before
anything is written. A real second install (a copy of the package tree under tmp_path, put first
by PYTHONPATH on two ranks of an MPMD launch) and real mpiexec ranks. The tests that start
mpiexec themselves are in tests/mpi/test_installs.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpifl.core.version import __version__
from mpifl.runtime.installs import (PACKAGE, describe, mismatch, rank_ranges, this_install,
                                    venv_warning)

A = ("/a/mpifl", "0.1.0", "/x/bin/python3.11", "3.11.7")
B = ("/b/mpifl", "0.1.0", "/x/bin/python3.11", "3.11.7")


@pytest.mark.parametrize("ranks,text", [([0], "0"), ([0, 1, 2], "0-2"),
                                        ([3, 0, 1, 5, 6], "0-1, 3, 5-6"), ([], "")])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_the_same_install_everywhere_passes():
    assert mismatch([A]) is None
    assert mismatch([A, A, A]) is None


def test_a_mismatch_names_every_group_of_ranks():
    line = mismatch([A, B, B, A])
    assert line == (
        "ranks run different mpifl installs: ranks 0, 3 /a/mpifl (python /x/bin/python3.11 "
        "3.11.7, mpifl 0.1.0); ranks 1-2 /b/mpifl (python /x/bin/python3.11 3.11.7, mpifl "
        "0.1.0); start every rank with the same interpreter and environment, e.g. mpiexec -n 4 "
        '"$(command -v python)" -m mpifl ... (docs/guides/running.md "Which mpifl each rank '
        'runs")')


def test_another_interpreter_with_the_same_package_is_a_mismatch():
    other = (A[0], A[1], "/venv/bin/python", A[3])  # a venv's python: same files, other packages
    assert "rank 1 /a/mpifl (python /venv/bin/python 3.11.7" in mismatch([A, other])


def test_this_install_is_this_process():
    path, version, python, _ = this_install()
    assert Path(path) == Path(__file__).resolve().parents[2] / "mpifl" == PACKAGE
    assert (version, python) == (__version__, sys.executable)
    assert describe(A) == "/a/mpifl (python /x/bin/python3.11 3.11.7, mpifl 0.1.0)"


def test_an_active_venv_that_the_ranks_do_not_run_is_warned_about(tmp_path):
    assert venv_warning(this_install(), {}) is None
    assert venv_warning(this_install(), {"VIRTUAL_ENV": sys.prefix}) is None
    warning = venv_warning(this_install(), {"VIRTUAL_ENV": str(tmp_path)})
    assert warning.startswith(f"the active virtual environment is {tmp_path} (VIRTUAL_ENV), but "
                              f"the ranks run {sys.executable}")
    assert f'"{tmp_path}/bin/python" -m mpifl' in warning


def test_python_dash_m_mpifl_works():
    proc = subprocess.run([sys.executable, "-m", "mpifl", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "usage: mpifl" in proc.stdout, proc.stderr
