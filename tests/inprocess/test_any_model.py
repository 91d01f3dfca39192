"""Any model researchers train: the loss declared once, the per-client loop trainer
(the oracle of the vectorised paths and the trainer of BatchNorm and Dropout), keyed dropout,
BatchNorm statistics averaged with the parameters, the trainer choice, and whole runs of the
example plugin package examples/models/ and of failing plugins, from the shared MPI world
(tests/world.py); a kill and resume, and a failure that ends the ranks with MPI_Abort, under
real mpiexec. The tests that start mpiexec themselves are in tests/mpi/test_any_model.py."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpifl.clients.interface import TrainOptions
from mpifl.clients.loop import LoopTrainer, step_seed
from mpifl.clients.select import select_trainer
from mpifl.clients.minibatches import client_minibatches
from mpifl.clients.trainer import VmapTrainer
from mpifl.core.errors import ConfigError
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model, get_loss, model_traits
from tests.helpers import train
from tests.world import world_run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


@pytest.fixture(scope="module", autouse=True)
def example_package():
    sys.path.insert(0, str(EXAMPLES))
    import mpifl_models  # noqa: F401  (registers cifar_like, small_resnet, smoothed_ce, ...)
    yield
    sys.path.remove(str(EXAMPLES))


def _data(n, shape, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _clients(sizes):
    bounds = np.cumsum([0, *sizes])
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _loop_oracle(model, layout, x, y, w, rnd, lr, cid, idx, *, epochs, batch_size, loss,
                 momentum=0.0, seed=0):
    """The obvious per-client training, written out: a fresh copy of the module in train mode,
    torch's generator seeded per step from the documented key, torch.optim.SGD."""
    net = copy.deepcopy(model).train()
    state = dict(net.named_parameters()) | dict(net.named_buffers())
    with torch.no_grad():
        for name, value in layout.unflatten(w).items():
            state[name].copy_(value)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for step, pos in enumerate(client_minibatches(seed, rnd, cid, len(idx), epochs, batch_size)):
        torch.manual_seed(step_seed(seed, rnd, cid, step))
        rows = torch.as_tensor(idx[pos])
        opt.zero_grad()
        loss.per_sample(net(x[rows]), y[rows]).mean().backward()
        opt.step()
    return layout.flatten_module(net)


# --------------------------------------------------------------------------- trainer paths


@pytest.mark.parametrize("name,shape,options", [
    ("mlp", (12,), dict(momentum=0.9, weight_decay=1e-3)),
    ("mlp", (12,), dict(prox_mu=0.5, pretrain_losses=False)),
    ("cnn_mnist", (1, 12, 12), dict(momentum=0.5)),
])
def test_vmap_equals_the_loop_oracle_on_the_models_it_takes(name, shape, options):
    model = build_model(name, shape, 4, hidden=(16,), seed=1)
    layout = ParamLayout.from_module(model)
    x, y = _data(90, shape, 4)
    idx = _clients((13, 40, 37))
    w = layout.flatten_module(model)
    kw = dict(epochs=2, batch_size=8, **options)
    got = train(VmapTrainer(model, layout, x, y, TrainOptions(**kw)),
        w, 5, 0.1, np.array([3, 1, 7]), idx)
    want = train(LoopTrainer(model, layout, x, y, TrainOptions(**kw)),
        w, 5, 0.1, np.array([3, 1, 7]), idx)
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert torch.allclose(got[1], want[1], atol=1e-5)


def _resnet_model():
    """The model of the RESNET job below (6 clients of 3 x 32 x 32 images, 10 classes)."""
    return build_model("small_resnet", (3, 32, 32), 10, seed=0, channels=4, stages=2)


def _bn_dropout_model():
    return build_model("small_resnet", (3, 8, 8), 3, seed=2, channels=4, stages=2, dropout=0.3)


def test_loop_trainer_is_the_written_out_loop_for_batchnorm_and_dropout():
    model = _bn_dropout_model()
    layout = ParamLayout.from_module(model)
    assert any(n.endswith("running_mean") for n in layout.names)
    x, y = _data(50, (3, 8, 8), 3)
    idx = _clients((20, 30))
    w = layout.flatten_module(model)
    loss = get_loss("cross_entropy")
    trainer = LoopTrainer(model, layout, x, y, TrainOptions(epochs=2, batch_size=6, momentum=0.9))
    updates, _ = train(trainer, w, 4, 0.05, np.array([2, 9]), idx)
    for row, cid, i in zip(updates, (2, 9), idx):
        want = _loop_oracle(model, layout, x, y, w, 4, 0.05, cid, i, epochs=2, batch_size=6,
                            loss=loss, momentum=0.9)
        assert torch.allclose(w - row, want, atol=1e-6)  # u_k = w - w_k rounds once
    # the running statistics moved (train mode) and came back in the update
    stats = [layout.unflatten(updates[0])[n] for n in layout.names if "running" in n]
    assert all(s.abs().sum() > 0 for s in stats)


def test_dropout_masks_are_keyed_by_client_not_by_chunk_order_or_caller():
    model = _bn_dropout_model()
    layout = ParamLayout.from_module(model)
    x, y = _data(60, (3, 8, 8), 3)
    idx = _clients((20, 25, 15))
    w = layout.flatten_module(model)
    trainer = LoopTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=5))
    both, _ = train(trainer, w, 1, 0.1, np.array([0, 1, 2]), idx)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    alone, _ = train(trainer, w, 1, 0.1, np.array([2]), idx[2:])
    assert torch.equal(torch.random.get_rng_state(), before)  # caller's stream untouched
    assert torch.equal(alone[0], both[2])  # the same masks without the other clients
    other, _ = train(trainer, w, 1, 0.1, np.array([7]), idx[2:])
    assert not torch.equal(other[0], both[2])  # another client id: other masks


def test_global_batchnorm_statistics_are_averaged_like_parameters():
    """FedAvg of two clients' updates moves the running statistics to the sample-weighted
    mean of the clients' own, exactly as it does the parameters."""
    from mpifl.aggregators import create
    from mpifl.aggregators.base import RoundUpdates

    model = _bn_dropout_model()
    layout = ParamLayout.from_module(model)
    x, y = _data(40, (3, 8, 8), 3)
    idx = _clients((10, 30))
    w = layout.flatten_module(model)
    trainer = LoopTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=10))
    updates, losses = train(trainer, w, 0, 0.1, np.array([0, 1]), idx)
    rule = create("fedavg")
    step = rule.aggregate(RoundUpdates(round=0, client_ids=np.array([0, 1]), updates=updates,
                                       losses=losses, num_samples=torch.tensor([10, 30]),
                                       lr=0.1))
    new = layout.unflatten(w - step)
    clients = [layout.unflatten(w - u) for u in updates]
    for name in (n for n in layout.names if "running_var" in n):
        want = 0.25 * clients[0][name] + 0.75 * clients[1][name]
        assert torch.allclose(new[name], want, atol=1e-6)


def test_local_batchnorm_trains_from_each_clients_own_coordinates():
    from mpifl.models.zoo import batchnorm_coordinates

    model = _bn_dropout_model()
    layout = ParamLayout.from_module(model)
    local = batchnorm_coordinates(model, layout, "local")
    assert len(local) == len(batchnorm_coordinates(model, layout, "local_stats")) * 2
    x, y = _data(50, (3, 8, 8), 3)
    idx = _clients((20, 30))
    w = layout.flatten_module(model)
    state = torch.stack([w[local] + 0.1, w[local] * 0.5])
    trainer = LoopTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=7),
                          local_index=local)
    assert trainer.columns.state == len(local)
    updates, _, stats = trainer.run_round(w, 2, 0.1, np.array([4, 5]), idx, state=state)
    assert torch.equal(updates[:, local], torch.zeros(2, len(local)))
    for i, cid in enumerate((4, 5)):
        own = w.clone()
        own[local] = state[i]
        want = _loop_oracle(model, layout, x, y, own, 2, 0.1, cid, idx[i], epochs=1,
                            batch_size=7, loss=get_loss("cross_entropy"))
        assert torch.allclose(stats["local_state"][i], want[local], atol=1e-6)
        rest = np.setdiff1d(np.arange(layout.d), local)
        assert torch.allclose((w - updates[i])[rest], want[rest], atol=1e-6)
    acc, loss = trainer.evaluate_local(w, stats["local_state"], idx)
    for i in range(2):
        own = w.clone()
        own[local] = stats["local_state"][i]
        assert loss[i] == pytest.approx(trainer.evaluate(own, [idx[i]])[1][0])


def test_evaluation_uses_the_models_running_statistics_not_the_test_batch():
    model = _bn_dropout_model()
    layout = ParamLayout.from_module(model)
    x, y = _data(30, (3, 8, 8), 3)
    w = layout.flatten_module(model)
    trainer = LoopTrainer(model, layout, x, y, TrainOptions(epochs=1, batch_size=10))
    acc, loss = trainer.evaluate(w, [np.arange(30)])
    net = copy.deepcopy(model).eval()
    want = F.cross_entropy(net(x), y).item()
    assert loss[0] == pytest.approx(want, rel=1e-6)
    # changing the stored statistics changes the evaluation: they are what is used
    moved = w.clone()
    moved[layout.offsets[layout.names.index("1.running_mean")]] += 5.0
    assert trainer.evaluate(moved, [np.arange(30)])[1][0] != pytest.approx(loss[0])


# --------------------------------------------------------------------------- model checks


class _FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(F.dropout(x, 0.5, self.training))


def test_model_traits_find_buffers_and_functional_randomness_at_check_time():
    plain = model_traits(build_model("mlp", (6,), 3), (6,))
    assert plain.vmappable and not plain.convolutional
    functional = model_traits(_FunctionalDropout(), (6,))
    assert functional.random and not functional.buffers
    resnet = model_traits(_bn_dropout_model(), (3, 8, 8))
    assert resnet.random and resnet.convolutional and "1.running_var" in resnet.buffers


def test_trainer_choice_and_its_refusals():
    plain = model_traits(build_model("mlp", (6,), 3), (6,))
    cnn = model_traits(build_model("cnn_mnist", (1, 12, 12), 3), (1, 12, 12))
    random = model_traits(_FunctionalDropout(), (6,))
    assert select_trainer("auto", plain, "sgd", "cpu")[0] == "vmap"
    assert select_trainer("auto", cnn, "sgd", "cpu")[0] == "loop"
    assert select_trainer("auto", cnn, "sgd", "cuda")[0] == "vmap"
    assert select_trainer("vmap", cnn, "sgd", "cpu")[0] == "vmap"
    assert select_trainer("auto", random, "sgd", "cuda")[0] == "loop"
    assert select_trainer("auto", cnn, "uga", "cpu")[0] == "vmap"
    with pytest.raises(ConfigError, match="'vmap' cannot train this model exactly"):
        select_trainer("vmap", random, "sgd", "cpu")
    with pytest.raises(ConfigError, match="uga's local training"):
        select_trainer("auto", random, "uga", "cpu", "uga")


# --------------------------------------------------------------------------- losses


def test_losses_train_the_same_on_both_paths():
    x, _ = _data(60, (5,), 2)
    targets = (x @ torch.arange(5.0)).float()
    labels = (targets > 0).long()
    for loss, y, width in ((get_loss("mse"), targets, 1), (get_loss("bce"), labels, 1),
                           (get_loss("mpifl_models.losses:smoothed_ce_fn"), labels, 2)):
        model = build_model("mlp", (5,), width, hidden=(8,), seed=0)
        layout = ParamLayout.from_module(model)
        w = layout.flatten_module(model)
        idx = _clients((25, 35))
        kw = dict(epochs=2, batch_size=10, loss=loss)
        got = train(VmapTrainer(model, layout, x, y, TrainOptions(**kw)),
            w, 0, 0.1, np.array([0, 1]), idx)
        want = train(LoopTrainer(model, layout, x, y, TrainOptions(**kw)),
            w, 0, 0.1, np.array([0, 1]), idx)
        assert torch.allclose(got[0], want[0], atol=1e-5), loss.name
        acc, ev_loss = VmapTrainer(model, layout, x, y, TrainOptions(**kw)).evaluate(w, idx)
        assert np.isnan(acc).all() == (not loss.classification)
        assert ev_loss[0] == pytest.approx(loss.per_sample(model(x[:25]), y[:25]).mean().item(),
                                           rel=1e-5)


def test_unknown_loss_is_one_line():
    with pytest.raises(ConfigError, match="model.loss: .*'cross_entropi'") as info:
        get_loss("cross_entropi")
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- whole runs


def _job_text(text: str) -> str:
    """A job on the example package's parts (its [plugins] table first)."""
    return f'[plugins]\nmodules = ["mpifl_models"]\npath = ["{EXAMPLES}"]\n' + text


def _run(name: str, text: str, ranks: int = 1, *sets: str, for_mpi: bool = False,
         files: dict[str, str] | None = None):
    """A run of the shared MPI world (tests/world.py): the job ``text`` as ``{name}.toml``,
    with ``--set`` words ``sets``; its results ``{name}.h5``."""
    words = [x for s in sets for x in ("--set", s)]
    return world_run(name, ["run", f"{{dir}}/{name}.toml", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress", *words], ranks=ranks,
                     files={f"{name}.toml": text, **(files or {})}, for_mpi=for_mpi)


RESNET = """
[run]
name = "resnet"
seed = 0
rounds = 4
eval_every = 2
checkpoint_every = 1

[data]
dataset = "cifar_like"
partition = "dirichlet"
num_clients = 6
train_fraction = 0.75

[data.params]
num_samples = 240

[model]
name = "small_resnet"
loss = "smoothed_ce"

[model.params]
channels = 4
stages = 2

[client]
batch_size = 10
lr = 0.05
momentum = 0.9

[server]
algorithm = "fedavg"
clients_per_round = 4
"""

BATCHNORM = ("global", "local")


def _resnet(batchnorm: str) -> str:
    return _job_text(RESNET.replace('loss = "smoothed_ce"',
                                    f'loss = "smoothed_ce"\nbatchnorm = "{batchnorm}"'))


#: each BatchNorm mode on 1 process and on 3 ranks
RESNET_RUNS = {(bn, ranks): _run(f"anymodel-resnet-{bn}-{ranks}", _resnet(bn), ranks)
               for bn in BATCHNORM for ranks in (1, 3)}


@pytest.mark.parametrize("batchnorm", BATCHNORM)
def test_batchnorm_dropout_resnet_is_bit_identical_on_1_and_3_ranks(world, batchnorm):
    from tests.inprocess.test_resume import contents

    outs = {ranks: world.file(RESNET_RUNS[batchnorm, ranks]) for ranks in (1, 3)}
    one, three = contents(outs[1]), contents(outs[3])
    assert one.keys() == three.keys()
    for key in (k for k in one if k.startswith(("model/", "eval/", "rounds/selected"))):
        assert np.array_equal(one[key], three[key], equal_nan=True), key
    with h5py.File(outs[3]) as f:
        assert f.attrs["trainer"] == "loop"
        config = f.attrs["config"]
        names = [n.decode() if isinstance(n, bytes) else n for n in f["model/layer_names"][()]]
        assert "1" in names  # the stem's BatchNorm, statistics included, is a layer of w
    assert np.isfinite(one["eval/client_accuracy"]).all()
    assert f'"batchnorm": "{batchnorm}"' in config
    if batchnorm == "local":  # FedBN: w's BatchNorm coordinates never move
        from mpifl.store.checkpoint import folder_for, load_latest

        model = _resnet_model()
        layout = ParamLayout.from_module(model)
        w0 = layout.flatten_module(model).numpy()
        bn = [n for n in layout.names if n.startswith("1.")]  # the stem's BatchNorm
        for name in bn:
            at = slice(layout.offsets[layout.names.index(name)],
                       layout.offsets[layout.names.index(name)] + layout.numels[layout.names.index(name)])
            assert np.array_equal(one["model/global"][at], w0[at]), name
        rows = load_latest(folder_for(outs[3])).client_state["local_rows"]
        assert rows.shape[0] == 6 and len(np.unique(rows, axis=0)) > 1  # each client its own


REGRESSION = """
[run]
name = "regression"
seed = 0
rounds = 6
eval_every = 3
checkpoint_every = 3

[data]
dataset = "sensor_regression"
partition = "iid"
num_clients = 8

[data.params]
num_samples = 800

[model]
name = "mlp"
hidden = [16]
loss = "mse"

[client]
batch_size = 20
lr = 0.05

[server]
algorithm = "fedavg"
clients_per_round = 4
"""

REGRESSION_RUNS = {ranks: _run(f"anymodel-regression-{ranks}", _job_text(REGRESSION), ranks)
                   for ranks in (1, 3)}
REGRESSION_REPORT = world_run("anymodel-regression-report",
                              ["report", "{dir}/anymodel-regression-3.h5"], ranks=1)
#: stopped after round 3 (its checkpoint), resumed to 6 on 3 ranks
REGRESSION_PART = _run("anymodel-regression-part", _job_text(REGRESSION), 3, "run.rounds=3")
REGRESSION_RESUMED = world_run("anymodel-regression-resumed", [
    "resume", "{dir}/anymodel-regression-part.h5", "--rounds", "6", "--no-progress"], ranks=3)


def test_regression_with_mse_under_mpi_summarises_losses(world):
    from tests.inprocess.test_resume import contents

    a, b = (contents(world.file(REGRESSION_RUNS[ranks])) for ranks in (1, 3))
    assert np.allclose(a["model/global"], b["model/global"], atol=1e-5)
    assert np.isnan(b["eval/client_accuracy"]).all()
    mean = b["eval/loss/mean"]
    assert (np.diff(mean) < 0).all() and np.allclose(mean, np.nanmean(b["eval/client_loss"], 1))
    assert world.status(REGRESSION_REPORT) == 0, world.output(REGRESSION_REPORT)[-2000:]
    report = world.output(REGRESSION_REPORT)
    assert "mean loss" in report and "mean acc" not in report
    # the run stopped after round 3 and resumed to 6 on 3 ranks is the same run exactly
    assert world.status(REGRESSION_PART) == 0
    c = contents(world.file(REGRESSION_RESUMED, "anymodel-regression-part.h5"))
    for key in (k for k in b if k.startswith(("model/", "eval/"))):
        assert np.array_equal(c[key], b[key], equal_nan=True), key


def _refused(world, run, message: str) -> None:
    """The world run ``run`` exited 2 with ``message``, no traceback and no results file."""
    output = world.output(run)
    assert world.status(run) == 2, output[-2000:]
    assert message in output and "Traceback" not in output, output[-2000:]
    assert not world.path(f"{run.name}.h5").exists()


LOSS_REFUSALS = [
    ('loss = "mse"', "model.loss: 'mse' needs float targets"),
    ('loss = "bce"', "model.loss: 'bce' is a two-class loss"),
    ('loss = "no_such_loss"', "model.loss: unknown loss 'no_such_loss'"),
]
LOSS_RUNS = [_run(f"anymodel-loss-{i}", _job_text(RESNET.replace('loss = "smoothed_ce"', change)))
             for i, (change, _) in enumerate(LOSS_REFUSALS)]


@pytest.mark.parametrize("case", range(len(LOSS_REFUSALS)))
def test_a_loss_that_does_not_fit_the_data_is_one_line_and_exit_2(world, case):
    _refused(world, LOSS_RUNS[case], LOSS_REFUSALS[case][1])


NEEDS_LABELS = _run("anymodel-fedfa-regression",
                    _job_text(REGRESSION.replace('algorithm = "fedavg"', 'algorithm = "fedfa"')))
PINNED_VMAP = _run("anymodel-pinned-vmap",
                   _job_text(RESNET.replace("lr = 0.05", 'lr = 0.05\ntrainer = "vmap"')))


def test_a_rule_that_needs_labels_refuses_a_regression_loss(world):
    _refused(world, NEEDS_LABELS, "'fedfa' needs class labels")


def test_vmap_pinned_for_a_batchnorm_model_is_refused(world):
    _refused(world, PINNED_VMAP,
             "client.trainer: 'vmap' cannot train this model exactly")


# --------------------------------------------------------------------------- failing plugins

FAULTY = '''
import torch
from torch import nn
from mpifl.plugin import Aggregator, Params, register_dataset, register_model, register_rule, DataPool
import numpy as np


class Fragile(nn.Module):
    """Passes mpifl's checks (up to 8 of the run's samples), fails on a training minibatch
    of 10."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        if x.shape[0] > 8:
            raise RuntimeError("kaboom in forward")
        return self.fc(x)


@register_model("fragile")
def fragile(input_shape, num_classes, *, seed):
    return Fragile()


@register_dataset("broken_loader")
def broken_loader(*, seed, data_root=None, **params):
    raise OSError("sensor archive unreadable")


@register_rule("short_step")
class ShortStep(Aggregator):
    class Params(Params):
        pass

    def aggregate(self, r):
        return r.updates.mean(0)[:-1]


@register_rule("raising_rule")
class RaisingRule(Aggregator):
    class Params(Params):
        pass

    def aggregate(self, r):
        raise ValueError("no consensus")
'''
#: the faulty plugin's module name (the world imports it once for all its runs: a name of
#: this module's own)
FAULTY_MODULE = "any_model_faulty"


def _faulty_job(old: str, new: str, folder: str) -> str:
    return (f'[plugins]\nmodules = ["mpifl_models", "{FAULTY_MODULE}"]\n'
            f'path = ["{EXAMPLES}", "{folder}"]\n'
            + REGRESSION.replace("rounds = 6", "rounds = 2").replace(old, new))


#: (old, new, ranks, message): the failures that end every rank in order, in the world
PLUGIN_FAILURES = [
    ("", "", 1, None),  # the unchanged job runs: the failures below are the changes'
    ('dataset = "sensor_regression"', 'dataset = "broken_loader"', 1,
     f"data set 'broken_loader' ({FAULTY_MODULE}:broken_loader) failed to load: OSError: "
     "sensor archive unreadable"),
    ('algorithm = "fedavg"', 'algorithm = "short_step"', 3,
     f"rule 'short_step' ({FAULTY_MODULE}:ShortStep): aggregate returned a step of shape "
     "(160,), expected (161,)"),
    ('algorithm = "fedavg"', 'algorithm = "raising_rule"', 1,
     f"rule 'raising_rule' ({FAULTY_MODULE}:RaisingRule) failed to aggregate: ValueError: "
     "no consensus"),
]
PLUGIN_RUNS = [_run(f"anymodel-plugin-{i}", _faulty_job(old, new, "{dir}"), ranks,
                    files={f"{FAULTY_MODULE}.py": FAULTY})
               for i, (old, new, ranks, _) in enumerate(PLUGIN_FAILURES)]


@pytest.mark.parametrize("case", range(len(PLUGIN_FAILURES)))
def test_a_failing_plugin_is_named_with_its_phase(world, case):
    run, message = PLUGIN_RUNS[case], PLUGIN_FAILURES[case][3]
    output = world.output(run)
    if message is None:
        assert world.status(run) == 0, output[-2000:]
        return
    assert world.status(run) == 2, output[-2000:]
    assert message in output, output[-2000:]
    assert "Traceback" not in output
