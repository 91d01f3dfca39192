"""The tier guard of tests/conftest.py: an unmarked test cannot start a launcher."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import _Guard, _launcher


@pytest.mark.parametrize("args, name", [
    (["mpiexec", "-n", "3", "python"], "mpiexec"),
    (["/opt/bin/mpirun", "-np", "2", "x"], "mpirun"),
    ("srun -N 2 python -m mpifl", "srun"),
    (["bash", "/repo/slurm/local-cluster.sh", "start"], "local-cluster.sh"),
    (["python", "-m", "mpifl", "run", "job.toml"], None),
    (["sh", "-c", "echo mpiexec"], None),
])
def test_launchers_are_told_from_other_programs(args, name):
    assert _launcher(args) == name


def test_an_unmarked_test_starting_mpiexec_fails_naming_the_marker():
    before = subprocess.Popen.__init__
    with _Guard("tests/test_x.py::test_y"):
        with pytest.raises(pytest.fail.Exception, match=r"starts mpiexec: mark it "
                                                        r"@pytest\.mark\.mpi"):
            subprocess.Popen(["mpiexec", "-n", "1", "true"])
        assert subprocess.run(["true"]).returncode == 0  # other programs still start
    assert subprocess.Popen.__init__ is before  # and the guard is gone after


def test_this_test_runs_guarded(request):
    """Unmarked tests are guarded while they run (the hooks in tests/conftest.py)."""
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slurm"):
        subprocess.run(["sbatch", "--wrap", "true"])
