"""Server optimizers: FedAvgM, FedAdagrad, FedAdam, FedYogi after any rule, against
the update equations of Reddi et al. (ICLR 2021, Algorithm 2) written out by hand per
coordinate, their state through checkpoints, and whole runs on 1 and 3 MPI ranks (runs of the
shared MPI world, tests/world.py; the kill-and-resume test launches its own). The tests that
start mpiexec themselves are in tests/mpi/test_server_optimizers.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpifl.aggregators.server_opt import OPTIMIZERS, ServerOptimizer, ServerOptimizerParams
from tests.helpers import small_fmnist_job
from tests.world import world_run


def _by_hand(name, steps, lr, momentum, b1, b2, tau):
    """The applied steps, one coordinate at a time in float64, in the papers' own terms: the
    pseudo-gradient Δ = -s, x_{t+1} = x_t + η m_t / (√v_t + τ) (or x + η m for FedAvgM)."""
    out = []
    d = len(steps[0])
    m, v = [0.0] * d, [tau * tau] * d
    for s in steps:
        applied = []
        for i in range(d):
            delta = -float(s[i])
            if name == "sgd":
                applied.append(lr * delta)
                continue
            if name == "momentum":
                m[i] = momentum * m[i] + delta
                applied.append(lr * m[i])
                continue
            m[i] = b1 * m[i] + (1 - b1) * delta
            if name == "adagrad":
                v[i] = v[i] + delta ** 2
            elif name == "adam":
                v[i] = b2 * v[i] + (1 - b2) * delta ** 2
            else:
                v[i] = v[i] - (1 - b2) * delta ** 2 * math.copysign(1.0, v[i] - delta ** 2) \
                    if v[i] != delta ** 2 else v[i]
            applied.append(lr * m[i] / (math.sqrt(v[i]) + tau))
        out.append(applied)  # Δx: x <- x + Δx
    return [[-a for a in row] for row in out]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_follows_its_update_equations(name):
    rng = np.random.default_rng(3)
    steps = [rng.normal(size=7).astype(np.float32) * 10 ** rng.uniform(-3, 0)
             for _ in range(6)]
    p = ServerOptimizerParams(name, lr=0.3, momentum=0.8, beta1=0.85, beta2=0.95, tau=1e-2)
    opt = ServerOptimizer(p)
    got = [opt.apply(torch.from_numpy(s)).numpy() for s in steps]
    want = _by_hand(name, steps, 0.3, 0.8, 0.85, 0.95, 1e-2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.array(w), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["momentum", "adam", "yogi"])
def test_state_round_trip_continues_identically(name):
    rng = np.random.default_rng(0)
    steps = [torch.from_numpy(rng.normal(size=5).astype(np.float32)) for _ in range(5)]
    a = ServerOptimizer(ServerOptimizerParams(name, lr=0.1))
    for s in steps[:3]:
        a.apply(s)
    b = ServerOptimizer(ServerOptimizerParams(name, lr=0.1))
    b.load_state_dict({k: np.array(v) for k, v in a.state_dict().items()})
    for s in steps[3:]:
        assert torch.equal(a.apply(s), b.apply(s))


def test_sgd_with_lr_one_is_the_rule_alone():
    opt = ServerOptimizer(ServerOptimizerParams())
    s = torch.randn(9)
    assert opt.identity and torch.equal(opt.apply(s), s) and opt.state_dict() == {}


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'nadam'"):
        ServerOptimizer(ServerOptimizerParams("nadam"))


# --------------------------------------------------------------------------- whole runs


ADAM = small_fmnist_job("adam", seed=1, rounds=8, eval_every=4, checkpoint_every=2,
                        partition='partition = "shards"', algorithm="fedfv") + (
    'optimizer = "adam"\nlr = 0.03\nbetas = [0.8, 0.95]\ntau = 0.01\n')


def _run(name: str, *sets: str, ranks: int = 1, for_mpi: bool = False):
    """A world run (tests/world.py) of the FedAdam job into ``{dir}/<name>.h5``."""
    return world_run(name, ["run", "{dir}/opt-adam.toml", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress", *[a for s in sets for a in ("--set", s)]],
                     ranks=ranks, files={"opt-adam.toml": ADAM}, for_mpi=for_mpi)


ONE, THREE = _run("opt-one"), _run("opt-three", ranks=3)
PLAIN = _run("opt-plain", 'server.optimizer="sgd"', "server.lr=1.0")  # the rule alone
BAD = [(_run(f"opt-bad-{i}", setting), message) for i, (setting, message) in enumerate((
    ('server.optimizer="nadam"', "server.optimizer"), ("server.lr=0", "server.lr"),
    ("server.betas=[0.9]", "server.betas")))]


def test_fedadam_on_fedfv_on_three_ranks_equals_one_rank(world):
    from tests.inprocess.test_resume import contents

    a, b = contents(world.file(ONE)), contents(world.file(THREE))
    np.testing.assert_allclose(a["model/global"], b["model/global"], atol=1e-5)
    np.testing.assert_allclose(a["eval/client_accuracy"], b["eval/client_accuracy"], atol=1e-3)
    # the rule alone (sgd, lr 1) moves differently: the optimizer is applied
    assert not np.allclose(contents(world.file(PLAIN))["model/global"], a["model/global"])
    from mpifl.store.checkpoint import folder_for, load_latest

    ckpt = load_latest(folder_for(world.file(THREE)))
    assert set(ckpt.server_state) == {"optimizer_m", "optimizer_v"}


def test_bad_server_optimizer_settings_are_one_line(world):
    for run, message in BAD:
        output = world.output(run)
        assert world.status(run) == 2, output[-2000:]
        assert message in output and "Traceback" not in output
