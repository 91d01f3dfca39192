"""What goes with what, in one place: a data set's and a partition's parameters (their entries'
``Params``), the old flat ``[data]`` keys they replace, and which partitions fit which data sets
(the tags the entries declare, :mod:`mpifl.data.registry`).

The config (:class:`mpifl.experiment.config.DataConfig`) and :func:`mpifl.data.load_federated`
both call these functions, so a combination is refused by the same rule and with the same words
before a run and inside a library call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from mpifl.core.errors import DataError
from mpifl.core.params import Params
from mpifl.core.registry import Registry
from mpifl.data.registry import (CLIENTS, DATASET_LOADERS, LABELS, PARTITIONERS, RAW, SENSITIVE,
                                 TAGS, DataPool, lazy_factory, params_class)

__all__ = ["IncompatibleData", "check_combination", "check_pool", "describe_params",
           "lazy_datasets", "nest_params", "provided", "providers", "resolve_params"]

#: Old flat keys a partition plugin without ``Params`` received when its signature named them.
PLUGIN_LEGACY = ("classes_per_client", "dirichlet_alpha")
#: The nested tables of ``[data]`` and the registry whose entry reads each.
TABLES = {"params": DATASET_LOADERS, "partition_params": PARTITIONERS}

#: a validation error's location: field names and list indices
Loc = tuple[int | str, ...]


@runtime_checkable
class _ChecksClients(Protocol):
    """A partition's Params that checks its values against K (``check_clients``)."""

    def check_clients(self, num_clients: int) -> None: ...


class IncompatibleData(DataError):
    """A data set, partition and parameters that do not go together; ``key`` is the config key
    to blame (``"data.partition"``, ``"data.num_clients"``, ...), ``str(exc)`` the reason."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def lookup(registry: Registry[Callable[..., Any]], name: Any
           ) -> Callable[..., Any] | None:
    """The entry registered as ``name`` (or at that import path), None if there is none (the
    config's name check says why)."""
    try:
        return registry.get(name)
    except (LookupError, TypeError, ValueError):
        return None


def provided(dataset: str) -> frozenset[str] | None:
    """The tags data set ``dataset`` declares; None when unknown or not declared (a plugin that
    says nothing: known once loaded)."""
    return getattr(lookup(DATASET_LOADERS, dataset), "provides", None)


def providers(tag: str) -> list[str]:
    """The registered data sets that declare ``tag``, sorted."""
    return [n for n in DATASET_LOADERS.available() if tag in (provided(n) or ())]


def lazy_datasets() -> list[str]:
    """The registered data sets that can be loaded lazily (they declare ``lazy=``), sorted."""
    return [n for n in DATASET_LOADERS.available()
            if lazy_factory(lookup(DATASET_LOADERS, n)) is not None]


# --------------------------------------------------------------------------- parameters

def resolve_params(registry: Registry[Callable[..., Any]], name: str,
                   params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` validated by entry ``name``'s Params, defaults filled in, as plain values (the
    loader's or partition's keyword arguments, and the config's stored form); unchanged for an
    entry without Params.

    Raises:
        pydantic.ValidationError: a key the Params lacks, a wrong type or a value out of range
            (locations relative to the table).
    """
    cls = params_class(lookup(registry, name))
    if cls is None:
        return dict(params or {})
    return cls.model_validate(dict(params or {})).model_dump()


def describe_params(exc: ValidationError, table: str) -> str:
    """The first error of ``exc`` as one line naming the key: ``"data.partition_params.alpha:
    input should be greater than 0 (got -1)"``, ``"unknown key 'data.params.beta2'"``."""
    err = exc.errors()[0]
    key = ".".join([table, *map(str, err["loc"])])
    if err["type"] == "extra_forbidden":
        return f"unknown key '{key}'"
    return f"{key}: {err['msg'][0].lower()}{err['msg'][1:]} (got {err.get('input')!r})"


def _relocated(exc: ValidationError, where: Callable[[Loc], Loc]) -> ValidationError:
    """``exc`` with every location mapped by ``where`` (pydantic prefixes the section's)."""
    return ValidationError.from_exception_data(exc.title, [InitErrorDetails(
        type=PydanticCustomError(e["type"], "{msg}", {"msg": e["msg"]}), loc=where(e["loc"]),
        input=e.get("input")) for e in exc.errors()])


def _conflict(flat: str, value: Any, table: str, field: str, nested: Any) -> ValidationError:
    msg = f"contradicts data.{table}.{field} = {nested!r}; set only one of them"
    return ValidationError.from_exception_data("data", [InitErrorDetails(
        type=PydanticCustomError("flat_key_conflict", "{msg}", {"msg": msg}), loc=(flat,),
        input=value)])


def legacy_keys(registry: Registry[Callable[..., Any]], entry: Any) -> dict[str, str]:
    """The old flat ``[data]`` keys an entry replaces: ``{flat key: its parameter}`` (its
    Params' ``legacy``; for a partition plugin without Params, the old keys it names, which it
    was given before)."""
    cls = params_class(entry)
    if cls is not None:
        return dict(getattr(cls, "legacy", {}))
    if registry is not PARTITIONERS or not callable(entry):
        return {}
    try:
        names = inspect.signature(entry).parameters
    except (TypeError, ValueError):
        return {}
    return {k: k for k in PLUGIN_LEGACY if k in names}


def _flat_schema() -> dict[str, tuple[type[Params], str]]:
    """Every old flat key: the Params and field that validate its value (its built-in entry)."""
    out: dict[str, tuple[type[Params], str]] = {}
    for registry in TABLES.values():
        for name in registry.available():
            cls = params_class(lookup(registry, name))
            if cls is None:
                continue
            for flat, field in getattr(cls, "legacy", {}).items():
                out.setdefault(flat, (cls, field))
    return out


def _flat_value(flat: str, value: Any, schema: dict[str, tuple[type[Params], str]]) -> Any:
    """``value`` of old key ``flat``, validated by the field it stands for."""
    cls, field = schema[flat]
    try:
        return getattr(cls.model_validate({field: value}), field)
    except ValidationError as exc:
        raise _relocated(exc, lambda loc: (flat, *loc[1:])) from None


def _same(entry: Any, field: str, flat_value: Any, nested: Any) -> bool:
    cls = params_class(entry)
    if cls is not None:
        try:
            nested = getattr(cls.model_validate({field: nested}), field)
        except ValidationError:
            return True  # the whole table's validation reports it
    return nested == flat_value


def nest_params(table: Mapping[str, Any], dataset: Any, partition: Any) -> dict[str, Any]:
    """A ``[data]`` table with the old flat keys (``dirichlet_alpha``, ``classes``, ...) moved
    into ``params`` / ``partition_params`` of the data set / partition that reads them (the
    others dropped, as the old code ignored them), each table then validated by its entry's
    Params with defaults filled in.

    Args:
        dataset, partition: the table's names (or the config's defaults).
    Raises:
        pydantic.ValidationError: a flat key with a bad value, or one that contradicts its
            nested key (located at the flat key); a bad nested table (located inside it).
    """
    schema = _flat_schema()
    out = {k: v for k, v in table.items() if k not in schema}
    flat = {k: _flat_value(k, v, schema) for k, v in table.items() if k in schema}
    names = {"params": dataset, "partition_params": partition}
    for key, registry in TABLES.items():
        entry = lookup(registry, names[key])
        given = out.get(key, {})
        if entry is None or not isinstance(given, dict):
            continue  # the name check / the field's type check reports it
        merged = dict(given)
        for old, field in legacy_keys(registry, entry).items():
            if old not in flat:
                continue
            if field in merged and not _same(entry, field, flat[old], merged[field]):
                raise _conflict(old, flat[old], key, field, merged[field])
            merged[field] = flat[old]
        try:
            out[key] = resolve_params(registry, names[key], merged)
        except ValidationError as exc:
            raise _relocated(exc, _under(key)) from None
    return out


def _under(key: str) -> Callable[[Loc], Loc]:
    """Locations inside table ``key``."""
    return lambda loc: (key, *loc)


# --------------------------------------------------------------------------- combinations

def _either(names: list[str]) -> str:
    return " or ".join(f"'{n}'" for n in names) or "none"


def _refusal(tag: str, dataset: str, partition: str) -> str:
    """Why ``partition`` cannot split ``dataset``, which lacks ``tag`` (or has CLIENTS)."""
    owners = providers(tag)
    if tag == CLIENTS:
        takers = [n for n in PARTITIONERS.available()
                  if CLIENTS in getattr(lookup(PARTITIONERS, n), "needs", ())]
        return (f"{_either(takers)} goes with the data sets that have their own clients "
                f"({', '.join(owners) or 'none'}) and they only with {_either(takers)} (got "
                f"dataset '{dataset}', partition '{partition}')")
    if tag == LABELS:
        return (f"partition '{partition}' splits by class label; data set '{dataset}' has "
                f"regression targets: use 'iid' or a partition that does not read labels")
    what = {SENSITIVE: "a sensitive attribute", RAW: "raw image pixels"}[tag]
    return f"partition '{partition}' needs a dataset with {what} ({', '.join(owners)}), got " \
           f"'{dataset}'"


def _check_tags(dataset: str, partition: str, offers: frozenset[str] | None) -> None:
    needs: frozenset[str] = getattr(lookup(PARTITIONERS, partition), "needs", frozenset())
    if offers is None:
        return
    if (CLIENTS in offers) != (CLIENTS in needs):
        raise IncompatibleData("data.partition", _refusal(CLIENTS, dataset, partition))
    for tag in TAGS:
        if tag in needs and tag not in offers:
            raise IncompatibleData("data.partition", _refusal(tag, dataset, partition))


def check_combination(dataset: str, partition: str, partition_params: Mapping[str, Any],
                      num_clients: int) -> None:
    """Before anything is loaded: the partition's needs against what the data set declares (a
    data set that declares nothing passes, to be checked by :func:`check_pool`), and the
    partition's parameters against K (its Params' ``check_clients``, when it has one).

    Raises:
        IncompatibleData: the reason, and the config key to blame.
        pydantic.ValidationError: ``partition_params`` that its Params refuses.
    """
    _check_tags(dataset, partition, provided(dataset))
    cls = params_class(lookup(PARTITIONERS, partition))
    if cls is not None and issubclass(cls, _ChecksClients):
        cls.model_validate(dict(partition_params)).check_clients(num_clients)


def check_pool(dataset: str, partition: str, pool: DataPool) -> None:
    """Once loaded: the partition's needs against what the pool has.

    Raises:
        IncompatibleData: the reason, and the config key to blame.
    """
    _check_tags(dataset, partition, pool.provides())
