"""Asynchronous rules on simulated time: FedBuff (Nguyen et al., AISTATS 2022) and FedAsync
(Xie, Koyejo, Gupta, 2019) under :class:`mpifl.runtime.asynchronous.AsyncServer`.

The oracle: FedBuff with buffer_size = concurrency = m, constant staleness and server_lr 1
starts m clients a step and aggregates all of them fresh, so it is FedAvg with uniform weights,
bit for bit, in one process and on 3 ranks (runs of the shared MPI world, tests/world.py). With
C > B updates arrive stale; a run stopped after 3 steps and resumed to 6 equals an uninterrupted
one bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import mpifl
from mpifl.aggregators import RoundUpdates, create, rule
from mpifl.aggregators.fedbuff import staleness_weights
from mpifl.core.errors import ConfigError
from mpifl.experiment.config import load_config
from mpifl.store.checkpoint import folder_for, load_latest
from tests.world import world_run

JOB = """
[run]
name = "async"
seed = 3
rounds = 4
eval_every = 2
checkpoint_every = 1
threads = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 12
[model]
name = "mlp"
hidden = [16]
[client]
epochs = 1
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 4
[fedavg]
weighting = "uniform"
"""

#: the oracle's FedBuff: B = C = m, f = 1, eta_g = 1
ORACLE = {"server.algorithm": "fedbuff", "fedbuff.buffer_size": 4, "fedbuff.concurrency": 4,
          "fedbuff.staleness": "constant"}
#: stale updates: 8 in flight, 3 a step, on devices of three tiers that come and go
STALE = {"server.algorithm": "fedbuff", "fedbuff.buffer_size": 3, "fedbuff.concurrency": 8,
         "system.enabled": True, "system.availability": "periodic", "system.period_s": 40.0,
         "run.eval_every": 3}  # the stopped run's last round (3) is evaluated by both
#: model, evaluation and system tables: what must be equal (times and memory are not)
EXACT = ("model/global", "eval/client_accuracy", "eval/client_loss", "rounds/selected",
         "rounds/aggregated", "rounds/train_loss", "rounds/num_clients")


def _sets(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        text = ("true" if v else "false") if isinstance(v, bool) else (
            f'"{v}"' if isinstance(v, str) else str(v))
        out += ["--set", f"{k}={text}"]
    return out


def _run(out: Path, overrides: dict | None = None, rounds: int | None = None) -> Path:
    """One run in this process."""
    job = out.parent / "job.toml"
    job.write_text(JOB)
    sets = {**(overrides or {}), **({"run.rounds": rounds} if rounds else {})}
    mpifl.run(job, out=out, overrides=sets, progress=False)
    return out


def _world(name: str, overrides: dict | None = None, rounds: int | None = None):
    """A run on 3 ranks of the shared world (tests/world.py), into ``{dir}/<name>.h5``."""
    sets = _sets({**(overrides or {}), **({"run.rounds": rounds} if rounds else {})})
    return world_run(name, ["run", "{dir}/async.toml", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress", *sets], files={"async.toml": JOB})


AVG3 = _world("async-avg3")
BUF3 = _world("async-buf3", ORACLE)
FULL3 = _world("async-full3", STALE, rounds=6)
PART3 = _world("async-part3", STALE, rounds=3)
RESUMED3 = world_run("async-part3-resumed", ["resume", "{dir}/async-part3.h5", "--rounds", "6",
                                             "--no-progress"])


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        found = {k: f[k][()] for k in EXACT}
        if "system" in f:
            f["system"].visititems(lambda n, o: found.__setitem__(f"system/{n}", o[()])
                                   if isinstance(o, h5py.Dataset) else None)
    return found


def _assert_same(a: Path, b: Path) -> None:
    x, y = _arrays(a), _arrays(b)
    assert sorted(x) == sorted(y)
    for k in x:
        assert np.array_equal(x[k], y[k], equal_nan=True), k


def _updates(m: int, d: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((m, d))).float()


def _round(updates: torch.Tensor, staleness=None) -> RoundUpdates:
    m = updates.shape[0]
    stats = {} if staleness is None else {"staleness": np.asarray(staleness, np.int64)}
    return RoundUpdates(round=5, client_ids=np.arange(m), updates=updates,
                        losses=np.ones(m, np.float32), num_samples=np.arange(1, m + 1),
                        lr=0.1, stats=stats)


# --------------------------------------------------------------------------- the rules


def test_staleness_functions_are_xie_et_al():
    tau = np.array([0, 3, 4, 6])
    assert staleness_weights(tau, "constant", 0.5, 4).tolist() == [1, 1, 1, 1]
    assert np.allclose(staleness_weights(tau, "polynomial", 0.5, 4),
                       [1, 0.5, 1 / np.sqrt(5), 1 / np.sqrt(7)])
    assert staleness_weights(tau, "hinge", 0.5, 4).tolist() == [1, 1, 1, 0.5]  # 1/(0.5*2+1)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weights(np.array([-1]), "constant", 0.5, 4)


def test_fresh_fedbuff_is_fedavg_uniform_bit_for_bit():
    u = _updates(5, 33, 0)
    avg = create("fedavg", weighting="uniform").aggregate(_round(u))
    buf = create("fedbuff", buffer_size=5, concurrency=9).aggregate(_round(u, [0] * 5))
    assert torch.equal(avg, buf)
    assert torch.equal(buf, create("fedbuff").aggregate(_round(u)))  # no staleness: tau = 0


def test_fedbuff_down_weights_stale_updates():
    u, tau = _updates(4, 17, 1), [0, 1, 3, 8]
    step = create("fedbuff", buffer_size=4, concurrency=6, server_lr=2.0, a=0.5,
                  staleness="polynomial").aggregate(_round(u, tau))
    want = sum(2.0 * (1 + t) ** -0.5 / 4 * u[k].double() for k, t in enumerate(tau))
    assert torch.allclose(step.double(), want, atol=1e-6)
    hinge = create("fedbuff", buffer_size=4, concurrency=4, staleness="hinge", a=1.0, b=2.0)
    want = sum((1.0 if t <= 2 else 1 / (t - 2 + 1)) / 4 * u[k].double()
               for k, t in enumerate(tau))
    assert torch.allclose(hinge.aggregate(_round(u, tau)).double(), want, atol=1e-6)


def test_fedasync_mixes_the_client_model_into_the_global_one():
    g = torch.Generator().manual_seed(0)
    w, wk = torch.randn(20, generator=g), torch.randn(20, generator=g)
    agg = create("fedasync", alpha=0.6, staleness="polynomial", a=1.0)
    step = agg.aggregate(_round((w - wk)[None], [3]))  # updates against the current model
    alpha_t = 0.6 / 4  # alpha (1 + 3)^-1
    assert torch.allclose(w - step, (1 - alpha_t) * w + alpha_t * wk, atol=1e-6)


def test_needs_and_parameters():
    for name in ("fedbuff", "fedasync"):
        needs = rule(name).needs
        assert needs.asynchronous and needs.shards is None and not needs.losses
    assert rule("fedasync").needs.current_updates and not rule("fedbuff").needs.current_updates
    assert not rule("fedavg").needs.asynchronous
    assert create("fedasync", concurrency=7).buffer_size == 1
    with pytest.raises(ValueError, match=r"fedbuff: concurrency: .*must be >= buffer_size \(5\)"):
        create("fedbuff", buffer_size=5, concurrency=4)


def test_a_sharded_server_is_refused_in_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    with pytest.raises(ConfigError) as err:
        load_config(job, ["server.algorithm=\"fedbuff\"", "server.shards=2"])
    assert "fedbuff cannot run on a sharded server" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("setting", ["system.deadline_s=30", "system.over_commit=0.3"])
def test_a_deadline_or_over_commitment_is_refused_with_the_config(tmp_path, setting):
    """Synchronous rounds only: refused when the config loads, before any data is read."""
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    with pytest.raises(ConfigError) as err:
        load_config(job, ["server.algorithm=\"fedbuff\"", "system.enabled=true", setting])
    assert str(err.value).startswith("system.deadline_s, system.over_commit: fedbuff is "
                                     "asynchronous")
    assert "\n" not in str(err.value)
    load_config(job, ["server.algorithm=\"fedbuff\"", "system.enabled=true"])  # without: fine


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process runs shared by the tests below."""
    base = tmp_path_factory.mktemp("async")
    (base / "fedavg").mkdir()
    (base / "stale").mkdir()
    return {"fedavg": _run(base / "fedavg" / "avg.h5"),
            "stale": _run(base / "stale" / "full.h5", STALE, rounds=6)}


def test_fedbuff_with_a_full_buffer_is_fedavg_uniform(runs, tmp_path):
    buf = _run(tmp_path / "buf.h5", ORACLE)
    a, b = _arrays(runs["fedavg"]), _arrays(buf)
    for k in EXACT:
        assert np.array_equal(a[k], b[k], equal_nan=True), k
    assert b["system/rounds/sim_time"].tolist() == [1.0, 2.0, 3.0, 4.0]  # 1 s a client
    assert b["system/rounds/finished"].tolist() == [4] * 4
    assert b["system/clients/finished"].sum() == 16


def test_stale_updates_resume_exactly(runs, tmp_path):
    part = _run(tmp_path / "part.h5", STALE, rounds=3)
    mpifl.run(tmp_path / "job.toml", out=part, overrides={**STALE, "run.rounds": 6},
              mode="resume", progress=False)
    _assert_same(runs["stale"], part)
    ckpt = load_latest(folder_for(runs["stale"]))
    steps = ckpt.server_state["async_steps"]  # (sim end, started, finished, late, staleness)
    assert steps.shape == (6, 5) and np.nanmax(steps[:, 4]) > 0  # stale updates were aggregated
    tables = _arrays(runs["stale"])
    assert tables["system/rounds/late"].sum() > 0  # devices went offline mid-training
    assert np.array_equal(tables["system/rounds/finished"], tables["rounds/num_clients"])
    assert (np.diff(tables["system/rounds/sim_time"]) > 0).all()


def test_fedasync_resumes_exactly(tmp_path):
    sets = {"server.algorithm": "fedasync", "fedasync.concurrency": 5, "fedasync.alpha": 0.5,
            "run.eval_every": 3}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    full = _run(tmp_path / "a" / "full.h5", sets, rounds=6)
    part = _run(tmp_path / "b" / "part.h5", sets, rounds=3)
    mpifl.run(tmp_path / "b" / "job.toml", out=part, overrides={**sets, "run.rounds": 6},
              mode="resume", progress=False)
    _assert_same(full, part)
    steps = load_latest(folder_for(full)).server_state["async_steps"]
    assert steps[:, 2].tolist() == [1] * 6 and steps[1:, 4].max() > 0  # one stale update a step


def test_the_oracle_and_resume_on_three_ranks(world):
    a, b = _arrays(world.file(AVG3)), _arrays(world.file(BUF3))
    for k in EXACT:
        assert np.array_equal(a[k], b[k], equal_nan=True), k
    assert world.status(PART3) == 0
    _assert_same(world.file(FULL3), world.file(RESUMED3, "async-part3.h5"))
