"""Any model on real MPI ranks started by mpiexec: the example package's BatchNorm and Dropout
ResNet SIGKILLed mid-run and resumed bit for bit against the shared world's uninterrupted run
(each BatchNorm mode), and a model that fails in training on the workers, which ends every
rank with MPI_Abort (it would end the shared world too), named with its phase."""

from __future__ import annotations

import numpy as np
import pytest

from tests.inprocess.test_any_model import (BATCHNORM, FAULTY, FAULTY_MODULE, _faulty_job,
                                            _resnet, _run)
from tests.inprocess.test_any_model import example_package  # noqa: F401 (autouse fixture)

#: the references of the kill-and-resume test (it runs in the MPI tier)
RESNET_REFERENCE = {bn: _run(f"anymodel-resnet-{bn}-ref", _resnet(bn), 3, for_mpi=True)
                    for bn in BATCHNORM}


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("batchnorm", BATCHNORM)
def test_batchnorm_dropout_resnet_resumes_bit_exact_after_sigkill(world, batchnorm, tmp_path):
    from tests.mpi.test_ditto import kill_mid_run
    from tests.inprocess.test_resume import command, contents, run

    ref = world.file(RESNET_REFERENCE[batchnorm])
    job = tmp_path / "job.toml"
    job.write_text(_resnet(batchnorm))
    for attempt in range(3):
        path = tmp_path / f"k{attempt}.h5"
        if kill_mid_run(command(3, "run", str(job), "--out", str(path)), path, 1.0 + attempt):
            break
    else:
        pytest.fail("the job finished before every kill point")
    run(3, "run", str(job), "--out", str(path), "--resume")
    got, want = contents(path), contents(ref)
    for key in want:
        assert np.array_equal(got[key], want[key], equal_nan=True), key


@pytest.mark.mpi
def test_a_model_failing_on_the_workers_is_named_with_its_phase(tmp_path):
    """A worker's failure in training ends every rank with MPI_Abort, which would end the
    shared world too: on real ranks."""
    from tests.inprocess.test_resume import run

    (tmp_path / f"{FAULTY_MODULE}.py").write_text(FAULTY)
    job = tmp_path / "job.toml"
    job.write_text(_faulty_job('name = "mlp"', 'name = "fragile"', str(tmp_path)))
    out = tmp_path / "x.h5"
    proc = run(3, "run", str(job), "--out", str(out), code=2)
    message = (f"model 'fragile' ({FAULTY_MODULE}:fragile) failed to train: RuntimeError: "
               "kaboom in forward")
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
