"""Naming the user code that failed: a plugin's model, loss, data set or rule that raises is
reported as ``model 'name' (pkg.module:object) failed to train: ValueError: ...`` instead of a
bare exception from somewhere inside a round.

Only code outside the ``mpifl`` package is blamed; an exception from mpifl's own parts stays
what it is (a bug, with its traceback under ``mpifl -v``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mpifl.core.errors import MpiflError, PluginFailure

__all__ = ["blame", "is_plugin", "origin"]


def origin(obj: object) -> str:
    """``"pkg.module:qualname"`` of a function, class or instance (its class)."""
    target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    inner = getattr(obj, "per_sample", None)  # a Loss: where its function lives
    if inner is not None and hasattr(inner, "__module__"):
        target = inner
    module = getattr(target, "__module__", "?") or "?"
    return f"{module}:{getattr(target, '__qualname__', type(target).__name__)}"


def is_plugin(obj: object) -> bool:
    """Whether ``obj`` comes from outside the mpifl package."""
    module = origin(obj).partition(":")[0]
    return module != "mpifl" and not module.startswith("mpifl.")


@contextlib.contextmanager
def blame(parts: list[tuple[str, str, object]], phase: str) -> Iterator[None]:
    """Turn an exception raised inside the block into a one-line :class:`PluginFailure` that
    names the plugin ``parts`` ``[(kind, name, obj), ...]`` (those from outside mpifl) and the
    ``phase``; with no plugin among them the exception passes unchanged."""
    try:
        yield
    except MpiflError:
        raise
    except Exception as exc:
        users = [(k, n, o) for k, n, o in parts if is_plugin(o)]
        if not users:
            raise
        who = " or ".join(f"{k} '{n}' ({origin(o)})" for k, n, o in users)
        first = (str(exc).strip().splitlines() or [""])[0]
        what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        raise PluginFailure(f"{who} failed to {phase}: {what}") from exc
