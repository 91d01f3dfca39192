"""Ditto (Li et al., ICML 2021): the trainer against a per-client torch.optim.SGD oracle, the
batched personal evaluation against a per-client loop, the aggregator by hand, its checkpoint
state, and real runs: 1 process against 3 ranks (both from the shared MPI world,
tests/world.py), and a SIGKILL of mpiexec -n 3 resumed against the world's uninterrupted run.
The tests that start mpiexec themselves are in tests/mpi/test_ditto.py."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpifl.aggregators import PersonalModels, RoundUpdates, create, rule
from mpifl.cli import main
from mpifl.clients.interface import TrainOptions
from mpifl.clients import TRAINERS, DittoTrainer, VmapTrainer, client_minibatches
from mpifl.experiment.config import load_config
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model
from tests.helpers import h5_round_trip, train
from tests.world import world_run

ATOL = 1e-5


# --------------------------------------------------------------------------- trainer


def oracle_ditto(model, x, y, w, V, *, round, lr, lam, client_ids, sample_idx, epochs,
                 batch_size, momentum=0.0, weight_decay=0.0, seed=0):
    """One client at a time, two torch.optim.SGD optimisers, as in the authors' code: per
    minibatch, a personal step on ``CE + (lam/2)||v - w||^2`` then a global step on CE, both on
    the same minibatch (docs/ALGORITHMS.md §1 order)."""
    updates, personal, losses = [], [], []
    for k, (cid, idx) in enumerate(zip(client_ids, sample_idx)):
        glob, pers = copy.deepcopy(model), copy.deepcopy(model)
        vector_to_parameters(w.clone(), glob.parameters())
        vector_to_parameters(V[k].clone(), pers.parameters())
        with torch.no_grad():
            losses.append(F.cross_entropy(glob(x[idx]), y[idx]))
        opt_g = torch.optim.SGD(glob.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
        opt_p = torch.optim.SGD(pers.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
        for pos in client_minibatches(seed, round, cid, len(idx), epochs, batch_size):
            batch = idx[pos]
            opt_p.zero_grad()
            prox = (parameters_to_vector(pers.parameters()) - w).pow(2).sum()
            (F.cross_entropy(pers(x[batch]), y[batch]) + lam / 2 * prox).backward()
            opt_p.step()
            opt_g.zero_grad()
            F.cross_entropy(glob(x[batch]), y[batch]).backward()
            opt_g.step()
        updates.append(w - parameters_to_vector(glob.parameters()).detach())
        personal.append(parameters_to_vector(pers.parameters()).detach())
    return torch.stack(updates), torch.stack(personal), torch.stack(losses)


def make_setup(sizes, shape=(12,), classes=4, seed=0):
    model = build_model("mlp", shape, classes, hidden=(16, 8), seed=seed)
    layout = ParamLayout.from_module(model)
    g = torch.Generator().manual_seed(seed)
    n = int(sum(sizes))
    x = torch.randn(n, *shape, generator=g)
    y = (x.reshape(n, -1) @ torch.randn(int(np.prod(shape)), classes, generator=g)).argmax(-1)
    perm = np.random.default_rng(seed).permutation(n)
    idx = np.split(perm, np.cumsum(sizes)[:-1])
    w = layout.flatten_module(model)
    return model, layout, x, y, idx, w


@pytest.mark.parametrize("epochs,batch_size,momentum,weight_decay,budget", [
    (1, 0, 0.0, 0.0, 1024.0),       # full batch: one step each
    (2, 7, 0.0, 0.0, 1024.0),       # minibatches, unequal clients (masked steps, padding)
    (2, 5, 0.5, 1e-3, 0.05),        # momentum + weight decay, tiny budget: several chunks
])
def test_trainer_matches_per_client_sgd_oracle(epochs, batch_size, momentum, weight_decay, budget):
    sizes = (23, 9, 16, 4)
    model, layout, x, y, idx, w = make_setup(sizes)
    ids = np.array([5, 1, 7, 2])
    g = torch.Generator().manual_seed(1)
    V = w + 0.3 * torch.randn(len(sizes), layout.d, generator=g)  # personal models away from w
    kw = dict(epochs=epochs, batch_size=batch_size, momentum=momentum, weight_decay=weight_decay,
              seed=4)
    trainer = DittoTrainer(model, layout, x, y, TrainOptions(memory_budget_mb=budget, **kw),
                           lam=0.7)
    if budget < 1:
        assert len(trainer.plan_chunks(np.array(sizes))) > 1
    updates, losses, stats = trainer.run_round(w, 3, 0.2, ids, idx, None, V.clone())
    want_u, want_v, want_l = oracle_ditto(model, x, y, w, V, round=3, lr=0.2, lam=0.7,
                                          client_ids=ids, sample_idx=idx, **kw)
    torch.testing.assert_close(updates, want_u, rtol=0, atol=ATOL)
    torch.testing.assert_close(stats["client_state"], want_v, rtol=0, atol=ATOL)
    torch.testing.assert_close(losses, want_l, rtol=0, atol=ATOL)
    assert set(stats) == {"client_state"} and stats["client_state"].dtype == torch.float32
    # the global part is exactly VmapTrainer's FedAvg local training
    plain = VmapTrainer(model, layout, x, y, TrainOptions(memory_budget_mb=budget, **kw))
    u0, l0 = train(plain, w, 3, 0.2, ids, idx)
    assert torch.equal(updates, u0) and torch.equal(losses, l0)


def test_lam_zero_is_local_training_and_columns():
    model, layout, x, y, idx, w = make_setup((10, 6))
    V = (w + 0.1).expand(2, -1).clone()
    ids = np.array([0, 1])
    kw = dict(epochs=1, batch_size=4, seed=0)
    t0 = DittoTrainer(model, layout, x, y, TrainOptions(**kw), lam=0.0)
    _, _, stats = t0.run_round(w, 0, 0.1, ids, idx, None, V)
    # lam = 0: the personal model is plain local SGD from v_k (= VmapTrainer started at v_k)
    local = VmapTrainer(model, layout, x, y, TrainOptions(**kw))._train(
        w, 0, 0.1, ids, idx, start=V)[0]
    torch.testing.assert_close(stats["client_state"], w - local, rtol=0, atol=1e-6)
    cols = DittoTrainer.columns_for(layout.d)
    assert cols.state == layout.d and cols.stats == (("client_state", layout.d),)
    assert TRAINERS["ditto"] is DittoTrainer
    with pytest.raises(ValueError, match="state rows"):
        t0.run_round(w, 0, 0.1, ids, idx, None, None)
    with pytest.raises(ValueError, match="lam"):
        DittoTrainer(model, layout, x, y, TrainOptions(**kw), lam=-1.0)


@pytest.mark.parametrize("budget", [1024.0, 0.004])
def test_evaluate_each_matches_a_per_client_evaluate_loop(budget):
    sizes = (31, 0, 12, 5, 40, 1)
    model, layout, x, y, idx, w = make_setup(sizes, seed=2)
    g = torch.Generator().manual_seed(3)
    W = w + 0.5 * torch.randn(len(sizes), layout.d, generator=g)
    trainer = DittoTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=5,
                                                             memory_budget_mb=budget), lam=0.1)
    if budget < 1:  # several client chunks, and sample blocks inside a chunk
        per_row = 4 * (2 * trainer._act_numel + trainer._in_numel) + 64
        chunks = trainer._eval_chunks(np.array(sizes), 8 * layout.d, per_row)
        assert len(chunks) > 1
        assert trainer.memory_budget - 8 * layout.d < 40 * per_row
    acc, loss = trainer.evaluate_each(W, idx)
    assert acc.dtype == np.float64 and loss.dtype == np.float64 and acc.shape == (len(sizes),)
    for i, s in enumerate(idx):
        a, l_ = trainer.evaluate(W[i], [s])
        np.testing.assert_allclose(acc[i], a[0], rtol=0, atol=1e-6, equal_nan=True)
        np.testing.assert_allclose(loss[i], l_[0], rtol=0, atol=1e-6, equal_nan=True)
    assert np.isnan(acc[1]) and np.isnan(loss[1])  # no samples
    with pytest.raises(ValueError, match="shape"):
        trainer.evaluate_each(W[:2], idx)


# --------------------------------------------------------------------------- aggregator


def ditto_round(t, ids, U, rows, n, dtype=torch.float64):
    return RoundUpdates(round=t, client_ids=np.asarray(ids), updates=torch.tensor(U, dtype=dtype),
                        losses=np.ones(len(ids)), num_samples=np.asarray(n), lr=0.1,
                        stats={"client_state": torch.tensor(rows, dtype=dtype)})


def test_hand_checkable_two_clients_in_2d():
    agg = create("ditto", lam=0.5, num_clients=3)
    assert isinstance(rule("ditto"), PersonalModels) and rule("ditto").needs.num_clients
    assert rule("ditto").needs.trainer == "ditto"
    assert rule("ditto").client_options(rule("ditto").Params(lam=0.5)) == {"lam": 0.5}
    w = torch.tensor([1.0, 2.0])
    # before any round: every client's personal model is w
    assert torch.equal(agg.personal_params(w), torch.tensor([[1.0, 2.0]] * 3))
    # round 0: clients 0 and 2; v_k starts as w^0
    assert torch.equal(agg.client_state(np.array([0, 2]), w), torch.tensor([[1.0, 2.0]] * 2))
    r = ditto_round(0, [0, 2], [[1.0, 0.0], [0.0, 2.0]], [[3.0, 4.0], [5.0, 6.0]], [1, 3])
    # FedAvg: p = (1/4, 3/4): s = (0.25, 1.5)
    torch.testing.assert_close(agg.aggregate(r), torch.tensor([0.25, 1.5], dtype=torch.float64))
    # only the aggregated clients' personal models changed; client 1 still holds w^0
    want = torch.tensor([[3.0, 4.0], [1.0, 2.0], [5.0, 6.0]])
    assert torch.equal(agg.personal_params(w - torch.tensor([0.25, 1.5])), want)
    assert agg.V.dtype == torch.float32
    # round 1: client 1 only; the others keep theirs, and client_state serves the stored rows
    assert torch.equal(agg.client_state(np.array([1, 2]), torch.zeros(2)),
                       torch.tensor([[1.0, 2.0], [5.0, 6.0]]))
    r = ditto_round(1, [1], [[2.0, -2.0]], [[7.0, 8.0]], [5])
    torch.testing.assert_close(agg.aggregate(r), torch.tensor([2.0, -2.0], dtype=torch.float64))
    assert torch.equal(agg.V, torch.tensor([[3.0, 4.0], [7.0, 8.0], [5.0, 6.0]]))
    # uniform weighting (the authors' simple_average): s = (0.5, 1.0)
    uni = create("ditto", lam=0.5, num_clients=3, weighting="uniform")
    uni.client_state(np.array([0, 2]), w)
    r = ditto_round(0, [0, 2], [[1.0, 0.0], [0.0, 2.0]], [[3.0, 4.0], [5.0, 6.0]], [1, 3])
    torch.testing.assert_close(uni.aggregate(r), torch.tensor([0.5, 1.0], dtype=torch.float64))


def test_aggregator_refuses_bad_input():
    agg = create("ditto", num_clients=2)
    agg.client_state(np.array([0]), torch.zeros(2))
    with pytest.raises(ValueError, match="client_state"):
        agg.aggregate(RoundUpdates(round=0, client_ids=np.array([0]), updates=torch.ones(1, 2),
                                   losses=[1.0], num_samples=[1], lr=0.1))
    with pytest.raises(ValueError, match="outside"):
        agg.client_state(np.array([2]), torch.zeros(2))
    agg.aggregate(ditto_round(0, [1], [[1.0, 1.0]], [[2.0, 2.0]], [1]))
    with pytest.raises(ValueError, match="round 0 is not after"):
        agg.aggregate(ditto_round(0, [1], [[1.0, 1.0]], [[2.0, 2.0]], [1]))
    with pytest.raises(ValueError, match="lam"):
        create("ditto", lam=-0.1, num_clients=2)
    with pytest.raises(ValueError, match="num_clients"):
        create("ditto", lam=0.1).client_state(np.array([0]), torch.zeros(2))


def random_rounds(K, d, rounds, m, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        ids = np.sort(rng.choice(K, size=m, replace=False))
        out.append((ids, rng.standard_normal((m, d)).astype(np.float32),
                    rng.standard_normal((m, d)).astype(np.float32), rng.integers(1, 50, m)))
    return out


def test_state_round_trip_gives_identical_continuation(tmp_path):
    K, d = 7, 5
    rounds = random_rounds(K, d, 5, 3)
    w = torch.linspace(-1, 1, d)
    live = create("ditto", lam=0.3, num_clients=K)
    # a checkpoint before any round (round 0's) restores "no personal models yet"
    fresh = create("ditto", lam=0.3, num_clients=K)
    fresh.load_state_dict(h5_round_trip(live.state_dict(), tmp_path / "fresh.h5"))
    assert fresh.V is None

    def step(agg, t, w):
        ids, U, rows, n = rounds[t]
        sent = agg.client_state(ids, w)
        s = agg.aggregate(RoundUpdates(round=t, client_ids=ids, updates=torch.from_numpy(U),
                                       losses=np.ones(len(ids)), num_samples=n, lr=0.1,
                                       stats={"client_state": torch.from_numpy(rows)}))
        return sent, w - s

    w_live = w
    for t in range(2):
        _, w_live = step(live, t, w_live)
    state = live.state_dict()
    for v in state.values():
        assert isinstance(v, (np.ndarray, int, float, str))
    assert state["personal"].shape == (K, d) and state["personal"].dtype == np.float32
    resumed = create("ditto", lam=0.3, num_clients=K)
    resumed.load_state_dict(h5_round_trip(state, tmp_path / "ditto.h5"))
    w_res = w_live.clone()
    for t in range(2, 5):
        sent_live, w_live = step(live, t, w_live)
        sent_res, w_res = step(resumed, t, w_res)
        assert torch.equal(sent_live, sent_res) and torch.equal(w_live, w_res)
        assert torch.equal(live.V, resumed.V)
    assert torch.equal(live.personal_params(w_live), resumed.personal_params(w_res))
    with pytest.raises(ValueError, match="lam"):
        create("ditto", lam=0.4, num_clients=K).load_state_dict(state)
    with pytest.raises(ValueError, match="num_clients"):
        create("ditto", lam=0.3, num_clients=K + 1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        create("ditto", lam=0.3, num_clients=K).load_state_dict({"lam": 0.3})
    with pytest.raises(ValueError, match="round 1 is not after"):
        resumed.aggregate(RoundUpdates(round=1, client_ids=np.array([0]), updates=torch.ones(1, d),
                                       losses=[1.0], num_samples=[1], lr=0.1,
                                       stats={"client_state": torch.ones(1, d)}))


def test_config_table():
    cfg = load_config("jobs/fmnist-fedfv.toml", ["server.algorithm=ditto", "ditto.lam=1",
                                                 "ditto.weighting=\"uniform\""])
    assert cfg.algorithm_params() == {"lam": 1.0, "weighting": "uniform"}


# --------------------------------------------------------------------------- real runs

JOB = """
[run]
name = "ditto"
seed = 2
rounds = 10
eval_every = 5
checkpoint_every = 2
[data]
dataset = "fashion_mnist"
partition = "shards"
num_clients = 30
[model]
name = "mlp"
hidden = [16]
[client]
epochs = 1
batch_size = 50
lr = 0.05
[server]
algorithm = "ditto"
clients_per_round = 4
[ditto]
lam = 0.5
"""


def _run(name: str, ranks: int, for_mpi: bool = False):
    return world_run(name, ["run", "{dir}/ditto.toml", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress"], ranks=ranks, files={"ditto.toml": JOB},
                     for_mpi=for_mpi)


#: the same Ditto job on 1 process and on 3 ranks, from the shared MPI world
RUNS = {n: _run(f"ditto-{n}", n) for n in (1, 3)}


def test_one_and_three_ranks_give_the_same_personal_accuracies(world, capsys):
    out = {n: world.file(run) for n, run in RUNS.items()}
    res = {}
    for n, path in out.items():
        with h5py.File(path, "r") as f:
            assert f.attrs["status"] == "complete" and f.attrs["algorithm"] == "ditto"
            res[n] = {k: f[k][()] for k in ("eval/personal_accuracy", "eval/personal_loss",
                                            "eval/client_accuracy", "eval/personal/mean",
                                            "eval/personal/worst5", "model/global")}
    one, three = res[1], res[3]
    assert one["eval/personal_accuracy"].shape == (2, 30)
    assert np.all((one["eval/personal_accuracy"] >= 0) & (one["eval/personal_accuracy"] <= 1))
    np.testing.assert_array_equal(three["eval/personal_accuracy"], one["eval/personal_accuracy"])
    np.testing.assert_array_equal(three["eval/client_accuracy"], one["eval/client_accuracy"])
    np.testing.assert_allclose(three["eval/personal_loss"], one["eval/personal_loss"],
                               rtol=1e-6, atol=0)
    np.testing.assert_allclose(three["model/global"], one["model/global"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(one["eval/personal/mean"],
                               one["eval/personal_accuracy"].mean(axis=1), rtol=1e-12)
    # personal models differ from the global one (they were trained on local data only)
    assert not np.array_equal(one["eval/personal_accuracy"], one["eval/client_accuracy"])
    assert main(["report", str(out[1])]) == 0
    text = capsys.readouterr().out
    assert "personal mean acc (%)" in text and "personal worst 5% (%)" in text
