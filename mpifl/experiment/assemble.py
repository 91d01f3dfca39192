"""Assembling an experiment's parts from its config, identically on every rank: the device, the
federated data, the model, its loss and initial parameters, the trainer path, the meta step."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

import torch

from mpifl import aggregators
from mpifl.clients import TRAINERS, VmapTrainer
from mpifl.clients.blamed import Blamed
from mpifl.clients.loop import LoopTrainer
from mpifl.clients.select import select_trainer
from mpifl.clients.faults import NaNClients
from mpifl.clients.meta import MetaStep
from mpifl.core.errors import ConfigError, MpiflError
from mpifl.core.layout import ParamLayout
from mpifl.core.rng import ADAPT_TAG
from mpifl.data import load_federated
from mpifl.experiment.budget import check_budget
from mpifl.experiment.config import Config
from mpifl.core.blame import blame
from mpifl.models import (MODEL_FACTORIES, Loss, ModelTraits, build_model, get_loss,
                          model_traits)
from mpifl.models.zoo import batchnorm_coordinates
from mpifl.runtime.backends import group_setup
from mpifl.runtime.comm import local_rank


@dataclass
class Parts:
    fed: object
    model: torch.nn.Module
    layout: ParamLayout
    w0: torch.Tensor  # (d,) float32 initial global parameters (and float buffers)
    loss: Loss  # [model] loss
    traits: ModelTraits  # buffers, random layers, convolutions (decide the trainer path)
    #: (s,) positions in w that stay with each client (model.batchnorm local; empty: none)
    local_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def device_for(cfg: Config, rank: int) -> torch.device:
    """``server.device``: auto picks this rank's GPU (by local rank) when CUDA is present."""
    if cfg.server.device == "cpu" or not torch.cuda.is_available():
        if cfg.server.device == "cuda":
            raise MpiflError("server.device: 'cuda' requested but no CUDA device is available")
        return torch.device("cpu")
    return torch.device("cuda", local_rank(rank) % torch.cuda.device_count())


def build_parts(cfg: Config) -> Parts:
    """Data, model and initial parameters, identical on every rank for the same config.

    Refuses first, before any data or model is built, a config whose run would not fit in this
    node's memory (:func:`mpifl.experiment.budget.check_budget`)."""
    check_budget(cfg)
    d = cfg.data
    fed = load_federated(
        d.dataset, partition=d.partition, num_clients=d.num_clients, seed=cfg.run.seed,
        train_fraction=d.train_fraction, data_root=d.data_root,
        classes_per_client=d.classes_per_client, dirichlet_alpha=d.dirichlet_alpha,
        classes=d.classes, synthetic_alpha=d.synthetic_alpha, synthetic_beta=d.synthetic_beta,
        heterogeneity=d.heterogeneity, group_proportions=d.group_proportions,
        sensitive_feature=d.sensitive_feature, dataset_params=d.params,
        partition_params=d.partition_params)
    rule = aggregators.rule(cfg.server.algorithm)
    if fed.sensitive is None and (rule.needs.num_groups or (
            uses_meta_step(cfg) and cfg.fedmeta.meta_sampling == "group_balanced")):
        raise ConfigError(f"data.dataset: '{d.dataset}' has no sensitive attribute, which "
                          f"{cfg.server.algorithm} (or the group-balanced meta set) needs")
    loss = get_loss(cfg.model.loss)
    _check_task(cfg, fed, loss)
    model = build_model(cfg.model.name, fed.input_shape, loss.width(fed.num_classes),
                        hidden=cfg.model.hidden, output=cfg.model.output, seed=cfg.run.seed,
                        **cfg.model.params)
    with blame([("model", cfg.model.name, MODEL_FACTORIES.get(cfg.model.name))], "check"):
        traits = model_traits(model, fed.input_shape)
    if traits.buffers and (uses_meta_step(cfg) or isinstance(rule, aggregators.PersonalModels)):
        raise ConfigError(f"model: '{cfg.model.name}' has buffers ({', '.join(traits.buffers)}), "
                          f"which FedMeta's meta step and personal models cannot carry")
    layout = ParamLayout.from_module(model)
    local = batchnorm_coordinates(model, layout, cfg.model.batchnorm)
    if len(local) and (cfg.server.shards > 1 or cfg.run.adapt_epochs):
        raise ConfigError(f"model.batchnorm: '{cfg.model.batchnorm}' keeps coordinates per "
                          f"client, which the sharded server and run.adapt_epochs do not carry yet")
    return Parts(fed, model, layout, layout.flatten_module(model).detach().clone(), loss, traits,
                 local)


def _check_task(cfg: Config, fed, loss: Loss) -> None:
    """The loss fits the data (labels or targets) and the rule (some need class labels)."""
    integer = fed.y.dtype.kind in "iu"
    if loss.classification != integer:
        want = "integer class labels" if loss.classification else "float targets"
        raise ConfigError(f"model.loss: '{loss.name}' needs {want}; data set "
                          f"'{cfg.data.dataset}' has {fed.y.dtype} y")
    if loss.outputs == 1 and fed.num_classes != 2:
        raise ConfigError(f"model.loss: '{loss.name}' is a two-class loss; data set "
                          f"'{cfg.data.dataset}' has {fed.num_classes} classes")
    rule = aggregators.rule(cfg.server.algorithm)
    needs_labels = (rule.needs.num_groups
                    or rule.client_options(cfg.rule_params()).get("report_accuracy"))
    if needs_labels and not loss.classification:
        raise ConfigError(f"server.algorithm: '{cfg.server.algorithm}' needs class labels "
                          f"(accuracies or groups); model.loss '{loss.name}' is a regression loss")


def trainer_path(cfg: Config, parts: Parts, device: torch.device) -> tuple[str, str]:
    """``client.trainer`` resolved for this model and device: ``("vmap" | "loop", why)``."""
    rule = aggregators.rule(cfg.server.algorithm)
    return select_trainer(cfg.client.trainer, parts.traits, rule.needs.trainer, device.type,
                          cfg.server.algorithm)


def _trainer_options(cfg: Config, parts: Parts) -> tuple[type, dict]:
    """The trainer class of the selected rule and its keyword options: the client section,
    overridden by the rule's own (e.g. FedFa's client momentum gamma_c), and
    ``pretrain_losses=False`` for rules that read no pre-training losses (``needs.losses``)."""
    c = cfg.client
    rule = aggregators.rule(cfg.server.algorithm)
    options = dict(epochs=c.epochs, batch_size=c.batch_size, momentum=c.momentum,
                   weight_decay=c.weight_decay, seed=cfg.run.seed,
                   memory_budget_mb=c.memory_budget_mb)
    options.update(rule.client_options(cfg.rule_params()))
    if not rule.needs.losses:  # no pre-training forward pass unless a statistic needs it
        options["pretrain_losses"] = False
    return TRAINERS[rule.needs.trainer], options


def trainer_columns(cfg: Config, parts: Parts):
    """The :class:`mpifl.clients.Columns` of the run's trainer, without building it (rank 0)."""
    cls, options = _trainer_options(cfg, parts)
    if len(parts.local_index):  # only the loop keeps local coordinates (models with BatchNorm)
        cls, options["local_index"] = LoopTrainer, parts.local_index
    groups = group_setup(parts.fed, torch.device("cpu"))
    return cls.columns_for(parts.layout.d, groups[1] if groups else 0, **options)


def make_trainer(cfg: Config, parts: Parts, device: torch.device):
    cls, options = _trainer_options(cfg, parts)
    if trainer_path(cfg, parts, device)[0] == "loop":
        cls = LoopTrainer
        if len(parts.local_index):
            options["local_index"] = parts.local_index
    options["loss"] = parts.loss
    x = torch.from_numpy(parts.fed.x).to(device)
    y = torch.from_numpy(parts.fed.y).to(device)
    if "sensitive" in inspect.signature(cls).parameters:  # trainers with a group-fair objective
        options["sensitive"] = torch.from_numpy(parts.fed.sensitive).to(device)
    trainer = Blamed(cls(parts.model, parts.layout, x, y, device=device, **options),
                     plugin_parts(cfg, parts))
    return NaNClients(trainer, cfg.faults.nan_clients) if cfg.faults.nan_clients else trainer


def plugin_parts(cfg: Config, parts: Parts) -> list[tuple[str, str, object]]:
    """The model and loss of the run, for naming them when they fail (:mod:`mpifl.core.blame`)."""
    return [("model", cfg.model.name, MODEL_FACTORIES.get(cfg.model.name)),
            ("loss", cfg.model.loss, parts.loss)]


def make_adapter(cfg: Config, parts: Parts, device: torch.device, trainer=None
                 ) -> VmapTrainer | None:
    """The trainer of evaluation after local adaptation, or None when ``run.adapt_epochs`` is 0.

    The client section's plain local SGD (``client.batch_size``, ``momentum``, ``weight_decay``,
    ``memory_budget_mb``; none of a rule's own objective or options) for ``run.adapt_epochs``
    epochs, its minibatch order keyed apart from training's (:data:`ADAPT_TAG`). It shares the
    sample store of ``trainer`` (the run's trainer on this rank) when given.
    """
    if not cfg.run.adapt_epochs:
        return None
    c = cfg.client
    inner = getattr(trainer, "trainer", trainer)  # NaNClients wraps the run's trainer
    x = getattr(inner, "x", None)
    y = getattr(inner, "y", None)
    if x is None or y is None:
        x, y = torch.from_numpy(parts.fed.x).to(device), torch.from_numpy(parts.fed.y).to(device)
    cls = LoopTrainer if trainer_path(cfg, parts, device)[0] == "loop" else VmapTrainer
    return Blamed(cls(parts.model, parts.layout, x, y, epochs=cfg.run.adapt_epochs,
                      batch_size=c.batch_size, momentum=c.momentum,
                      weight_decay=c.weight_decay, seed=cfg.run.seed,
                      memory_budget_mb=c.memory_budget_mb, device=device,
                      pretrain_losses=False, order_tag=ADAPT_TAG, loss=parts.loss),
                  plugin_parts(cfg, parts))


def make_aggregator(cfg: Config, parts: Parts):
    """The run's rule (:func:`mpifl.aggregators.create`) with the parameters the data decide
    (number of clients, of sensitive groups)."""
    params = cfg.algorithm_params()
    rule = aggregators.rule(cfg.server.algorithm)
    if rule.needs.num_clients:
        params["num_clients"] = parts.fed.num_clients
    if rule.needs.num_groups:
        groups = group_setup(parts.fed, torch.device("cpu"))
        params["num_groups"] = groups[1] if groups else 0
    return aggregators.create(cfg.server.algorithm, seed=cfg.run.seed, **params)


def uses_meta_step(cfg: Config) -> bool:
    """Whether the server applies FedMeta's meta step after every aggregation: the selected rule
    asks for it (``needs.meta_step``, e.g. ``fedmeta``) or ``server.meta = true``."""
    return bool(aggregators.rule(cfg.server.algorithm).needs.meta_step or cfg.server.meta)


def meta_step_for(cfg: Config, parts: Parts, device: torch.device | str = "cpu") -> MetaStep:
    """The meta step of an experiment: ``cfg.fedmeta`` and ``cfg.run.seed`` (rank 0)."""
    m = cfg.fedmeta
    return MetaStep(parts.fed, parts.model, parts.layout, seed=cfg.run.seed,
                    meta_size=m.meta_size, eta_meta=m.eta_meta, meta_sampling=m.meta_sampling,
                    device=device, loss=parts.loss)
