"""A new data set, model or aggregation rule is one file: its registration states every fact
about it (a data set's sizes as a :class:`~mpifl.data.registry.DataShape`, a model's factory
and how the memory budget counts it, a rule's ``Params`` and ``Needs``), and config
validation, the memory budget (:mod:`mpifl.experiment.budget`) and a run read them there."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

import mpifl
from mpifl.data import DATASETS
from mpifl.data.registry import DATASET_LOADERS, data_shape
from mpifl.experiment import budget
from mpifl.experiment.assemble import build_parts
from mpifl.experiment.config import load_config
from mpifl.experiment.plan import make_plan
from mpifl.models import MODEL_FACTORIES, MODELS, build_model
from mpifl.models.zoo import parameter_count

from .test_models import SMALL

MODULE = "one_file_parts"

#: One in-tree-style file: a data set, a model and a rule, each registered once.
PARTS = '''
import math

import numpy as np
from torch import nn

from mpifl.aggregators.base import Aggregator, register
from mpifl.aggregators.needs import Needs
from mpifl.core.params import Params
from mpifl.data.registry import LABELS, DataPool, DataShape, NoParams, register_dataset
from mpifl.data.roots import DatasetLayout, find_dataset_dir, register_files
from mpifl.models.zoo import MODEL_FACTORIES, register_model

N, FEATURES, CLASSES = 240, 6, 3

register_files("tiny_blobs", DatasetLayout("tiny-blobs", ("blobs.npz",),
                                           source="write it with numpy.savez"))


@register_dataset("tiny_blobs", params=NoParams, provides=(LABELS,),
                  shape=DataShape((FEATURES,), CLASSES, samples=N))
def tiny_blobs(*, seed, data_root=None):
    with np.load(find_dataset_dir("tiny_blobs", data_root) / "blobs.npz") as f:
        return DataPool(f["x"], f["y"], CLASSES)


@register_model("tiny_net")
def tiny_net(shape, num_classes, *, seed=0, width: int = 5):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), width), nn.ReLU(),
                         nn.Linear(width, num_classes))


# registered without saying how to count it: the budget never runs it before the real build
@MODEL_FACTORIES.register("tiny_uncounted")
def tiny_uncounted(shape, num_classes, *, seed=0, width: int = 5):
    return tiny_net(shape, num_classes, seed=seed, width=width)


@register("tiny_mean")
class TinyMean(Aggregator):
    """The plain mean of the updates, scaled."""

    needs = Needs(losses=False)

    class Params(Params):
        scale: float = 1.0

    def aggregate(self, r):
        return self.params.scale * r.updates.mean(0)
'''

JOB = f'''
[plugins]
modules = ["{MODULE}"]
[run]
name = "one_file"
rounds = 2
eval_every = 1
checkpoint_every = 0
threads = 1
[data]
dataset = "tiny_blobs"
data_root = "root"
partition = "iid"
num_clients = 4
[model]
name = "tiny_net"
params = {{ width = 7 }}
[client]
epochs = 1
batch_size = 0
lr = 0.1
[server]
algorithm = "tiny_mean"
clients_per_round = 2
[tiny_mean]
scale = 0.5
'''


@pytest.fixture
def job(tmp_path):
    """The file (and its data set's file) beside a job that names it; the registries as they
    were afterwards."""
    from mpifl.aggregators.base import RULES
    from mpifl.data import roots
    from mpifl.data.registry import PARTITIONERS

    registries = (RULES, MODEL_FACTORIES, DATASET_LOADERS, PARTITIONERS)
    saved = [dict(r._entries) for r in registries]
    layouts = dict(roots.LAYOUTS)
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(PARTS))
    (tmp_path / "root" / "tiny-blobs").mkdir(parents=True)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    x = (rng.normal(size=(240, 6)) + 2.0 * y[:, None]).astype(np.float32)
    np.savez(tmp_path / "root" / "tiny-blobs" / "blobs.npz", x=x, y=y)
    path = tmp_path / "job.toml"
    path.write_text(JOB.replace('"root"', f'"{tmp_path / "root"}"'))
    yield path
    for r, entries in zip(registries, saved):
        r._entries = entries
    roots.LAYOUTS.clear()
    roots.LAYOUTS.update(layouts)
    sys.modules.pop(MODULE, None)
    sys.path[:] = [p for p in sys.path if p != str(tmp_path)]


def test_a_data_set_a_model_and_a_rule_are_one_file_each(job, tmp_path, monkeypatch):
    monkeypatch.delenv(budget.LIMIT_VAR, raising=False)
    cfg = load_config(job)  # validation imports the file and accepts its three names
    assert (cfg.data.dataset, cfg.model.name, cfg.server.algorithm) == \
        ("tiny_blobs", "tiny_net", "tiny_mean")
    assert cfg.rule_params().scale == 0.5

    est = budget.estimate(cfg, ranks=1, world=1)
    assert est.samples == 240
    data = est.part("the tiny_blobs data set holds 240 samples")
    assert data is not None and data.nbytes > 0
    # d counted on the meta device equals the model built for real: 6*7 + 7 + 7*3 + 3
    real = build_model("tiny_net", (6,), 3, width=7)
    assert est.d == sum(p.numel() for p in real.parameters()) == 73
    assert est.part("the model has d = 73 parameters") is not None

    ds = mpifl.run(job, out=tmp_path / "one_file.h5", progress=False)
    assert ds.sizes["round"] == 2 and ds.sizes["client"] == 4
    assert str(ds.algorithm.values[0]) == "tiny_mean"


def test_the_files_it_declares_are_where_the_run_looks(job, tmp_path):
    (tmp_path / "root" / "tiny-blobs" / "blobs.npz").unlink()
    with pytest.raises(mpifl.MpiflError, match=r"dataset 'tiny_blobs' not found in data.data_root"
                       r" .*tiny-blobs lacks blobs.npz; put its files in .* \(write it with "
                       r"numpy.savez\)"):
        mpifl.run(job, out=tmp_path / "missing.h5", progress=False)


def test_the_budget_holds_exactly_the_arrays_a_declared_set_builds(job, monkeypatch):
    """x, y and one train-or-test index a sample, plus the per-client bookkeeping: what the
    DataShape declares is what the run holds, to the byte."""
    monkeypatch.delenv(budget.LIMIT_VAR, raising=False)
    cfg = load_config(job)
    est = budget.estimate(cfg, ranks=1, world=1)
    fed = build_parts(make_plan(cfg)).fed
    held = sum(a.nbytes for a in (fed.x, fed.y, fed.train_idx, fed.test_idx))
    assert len(fed.train_idx) + len(fed.test_idx) == len(fed.x) == 240
    data = est.part("the tiny_blobs data set")
    assert data.nbytes - budget.PER_CLIENT_BYTES * cfg.data.num_clients == held


def test_a_model_registered_without_a_size_is_not_run_by_the_budget(job, monkeypatch):
    monkeypatch.delenv(budget.LIMIT_VAR, raising=False)
    cfg = load_config(job, ["model.name=tiny_uncounted"])
    est = budget.estimate(cfg, ranks=1, world=1)
    assert est.d is None and est.part("the model has") is None
    assert est.samples == 240  # the data set is still counted


def test_every_built_in_declares_what_the_budget_reads():
    """No built-in data set or model is sized anywhere but at its registration."""
    undeclared = [n for n in DATASETS if data_shape(DATASET_LOADERS.get(n)) is None]
    assert not undeclared, undeclared
    uncounted = [n for n in MODELS if getattr(MODEL_FACTORIES.get(n), "size", None) is None]
    assert not uncounted, uncounted
    assert set(MODELS) >= {"logreg", "mlp", "cnn_mnist", "cnn_cifar", "cnn_femnist",
                           "char_lstm", "transformer_lm", "resnet18_gn"}


@pytest.mark.parametrize("name", MODELS)
def test_every_built_in_model_is_counted_as_built(name):
    """What the budget counts on the meta device is the model built for real: parameters and
    float buffers (BatchNorm's statistics travel in w)."""
    shape, params = SMALL[name]
    real = build_model(name, shape, 5, **params)
    want = sum(p.numel() for p in real.parameters())
    want += sum(b.numel() for b in real.buffers() if b.is_floating_point())
    keywords = {k: v for k, v in params.items() if k != "sequence_targets"}  # build_model's
    assert parameter_count(name, shape, 5, seed=0, params=keywords) == \
        (want, len(list(real.parameters())))


@pytest.mark.parametrize("dataset, samples, shape, classes", [
    ("fashion_mnist", 70_000, (1, 28, 28), 10), ("cifar100", 60_000, (3, 32, 32), 100),
    ("adult", 45_222, (105,), 2), ("german", 1_000, (63,), 2)])
def test_the_file_bound_sets_declare_their_pools(dataset, samples, shape, classes):
    declared = data_shape(DATASET_LOADERS.get(dataset))
    assert (declared.samples, declared.input_shape, declared.num_classes) == \
        (samples, shape, classes)


def test_the_partition_that_relabels_sizes_the_model_by_its_classes():
    cfg = load_config(None, ["data.dataset=fashion_mnist", "data.partition=one_class_per_client",
                             "data.num_clients=3", "server.clients_per_round=3",
                             "model.name=logreg"])
    assert budget.estimate(cfg, ranks=1, world=1).d == 784 * 3 + 3
