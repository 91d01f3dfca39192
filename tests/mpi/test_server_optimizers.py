"""A server optimizer on real MPI ranks: FedAdam after FedFV under ``mpiexec -n 3``, SIGKILLed
mid-run and resumed, equals the shared world's uninterrupted 3-rank run (its optimizer state
restored from the checkpoint). Real ranks, because the kill hits the launched processes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.inprocess.test_server_optimizers import ADAM, _run

#: the reference of the kill-and-resume test (marked mpi)
THREE_MPI = _run("opt-three-mpi", ranks=3, for_mpi=True)


@pytest.fixture(scope="module")
def adam_job(tmp_path_factory):
    from tests.helpers import write_fmnist_job

    return write_fmnist_job(tmp_path_factory, "adam.toml", ADAM)


@pytest.mark.mpi
@pytest.mark.slow
def test_fedadam_on_fedfv_under_mpi_resumes_exactly(adam_job, world, tmp_path):
    from tests.mpi.test_ditto import kill_mid_run
    from tests.inprocess.test_resume import command, contents, run

    b = contents(world.file(THREE_MPI))
    for attempt in range(3):
        path = tmp_path / f"k{attempt}.h5"
        if kill_mid_run(command(3, "run", str(adam_job), "--out", str(path)), path,
                        0.5 + attempt):
            break
    else:
        pytest.fail("the job finished before every kill point")
    run(3, "run", str(adam_job), "--out", str(path), "--resume")
    got = contents(path)
    for key in (k for k in b if k.startswith(("model/", "eval/"))):
        assert np.array_equal(got[key], b[key], equal_nan=True), key
