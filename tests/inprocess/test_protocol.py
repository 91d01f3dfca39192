"""The round protocol's extras on real ranks: evaluation-only LOSSES requests (FedMDFG's line
search), per-client statistics rows (FedFa's training accuracy), and the phase columns every
run records (checkpoint time, peak memory). One process and 3 ranks of the shared MPI world
(tests/world.py) must agree; the waits and hangs run under their own mpiexec. The tests that
start mpiexec themselves are in tests/mpi/test_protocol.py."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from mpifl.aggregators import available
from tests.helpers import small_fmnist_job
from tests.world import world_run

JOB = small_fmnist_job("protocol", seed=5, rounds=4, eval_every=2, checkpoint_every=2,
                       partition='partition = "dirichlet"\ndirichlet_alpha = 0.5',
                       algorithm="fedmdfg")

RULES = [r for r in ("fedmdfg", "fedfa") if r in available()]
#: each rule on 1 and on 3 ranks
RUNS = {(rule, n): world_run(f"protocol-{rule}-n{n}", [
    "run", "{dir}/protocol.toml", "--out", f"{{dir}}/protocol-{rule}-n{n}.h5", "--no-progress",
    "--set", f"server.algorithm={rule}"], ranks=n, files={"protocol.toml": JOB})
    for rule in RULES for n in (1, 3)}


@pytest.fixture(scope="module", params=RULES)
def runs(request, world):
    return request.param, {n: world.file(RUNS[request.param, n]) for n in (1, 3)}


def read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in ("eval/client_accuracy", "model/global", "rounds/train_loss",
                                      "rounds/bytes_moved", "rounds/time_checkpoint",
                                      "rounds/peak_rss_server_mb", "rounds/peak_rss_worker_mb")}


def test_one_and_three_ranks_agree(runs):
    _, out = runs
    one, three = read(out[1]), read(out[3])
    np.testing.assert_array_equal(three["eval/client_accuracy"], one["eval/client_accuracy"])
    np.testing.assert_allclose(three["model/global"], one["model/global"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(three["rounds/train_loss"], one["rounds/train_loss"], rtol=1e-6)


def test_phase_columns_are_recorded(runs):
    name, out = runs
    r = read(out[3])
    d = len(r["model/global"])
    # checkpoints after rounds 2 and 4 (checkpoint_every = 2): timed; other rounds: none
    assert np.all(r["rounds/time_checkpoint"][[1, 3]] > 0)
    assert np.all(r["rounds/time_checkpoint"][[0, 2]] == 0)
    # each rank's peak since its process began (a world rank's earlier runs included): a floor
    assert np.all(r["rounds/peak_rss_server_mb"] > 50) and np.all(r["rounds/peak_rss_worker_mb"] > 50)
    # every round: w to 2 workers, 4 updates back (float32); FedMDFG's line search sends at
    # least one candidate w to both workers on top (a LOSSES request)
    floor = (2 + 4) * d * 4
    assert np.all(r["rounds/bytes_moved"] >= (floor + 2 * d * 4 if name == "fedmdfg" else floor))
