"""The tier guard of tests/conftest.py: an unmarked test cannot start a launcher, and a test's
folder and its tier's marker agree."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from tests.conftest import TESTS, _Guard, _launcher, _place


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


def _item(path: str, *markers: str) -> SimpleNamespace:
    """What :func:`tests.conftest._place` reads of a collected test: its file, id and markers."""
    marks = set(markers)
    return SimpleNamespace(path=TESTS / path, nodeid=f"tests/{path}::test_y", marks=marks,
                           get_closest_marker=lambda name: name if name in marks else None,
                           add_marker=marks.add)


@pytest.mark.parametrize("path, markers, after", [
    ("mpi/test_x.py", (), {"mpi"}),                 # the folder's marker, where it lacks it
    ("mpi/test_x.py", ("mpi", "slow"), {"mpi", "slow"}),
    ("slurm/test_x.py", (), {"slurm"}),
    ("gpu/test_x.py", ("mpi",), {"gpu", "mpi"}),    # tests/gpu/ holds mpi tests too
    ("inprocess/test_x.py", ("slow", "world"), {"slow", "world"}),  # nothing added
])
def test_a_test_gets_the_marker_of_its_folder(path, markers, after):
    item = _item(path, *markers)
    assert _place(item) is None
    assert item.marks == after


@pytest.mark.parametrize("path, marker, where", [
    ("inprocess/test_x.py", "mpi", "lies in tests/inprocess/ (the in-process tier)"),
    ("inprocess/test_x.py", "slurm", "lies in tests/inprocess/ (the in-process tier)"),
    ("test_x.py", "mpi", "lies outside tests/mpi/, tests/slurm/ and tests/gpu/"),
    ("ranks/test_x.py", "slurm", "lies outside tests/mpi/, tests/slurm/ and tests/gpu/"),
])
def test_a_test_marked_mpi_or_slurm_elsewhere_is_one_line(path, marker, where):
    assert _place(_item(path, marker)) == (
        f"tests/{path}::test_y is marked {marker} but {where}: move it to tests/{marker}/ "
        "(tests/conftest.py)")


def test_the_collected_tests_lie_in_their_tiers_folders(request):
    """This session's tests (the hook has run): each marked mpi or slurm lies under tests/mpi/,
    tests/slurm/ or tests/gpu/, and each there carries its folder's marker."""
    for item in request.session.items:
        folder = item.path.relative_to(TESTS).parts[0]
        tiers = {t for t in ("mpi", "slurm") if item.get_closest_marker(t)}
        assert folder in ("mpi", "slurm", "gpu") or not tiers, item.nodeid
        if folder in ("mpi", "slurm", "gpu"):
            assert item.get_closest_marker(folder), item.nodeid
