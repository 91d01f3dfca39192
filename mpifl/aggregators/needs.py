"""What a rule needs from the server, declared once.

A rule states everything the run must do for it in one frozen record, its class attribute
``needs: ClassVar[Needs]`` (:class:`Needs`; the default asks for nothing but plain local SGD and
the pre-training losses). Anything only one or two rules use is an opt-in
:class:`typing.Protocol` below: a rule takes part by defining the protocol's methods, and the
code that serves it tests ``isinstance(rule, Protocol)`` (the rule's class or an instance)
where it is used. No code outside a rule's own file tests a rule's name.

=======================  ========================================================  ==============
protocol                 what the rule defines (read by)                           built-in rules
=======================  ========================================================  ==============
:class:`ObservesParams`  ``observe_params(w)`` after every round and              AFL
                         ``evaluation_params(w)`` at every evaluation
                         (``runtime.server``, ``bench``)
:class:`PersonalModels`  ``client_state(ids, w)`` rows sent with TRAIN and        Ditto
                         ``personal_params(w)`` evaluated beside w
                         (``runtime.server``, ``experiment.run``/``assemble``/
                         ``budget``)
:class:`RoundInputs`     ``round_inputs()`` broadcast with TRAIN                  mFairFL
                         (``runtime.server``)
:class:`BenchInputs`     ``bench_inputs()``: the extra inputs a benchmark must    FedFa, FedFV,
                         give it (``bench.aggregation``, ``bench.statecheck``,    FedMDFG, Ditto,
                         ``bench.sharded``)                                       mFairFL
:class:`MemoryRows`      ``memory_rows(p, ...)``: its d-sized rows of state,      FedFV, FedLF,
                         for the memory estimate (``experiment.budget``)          FedMDFG
=======================  ========================================================  ==============

This module imports nothing of mpifl: ``aggregators.base`` builds on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only
    import numpy as np
    import torch

__all__ = ["BenchInputs", "BenchSpec", "MemoryRows", "Needs", "ObservesParams", "PROTOCOLS",
           "PersonalModels", "RoundInputs", "Shards", "StateRows", "partial_protocols"]


@dataclass(frozen=True)
class Shards:
    """A rule runs on a sharded server (``server.shards = P > 1``; docs/ARCHITECTURE.md, "Sharded
    server").

    Its ``aggregate`` takes every sum over coordinates through ``RoundUpdates.total``/``gram``/
    ``dots``/``dot``/``norm``, acts on ``r.updates`` as a column block, and keeps d-sized state
    only in the keys of :attr:`state`.

    Attributes:
        state: keys of ``state_dict()`` whose arrays are (N, block) column blocks of rows: each
            shard checkpoints its own block, and a resume with another P re-cuts them.
    """

    state: tuple[str, ...] = ()


@dataclass(frozen=True)
class Needs:
    """Everything a rule needs from the run, in one frozen record (``Aggregator.needs``).

    Attributes:
        num_clients: the rule keeps per-client state over all K clients (e.g. AFL's lambda):
            the server passes ``num_clients=K`` to the constructor.
        num_groups: the rule's state is per sensitive group (mFairFL's multipliers): the server
            passes ``num_groups=G`` of the data to the constructor.
        all_clients: every client in every round (``server.sampling = "all"``, AFL).
        losses: the rule reads the clients' pre-training losses ``RoundUpdates.losses`` (the
            default, to be safe). False lets the trainer skip the forward pass that measures
            them; ``losses`` is then the first epoch's mean training loss.
        trainer: the local training it needs, a key of :data:`mpifl.clients.TRAINERS`
            (``"sgd"``: plain local SGD; ``"uga"``: keep-trace; ...).
        meta_step: FedMeta's server-side meta step follows the aggregation
            (:mod:`mpifl.clients.meta`).
        shards: None when the rule does not run on a sharded server, else its :class:`Shards`.
        shards_note: why not, when ``shards`` is None (shown in the config error and in
            docs/ALGORITHMS.md).
        asynchronous: the rule aggregates clients as they finish, on simulated time
            (:class:`mpifl.runtime.asynchronous.AsyncServer`: a "round" is one server step of
            ``buffer_size`` updates, with ``concurrency`` clients training at once); its
            instances have int attributes ``buffer_size`` (B >= 1) and ``concurrency``
            (C >= B), and ``RoundUpdates.stats["staleness"]`` (m,) gives each update's
            staleness (server steps since the model it started from).
        current_updates: asynchronous rules only: ``RoundUpdates.updates`` are the clients'
            models against the current global model, ``w - w_k`` (FedAsync's mixing), instead
            of against the model each started from, ``w_start_k - w_k`` (FedBuff).
    """

    num_clients: bool = False
    num_groups: bool = False
    all_clients: bool = False
    losses: bool = True
    trainer: str = "sgd"
    meta_step: bool = False
    shards: Shards | None = None
    shards_note: str = "not adapted to a sharded server"
    asynchronous: bool = False
    current_updates: bool = False

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_groups", "all_clients", "losses", "meta_step",
                     "asynchronous", "current_updates"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Needs.{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.trainer, str) and self.trainer):
            raise TypeError(f"Needs.trainer must be a trainer name, got {self.trainer!r}")
        if self.shards is not None and not isinstance(self.shards, Shards):
            raise TypeError(f"Needs.shards must be None or a Shards record, got {self.shards!r}")
        if self.current_updates and not self.asynchronous:
            raise TypeError("Needs.current_updates is for asynchronous rules only "
                            "(set asynchronous=True)")
        if self.asynchronous and self.shards is not None:
            raise TypeError("Needs.asynchronous: an asynchronous rule runs on one server "
                            "(shards must be None)")

    @property
    def sharded_state(self) -> tuple[str, ...]:
        """The state keys kept as column blocks (``shards.state``; ``()`` when unsharded)."""
        return self.shards.state if self.shards is not None else ()


@dataclass(frozen=True)
class BenchSpec:
    """What ``mpifl bench aggregation`` (and ``mpifl check``) must give a rule besides updates,
    losses and sample counts (:meth:`BenchInputs.bench_inputs`).

    Attributes:
        params: constructor keyword arguments (besides ``seed``, ``tau``, ``num_clients``).
        stats: ``RoundUpdates.stats`` columns as name -> trailing shape; ``()`` gives (m,),
            ``("d",)`` gives (m, d) (e.g. Ditto's personal-model rows).
        loss_at: give ``RoundUpdates.loss_at`` a synthetic probe (FedMDFG's line search).
        baseline: import path ``"pkg.module:function"`` of ``function(rule, seed)`` building a
            reference implementation (``aggregate(r)`` and ``observe(r)`` to feed it the same
            history) timed beside the rule (FedFV's direct form), or None.
        forms: the benchmark rows' ``form`` for the rule and its baseline.
    """

    params: Mapping[str, Any] = field(default_factory=dict)
    stats: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    loss_at: bool = False
    baseline: str | None = None
    forms: tuple[str, str] = ("default", "baseline")


@dataclass(frozen=True)
class StateRows:
    """A rule's own d-sized rows of state (:meth:`MemoryRows.memory_rows`).

    Attributes:
        key: the config key that sets their number (e.g. ``"fedfv.tau"``), named in the error.
        what: what they are, for the one-line error ("FedFV's history of 2 round(s) of ...").
        rows: how many d-sized float32 rows the server keeps.
    """

    key: str
    what: str
    rows: float


@runtime_checkable
class ObservesParams(Protocol):
    """A rule that watches the global model (AFL evaluates the running average of its iterates).
    """

    def observe_params(self, w: torch.Tensor) -> None:
        """Called with the global parameters (d,) after every round, also when the model did not
        move (everyone dropped out or was rejected)."""

    def evaluation_params(self, w: torch.Tensor) -> torch.Tensor:
        """The parameters to evaluate given the current global ones (d,)."""


@runtime_checkable
class PersonalModels(Protocol):
    """A rule that keeps a personal model per client (Ditto): ``/eval/personal_*``."""

    def client_state(self, client_ids: np.ndarray, w: torch.Tensor) -> torch.Tensor:
        """Per-client state rows (m, s) float32 sent with the selected clients of this round,
        ``Columns.state`` wide, given the round's global parameters w (d,). The trainer's new
        rows come back in ``RoundUpdates.stats["client_state"]``."""

    def personal_params(self, w: torch.Tensor) -> torch.Tensor:
        """(K, d) per-client parameters evaluated beside the global ones w (d,) at every
        evaluation."""


@runtime_checkable
class RoundInputs(Protocol):
    """A rule that broadcasts a vector to every client with each TRAIN request (mFairFL)."""

    def round_inputs(self) -> np.ndarray:
        """Float64 vector of length ``Columns.inputs`` of the rule's trainer."""


@runtime_checkable
class BenchInputs(Protocol):
    """A rule that needs more than the common benchmark inputs (stats columns, a loss probe,
    constructor arguments, a baseline): the benchmarks ask the rule, never a table of names."""

    @classmethod
    def bench_inputs(cls) -> BenchSpec:
        """The extra inputs (and baseline) the benchmarks give this rule."""


@runtime_checkable
class MemoryRows(Protocol):
    """A rule with d-sized state of its own (histories, the last round), for the memory
    estimate made from the config before a run is built (``experiment.budget``)."""

    @classmethod
    def memory_rows(cls, p: Any, *, num_clients: int, per_round: int,
                    rounds: int) -> StateRows:
        """The rows it keeps given its validated ``Params`` p, K clients, m clients per round
        and the run's rounds."""


#: Every opt-in protocol (the registry refuses a rule that defines only part of one).
PROTOCOLS: tuple[type, ...] = (ObservesParams, PersonalModels, RoundInputs, BenchInputs,
                               MemoryRows)


def _members(proto: type) -> list[str]:
    return sorted(n for n in vars(proto) if not n.startswith("_"))


def partial_protocols(cls: type) -> list[str]:
    """One line per protocol ``cls`` defines only part of (e.g. ``client_state`` without
    ``personal_params``); empty when it takes part in each protocol fully or not at all."""
    out = []
    for proto in PROTOCOLS:
        names = _members(proto)
        have = [n for n in names if hasattr(cls, n)]
        if have and len(have) < len(names):
            missing = [n for n in names if n not in have]
            out.append(f"{proto.__name__} needs {', '.join(names)} (missing {', '.join(missing)})")
    return out
