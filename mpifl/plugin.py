"""The public API for extending mpifl without forking it: your own aggregation rules, models,
losses, data sets and partitions, registered by decorators when your module is imported.

Name your module in the job file and mpifl imports it on every rank before it validates the
config (or publish it under the ``mpifl.plugins`` entry-point group)::

    [plugins]
    modules = ["my_fl_plugins"]        # searched beside the job file, then on sys.path

    [server]
    algorithm = "trimmed_mean"         # or an import path "my_fl_plugins.rules:TrimmedMean"

    [trimmed_mean]                     # the rule's Params, validated like a built-in table
    trim = 0.2

The decorators (docs/tutorials/first-plugin.md walks through examples/plugin/; docs/guides/models.md
through examples/models/):

- :func:`register_rule` on an :class:`Aggregator` subclass with a nested ``Params``
  (:class:`Params`): ``aggregate(r: RoundUpdates) -> step`` (d,), ``w <- w - step``; what it
  needs from the run is its ``needs = Needs(...)`` record and the opt-in protocols it
  implements (:class:`ObservesParams`, :class:`PersonalModels`, :class:`RoundInputs`,
  :class:`BenchInputs`, :class:`MemoryRows`; :mod:`mpifl.aggregators.needs`).
- :func:`register_model` on ``factory(input_shape, num_classes, *, seed, **params) -> nn.Module``;
  ``[model.params]`` are its keywords. mpifl seeds torch's RNG around the call (weights depend on
  the seed only) and checks the model (:func:`mpifl.models.check_model`); BatchNorm and Dropout
  are trained by the per-client loop (:mod:`mpifl.clients.select`).
- :func:`register_loss` on a :class:`Loss` (``[model] loss = "<name>"``): the per-sample loss,
  the task (classification or regression) and the predicted labels.
- :func:`register_dataset` on ``loader(*, seed, data_root, **params) -> DataPool | FederatedData``;
  ``[data.params]`` are its keywords, validated by its ``Params`` when it declares one
  (``params=``), and ``provides=`` says what its pool has (``LABELS``, ``SENSITIVE``, ``RAW``,
  ``CLIENTS``). A :class:`DataPool` is split by ``data.partition``.
- :func:`register_partition` on ``partition(labels, num_clients, rng, **context) -> list of K
  index arrays`` (or a :class:`Partitioned`; :mod:`mpifl.data.registry`);
  ``[data.partition_params]`` are its keywords (``params=``: its ``Params``), ``needs=`` what a
  data set must provide for it.

mpifl's own data sets and partitions are registered by these same decorators
(:mod:`mpifl.data.builtin`).
"""

from collections.abc import Callable

from mpifl.aggregators.base import RULES, Aggregator, RoundUpdates
from mpifl.aggregators.base import register as register_rule
from mpifl.aggregators.needs import (BenchInputs, BenchSpec, MemoryRows, Needs, ObservesParams,
                                     PersonalModels, RoundInputs, Shards, StateRows)
from mpifl.core.params import Params
from mpifl.data.federated import FederatedData
from mpifl.data import registry as _data
from mpifl.data.registry import CLIENTS, LABELS, RAW, SENSITIVE, DataPool, DataShape, Partitioned
from mpifl.models.losses import LOSSES, Loss
from mpifl.models import zoo as _zoo
from mpifl.models.zoo import MODEL_FACTORIES

__all__ = ["Aggregator", "BenchInputs", "BenchSpec", "CLIENTS", "DataPool", "DataShape",
           "FederatedData",
           "LABELS", "Loss", "MemoryRows", "Needs", "ObservesParams", "Params", "Partitioned",
           "PersonalModels", "RAW", "RoundInputs", "RoundUpdates", "SENSITIVE", "Shards",
           "StateRows", "register_dataset", "register_loss", "register_model",
           "register_partition", "register_rule", "RULES"]


def register_loss(name: str):
    """Register a :class:`Loss` as ``model.loss = "<name>"``: ``register_loss("name")(loss)``
    or as a decorator on a function ``fn(out, y) -> (batch,)`` per-sample losses (then a
    classification loss with argmax predictions).

    Raises:
        ValueError: the name is taken by another loss, empty, or contains ':'.
    """
    return LOSSES.register(name)


def register_model(name: str, *, size: Callable[..., int] | str | None = None):
    """Decorator: register a model factory as ``model.name = "<name>"``.

    Args:
        size: how the memory budget counts its parameters before the run: ``"meta"`` (build
            it on torch's meta device: only for a factory that does nothing but build torch
            modules) or ``size(input_shape, num_classes, **params) -> d``; None (default): not
            counted (the factory is not run before the real build).

    Raises:
        ValueError: the name is taken by another factory, empty, or contains ':'.
        TypeError: ``size`` is neither ``"meta"``, a function nor None.
    """
    if size is None:
        return MODEL_FACTORIES.register(name)
    return _zoo.register_model(name, size=size)


def register_dataset(name: str, *, params: type[Params] | None = None, provides=None,
                     shape: DataShape | None = None):
    """Decorator: register a data set loader as ``data.dataset = "<name>"``.

    Args:
        params: its ``Params`` (the ``[data.params]`` table, validated, defaults filled in);
            None: the table's keys are passed through unchecked.
        provides: what its pool has, of ``LABELS``, ``SENSITIVE``, ``RAW``, ``CLIENTS``, checked
            against the partition before anything is loaded; None: checked once loaded.
        shape: its sizes (:class:`DataShape`: samples, one sample's shape, classes), which the
            memory budget reads before anything is loaded; None: the data is not counted.

    Raises:
        ValueError: the name is taken by another loader, empty, or contains ':'; unknown tags.
        TypeError: ``params`` is not a :class:`Params` subclass.
    """
    return _data.register_dataset(name, params=params, provides=provides, shape=shape)


def register_partition(name: str, *, params: type[Params] | None = None, needs=()):
    """Decorator: register a partition as ``data.partition = "<name>"``.

    Args:
        params: its ``Params`` (the ``[data.partition_params]`` table); None: unchecked keys.
        needs: what a data set must provide for it, of ``LABELS``, ``SENSITIVE``, ``RAW``,
            ``CLIENTS``.

    Raises:
        ValueError: the name is taken by another partition, empty, or contains ':'; unknown tags.
        TypeError: ``params`` is not a :class:`Params` subclass.
    """
    return _data.register_partition(name, params=params, needs=needs)
