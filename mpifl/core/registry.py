"""One registry type for everything a user can name in a config: rules, models, data sets,
partitions, trainers.

Built-ins and plugins come in by the same route (``@REGISTRY.register("name")``), and wherever a
registered name is accepted an import path ``"pkg.module:obj"`` works too: the object is imported
and registered under that path on first use. A name clash raises instead of silently replacing
the first entry (a re-import of the same module is not a clash).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Callable, Generic, TypeVar

__all__ = ["Registry", "UnknownName", "closest", "import_object"]

T = TypeVar("T")


class UnknownName(KeyError):
    """A name that is neither registered nor an importable ``"pkg.module:obj"`` path.

    ``str(exc)`` is one line naming the kind, the name, the closest known name and the known ones.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def import_object(path: str) -> object:
    """The object named by ``"pkg.module:attr"`` (``attr`` may be dotted).

    Raises:
        UnknownName: not of that form, the module cannot be imported, or it has no such attribute
            (the message names which).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UnknownName(f"'{path}' is not an import path of the form 'package.module:object'")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownName(f"'{path}': cannot import module '{module_name}' ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UnknownName(f"'{path}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Named entries of one kind (``"rule"``, ``"model"``, ...).

    Args:
        kind: what the entries are, for error messages.
        check: optional validator called on every entry before it is registered; it raises
            TypeError or ValueError with the reason an object cannot be one of this kind.
    """

    def __init__(self, kind: str, check: Callable[[str, T], None] | None = None) -> None:
        self.kind = kind
        self._check = check
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@registry.register("name")`` on a class or function.

        Raises:
            ValueError: ``name`` is empty, contains ':' (reserved for import paths), or is
                already taken by another object.
        """
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name must be a non-empty string without ':', "
                             f"got {name!r}")

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name`` (see :meth:`register`)."""
        old = self._entries.get(name)
        if old is not None and _qualified(old) != _qualified(obj):
            raise ValueError(f"{self.kind} name {name!r} is already registered by "
                             f"{_qualified(old)}")
        if self._check is not None:
            self._check(name, obj)
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """The entry registered as ``name``, or the object at import path ``"pkg.module:obj"``
        (registered under that path on first use).

        Raises:
            UnknownName: neither registered nor importable; the message suggests the closest name.
            TypeError, ValueError: the imported object cannot be one of this kind.
        """
        if name in self._entries:
            return self._entries[name]
        if isinstance(name, str) and ":" in name:
            obj = import_object(name)
            self.add(name, obj)  # type: ignore[arg-type]
            return obj  # type: ignore[return-value]
        close = closest(str(name), self.available())
        hint = f" (did you mean '{close}'?)" if close else ""
        raise UnknownName(f"unknown {self.kind} '{name}'{hint}; known: {', '.join(self.available())}"
                          f", or an import path 'package.module:object'")

    __getitem__ = get

    def available(self) -> list[str]:
        """Registered names, sorted (import paths used so far included)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.available()})"


def _qualified(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def closest(word: str, candidates: list[str]) -> str | None:
    """difflib's close matches, the one fewest edits away first ('fedfw' -> 'fedfv', whose
    difflib ratio ties with 'fedlf'); None when nothing is close."""
    close = difflib.get_close_matches(word, candidates, n=max(1, len(candidates)))
    return min(close, key=lambda c: (_edits(word, c), close.index(c))) if close else None


def _edits(a: str, b: str) -> int:
    """Levenshtein distance."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]
