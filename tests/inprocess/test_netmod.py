"""MPICH's netmod under srun (mpifl/sweep/netmod.py): libfabric chosen for the pip wheel, whose
UCX business card can overflow SLURM's PMI-2 lines (slurm/README.md "MPI_Init under srun"),
and nothing chosen for another MPI or over the user's own choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpifl.sweep.netmod import VARIABLE, choose_netmod, library_version

ROOT = Path(__file__).resolve().parents[2]
WHEEL = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\nMPICH configure: ...\n"


@pytest.mark.parametrize("text, environ, want", [
    (WHEEL, {}, "ofi"),
    (WHEEL, {VARIABLE: "ucx"}, None),                    # the user's choice wins
    ("MPICH Version: 4.1\nMPICH Device: ch4:ofi\n", {}, None),    # one netmod: no choice
    ("MPICH Version: 4.1\nMPICH Device: ch4:ucx\n", {}, None),
    ("MPICH Version: 3.4\nMPICH Device: ch3:nemesis\n", {}, None),
    ("Open MPI v4.1.5, package: Open MPI ...", {}, None),
    ("", {}, None),                                        # no mpi4py
])
def test_the_wheel_gets_libfabric_and_nothing_else_is_touched(text, environ, want):
    assert choose_netmod(text, environ) == want


def test_the_command_follows_the_mpi_that_mpi4py_loads():
    """The templates' command prints the choice for this machine's MPI (the choice above,
    from the library's own version text)."""
    want = choose_netmod(library_version(), {}) or ""
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    out = subprocess.run([sys.executable, "-m", "mpifl.sweep.netmod"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120, check=True).stdout
    assert out.strip() == want


@pytest.mark.parametrize("template", ["mpifl-run.sbatch", "mpifl-array.sbatch"])
def test_the_templates_export_the_choice_before_srun(template):
    text = (ROOT / "slurm" / template).read_text()
    choose, srun = text.find("-m mpifl.sweep.netmod)"), text.find("\n    srun --mpi")
    assert 0 < choose < srun and f"export {VARIABLE}=$netmod" in text
