"""The documentation site's reference is generated from the code and complete.

Every config key (every section, every registered rule's table, ``[system]`` and its tiers,
the ``[data.params]`` / ``[data.partition_params]`` keys of each of mpifl's data sets and
partitions) has a description (its field docstring) and every command-line subcommand and flag
a help text; the generator in ``docs/hooks.py`` puts each of them on its page. The last test builds the whole
site with warnings as errors, as CI does.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from mpifl import aggregators
from mpifl.cli import build_parser
from mpifl.experiment.config import schema

ROOT = Path(__file__).resolve().parents[2]


def _hooks():
    spec = importlib.util.spec_from_file_location("mpifl_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tables() -> list[tuple[str, type[BaseModel]]]:
    """(title, model) of every table of a job file: the sections, the rule tables and the
    nested lists of tables (``[[system.tiers]]``)."""
    out = []
    for name, field in schema().model_fields.items():
        model = field.annotation
        out.append((name, model))
        for key, sub in model.model_fields.items():
            args = typing.get_args(sub.annotation)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                out.append((f"{name}.{key}", args[0]))
    return out


def _keys() -> list[tuple[str, str, object]]:
    return [(title, key, field) for title, model in _tables()
            for key, field in model.model_fields.items()]


def _entry_keys() -> list[tuple[str, str, object]]:
    """(heading of its table on the reference page, key, field) of every key of the ``Params``
    of every registered data set (``[data.params]``) and partition
    (``[data.partition_params]``) defined in mpifl; plugins that tests register are left out."""
    from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS, params_class

    out = []
    for kind, registry, table in (("data set", DATASET_LOADERS, "[data.params]"),
                                  ("partition", PARTITIONERS, "[data.partition_params]")):
        for name in registry.available():
            params = params_class(registry.get(name))
            if params is None or params.__module__.partition(".")[0] != "mpifl":
                continue
            out += [(f"`{table}` of {kind} `{name}`", key, field)
                    for key, field in params.model_fields.items()]
    return out


def _actions(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("mpifl",)):
    """(command words, action) of every argument of ``parser`` and its subcommands, and
    (command words, None, help) of every subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield path + (name,), None, helps.get(name)
                yield from _actions(sub, path + (name,))
        else:
            yield path, action, action.help


def test_the_schema_has_every_table():
    titles = {t for t, _ in _tables()}
    assert {"run", "plugins", "data", "model", "client", "server", "faults", "system",
            "system.tiers"} <= titles
    rules = [n for n in aggregators.available() if n.isidentifier()]
    assert rules and set(rules) <= titles, set(rules) - titles


def test_the_data_tables_are_found():
    """The keys below are real: a data set's and a partition's (else the tests that go over
    :func:`_entry_keys` would pass on nothing)."""
    found = {(title, key) for title, key, _ in _entry_keys()}
    assert {("`[data.params]` of data set `synthetic`", "alpha"),
            ("`[data.partition_params]` of partition `dirichlet`", "alpha")} <= found


def test_every_config_key_has_a_description():
    missing = [f"{t}.{k}" for t, k, f in _keys() if not (f.description or "").strip()]
    missing += [f"{t}: {k}" for t, k, f in _entry_keys() if not (f.description or "").strip()]
    assert not missing, ("config keys without a description (a docstring right below the "
                         f"field): {missing}")


def test_every_cli_argument_and_subcommand_has_help():
    missing = [" ".join(words) + (f" {'/'.join(a.option_strings) or a.dest}" if a else "")
               for words, a, help_text in _actions(build_parser()) if not (help_text or "").strip()]
    assert not missing, f"command-line arguments or subcommands without help: {missing}"


def _blocks(markdown: str) -> dict[str, str]:
    """Heading text -> the Markdown under it, up to the next heading of any level."""
    parts = re.split(r"^#+ (.*)$", markdown, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_config_reference_lists_every_key_with_its_default():
    hooks = _hooks()
    blocks = _blocks(hooks.config_reference())
    keys = []  # (where, the Markdown of its table, key, field)
    for title, key, field in _keys():
        if "." in title:  # a nested list of tables: its rows follow its section's
            section, _, nested = title.partition(".")
            block = blocks[f"`[{section}]`"].split(f"`[[{title}]]`", 1)[1]
        else:
            block = blocks.get(f"`[{title}]`", "")
            block = block.split("`[[", 1)[0]
        keys.append((f"{title}.{key}", block, key, field))
    # the data sets' and partitions' tables, each under its own heading
    keys += [(f"{title}: {key}", blocks.get(title, ""), key, field)
             for title, key, field in _entry_keys()]
    absent = []
    for where, block, key, field in keys:
        row = next((line for line in block.splitlines() if line.startswith(f"| `{key}` |")),
                   None)
        if row is None:
            absent.append(where)
            continue
        assert hooks._code(hooks._default(field)) in row, (where, row)
        assert hooks._cell(field.description) in row, (where, row)
    assert not absent, f"keys missing from the generated configuration reference: {absent}"


def test_the_cli_reference_lists_every_command_and_flag():
    text = _hooks().cli_reference()
    blocks = _blocks(text)
    absent = []
    for words, action, _ in _actions(build_parser()):
        block = blocks.get(f"`{' '.join(words)}`")
        if block is None:
            absent.append(" ".join(words))
        elif action is not None:
            names = action.option_strings or [action.metavar or action.dest]
            if not all(f"`{n}`" in block for n in names):
                absent.append(f"{' '.join(words)} {'/'.join(names)}")
    assert not absent, f"missing from the generated command-line reference: {absent}"


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail('mkdocs is not installed: pip install -e ".[docs]"')
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("reference/config", "reference/cli", "reference/api"):
        assert (tmp_path / "site" / f"{page}.html").is_file(), page
    # opened from disk (file://, as `make docs` says): links name files, not folders a browser
    # would list, and search reads its index from a script, not by fetch()
    home = (tmp_path / "site" / "index.html").read_text()
    links = re.findall(r'href="([^"#:]+)"', home)
    assert links and not [link for link in links if link.endswith("/")], links
    assert (tmp_path / "site" / "search" / "search_index.js").is_file()
    html = (tmp_path / "site" / "reference" / "config.html").read_text()
    assert "checkpoint_minutes" in html and "fedfv" in html
