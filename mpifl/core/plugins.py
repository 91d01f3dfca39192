"""Loading users' plugin modules: the ``[plugins] modules = [...]`` config key and the
``mpifl.plugins`` entry-point group.

A plugin is an ordinary Python module that registers rules, models, data sets or partitions with
mpifl's public decorators when it is imported. Every rank imports the same modules (the config
travels to the workers as JSON and names them), so registries agree across ranks.

Entry points are loaded once per process; one that fails to load is logged and skipped (a
broken package elsewhere on the machine must not stop a run that does not use it). A module the
config names is required: failing to import it is an error.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from collections.abc import Iterable

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "load_entry_points", "load_modules"]

ENTRY_POINT_GROUP = "mpifl.plugins"
log = logging.getLogger("mpifl.plugins")
_entry_points_loaded = False


class PluginError(ImportError):
    """A plugin module named in the config cannot be imported (one-line message)."""


def load_entry_points() -> list[str]:
    """Import every module of the ``mpifl.plugins`` entry-point group (once per process).

    Returns:
        The names of the entry points that loaded.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return []
    _entry_points_loaded = True
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
            loaded.append(ep.name)
        except Exception as exc:  # noqa: BLE001 — any failure of a third-party plugin is skipped
            log.warning("plugin entry point %s (%s) failed to load and is skipped: %s: %s",
                        ep.name, ep.value, type(exc).__name__, exc)
    return loaded


def load_modules(modules: Iterable[str], search_path: Iterable[str] = ()) -> None:
    """Import the modules a config names, after the entry points.

    Args:
        modules: dotted module names (``"mypkg.rules"``).
        search_path: folders put in front of ``sys.path`` first (e.g. the folder of the TOML file,
            so a plugin beside the job file imports without installing it).

    Raises:
        PluginError: a module cannot be imported; the message names it and the cause.
    """
    load_entry_points()
    for folder in search_path:
        if folder not in sys.path:
            sys.path.insert(0, folder)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- a user's module may fail in any way
            raise PluginError(f"plugins.modules: cannot import '{name}': "
                              f"{type(exc).__name__}: {exc}") from None
