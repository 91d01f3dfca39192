"""Ditto on real MPI ranks: ``mpiexec -n 3`` SIGKILLed at a random point of its rounds and
resumed, bit for bit against the shared world's uninterrupted run, personal models and their
evaluation included. It needs real ranks because the kill hits the launched processes
themselves (mpiexec, hydra's proxy, each rank)."""

from __future__ import annotations

import time

import h5py
import numpy as np
import pytest

from tests.helpers import write_fmnist_job
from tests.inprocess.test_ditto import JOB, _run


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return write_fmnist_job(tmp_path_factory, "ditto.toml", JOB)


#: the kill-and-resume test's reference (it runs in the MPI tier)
REFERENCE = _run("ditto-3-ref", 3, for_mpi=True)


def contents(path) -> dict[str, np.ndarray]:
    """Everything a run computes: model, /eval (with its personal/ subgroup), /rounds (timings
    and memory aside). (tests/inprocess/test_resume.py's reads only flat
    /eval.)"""
    from mpifl.store.results import MEASURED_COLUMNS

    out = {}
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        out["model/global"] = f["model/global"][()]

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and name.rsplit("/", 1)[-1] not in MEASURED_COLUMNS:
                out[f"{obj.parent.name}/{name.rsplit('/', 1)[-1]}"] = obj[()]

        f["eval"].visititems(visit)
        f["rounds"].visititems(visit)
    return out


def kill_mid_run(cmd: list[str], out, seconds: float) -> bool:
    """Start a job, wait until its rounds have begun (the round-0 checkpoint exists), then
    SIGKILL every process of it (ranks, proxy, mpiexec) ``seconds`` later; False if it
    finished first."""
    import subprocess

    from mpifl.store.checkpoint import folder_for
    from tests.helpers import kill_tree
    from tests.inprocess.test_resume import ENV

    proc = subprocess.Popen(cmd, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    folder = folder_for(out)
    try:
        while not (folder.is_dir() and any(folder.glob("round-*.h5"))):
            if proc.poll() is not None:
                return False
            time.sleep(0.02)
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return True


@pytest.mark.mpi
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(job, world, tmp_path):
    from mpifl.store.results import MEASURED_COLUMNS
    from tests.inprocess.test_resume import command, run

    ref = world.file(REFERENCE)
    with h5py.File(ref, "r") as f:  # how long the reference's rounds took
        rounds_s = sum(float(f["rounds"][k][()].sum()) for k in MEASURED_COLUMNS
                       if k.startswith("time_"))
    rng = np.random.default_rng(int(time.time()))
    for attempt in range(3):  # a random point of the rounds (retry if the job finished first)
        path = tmp_path / f"k{attempt}.h5"
        if kill_mid_run(command(3, "run", str(job), "--out", str(path)), path,
                        float(rng.uniform(0.1, 0.9)) * rounds_s):
            break
    else:
        pytest.fail(f"the job finished before every kill point (rounds took {rounds_s:.1f} s)")
    run(3, "run", str(job), "--out", str(path), "--resume")
    got, want = contents(path), contents(ref)
    assert got.keys() == want.keys() and "/eval/personal/mean" in want
    assert "/eval/personal_accuracy" in want
    for key in want:
        assert np.array_equal(got[key], want[key], equal_nan=True), key
