"""Evaluation after local adaptation (``run.adapt_epochs``): each client's test
accuracy after k epochs of plain local SGD from the global model, against a per-client
torch.optim.SGD oracle; the option changes no trained model; 1 rank vs 3 ranks (runs of the
shared MPI world, tests/world.py); stored, reported and loaded beside the global model's
accuracy."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import vector_to_parameters

from mpifl.cli import main
from mpifl.clients.interface import TrainOptions
from mpifl.clients import VmapTrainer, client_minibatches
from mpifl.core.layout import ParamLayout
from mpifl.core.rng import ADAPT_TAG
from mpifl.experiment.assemble import build_parts
from mpifl.experiment.plan import make_plan
from mpifl.experiment.config import RESUME_MUTABLE, config_diff, load_config
from mpifl.models import build_model
from mpifl.store.results import read_results
from tests.helpers import small_fmnist_job
from tests.world import world_run

ADAPT = 2  # local epochs of the adaptation in the real runs


def oracle_adapted(model, x, y, w, *, round, lr, epochs, batch_size, client_ids, train_idx,
                   test_idx, momentum=0.0, weight_decay=0.0, seed=0):
    """One client at a time: a copy of the model at w, ``epochs`` of torch.optim.SGD on its
    training samples in the adaptation's minibatch order, then accuracy and mean CE on its test
    samples. Returns (n,) float64 accuracies and losses."""
    acc, loss = [], []
    for cid, tr, te in zip(client_ids, train_idx, test_idx):
        net = copy.deepcopy(model)
        vector_to_parameters(w.clone(), net.parameters())
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum,
                              weight_decay=weight_decay)
        steps = client_minibatches(seed, round, cid, len(tr), epochs, batch_size, ADAPT_TAG)
        for pos in steps if len(tr) else ():  # no training samples: w itself
            opt.zero_grad()
            F.cross_entropy(net(x[tr[pos]]), y[tr[pos]]).backward()
            opt.step()
        with torch.no_grad():
            out = net(x[te])
        acc.append(float((out.argmax(-1) == y[te]).double().mean()) if len(te) else np.nan)
        loss.append(float(F.cross_entropy(out, y[te]).double()) if len(te) else np.nan)
    return np.array(acc), np.array(loss)


def assert_accuracies_match(got, want, test_sizes):
    """Equal up to float rounding of batched kernels: at most one test sample apart per
    client, and nearly always exactly equal."""
    got, want = np.asarray(got), np.asarray(want)
    assert np.all(np.abs(got - want) * np.asarray(test_sizes) <= 1 + 1e-9), (got, want)
    assert np.mean(got == want) >= 0.9, (got, want)


# --------------------------------------------------------------------------- trainer


@pytest.mark.parametrize("epochs,batch_size,momentum,weight_decay,budget", [
    (1, 0, 0.0, 0.0, 1024.0),       # one full-batch step each
    (2, 7, 0.0, 0.0, 1024.0),       # minibatches, unequal clients (masked steps, padding)
    (3, 5, 0.5, 1e-3, 0.05),        # momentum + weight decay, tiny budget: several chunks
])
def test_evaluate_adapted_matches_per_client_sgd(epochs, batch_size, momentum, weight_decay,
                                                 budget):
    sizes, tests = (23, 9, 0, 16, 4), (11, 5, 6, 0, 7)  # a client without training / test data
    model = build_model("mlp", (12,), 4, hidden=(16, 8), seed=3)
    layout = ParamLayout.from_module(model)
    g = torch.Generator().manual_seed(3)
    n = sum(sizes) + sum(tests)
    x = torch.randn(n, 12, generator=g)
    y = (x @ torch.randn(12, 4, generator=g)).argmax(-1)
    cuts = np.cumsum(np.ravel(list(zip(sizes, tests))))[:-1]
    parts = np.split(np.random.default_rng(3).permutation(n), cuts)
    train_idx, test_idx = parts[0::2], parts[1::2]
    ids = np.array([7, 2, 9, 4, 11])
    w = layout.flatten_module(model).detach() + 0.05
    trainer = VmapTrainer(model, layout, x, y, TrainOptions(
        epochs=epochs, batch_size=batch_size, momentum=momentum, weight_decay=weight_decay,
        seed=5, memory_budget_mb=budget, order_tag=ADAPT_TAG, pretrain_losses=False))
    acc, loss = trainer.evaluate_adapted(w, 6, 0.3, ids, train_idx, test_idx)
    want_acc, want_loss = oracle_adapted(
        model, x, y, w, round=6, lr=0.3, epochs=epochs, batch_size=batch_size, client_ids=ids,
        train_idx=train_idx, test_idx=test_idx, momentum=momentum, weight_decay=weight_decay,
        seed=5)
    assert acc.dtype == loss.dtype == np.float64 and acc.shape == loss.shape == (5,)
    assert np.isnan(acc[3]) and np.isnan(loss[3])  # no test samples
    keep = np.arange(5) != 3
    assert_accuracies_match(acc[keep], want_acc[keep], np.array(tests)[keep])
    np.testing.assert_allclose(loss[keep], want_loss[keep], rtol=1e-4, atol=1e-5)
    # the client without training samples is evaluated at w itself
    at_w = trainer.evaluate(w, [test_idx[2]])
    assert (acc[2], loss[2]) == (at_w[0][0], at_w[1][0])


def test_adaptation_has_its_own_minibatch_order():
    from mpifl.clients import batch_order

    assert np.array_equal(batch_order(1, 2, 3, 0, 50), batch_order(1, 2, 3, 0, 50, None))
    assert not np.array_equal(batch_order(1, 2, 3, 0, 50), batch_order(1, 2, 3, 0, 50, ADAPT_TAG))


# --------------------------------------------------------------------------- config


def test_negative_value_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "out" / "r.h5"
    assert main(["run", "jobs/fmnist-fedfv.toml", "--set", "run.adapt_epochs=-1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mpifl: error: run.adapt_epochs"), err
    assert not (tmp_path / "out").exists()


def test_not_changeable_on_resume():
    a = load_config("jobs/fmnist-fedfv.toml", [])
    b = load_config("jobs/fmnist-fedfv.toml", ["run.adapt_epochs=3"])
    assert a.run.adapt_epochs == 0 and b.run.adapt_epochs == 3
    assert "run.adapt_epochs" not in RESUME_MUTABLE
    assert config_diff(a, b) == ["run.adapt_epochs: 0 -> 3"]


# --------------------------------------------------------------------------- real runs


JOB = small_fmnist_job("adapt", seed=3, rounds=4, eval_every=2, checkpoint_every=0,
                       partition='partition = "shards"', algorithm="fedfv").replace(
    "batch_size = 0", "batch_size = 20").replace("lr = 0.1", "lr = 0.05")
ON = f"run.adapt_epochs={ADAPT}"


def _run(name: str, *words: str, ranks: int = 1, out: str = ""):
    """A world run (tests/world.py) of the job, into ``{dir}/<out or name>.h5``."""
    return world_run(name, ["run", "{dir}/adapt.toml", "--out", f"{{dir}}/{out or name}.h5",
                            "--no-progress", *words], ranks=ranks, files={"adapt.toml": JOB})


# the job with the option off (1 rank) and on (1 and 3 ranks); the report labels runs by stem
OFF = _run("adapt-off")
ON1 = _run("adapt-on1", "--set", ON)
ON3 = _run("adapt-on3", "--set", ON, ranks=3)
# stopped after 2 of 4 rounds, a resume that changes run.adapt_epochs, then the right resume
CKPT = ("--set", "run.checkpoint_every=2")
HALF = _run("adapt-half", "--set", ON, "--set", "run.rounds=2", *CKPT)
REFUSED = _run("adapt-half-refused", "--resume", "--set", "run.adapt_epochs=1", *CKPT,
               out="adapt-half")
RESUMED = _run("adapt-half-resumed", "--resume", "--set", ON, *CKPT, out="adapt-half")


@pytest.fixture(scope="module")
def runs(world):
    return {"off": world.file(OFF), "on1": world.file(ON1), "on3": world.file(ON3)}


def test_option_off_writes_nothing_and_on_changes_no_trained_model(runs):
    from tests.inprocess.test_resume import contents

    off, on = contents(runs["off"]), contents(runs["on1"])
    assert not any(k.startswith("eval/adapted") for k in off)
    assert read_results(runs["off"])["eval"].keys().isdisjoint(
        {"adapted/client_accuracy", "adapted/mean"})
    assert np.array_equal(on["model/global"], off["model/global"])  # bit-identical
    for key, value in off.items():  # every other result too
        assert np.array_equal(on[key], value, equal_nan=True), key
    adapted = sorted(k for k in on if k not in off)
    assert "eval/adapted/client_accuracy" in adapted and "eval/adapted/worst5" in adapted


def test_stored_accuracies_equal_the_per_client_oracle(runs, world):
    res = read_results(runs["on1"])
    ev, cfg = res["eval"], load_config(str(world.path("adapt.toml")), [ON])
    k = cfg.data.num_clients
    assert ev["adapted/client_accuracy"].shape == ev["adapted/client_loss"].shape == (2, k)
    np.testing.assert_allclose(ev["adapted/mean"], ev["adapted/client_accuracy"].mean(axis=1),
                               rtol=1e-12)
    lowest = np.sort(ev["adapted/client_accuracy"], axis=1)[:, 0]  # K = 10: worst 5% = 1 client
    np.testing.assert_array_equal(ev["adapted/worst5"], lowest)
    parts = build_parts(make_plan(cfg))
    fed = parts.fed
    with h5py.File(runs["on1"], "r") as f:
        w = torch.from_numpy(f["model/global"][()])  # fedfv evaluates w itself
    rounds = int(ev["round"][-1])
    ids = np.arange(k)
    acc, loss = oracle_adapted(
        parts.model, torch.from_numpy(fed.x), torch.from_numpy(fed.y), w, round=rounds,
        lr=cfg.client.lr * cfg.client.lr_decay ** rounds, epochs=ADAPT,
        batch_size=cfg.client.batch_size, client_ids=ids,
        train_idx=[fed.train_indices(i) for i in ids], test_idx=[fed.test_indices(i) for i in ids],
        seed=cfg.run.seed)
    assert_accuracies_match(ev["adapted/client_accuracy"][-1], acc, fed.num_test)
    np.testing.assert_allclose(ev["adapted/client_loss"][-1], loss, rtol=1e-4, atol=1e-5)
    # adaptation on local data moves the accuracies (shards: 2 labels per client)
    assert ev["adapted/mean"][-1] > ev["mean"][-1]


def test_one_and_three_ranks_agree(runs):
    one, three = read_results(runs["on1"])["eval"], read_results(runs["on3"])["eval"]
    np.testing.assert_array_equal(three["adapted/client_accuracy"], one["adapted/client_accuracy"])
    np.testing.assert_allclose(three["adapted/client_loss"], one["adapted/client_loss"],
                               rtol=1e-6, atol=0)
    for key in ("adapted/mean", "adapted/worst5"):
        np.testing.assert_array_equal(three[key], one[key])


def test_report_and_load_show_the_adapted_metrics(runs, capsys):
    from mpifl import load
    from mpifl.report.tables import summarise

    row = summarise(runs["on1"], last=2)
    ev = read_results(runs["on1"])["eval"]
    assert row["adapted_mean"] == pytest.approx(100 * ev["adapted/mean"][-2:].mean())
    assert row["adapted_worst5"] == pytest.approx(100 * ev["adapted/worst5"][-2:].mean())
    assert "adapted_mean" not in summarise(runs["off"])
    assert main(["report", str(runs["on1"]), str(runs["off"])]) == 0
    text = capsys.readouterr().out
    assert "adapted mean acc (%)" in text and "adapted worst 5% (%)" in text
    ds = load([runs["on1"], runs["off"]])
    assert ds["adapted_accuracy"].dims == ("run", "eval_round", "client")
    np.testing.assert_array_equal(ds["adapted_accuracy"].sel(run="adapt-on1").values,
                                  ev["adapted/client_accuracy"])
    assert np.isnan(ds["adapted_mean"].sel(run="adapt-off").values).all()


def test_resume_keeps_the_adapted_history(runs, world):
    """Stop after 2 of 4 rounds (checkpoint), extend to 4 with --resume: the same results as the
    run left alone (the checkpoint's history holds /eval/adapted), and a changed
    run.adapt_epochs is refused."""
    from tests.inprocess.test_resume import contents

    assert world.status(HALF) == 0
    assert world.status(REFUSED) == 2
    assert "run.adapt_epochs: 2 -> 1" in world.output(REFUSED)
    got, want = contents(world.file(RESUMED, "adapt-half.h5")), contents(runs["on1"])
    assert got.keys() == want.keys() and "eval/adapted/client_accuracy" in got
    for key in want:
        assert np.array_equal(got[key], want[key], equal_nan=True), key
