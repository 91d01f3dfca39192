"""MkDocs hooks: the reference pages generated from the code at build time.

``mkdocs.yml`` names this file under ``hooks:``; :func:`on_files` adds two pages that exist in
no file of the repository:

- ``reference/config.md`` from the pydantic schema (:func:`mpifl.experiment.config.schema`):
  every key of every section, every registered rule's table (its ``Params``) and ``[system]``,
  with its type, default, bounds and the field's docstring;
- ``reference/cli.md`` from the argparse parser (:func:`mpifl.cli.build_parser`, which adds
  ``mpifl sweep`` from :mod:`mpifl.sweep.cli`): every subcommand and argument with its help.

``tests/inprocess/test_site.py`` calls :func:`config_reference` and :func:`cli_reference` directly.
"""

from __future__ import annotations

import argparse
import html
import inspect
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

#: the generated pages: path under docs/ -> the function that writes it
PAGES = {"reference/config.md": "config_reference", "reference/cli.md": "cli_reference"}

#: the config's own sections, in the order a job file usually has them, with what they hold
SECTIONS = {
    "run": "The run as a whole: its name and seed, rounds, evaluations, checkpoints, progress "
           "lines, loggers, the bounds on set-up and hung ranks, threads.",
    "plugins": "",
    "data": "The data set, how it is split into clients, and where its files are "
            "([data sets and partitions](../guides/data.md)). `[data.params]` and "
            "`[data.partition_params]` are the data set's and the partition's own keywords.",
    "model": "The model and its loss ([models and losses](../guides/models.md)).",
    "client": "Local training on each selected client.",
    "server": "Client selection, the aggregation rule, the server optimizer, the device and "
              "the sharded server.",
    "faults": "Injected faults, for robustness tests.",
    "system": "",
}


# ----------------------------------------------------------------------------------------------
# The configuration


def _cell(text: str) -> str:
    """``text`` made safe for one cell of a Markdown table (``<name>`` shown, not a tag)."""
    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` as inline code in one cell of a Markdown table."""
    return "`" + " ".join(str(text).split()).replace("|", "\\|") + "`"


def _type(ann: Any) -> str:
    """A TOML reader's name for a field's annotation."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a!r}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" or not set" if type(None) in args else "")
    if origin is list:
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict or ann is dict:
        return "table"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "table"
    names = {str: "string", int: "integer", float: "float", bool: "boolean"}
    return names.get(ann, getattr(ann, "__name__", str(ann)))


def _toml(value: Any) -> str:
    """``value`` as it would be written in a job file."""
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, BaseModel):
        return getattr(value, "name", type(value).__name__)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, int) and value >= 2**16 and (value & (value - 1)) == 0:
        return f"{value} (2^{value.bit_length() - 1})"
    return repr(value)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    return _toml(field.get_default(call_default_factory=True))


_BOUNDS = ((annotated_types.Ge, "≥", "ge"), (annotated_types.Gt, ">", "gt"),
           (annotated_types.Le, "≤", "le"), (annotated_types.Lt, "<", "lt"),
           (annotated_types.MinLen, "length ≥", "min_length"),
           (annotated_types.MaxLen, "length ≤", "max_length"))


def _number(x: Any) -> str:
    """A bound, with large powers of 2 and 10 as such (``2^31 - 1``, ``10^7``)."""
    if isinstance(x, float) and x.is_integer() and x >= 1e4:
        x = int(x)
    if isinstance(x, int) and x >= 2**16:
        for p in (2, 10):
            e = round(math.log(x + 1, p))
            if p**e - x in (0, 1):
                return f"{p}^{e}" + (" - 1" if p**e - x == 1 else "")
    return _toml(x)


def _bounds(metadata: list[Any]) -> list[str]:
    out = []
    for m in metadata:
        for kind, sign, attr in _BOUNDS:
            if isinstance(m, kind):
                out.append(f"{sign} {_number(getattr(m, attr))}")
    return out


def _field_bounds(field: FieldInfo) -> str:
    """The field's bounds, and its list items' (``each ≥ 1``)."""
    out = _bounds(field.metadata)
    ann = field.annotation
    if typing.get_origin(ann) is list and typing.get_args(ann):
        item = typing.get_args(ann)[0]
        if typing.get_origin(item) is typing.Annotated:
            inner = [m for a in typing.get_args(item)[1:]
                     for m in (a.metadata if isinstance(a, FieldInfo) else [a])]
            out += [f"each {b}" for b in _bounds(inner)]
    return ", ".join(out)


def _summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _builtin_names() -> dict[tuple[str, str], list[str]]:
    """(section, key) -> the names registered for a key that names a registry entry."""
    from mpifl import aggregators
    from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS
    from mpifl.models import MODEL_FACTORIES
    from mpifl.models.losses import LOSSES
    from mpifl.runtime.loggers import LOGGERS

    return {("data", "dataset"): DATASET_LOADERS.available(),
            ("data", "partition"): PARTITIONERS.available(),
            ("model", "name"): MODEL_FACTORIES.available(),
            ("model", "loss"): LOSSES.available(),
            ("server", "algorithm"): aggregators.available(),
            ("run", "loggers"): LOGGERS.available()}


def _table(model: type[BaseModel], section: str = "",
           names: dict[tuple[str, str], list[str]] | None = None) -> list[str]:
    """One row per key of ``model``: key, type, default, bounds, meaning (with the registered
    names of a key that names a registry entry)."""
    lines = ["| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
    for key, field in model.model_fields.items():
        meaning = field.description or ""
        known = (names or {}).get((section, key))
        if known:
            meaning += " Registered now: " + ", ".join(f"`{n}`" for n in known) + "."
        lines.append(f"| `{key}` | {_type(field.annotation)} | {_code(_default(field))} "
                     f"| {_cell(_field_bounds(field))} | {_cell(meaning)} |")
    return lines


def _entry_tables(kind: str, registry: Any, table: str) -> list[str]:
    """The ``Params`` table of every registered data set or partition that has keys."""
    from mpifl.data.registry import params_class

    out = []
    for name in registry.available():
        params = params_class(registry.get(name))
        if params is not None and params.model_fields:
            out += [f"### `{table}` of {kind} `{name}`", ""] + _table(params) + [""]
    return out


def _nested(model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """The keys of ``model`` that are lists of tables (``[[system.tiers]]``)."""
    out = []
    for key, field in model.model_fields.items():
        args = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is list and args and isinstance(args[0], type) \
                and issubclass(args[0], BaseModel):
            out.append((key, args[0]))
    return out


def config_reference() -> str:
    """The Markdown of ``reference/config.md``: every section, key and rule table of the
    schema, read from the code."""
    from mpifl import aggregators
    from mpifl.experiment.config import schema

    config = schema()
    fields = config.model_fields
    names = _builtin_names()
    rules = [name for name in fields if name not in SECTIONS]
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by docs/hooks.py from mpifl.experiment.config.schema(); do not edit -->",
        "",
        "A job file is TOML with the tables below; every key is optional and takes the default",
        "shown. `mpifl run JOB --set section.key=VALUE` overrides one key (a TOML value; a key of",
        "a nested table is `section.table.key`). An unknown key, a wrong type or a value outside",
        "its bounds stops the run before any work, with one line naming the key (an unknown",
        "key or name even before torch is imported: `mpifl/experiment/precheck.py`). `jobs/` holds",
        "complete examples. This page is generated from the code at every build of the site:",
        "the meanings are the fields' docstrings in `mpifl/experiment/config.py`,",
        "`mpifl/clients/system.py` and each rule's `Params` class under `mpifl/aggregators/`.",
        "",
        "## Sections",
        "",
    ]
    for name in SECTIONS:
        model = fields[name].annotation
        doc = SECTIONS[name] or fields[name].description or _summary(model)
        out += [f"### `[{name}]`", "", doc, ""]
        out += _table(model, name, names) + [""]
        for key, sub in _nested(model):
            out += [f"Each `[[{name}.{key}]]` table: {_summary(sub).lower()}", ""]
            out += _table(sub) + [""]
    out += [
        "## Rule tables",
        "",
        "Each aggregation rule (`server.algorithm`) reads only its own table, so one file holds",
        "the settings of several rules and `--set server.algorithm=...` switches between them.",
        "A table is the rule's `Params` class; a plugin rule's table is checked the same way.",
        "What each rule computes, with its paper: [the algorithm reference](../ALGORITHMS.md).",
        "",
    ]
    for name in rules:
        model = fields[name].annotation
        cls = aggregators.rule(name)
        out += [f"### `[{name}]`", "", _summary(cls) or cls.__name__, ""]
        if model.model_fields:
            out += _table(model) + [""]
        else:
            out += ["No hyper-parameters.", ""]
    from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS

    out += [
        "## Data set and partition parameters",
        "",
        "`[data.params]` are the keywords of the data set named by `data.dataset` and",
        "`[data.partition_params]` those of `data.partition`, validated by the entry's `Params`",
        "(`mpifl/data/builtin.py` and the readers under `mpifl/data/`); entries without keys",
        "are left out. A plugin entry without a `Params` gets its table's keys unchecked.",
        "",
    ]
    out += _entry_tables("data set", DATASET_LOADERS, "[data.params]")
    out += _entry_tables("partition", PARTITIONERS, "[data.partition_params]")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# The command line


def _subcommands(parser: argparse.ArgumentParser, path: list[str]
                 ) -> list[tuple[list[str], str, argparse.ArgumentParser]]:
    """(words, help, parser) of ``parser`` and every subcommand below it, depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((path + [name], helps.get(name, ""), sub))
                found += _subcommands(sub, path + [name])
    return found


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.metavar or a.dest}`"
        if a.option_strings and a.nargs != 0:
            name += f" `{a.metavar or a.dest.upper()}`"
        help_text = (a.help or "") % {"default": a.default, "prog": parser.prog} \
            if a.help else ""
        if a.choices:
            help_text += f" (one of: {', '.join(map(str, a.choices))})"
        rows.append(f"| {_cell(name)} | {_cell(help_text)} |")
    return ["| argument | what |", "| --- | --- |"] + rows if rows else []


def cli_reference() -> str:
    """The Markdown of ``reference/cli.md``: every subcommand and argument of ``mpifl``, read
    from its argparse parser."""
    from mpifl.cli import build_parser

    top = build_parser()
    out = [
        "# Command-line reference",
        "",
        "<!-- generated by docs/hooks.py from mpifl.cli.build_parser(); do not edit -->",
        "",
        "Every subcommand of `mpifl` with its arguments, read from the code's argument parser at",
        "every build of the site (`mpifl/cli.py`, `mpifl/sweep/cli.py`); `mpifl COMMAND --help`",
        "prints the same. Under `mpiexec` or `srun` run it as `python -m mpifl ...` (see",
        "[running experiments](../guides/running.md)). A mistake in the arguments, the config",
        "or the files is one line on standard error and exit status 2.",
        "",
        "## `mpifl`",
        "",
        "```text",
        top.format_usage().strip(),
        "```",
        "",
    ]
    out += _arguments(top) + [""]
    for words, help_text, parser in _subcommands(top, ["mpifl"]):
        title = " ".join(words)
        out += [f"## `{title}`", "", _cell(help_text % {}) if help_text else "", "",
                "```text", parser.format_usage().strip(), "```", ""]
        out += _arguments(parser) + [""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# MkDocs events


def on_files(files, config):
    """Add the generated pages to the site's files (MkDocs' ``on_files`` event)."""
    from mkdocs.structure.files import File

    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:  # the checkout's mpifl, installed (pip install -e) or not
        sys.path.insert(0, root)
    for path, function in PAGES.items():
        files.append(File.generated(config, path, content=globals()[function]()))
    return files
