"""Assembling an experiment's parts from its plan (:mod:`mpifl.experiment.plan`), identically on
every rank: the device, the federated data, the model, its loss and initial parameters, the
trainer, the rule, the meta step."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import numpy as np

import torch

from mpifl import aggregators
from mpifl.clients import TrainerBase, VmapTrainer
from mpifl.clients.interface import ClientTrainer, TrainOptions
from mpifl.clients.blamed import Blamed
from mpifl.clients.loop import LoopTrainer
from mpifl.clients.select import select_trainer
from mpifl.clients.faults import NaNClients
from mpifl.clients.meta import MetaStep
from mpifl.clients.minibatches import trained_samples
from mpifl.clients.system import SystemModel
from mpifl.aggregators.server_opt import ServerOptimizer, ServerOptimizerParams
from mpifl.core.errors import ConfigError, MpiflError, OutputError
from mpifl.core.layout import ParamLayout
from mpifl.core.rng import ADAPT_TAG
from mpifl.data import load_federated
from mpifl.data.federated import FederatedData
from mpifl.data.lazy import LazyPopulation, load_population
from mpifl.experiment.plan import Plan
from mpifl.core.blame import blame
from mpifl.models import (MODEL_FACTORIES, Loss, ModelTraits, build_model, get_loss,
                          model_traits)
from mpifl.models.losses import check_fit, check_loss, check_targets
from mpifl.models.zoo import (batchnorm_coordinates, factory_keywords, model_output,
                              model_params)
from mpifl.runtime.clock import Clock
from mpifl.runtime.backends import num_groups
from mpifl.runtime.client_state import LocalCoordinates
from mpifl.runtime.comm import local_rank
from mpifl.store import checkpoint

log = logging.getLogger("mpifl")


@dataclass
class Parts:
    fed: FederatedData | LazyPopulation
    model: torch.nn.Module
    layout: ParamLayout
    w0: torch.Tensor  # (d,) float32 initial global parameters (and float buffers)
    loss: Loss  # [model] loss
    traits: ModelTraits  # buffers, random layers, convolutions (decide the trainer path)
    #: (s,) positions in w that stay with each client (model.batchnorm local; empty: none)
    local_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: G sensitive groups of a two-class task with a sensitive attribute (0: no group metrics)
    num_groups: int = 0


def device_for(plan: Plan, rank: int) -> torch.device:
    """``server.device``: auto picks this rank's GPU (by local rank) when CUDA is present."""
    if plan.device == "cpu" or not torch.cuda.is_available():
        if plan.device == "cuda":
            raise MpiflError("server.device: 'cuda' requested but no CUDA device is available")
        return torch.device("cpu")
    return torch.device("cuda", local_rank(rank) % torch.cuda.device_count())


def build_parts(plan: Plan) -> Parts:
    """Data, model and initial parameters, identical on every rank for the same plan.

    Raises:
        ConfigError: the data, the loss and the rule do not fit together (a rule that needs
            groups on data without a sensitive attribute, labels against a regression loss).
        DataError: a missing or damaged data set.
    """
    d, seed = plan.data, plan.seed
    load = load_population if d.lazy else load_federated  # data.lazy: drawn per request
    fed = load(
        d.dataset, partition=d.partition, num_clients=d.num_clients, seed=seed,
        train_fraction=d.train_fraction, data_root=d.data_root, dataset_params=d.params,
        partition_params=d.partition_params)
    if fed.sensitive is None and (plan.needs.num_groups or (
            plan.meta is not None and plan.meta.meta_sampling == "group_balanced")):
        raise ConfigError(f"data.dataset: '{d.dataset}' has no sensitive attribute, which "
                          f"{plan.rule} (or the group-balanced meta set) needs")
    m = plan.model
    loss = get_loss(m.loss)
    x, y = real_batch(fed)
    _check_task(plan, fed, loss, y)
    sequence = y.ndim == 2 and y.dtype.kind in "iu"
    params, vocab = factory_keywords(m.name, model_params(m.name, m.hidden, m.params),
                                     fed.vocab_size, d.dataset)
    model = build_model(m.name, fed.input_shape, loss.width(fed.num_classes),
                        output=m.output, seed=seed, vocab_size=vocab, sample=x,
                        sequence_targets=sequence, dataset=d.dataset, **params)
    # the loss against the run's own targets, on the model's own output, as training will
    out = model_output(model, x)
    check_fit(loss, out, y, m.name, d.dataset)
    check_loss(loss, fed.num_classes, y, shape=tuple(out.shape))  # it trains the model
    with blame([("model", m.name, MODEL_FACTORIES.get(m.name))], "check"):
        traits = model_traits(model, fed.input_shape, x)
    if traits.buffers and (plan.meta is not None or plan.personal):
        raise ConfigError(f"model: '{m.name}' has buffers ({', '.join(traits.buffers)}), "
                          f"which FedMeta's meta step and personal models cannot carry")
    layout = ParamLayout.from_module(model)
    local = batchnorm_coordinates(model, layout, m.batchnorm)
    if len(local) and (plan.shards > 1 or plan.adapt is not None):
        raise ConfigError(f"model.batchnorm: '{m.batchnorm}' keeps coordinates per "
                          f"client, which the sharded server and run.adapt_epochs do not carry yet")
    return Parts(fed, model, layout, layout.flatten_module(model).detach().clone(), loss, traits,
                 local, num_groups(fed))


def _check_task(plan: Plan, fed, loss: Loss, y: np.ndarray) -> None:
    """The loss fits the data (its targets' shape, dtype and classes, on the run's own
    samples y) and the rule (some need class labels)."""
    dataset = plan.data.dataset
    if loss.targets is None:  # a user loss: its task says which targets it takes
        integer = fed.label_dtype.kind in "iu"
        if loss.integer_labels != integer:
            want = "integer class labels" if loss.integer_labels else "float targets"
            raise ConfigError(f"model.loss: '{loss.name}' needs {want}; data set "
                              f"'{dataset}' has {fed.label_dtype} y")
    if loss.outputs == 1 and fed.num_classes != 2 and fed.label_dtype.kind in "iu":
        raise ConfigError(f"model.loss: '{loss.name}' is a two-class loss; data set "
                          f"'{dataset}' has {fed.num_classes} classes")
    check_targets(loss, y, fed.num_classes, dataset)
    if plan.needs.num_groups and not loss.integer_labels:
        kind = "a multi-label" if loss.classification else "a regression"
        raise ConfigError(f"server.algorithm: '{plan.rule}' needs one class label a sample "
                          f"(group counts); model.loss '{loss.name}' is {kind} loss")
    if plan.trainer.options.get("report_accuracy") and not loss.classification:
        raise ConfigError(f"server.algorithm: '{plan.rule}' needs class labels "
                          f"(accuracies or groups); model.loss '{loss.name}' is a regression loss")


def trainer_path(plan: Plan, parts: Parts, device: torch.device) -> tuple[str, str]:
    """``client.trainer`` resolved for this model and device: ``("vmap" | "loop", why)``."""
    return select_trainer(plan.trainer.requested, parts.traits, plan.needs.trainer, device.type,
                          plan.rule)


def _trainer_class(plan: Plan, parts: Parts, loop: bool) -> tuple[type[TrainerBase], dict]:
    """The trainer class and its options: the rule's, or the loop (which alone keeps local
    coordinates: models with local BatchNorm)."""
    cls, options = plan.trainer.cls, dict(plan.trainer.options)
    if loop:
        cls = LoopTrainer
        options["random"] = parts.traits.random
        if len(parts.local_index):
            options["local_index"] = parts.local_index
    return cls, options


def trainer_columns(plan: Plan, parts: Parts):
    """The :class:`mpifl.clients.Columns` of the run's trainer, without building it (rank 0)."""
    cls, options = _trainer_class(plan, parts, loop=bool(len(parts.local_index)))
    return cls.columns_for(parts.layout.d, parts.num_groups, **options)


def make_trainer(plan: Plan, parts: Parts, device: torch.device) -> ClientTrainer:
    """The run's trainer on this rank (:mod:`mpifl.clients`), its failures named by the model
    and loss they come from, with ``faults.nan_clients`` injected."""
    cls, options = _trainer_class(plan, parts, trainer_path(plan, parts, device)[0] == "loop")
    options["loss"] = parts.loss
    x, y = sample_store(parts.fed, device, plan.samples_on)
    if "sensitive" in inspect.signature(cls).parameters:  # trainers with a group-fair objective
        options["sensitive"] = torch.from_numpy(parts.fed.sensitive).to(device)
    train_options, own = TrainOptions.split({**options, "device": device})
    inner: ClientTrainer = cls(parts.model, parts.layout, x, y, train_options, **own)
    trainer = Blamed(inner, plugin_parts(plan, parts))
    nan = plan.trainer.nan_clients
    return NaNClients(trainer, list(nan)) if nan else trainer


def real_batch(fed, n: int = 8) -> tuple[torch.Tensor, np.ndarray]:
    """Up to n of the data's own samples, ``(x (b, *input_shape), y (b, ...))`` with b >= 2
    (every client has 2): what the model and loss are checked on, never zeros or random
    floats (token ids, a language model's inputs, are neither). A lazy population draws
    client 0 for them."""
    if fed.lazy:
        window = fed.clients([0])
        x, y = window.x[:n], window.y[:n]
    else:
        x, y = fed.x[:n], fed.y[:n]
    return torch.from_numpy(np.ascontiguousarray(x)), y


def sample_store(fed, device: torch.device, samples_on: str = "device"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's sample store (x (N, *input_shape), y (N, *target_shape), the pool's
    dtypes): the whole pool, or for a lazy population an empty store of its shape, each
    request's window staged in it (:func:`mpifl.runtime.backends.client_rows`).

    Args:
        device: where the trainer computes.
        samples_on: ``client.samples_on`` as the plan resolved it
            (:func:`mpifl.experiment.budget.check_gpu`): ``"device"`` (and an unresolved
            ``"auto"``) puts the store on ``device``; ``"host"`` keeps it in host memory, pinned
            when ``device`` is CUDA so that each chunk's rows can be copied with
            ``non_blocking`` (the trainer moves only those, ``TrainerBase._gather``). On a CPU
            every choice is the same store.
    """
    where = torch.device("cpu") if samples_on == "host" else device
    if fed.lazy:
        return (torch.from_numpy(np.empty((0, *fed.input_shape), dtype=fed.x_dtype)).to(where),
                torch.from_numpy(np.empty((0, *fed.target_shape),
                                          dtype=fed.label_dtype)).to(where))
    x, y = torch.from_numpy(fed.x), torch.from_numpy(fed.y)
    if where.type != "cpu":
        return x.to(where), y.to(where)
    if device.type == "cuda":
        # Page-locked, so the per-chunk copies can overlap; the pool's arrays become views of
        # the pinned copy, so host memory holds the samples once, not twice.
        x, y = x.pin_memory(), y.pin_memory()
        fed.x, fed.y = x.numpy(), y.numpy()
    return x, y


def plugin_parts(plan: Plan, parts: Parts) -> list[tuple[str, str, object]]:
    """The model and loss of the run, for naming them when they fail (:mod:`mpifl.core.blame`)."""
    return [("model", plan.model.name, MODEL_FACTORIES.get(plan.model.name)),
            ("loss", plan.model.loss, parts.loss)]


def make_adapter(plan: Plan, parts: Parts, device: torch.device,
                 trainer: ClientTrainer | None = None) -> ClientTrainer | None:
    """The trainer of evaluation after local adaptation, or None when ``run.adapt_epochs`` is 0.

    The client section's plain local SGD (``client.batch_size``, ``momentum``, ``weight_decay``,
    ``memory_budget_mb``; none of a rule's own objective or options) for ``run.adapt_epochs``
    epochs, its minibatch order keyed apart from training's (:data:`ADAPT_TAG`). It shares the
    sample store of ``trainer`` (the run's trainer on this rank) when given.
    """
    a = plan.adapt
    if a is None:
        return None
    x, y = ((trainer.x, trainer.y) if trainer is not None
            else sample_store(parts.fed, device, plan.samples_on))
    cls = LoopTrainer if trainer_path(plan, parts, device)[0] == "loop" else VmapTrainer
    options = TrainOptions(epochs=a.epochs, batch_size=a.batch_size, momentum=a.momentum,
                           weight_decay=a.weight_decay, seed=plan.seed,
                           memory_budget_mb=a.memory_budget_mb, device=device,
                           pretrain_losses=False, order_tag=ADAPT_TAG, loss=parts.loss,
                           minibatch_order=plan.trainer.options["minibatch_order"])
    return Blamed(cls(parts.model, parts.layout, x, y, options), plugin_parts(plan, parts))


def make_aggregator(plan: Plan, parts: Parts):
    """The run's rule (:func:`mpifl.aggregators.create`) with the parameters the data decide
    (number of clients, of sensitive groups)."""
    params = dict(plan.rule_params)
    if plan.needs.num_clients:
        params["num_clients"] = parts.fed.num_clients
    if plan.needs.num_groups:
        params["num_groups"] = parts.num_groups
    return aggregators.create(plan.rule, seed=plan.seed, **params)


def meta_step_for(plan: Plan, parts: Parts, device: torch.device | str = "cpu") -> MetaStep | None:
    """The meta step of the run (rank 0), or None without one."""
    m = plan.meta
    if m is None:
        return None
    return MetaStep(parts.fed, parts.model, parts.layout, seed=plan.seed,
                    meta_size=m.meta_size, eta_meta=m.eta_meta, meta_sampling=m.meta_sampling,
                    device=device, loss=parts.loss)


@dataclass
class ServerParts:
    """What rank 0 adds to the parts: the rule, the meta step, the clients' local coordinates,
    the server optimizer, restored from a checkpoint when resuming; and the trainer path the
    results record."""

    aggregator: object
    meta: MetaStep | None
    local: LocalCoordinates | None
    optimizer: ServerOptimizer | None
    trainer_path: tuple[str, str]


def server_parts(plan: Plan, parts: Parts, device: torch.device, ckpt=None,
                 shard=None) -> ServerParts:
    """Rank 0's :class:`ServerParts`; ``ckpt`` (a :class:`mpifl.store.checkpoint.Checkpoint`)
    restores their state. On a sharded server the rule is shard 0's, restored already.

    Raises:
        OutputError: the checkpoint lacks the local BatchNorm rows the model keeps.
    """
    aggregator = shard.aggregator if shard is not None else make_aggregator(plan, parts)
    if ckpt is not None and shard is None:  # a sharded checkpoint's blocks are joined (P = 1)
        aggregator.load_state_dict(checkpoint.aggregator_state(
            ckpt, aggregator.needs.sharded_state, parts.layout.d))
    return ServerParts(aggregator, meta_step_for(plan, parts, device),
                       _local_coordinates(parts, ckpt), _server_optimizer(plan.optimizer, ckpt),
                       trainer_path(plan, parts, device))


def _local_coordinates(parts: Parts, ckpt) -> LocalCoordinates | None:
    """The clients' local coordinates (local BatchNorm), restored from the checkpoint."""
    if not len(parts.local_index):
        return None
    local = LocalCoordinates(parts.local_index, parts.w0, parts.fed.num_clients)
    if ckpt is not None:
        if "local_rows" not in ckpt.client_state:
            raise OutputError(f"{ckpt.path}: the checkpoint has no local BatchNorm rows")
        local.load_state_dict(ckpt.client_state)
    return local


def local_work(plan: Plan, num_train: np.ndarray) -> np.ndarray | None:
    """(K,) int64: the samples each client's round goes through when
    ``client.max_local_steps`` caps it (the simulated clock's local work); None uncapped
    (``epochs`` epochs over each client's data)."""
    options = plan.trainer.options
    if options.get("max_local_steps") is None:
        return None
    return trained_samples(num_train, plan.epochs, options["batch_size"],
                           options["max_local_steps"])


def make_clock(plan: Plan, parts: Parts, ckpt=None) -> Clock | None:
    """Rank 0's simulated time (``[system] enabled``), restored from the checkpoint; None when
    the run is not on simulated time.

    Raises:
        OutputError: the checkpoint lacks the clock's state (it was written without it).
    """
    s = plan.system
    if s is None:
        return None
    system = SystemModel(s, plan.seed, parts.fed.num_clients, model_bytes=4 * parts.layout.d)
    clock = Clock(system, parts.fed.num_train, plan.epochs, plan.seed, s.deadline_s,
                  s.over_commit, work=local_work(plan, parts.fed.num_train))
    if ckpt is not None:
        try:
            clock.load_state_dict({k.split("_", 1)[1]: v for k, v in ckpt.server_state.items()
                                   if k.startswith("clock_")})
        except ValueError as exc:
            raise OutputError(f"{ckpt.path}: {exc}") from None
    return clock


def _server_optimizer(params: ServerOptimizerParams, ckpt) -> ServerOptimizer | None:
    """``server.optimizer`` (None for plain sgd with lr 1), its moments restored from the
    checkpoint."""
    opt = ServerOptimizer(params)
    if opt.identity:
        return None
    if ckpt is not None:
        opt.load_state_dict({k.split("_", 1)[1]: v for k, v in ckpt.server_state.items()
                             if k.startswith("optimizer_")})
    log.info("server optimizer: %s, lr %g", params.name, params.lr)
    return opt
