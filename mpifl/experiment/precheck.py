"""A torch-free first look at a job file: the mistakes that are certainly wrong, in a fraction of
a second.

The full validation (:func:`mpifl.experiment.config.load_config`) needs the pydantic models and
the registries, which import torch: seconds on every rank before a typo is reported, and tens
of seconds under ``mpiexec`` on a loaded machine. :func:`check_job` reads the job file with
tomllib, applies ``--set`` as ``load_config`` does, and compares it with ``keys.json`` (beside
this module): every table's keys and the built-in names of rules, models, losses, data sets,
partitions and loggers, generated from the models and the registries
(``python -m mpifl.experiment.precheck --write``; a test keeps it in sync).

It refuses only an unknown key or table and an unknown name, with the very line the full
validation gives for the same mistake, and in the full validation's order; anything it cannot
decide (types, ranges, cross-field rules, import paths, a file it cannot read, a malformed
``--set``, a job with plugins, which may register anything) ends the look without a verdict and
is left to the full validation, which stays the authority. Every rank reads the same file, so
every rank reaches the same verdict without talking to the others.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mpifl.core.errors import ConfigError
from mpifl.core.plugins import ENTRY_POINT_GROUP
from mpifl.core.registry import closest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["KEYS", "check_job", "describe"]

#: The generated description of the configuration's keys and built-in names.
KEYS = Path(__file__).with_name("keys.json")
#: The command that rewrites :data:`KEYS` (named by the test that keeps it in sync).
WRITE_COMMAND = "python -m mpifl.experiment.precheck --write"


class _Unsure(Exception):
    """The pre-check cannot decide: the full validation will."""


def check_job(path: str | Path, overrides: Sequence[str] = (),
              add_loggers: Sequence[str] = ()) -> None:
    """Refuse a job file (plus ``--set`` overrides) with a mistake that is certainly wrong,
    without importing torch or pydantic.

    Args:
        path: the TOML job file.
        overrides: ``--set`` items, ``section.key=value``, applied as ``load_config`` does.
        add_loggers: logger names added to ``run.loggers`` (``mpifl run --log``).
    Returns:
        None when it finds no mistake or cannot be sure (types, ranges, cross-field rules,
        import paths, an unreadable file, a malformed ``--set``, a job with plugins).
    Raises:
        ConfigError: an unknown key or table, or an unknown rule, model, data set, partition,
            loss or logger name; the message is the one line the full validation gives.
    """
    try:
        _check(Path(path), list(overrides), list(add_loggers))
    except _Unsure:
        return


def _check(path: Path, overrides: list[str], add_loggers: list[str]) -> None:
    keys = _keys()
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except (OSError, ValueError, RecursionError):  # its own one line, from the full validation
        raise _Unsure from None
    for text in overrides:
        _set(raw, *_parse_override(text), keys["tables"])
    if _depth(raw) > keys["max_depth"]:
        raise _Unsure
    tables = keys["tables"]
    # the full validation imports the plugins first, after checking their table
    plugins = raw.get("plugins", {})
    if not isinstance(plugins, dict):
        raise _Unsure
    _check_keys(plugins, ("plugins",), tables)
    if plugins.get("modules") or _entry_points():
        raise _Unsure  # plugins may register rules (tables), models, data sets, ...
    _check_keys(raw, (), tables)
    for spec in keys["names"]:
        _check_name(raw, spec)
    trainer = _get(raw, "client.trainer", "auto")
    if trainer not in ("auto", "vmap"):
        raise _Unsure  # "loop" is refused for some rules, before the loggers are checked
    _check_loggers(raw, add_loggers, keys["loggers"])


def _keys() -> dict[str, Any]:
    try:
        return json.loads(KEYS.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not installed with the package: no pre-check
        raise _Unsure from None


def _entry_points() -> bool:
    """Whether installed packages declare mpifl plugins (loaded by every run)."""
    import importlib.metadata

    return bool(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key[.key...]=value`` as :func:`mpifl.experiment.config.parse_override` reads
    it: the key's parts and the value read as TOML, else the bare string; any malformed item
    is left to it."""
    key, sep, raw = text.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not sep or not all(parts) or len(parts) == 1:
        raise _Unsure
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError:
        raise _Unsure from None
    return parts, value


def _set(raw: dict[str, Any], path: list[str], value: Any, tables: dict[str, Any]) -> None:
    """``raw[path[0]][path[1]]... = value`` as ``load_config``'s ``--set`` does, making the
    tables on the way; a part that is a value, not a table, is left to the full validation."""
    table, where, spec = raw, "", tables.get("")
    for part in path[:-1]:
        if spec is not None and part in spec["keys"]:
            if part not in spec["subtables"]:
                raise _Unsure  # a value, not a table: the full validation says so
            where = f"{where}.{part}" if where else part
            spec = tables.get(where)  # None: a free table, any key
        else:
            spec = None  # an unknown key (reported later) or an old flat one
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise _Unsure
    table[path[-1]] = value


def _depth(raw: Any) -> int:
    """Levels of tables and arrays in ``raw`` (iterative: it may be deep)."""
    deepest, stack = 0, [(0, raw)]
    while stack:
        level, value = stack.pop()
        deepest = max(deepest, level)
        items = value.values() if isinstance(value, dict) else \
            value if isinstance(value, list) else ()
        stack.extend((level + 1, v) for v in items)
    return deepest


def _check_keys(table: dict[str, Any], where: tuple[str, ...], tables: dict[str, Any]) -> None:
    """Unknown keys of ``table`` and of its known sub-tables, in pydantic's order: a table's
    fields (nested tables first reported in field order), then its unknown keys in the file's
    order. Tables not described (free ``params`` tables, arrays of tables) are not looked at."""
    spec = tables.get(".".join(where))
    if spec is None:
        return
    for key in spec["keys"]:
        if key in spec["subtables"] and isinstance(table.get(key), dict):
            _check_keys(table[key], (*where, key), tables)
    accepted = {*spec["keys"], *spec.get("also", ())}
    for key in table:
        if key not in accepted:
            close = closest(str(key), spec["keys"])
            hint = f" (did you mean '{'.'.join([*where, close])}'?)" if close else ""
            raise ConfigError(f"unknown key '{'.'.join([*where, str(key)])}'{hint}")


def _get(raw: dict[str, Any], dotted: str, default: Any = None) -> Any:
    section, key = dotted.split(".")
    table = raw.get(section, {})
    if not isinstance(table, dict):
        raise _Unsure
    return table.get(key, default)


def _check_name(raw: dict[str, Any], spec: dict[str, Any]) -> None:
    """A rule, model, data set, partition or loss name against the built-in ones; an import
    path ``"pkg.module:obj"`` is left to the full validation (and so is all that follows it)."""
    name = _get(raw, spec["key"])
    if name is None:
        return  # the default, a built-in name
    if not isinstance(name, str) or ":" in name:
        raise _Unsure
    if name in spec["known"]:
        return
    close = closest(name, spec["known"])
    hint = f" (did you mean '{close}'?)" if close else ""
    raise ConfigError(f"{spec['key']}: unknown {spec['kind']} '{name}'{hint}; known: "
                      f"{', '.join(spec['known'])}, or an import path 'package.module:object'")


def _check_loggers(raw: dict[str, Any], added: list[str], spec: dict[str, Any]) -> None:
    names = _get(raw, "run.loggers", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _Unsure
    for name in dict.fromkeys([*names, *added]):
        if name in spec["need_packages"]:
            raise _Unsure  # the full validation checks the package is installed first
        if name not in spec["known"]:
            close = closest(name, spec["known"])
            hint = f" (did you mean '{close}'?)" if close else ""
            raise ConfigError(f"run.loggers: unknown logger '{name}'{hint}; known: "
                              f"{', '.join(spec['known'])}")


# ----------------------------------------------------------------------------------------------
# Generating keys.json from the pydantic models and the registries (imports torch)


def describe() -> dict[str, Any]:
    """The content of :data:`KEYS`: for every table whose keys are fixed, its keys in the
    models' order (``subtables``: those that are tables themselves; ``also``: old keys a
    ``before`` validator moves, ``[data]``'s flat keys), and the built-in names.

    Call it in a fresh process: entries registered at run time (plugins, import paths) would be
    listed too."""
    from pydantic import BaseModel

    from mpifl import aggregators
    from mpifl.aggregators.base import RULES
    from mpifl.data.compat import _flat_schema
    from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS
    from mpifl.experiment import config
    from mpifl.models import LOSSES, MODEL_FACTORIES, MODELS
    from mpifl.runtime.loggers import LOGGERS

    def plain(names: Sequence[str]) -> list[str]:  # no import paths used so far
        return sorted(n for n in names if ":" not in n)

    rules = plain(aggregators.available())
    top = config._schema(tuple(n for n in rules if config._table_name(n)))
    tables: dict[str, Any] = {}

    def walk(model: type[BaseModel], where: str) -> None:
        validators = model.__pydantic_decorators__.model_validators.values()
        moved = any(v.info.mode in ("before", "wrap") for v in validators)
        if (model.model_config.get("extra") != "forbid"
                or any(f.alias or f.validation_alias for f in model.model_fields.values())
                or (moved and model is not config.DataConfig)):
            return  # keys this description cannot state: left to the full validation
        spec: dict[str, Any] = {"keys": list(model.model_fields), "subtables": []}
        if model is config.DataConfig:  # its _nest validator moves the old flat keys
            spec["also"] = sorted(_flat_schema())
        for key, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                spec["subtables"].append(key)
                walk(ann, f"{where}.{key}".lstrip("."))
            elif ann is dict or getattr(ann, "__origin__", None) is dict:
                spec["subtables"].append(key)  # a free table: any key
        tables[where] = spec

    walk(top, "")
    names = [("server.algorithm", RULES.kind, rules),
             ("model.name", MODEL_FACTORIES.kind, [*MODELS, *MODEL_FACTORIES.available()]),
             ("data.dataset", DATASET_LOADERS.kind, DATASET_LOADERS.available()),
             ("data.partition", PARTITIONERS.kind, PARTITIONERS.available()),
             ("model.loss", LOSSES.kind, LOSSES.available())]
    loggers = plain(LOGGERS.available())
    return {
        "about": f"generated by `{WRITE_COMMAND}` from mpifl/experiment/config.py and the "
                 f"registries; read by mpifl/experiment/precheck.py",
        "max_depth": config.MAX_DEPTH,
        "tables": dict(sorted(tables.items())),
        "names": [{"key": key, "kind": kind, "known": plain(sorted(set(known)))}
                  for key, kind, known in names],
        "loggers": {"known": loggers,
                    "need_packages": [n for n in loggers
                                      if getattr(LOGGERS.get(n), "requires", None)]},
    }


def render(description: dict[str, Any]) -> str:
    """``description`` as the text of :data:`KEYS`."""
    return json.dumps(description, indent=1) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpifl.experiment.precheck --write | --check``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mpifl.experiment.precheck",
                                description="write or check mpifl/experiment/keys.json")
    p.add_argument("--write", action="store_true", help="rewrite keys.json")
    args = p.parse_args(argv)
    text = render(describe())
    if args.write:
        KEYS.write_text(text, encoding="utf-8")
        print(f"wrote {KEYS}")
        return 0
    if KEYS.is_file() and KEYS.read_text(encoding="utf-8") == text:
        print(f"{KEYS} is up to date")
        return 0
    print(f"{KEYS} is out of date: {WRITE_COMMAND}", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
