"""A run planned once: the config and the rule's needs turned into one frozen :class:`Plan`.

Everything a run decides from its config is decided here, the same on every rank: the round
loop's schedule, the rule and its parameters, the trainer class and its options, the meta step,
the server optimizer, the shards and the loggers. :mod:`mpifl.experiment.assemble` builds the
parts from the plan and the runtime receives the plan's records (:class:`mpifl.runtime.plan.
RoundPlan` and the like), never the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mpifl import aggregators
from mpifl.aggregators.needs import Needs
from mpifl.aggregators.server_opt import ServerOptimizerParams
from mpifl.clients import TRAINERS
from mpifl.clients.system import SystemParams
from mpifl.experiment.budget import check_budget, check_gpu
from mpifl.experiment.config import Config, DataConfig, ModelConfig
from mpifl.runtime.plan import RoundPlan
from mpifl.runtime.schedule import DEFAULT_SHARE, default_every


@dataclass(frozen=True)
class TrainerPlan:
    """Local training: the rule's trainer class and its keyword options.

    Attributes:
        cls: the trainer class of the rule (``TRAINERS[needs.trainer]``).
        options: its keyword options: the client section (epochs, batch size, momentum, weight
            decay, seed, memory budget), overridden by the rule's own (e.g. FedFa's gamma_c),
            and ``pretrain_losses=False`` for a rule that reads no pre-training losses.
        requested: ``client.trainer`` (``auto``, ``vmap`` or ``loop``).
        nan_clients: clients whose updates are replaced by NaN (``faults.nan_clients``).
    """

    cls: type
    options: dict[str, Any]
    requested: str
    nan_clients: tuple[int, ...] = ()


@dataclass(frozen=True)
class AdaptPlan:
    """Evaluation after local adaptation (``run.adapt_epochs > 0``): the client section's plain
    local SGD for ``epochs`` epochs (none of a rule's own objective or options)."""

    epochs: int
    batch_size: int
    momentum: float
    weight_decay: float
    memory_budget_mb: float


@dataclass(frozen=True)
class MetaPlan:
    """FedMeta's meta step after every aggregation (``[fedmeta]``; Yao et al. 2019)."""

    meta_size: int
    eta_meta: float
    meta_sampling: str


@dataclass(frozen=True)
class Plan:
    """One run, decided once.

    Attributes:
        rounds: the round loop's schedule (:class:`mpifl.runtime.plan.RoundPlan`).
        rule: ``server.algorithm``; rule_params: its validated table as a dict; needs: its
            :class:`mpifl.aggregators.needs.Needs`; personal: it keeps a model per client
            (:class:`mpifl.aggregators.PersonalModels`, Ditto).
        seed: ``run.seed`` (data, model, trainer, rule).
        data, model: the data and model sections (what :func:`mpifl.experiment.assemble.
            build_parts` builds).
        trainer: local training; adapt: adapted evaluation (None: off); meta: the meta step
            (None: off); optimizer: the server optimizer.
        device: ``server.device`` (``auto``, ``cpu`` or ``cuda``); samples_on:
            ``client.samples_on``, where a worker on a GPU keeps its clients' samples.
        shards: P, ranks 0 .. P-1 aggregate one block of the parameters each (1: rank 0 alone).
        peer_timeout_s, setup_timeout_s: the bounds of ``[run]`` (0: none).
        threads: ``run.threads``, each rank's threads (0: decided at set-up,
            :mod:`mpifl.runtime.threads`).
        loggers: ``run.loggers``; config: the config as a plain dict, for them.
        system: the clients' devices and the round deadline (the ``[system]`` table) when the
            run is on simulated time, else None; epochs: ``client.epochs`` (a client's work).
    """

    rounds: RoundPlan
    rule: str
    rule_params: dict[str, Any]
    needs: Needs
    personal: bool
    seed: int
    data: DataConfig
    model: ModelConfig
    trainer: TrainerPlan
    optimizer: ServerOptimizerParams
    device: str = "auto"
    samples_on: str = "auto"
    shards: int = 1
    peer_timeout_s: float = 0.0
    setup_timeout_s: float = 0.0
    threads: int = 0
    adapt: AdaptPlan | None = None
    meta: MetaPlan | None = None
    loggers: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)
    system: SystemParams | None = None
    epochs: int = 1


def make_plan(cfg: Config) -> Plan:
    """The plan of a validated config.

    Raises:
        ConfigError: the run would not fit in this node's memory
            (:func:`mpifl.experiment.budget.check_budget`) or in its GPU's
            (:func:`mpifl.experiment.budget.check_gpu`), before any data or model is built.
    """
    check_budget(cfg)
    samples_on = check_gpu(cfg)  # on a CUDA run: checked, "auto" resolved
    run, client, server = cfg.run, cfg.client, cfg.server
    rule = aggregators.rule(server.algorithm)
    text = cfg.to_json()
    return Plan(
        rounds=_round_plan(cfg, text),
        rule=server.algorithm, rule_params=cfg.algorithm_params(), needs=rule.needs,
        personal=isinstance(rule, aggregators.PersonalModels), seed=run.seed, data=cfg.data, model=cfg.model,
        trainer=_trainer_plan(cfg, rule),
        optimizer=ServerOptimizerParams(server.optimizer, server.lr, server.momentum,
                                        server.betas[0], server.betas[1], server.tau),
        device=server.device, samples_on=samples_on, shards=server.shards, peer_timeout_s=run.peer_timeout_s,
        setup_timeout_s=run.setup_timeout_s, threads=run.threads,
        adapt=(AdaptPlan(run.adapt_epochs, client.batch_size, client.momentum,
                         client.weight_decay, client.memory_budget_mb)
               if run.adapt_epochs else None),
        # [fedmeta] is a rule's table, a field that config.schema() adds
        meta=(MetaPlan(cfg.fedmeta.meta_size, cfg.fedmeta.eta_meta,  # type: ignore[attr-defined]
                       cfg.fedmeta.meta_sampling)  # type: ignore[attr-defined]
              if rule.needs.meta_step or server.meta else None),
        loggers=tuple(run.loggers), config=json.loads(text),
        system=cfg.system if cfg.system.enabled else None, epochs=client.epochs)


def _round_plan(cfg: Config, config_json: str) -> RoundPlan:
    """Rank 0's round loop; ``run.checkpoint_every`` not set: 2% of the rounds
    (:func:`mpifl.runtime.schedule.default_every`), under the default share of the run's time."""
    run, client, server = cfg.run, cfg.client, cfg.server
    default = run.checkpoint_every is None
    return RoundPlan(
        name=run.name, seed=run.seed, rounds=run.rounds,
        clients_per_round=server.clients_per_round, sampling=server.sampling, lr=client.lr,
        lr_decay=client.lr_decay, dropout=client.dropout, max_update_norm=server.max_update_norm,
        eval_every=run.eval_every,
        checkpoint_every=(default_every(run.rounds) if run.checkpoint_every is None
                          else run.checkpoint_every),
        checkpoint_minutes=run.checkpoint_minutes, progress_every_s=run.progress_every_s,
        adapt=run.adapt_epochs > 0, rule=server.algorithm, config_json=config_json,
        eval_clients=run.eval_clients, full_eval_every=run.full_eval_every,
        checkpoint_share=DEFAULT_SHARE if default else 0.0,
        eval_window_samples=run.eval_window_samples)


def _trainer_plan(cfg: Config, rule) -> TrainerPlan:
    """The client section, overridden by the rule's own options; no pre-training forward pass
    unless a statistic needs it (``needs.losses``)."""
    c = cfg.client
    options = dict(epochs=c.epochs, batch_size=c.batch_size, momentum=c.momentum,
                   weight_decay=c.weight_decay, seed=cfg.run.seed,
                   memory_budget_mb=c.memory_budget_mb, minibatch_order=c.minibatch_order,
                   max_local_steps=c.max_local_steps)
    options.update(rule.client_options(cfg.rule_params()))
    if not rule.needs.losses:
        options["pretrain_losses"] = False
    return TrainerPlan(TRAINERS[rule.needs.trainer], options, c.trainer,
                       tuple(cfg.faults.nan_clients))
