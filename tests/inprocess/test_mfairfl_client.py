"""mFairFL's client side (docs/ALGORITHMS.md §4): the Lagrangian local training of LagrangianTrainer
against direct per-client computations (autograd, a torch.optim.SGD loop), the reported constraint
values, and end-to-end runs on Adult on 3 ranks and 1 process, with a resume, from the shared MPI
world (tests/world.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpifl import aggregators
from mpifl.metrics import fairness
from mpifl.aggregators.mfairfl import MFairFL
from mpifl.cli import main
from mpifl.clients.interface import TrainOptions
from mpifl.clients import TRAINERS, LagrangianTrainer, VmapTrainer, client_minibatches
from mpifl.experiment.config import load_config
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model
from mpifl.store.results import MEASURED_COLUMNS
from tests.helpers import TABULAR_DATA, train
from tests.world import world_run

ATOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
DATA = TABULAR_DATA
NOTIONS = ("dp", "eo", "ap")


# --------------------------------------------------------------------------- direct oracles

def direct_constraints(notion, out, y, s, num_groups, eps):
    """``|M_a - M| - eps`` written out with boolean masks (no weights, no matrix products):
    DP/EO on ``softmax(out)[:, 1]``, AP on the per-sample cross-entropy; an empty cell has
    gap 0 (and no gradient)."""
    p = torch.softmax(out, dim=-1)[:, 1]
    ce = F.cross_entropy(out, y, reduction="none")
    zero = out.sum() * 0.0
    gaps = []
    if notion in ("dp", "ap"):
        v = p if notion == "dp" else ce
        for a in range(num_groups):
            cell = s == a
            gaps.append((v[cell].mean() - v.mean()).abs() if cell.any() else zero)
    else:
        for a in range(num_groups):
            for label in (0, 1):
                cell = (s == a) & (y == label)
                gaps.append((p[cell].mean() - p[y == label].mean()).abs() if cell.any() else zero)
    return torch.stack(gaps) - eps


def direct_lagrangian(net, x, y, s, lam, notion, num_groups, eps):
    out = net(x)
    return F.cross_entropy(out, y) + (lam * direct_constraints(notion, out, y, s, num_groups,
                                                               eps)).sum()


def oracle_round(model, x, y, s, w, lam, *, notion, eps, num_groups, round, lr, client_ids,
                 sample_idx, epochs, batch_size, momentum=0.0, weight_decay=0.0, seed=0):
    """One client at a time, torch.optim.SGD on the minibatch Lagrangian
    (docs/ALGORITHMS.md §1, §4); returns updates, Lagrangian losses and constraint values at w on
    the whole split."""
    updates, losses, cons = [], [], []
    for cid, idx in zip(client_ids, sample_idx):
        net = copy.deepcopy(model)
        vector_to_parameters(w.clone(), net.parameters())
        with torch.no_grad():
            out = net(x[idx])
            c = direct_constraints(notion, out, y[idx], s[idx], num_groups, eps)
            losses.append(F.cross_entropy(out, y[idx]) + (lam * c).sum())
            cons.append(c)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        for pos in client_minibatches(seed, round, cid, len(idx), epochs, batch_size):
            b = idx[pos]
            opt.zero_grad()
            direct_lagrangian(net, x[b], y[b], s[b], lam, notion, num_groups, eps).backward()
            opt.step()
        updates.append(w - parameters_to_vector(net.parameters()).detach())
    return torch.stack(updates), torch.stack(losses), torch.stack(cons)


# --------------------------------------------------------------------------- a hand-made table

def table(n=96, seed=0):
    """Samples whose label depends on the sensitive attribute (so the gaps are not small)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    s = (torch.rand(n, generator=g) < 0.4).long()
    x[:, 5] = s.float()                                    # the attribute is also a feature
    y = ((x[:, 0] + 1.2 * s + 0.3 * torch.randn(n, generator=g)) > 0.6).long()
    model = build_model("mlp", (6,), 2, hidden=(8, 8), seed=seed)
    layout = ParamLayout.from_module(model)
    perm = np.random.default_rng(seed).permutation(n)
    idx = np.split(perm, [37, 37 + 31])                     # 37, 31, 28 samples
    return model, layout, x, y, s, idx


def trainer(model, layout, x, y, s, notion, eps=0.02, **kw):
    kw.setdefault("epochs", 2)
    kw.setdefault("batch_size", 8)
    return LagrangianTrainer(model, layout, x, y, TrainOptions(**kw), sensitive=s,
                             fair_notion=notion, fair_eps=eps)


def multipliers(notion, seed=1):
    a = fairness.num_constraints(notion, 2)
    return np.random.default_rng(seed).uniform(0.5, 3.0, a)


# --------------------------------------------------------------------------- unit tests

@pytest.mark.parametrize("notion", NOTIONS)
def test_vmapped_minibatch_gradient_is_autograd_of_the_direct_lagrangian(notion):
    model, layout, x, y, s, _ = table()
    t = trainer(model, layout, x, y, s, notion)
    lam = multipliers(notion)
    t._lam = torch.as_tensor(lam, dtype=torch.float32)
    w = layout.flatten_module(model).detach()
    g = torch.Generator().manual_seed(3)
    flat = torch.stack([w, w + 0.3 * torch.randn(w.shape, generator=g)])    # two clients
    rows = torch.tensor([list(range(0, 10)), list(range(40, 47)) + [40, 40, 40]])
    wb = torch.tensor([[1.0] * 10, [1.0] * 7 + [0.0] * 3])                   # client 1: padded
    grads = t._step_grad(layout.unflatten(flat.clone()), x[rows], y[rows], s[rows], wb)
    for i in range(2):
        net = copy.deepcopy(model)
        vector_to_parameters(flat[i].clone(), net.parameters())
        real = rows[i][wb[i] > 0]
        loss = direct_lagrangian(net, x[real], y[real], s[real], torch.as_tensor(lam).float(),
                                 notion, 2, 0.02)
        want = parameters_to_vector(torch.autograd.grad(loss, list(net.parameters())))
        got = torch.cat([v[i].reshape(-1) for v in grads.values()])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # the constraint term matters: without it the gradient is another one
    t._lam = torch.zeros_like(t._lam)
    plain = t._step_grad(layout.unflatten(flat.clone()), x[rows], y[rows], s[rows], wb)
    assert max((a - b).abs().max() for a, b in zip(plain.values(), grads.values())) > 1e-3


@pytest.mark.parametrize("notion,kw", [("dp", {}), ("eo", {"momentum": 0.9}),
                                       ("ap", {"weight_decay": 0.01}),
                                       ("dp", {"batch_size": 0, "epochs": 3})])
def test_local_training_matches_a_per_client_sgd_loop(notion, kw):
    model, layout, x, y, s, idx = table()
    kw = {"epochs": 2, "batch_size": 8, **kw}
    t = trainer(model, layout, x, y, s, notion, **kw)
    lam = multipliers(notion)
    w = layout.flatten_module(model).detach()
    ids = np.array([4, 0, 9])
    u, losses, stats = t.run_round(w, 5, 0.1, ids, idx, lam)
    u_ref, l_ref, c_ref = oracle_round(model, x, y, s, w, torch.as_tensor(lam).float(),
                                       notion=notion, eps=0.02, num_groups=2, round=5, lr=0.1,
                                       client_ids=ids, sample_idx=idx, **kw)
    assert u.dtype == losses.dtype == stats["constraints"].dtype == torch.float32
    assert u_ref.abs().max() > 1e-2
    torch.testing.assert_close(u, u_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(losses, l_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(stats["constraints"], c_ref, atol=ATOL, rtol=0)
    # and the multipliers change the training
    u0, _, _ = t.run_round(w, 5, 0.1, ids, idx, np.zeros_like(lam))
    assert (u0 - u).abs().max() > 1e-3


@pytest.mark.parametrize("notion", NOTIONS)
def test_chunking_and_client_company_do_not_change_an_update(notion):
    model, layout, x, y, s, idx = table()
    lam = multipliers(notion)
    w = layout.flatten_module(model).detach()
    ids = np.array([4, 0, 9])
    u, l, st = trainer(model, layout, x, y, s, notion).run_round(w, 2, 0.1, ids, idx, lam)
    tiny = trainer(model, layout, x, y, s, notion, memory_budget_mb=1e-3)
    assert len(tiny.plan_chunks(np.array([len(i) for i in idx]))) == 3
    u1, l1, st1 = tiny.run_round(w, 2, 0.1, ids[1:], idx[1:], lam)
    torch.testing.assert_close(u1, u[1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(l1, l[1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(st1["constraints"], st["constraints"][1:], atol=1e-6, rtol=0)


def test_reported_constraints_on_a_hand_computed_table():
    # logreg 1 -> 2 with weights (0, 1), bias 0: P(y=1) = sigmoid(x), so p is chosen directly
    p = torch.tensor([0.2, 0.4, 0.6, 0.8, 0.7], dtype=torch.float64)
    x = torch.log(p / (1 - p)).float().view(-1, 1)
    s = torch.tensor([0, 0, 1, 1, 1])
    y = torch.tensor([0, 1, 0, 1, 1])
    model = build_model("logreg", (1,), 2, seed=0)
    layout = ParamLayout.from_module(model)
    w = torch.tensor([0.0, 1.0, 0.0, 0.0])                  # weight (2, 1) then bias (2,)
    net = copy.deepcopy(model)
    vector_to_parameters(w, net.parameters())
    with torch.no_grad():
        assert torch.allclose(torch.softmax(net(x), -1)[:, 1].double(), p, atol=1e-6)
    eps = 0.05
    ce_hand = -(np.log(0.8) + np.log(0.4) + np.log(0.4) + np.log(0.8) + np.log(0.7)) / 5
    # DP: M = 2.7/5 = 0.54, M_0 = 0.3, M_1 = 0.7
    # EO: y=0: M = 0.4, (a0) 0.2, (a1) 0.6; y=1: M = 1.9/3, (a0) 0.4, (a1) 0.75
    # AP: CE per sample -log(0.8, 0.4, 0.4, 0.8, 0.7)
    ce = -np.log([0.8, 0.4, 0.4, 0.8, 0.7])
    hand = {"dp": [0.24, 0.16],
            "eo": [0.2, abs(0.4 - 1.9 / 3), 0.2, abs(0.75 - 1.9 / 3)],
            "ap": [abs(ce[:2].mean() - ce.mean()), abs(ce[2:].mean() - ce.mean())]}
    for notion, gaps in hand.items():
        t = LagrangianTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=0),
                              sensitive=s, fair_notion=notion, fair_eps=eps)
        lam = np.arange(1, len(gaps) + 1, dtype=np.float64)
        _, losses, stats = t.run_round(w, 0, 0.1, np.array([0]), [np.arange(5)], lam)
        want = np.array(gaps) - eps
        np.testing.assert_allclose(stats["constraints"][0].numpy(), want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(losses[0].item(), ce_hand + lam @ want, rtol=0, atol=1e-6)
        # and the library's surrogate on the same table says the same
        lib = fairness.constraint_values(notion, p, y, s, 2, eps, losses=torch.as_tensor(ce))
        np.testing.assert_allclose(lib.numpy(), want, rtol=0, atol=1e-12)


def test_constraints_of_many_clients_follow_the_library_surrogate():
    model, layout, x, y, s, idx = table()
    w = layout.flatten_module(model).detach()
    for notion in NOTIONS:
        t = trainer(model, layout, x, y, s, notion, memory_budget_mb=0.05)  # several row blocks
        ce, cons = t.constraint_values(w, idx)
        for k, i in enumerate(idx):
            with torch.no_grad():
                out = model(x[i])
            lib = fairness.constraint_values(
                notion, fairness.positive_probability(out), y[i], s[i], 2, 0.02,
                losses=F.cross_entropy(out, y[i], reduction="none"))
            np.testing.assert_allclose(cons[k], lib.numpy(), rtol=0, atol=1e-6)
            np.testing.assert_allclose(ce[k], F.cross_entropy(out, y[i]).item(), atol=1e-6)


@pytest.mark.parametrize("notion", NOTIONS)
def test_zero_multipliers_give_exactly_vmap_trainers_updates(notion):
    model, layout, x, y, s, idx = table()
    w = layout.flatten_module(model).detach()
    ids = np.array([4, 0, 9])
    for kw in ({}, {"momentum": 0.5, "weight_decay": 1e-3}):
        t = trainer(model, layout, x, y, s, notion, **kw)
        u, losses, _ = t.run_round(w, 1, 0.1, ids, idx, np.zeros(t.columns.inputs))
        u_ref, l_ref = train(VmapTrainer(model, layout, x, y,
                                         TrainOptions(epochs=2, batch_size=8, **kw)),
            w, 1, 0.1, ids, idx)
        assert torch.equal(u, u_ref) and torch.equal(losses, l_ref)
        u2, l2 = train(t, w, 1, 0.1, ids, idx)                 # no inputs: lambda = 0
        assert torch.equal(u2, u_ref) and torch.equal(l2, l_ref)


def test_softmax_output_model_uses_its_probabilities():
    model, layout, x, y, s, idx = table()
    soft = build_model("mlp", (6,), 2, hidden=(8, 8), output="softmax", seed=0)
    t = LagrangianTrainer(soft, ParamLayout.from_module(soft), x, y,
                          TrainOptions(epochs=1, batch_size=0), sensitive=s,
                          fair_notion="dp", fair_eps=0.0)
    w = ParamLayout.from_module(soft).flatten_module(soft).detach()
    _, cons = t.constraint_values(w, idx[:1])
    with torch.no_grad():
        prob = soft(x[idx[0]])[:, 1]
    lib = fairness.constraint_values("dp", prob, y[idx[0]], s[idx[0]], 2, 0.0)
    np.testing.assert_allclose(cons[0], lib.numpy(), atol=1e-6)


def test_columns_options_and_bad_input():
    model, layout, x, y, s, idx = table()
    assert LagrangianTrainer.columns_for(10, 2, fair_notion="eo").inputs == 4
    assert LagrangianTrainer.columns_for(10, 2, fair_notion="dp").stats == (("constraints", 2),)
    assert LagrangianTrainer.columns_for(10, 0, fair_notion="dp").inputs == 0
    t = trainer(model, layout, x, y, s, "eo")
    assert t.columns.inputs == t.num_constraints == 4 and t.columns.stats_width == 4
    w = layout.flatten_module(model).detach()
    with pytest.raises(ValueError, match="expected 4 multipliers"):
        t.run_round(w, 0, 0.1, np.array([0]), idx[:1], np.zeros(2))
    with pytest.raises(ValueError, match=">= 0"):
        t.run_round(w, 0, 0.1, np.array([0]), idx[:1], np.array([0, 0, -1.0, 0]))
    with pytest.raises(ValueError, match="2 outputs"):
        m3 = build_model("mlp", (6,), 3, hidden=(4,), seed=0)
        LagrangianTrainer(m3, ParamLayout.from_module(m3), x, y,
                          TrainOptions(epochs=1, batch_size=0), sensitive=s)
    with pytest.raises(ValueError, match="sensitive"):
        trainer(model, layout, x, y, s[:-1], "dp")
    with pytest.raises(ValueError, match="notion"):
        trainer(model, layout, x, y, s, "xx")
    # the rule asks for this trainer, with these options, and broadcasts its multipliers
    r = aggregators.rule("mfairfl")
    assert TRAINERS[r.needs.trainer] is LagrangianTrainer
    assert r.client_options(r.Params(notion="ap", eps=0.1)) == {"fair_notion": "ap", "fair_eps": 0.1}
    agg = aggregators.create("mfairfl", notion="eo", num_groups=2)
    assert np.array_equal(agg.round_inputs(), np.zeros(4)) and agg.round_inputs().dtype == np.float64
    with pytest.raises(ValueError, match="sensitive attribute"):
        MFairFL(num_groups=0)
    with pytest.raises(ValueError, match="contradicts"):
        MFairFL(num_groups=2, num_constraints=3)


def test_a_round_feeds_the_server_update():
    """Trainer output -> RoundUpdates -> multipliers: λ rises exactly by eta * sum p_k c_k."""
    model, layout, x, y, s, idx = table()
    t = trainer(model, layout, x, y, s, "dp", eps=0.0)
    agg = aggregators.create("mfairfl", notion="dp", eps=0.0, eta_lambda=2.0, num_groups=2)
    w = layout.flatten_module(model).detach()
    ids = np.array([0, 1, 2])
    u, losses, stats = t.run_round(w, 0, 0.1, ids, idx, agg.round_inputs())
    n = np.array([len(i) for i in idx])
    agg.aggregate(aggregators.RoundUpdates(0, ids, u, losses, n, 0.1, stats=stats))
    c = stats["constraints"].double().numpy()
    np.testing.assert_allclose(agg.round_inputs(), np.maximum(0, 2.0 * (n / n.sum()) @ c))
    assert (agg.round_inputs() > 0).all()


def test_config_needs_tabular_data(tmp_path, capsys):
    out = tmp_path / "r.h5"
    job = ROOT / "jobs" / "fmnist-fedfv.toml"
    assert main(["run", str(job), "--set", "server.algorithm=mfairfl", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mfairfl's group-fairness constraints need" in err[0]
    assert not out.exists()
    cfg = load_config(ROOT / "jobs" / "mfairfl-adult.toml")
    assert cfg.server.algorithm == "mfairfl" and cfg.data.partition == "group_skew"
    assert len(cfg.model.hidden) == 4 and cfg.client.epochs == 20 and cfg.run.rounds == 10
    assert load_config(ROOT / "jobs" / "mfairfl-compas.toml").data.dataset == "compas"


# --------------------------------------------------------------------------- end to end (Adult)

JOB = f"""
[run]
name = "mfairfl-small"
seed = 3
rounds = 4
eval_every = 1
checkpoint_every = 2
[data]
dataset = "adult"
partition = "group_skew"
num_clients = 5
heterogeneity = "high"
data_root = "{DATA}"
[model]
name = "mlp"
hidden = [16, 16, 16, 16]
[client]
epochs = 2
batch_size = 128
lr = 0.1
[server]
algorithm = "mfairfl"
sampling = "all"
[mfairfl]
notion = "dp"
eps = 0.01
eta_lambda = 5.0
"""

#: the runs only read, in the shared MPI world (tests/world.py): 3 ranks, 1 process, and 2
#: rounds on 3 ranks resumed to 4
ADULT_JOB = {"mfairfl-adult.toml": JOB}


def _run(name: str, ranks: int, *argv: str):
    return world_run(name, [*(argv or ("run", "{dir}/mfairfl-adult.toml", "--out",
                                       f"{{dir}}/{name}.h5")), "--no-progress"],
                     ranks=ranks, files=ADULT_JOB)


REFERENCE = _run("mfairfl-adult-3", 3)
ONE = _run("mfairfl-adult-1", 1)
PART = _run("mfairfl-adult-part", 3, "run", "{dir}/mfairfl-adult.toml", "--out",
            "{dir}/mfairfl-adult-part.h5", "--set", "run.rounds=2")
RESUMED = _run("mfairfl-adult-resumed", 3, "resume", "{dir}/mfairfl-adult-part.h5",
               "--rounds", "4")


def contents(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        out = {"model/global": f["model/global"][()]}
        for group in ("eval", "rounds"):
            for key, item in f[group].items():
                if isinstance(item, h5py.Group):
                    out.update({f"{group}/{key}/{k}": v[()] for k, v in item.items()})
                elif key not in MEASURED_COLUMNS:
                    out[f"{group}/{key}"] = item[()]
    return out


@pytest.fixture(scope="module")
def reference(world) -> Path:
    if not (DATA / "adult").is_dir():
        pytest.fail(f"{DATA}/adult missing (MPIFL_TEST_DATA names the tabular test data folder)")
    return world.file(REFERENCE)


def test_runs_under_mpiexec_on_adult_with_group_metrics(reference):
    with h5py.File(reference, "r") as f:
        assert f.attrs["algorithm"] == "mfairfl" and f.attrs["world_size"] == 3
        dp = f["eval/group/dp"][()]
        assert dp.shape == (4,) and np.isfinite(dp).all()
        assert np.isfinite(f["eval/cf"][()]).all()
        assert f["eval/client_accuracy"].shape == (4, 5)
        assert np.isfinite(f["rounds/train_loss"][()]).all()
    # the multipliers reached the checkpoint: the constraints came back from the workers
    from mpifl.store import checkpoint
    ckpt = checkpoint.load_latest(checkpoint.folder_for(reference))
    assert ckpt.round == 4 and ckpt.aggregator["multipliers"].shape == (2,)
    assert (ckpt.aggregator["multipliers"] > 0).any()


def test_one_and_three_ranks_agree(reference, world):
    a, b = contents(reference), contents(world.file(ONE))
    # accuracies exactly; the rest to float rounding of differently batched kernels
    np.testing.assert_array_equal(a["eval/client_accuracy"], b["eval/client_accuracy"])
    np.testing.assert_allclose(a["model/global"], b["model/global"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(a["eval/group/dp"], b["eval/group/dp"], rtol=0, atol=1e-12)


def test_resume_is_exact(reference, world):
    assert world.status(PART) == 0
    a, b = contents(reference), contents(world.file(RESUMED, "mfairfl-adult-part.h5"))
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=True), key
