"""Server optimizers: FedAvgM, FedAdagrad, FedAdam, FedYogi after any rule, against
the update equations of Reddi et al. (ICLR 2021, Algorithm 2) written out by hand per
coordinate, their state through checkpoints, and whole runs under mpiexec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpifl.aggregators.server_opt import OPTIMIZERS, ServerOptimizer, ServerOptimizerParams


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


@pytest.fixture(scope="module")
def adam_job(tmp_path_factory):
    from tests.helpers import small_fmnist_job, write_fmnist_job

    text = small_fmnist_job("adam", seed=1, rounds=8, eval_every=4, checkpoint_every=2,
                            partition='partition = "shards"', algorithm="fedfv")
    text += 'optimizer = "adam"\nlr = 0.03\nbetas = [0.8, 0.95]\ntau = 0.01\n'
    return write_fmnist_job(tmp_path_factory, "adam.toml", text)


@pytest.mark.mpi
@pytest.mark.slow
def test_fedadam_on_fedfv_under_mpi_equals_one_process_and_resumes_exactly(adam_job, tmp_path):
    from tests.test_ditto import kill_mid_run
    from tests.test_resume import command, contents, run

    one, three = tmp_path / "one.h5", tmp_path / "three.h5"
    run(1, "run", str(adam_job), "--out", str(one))
    run(3, "run", str(adam_job), "--out", str(three))
    a, b = contents(one), contents(three)
    np.testing.assert_allclose(a["model/global"], b["model/global"], atol=1e-5)
    np.testing.assert_allclose(a["eval/client_accuracy"], b["eval/client_accuracy"], atol=1e-3)
    # the rule alone (sgd, lr 1) moves differently: the optimizer is applied
    plain = tmp_path / "plain.h5"
    run(1, "run", str(adam_job), "--out", str(plain), "--set", 'server.optimizer="sgd"',
        "--set", "server.lr=1.0")
    assert not np.allclose(contents(plain)["model/global"], a["model/global"])
    from mpifl.store.checkpoint import folder_for, load_latest

    ckpt = load_latest(folder_for(three))
    assert set(ckpt.server_state) == {"optimizer_m", "optimizer_v"}
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


@pytest.mark.slow
def test_bad_server_optimizer_settings_are_one_line(adam_job, tmp_path):
    from tests.test_resume import run

    for setting, message in (('server.optimizer="nadam"', "server.optimizer"),
                             ("server.lr=0", "server.lr"),
                             ("server.betas=[0.9]", "server.betas")):
        proc = run(1, "run", str(adam_job), "--out", str(tmp_path / "x.h5"), "--set", setting,
                   code=2)
        assert message in proc.stderr and "Traceback" not in proc.stderr
