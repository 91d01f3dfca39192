"""How much memory a reader may take for what a file declares, checked before it reads.

The memory budget (:mod:`mpifl.experiment.budget`) sizes a run from a data set's built-in
shapes (:class:`mpifl.data.registry.DataShape`, published means) before anything is read; a
damaged or foreign file can declare far more (an h5 client of 10^9 rows, images of 60,000 x
60,000 pixels, a JSON file of many GB). The readers compare what a file declares (an h5
dataset's shape and dtype, a JSON file's size) with :func:`memory_bound` before reading it, so
such a file ends in one line naming the file and the client rather than in ``MemoryError`` or
the kernel's out-of-memory killer.

The bound is the budget's notion of available memory (the budget sits in a layer above and
cannot be imported here): ``MPIFL_MEMORY_LIMIT_MB`` (MiB) when set, else the smaller of
``MemAvailable`` (``/proc/meminfo``) and what this process's cgroup still allows; no bound
(infinity) when neither can be read.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from mpifl.core.errors import ConfigError, DataError

__all__ = ["LIMIT_VAR", "check_memory", "env_limit", "memory_bound", "size_text"]

#: the environment variable that sets this node's memory in MiB (the budget's too)
LIMIT_VAR = "MPIFL_MEMORY_LIMIT_MB"


def env_limit(var: str) -> float | None:
    """Bytes the environment variable ``var`` sets in MiB, or None when it is not set.

    Raises:
        ConfigError: it is set to something other than a positive number.
    """
    text = os.environ.get(var, "")
    if not text.strip():
        return None
    try:
        mb = float(text)
    except ValueError:
        mb = math.nan
    if not (mb > 0 and math.isfinite(mb)):
        raise ConfigError(f"{var}={text!r}: expected a positive number of MiB")
    return mb * 2**20


def memory_bound() -> tuple[float, str]:
    """(bytes a reader may hold, where that number comes from).

    Raises:
        ConfigError: ``MPIFL_MEMORY_LIMIT_MB`` is set to something other than a positive number.
    """
    env = env_limit(LIMIT_VAR)
    if env is not None:
        return env, LIMIT_VAR
    found: list[tuple[float, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024.0, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            found.append((float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")),
                          "free physical memory"))
        except (OSError, ValueError, AttributeError):
            pass
    try:  # cgroup v2: the container's limit minus what it uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(0.0, float(int(limit) - used)), "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    return min(found) if found else (math.inf, "unknown")


def size_text(nbytes: float) -> str:
    """``nbytes`` in binary units: ``"2.9 TiB"``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    i = 0
    while nbytes >= 1024 and i < len(units) - 1:
        nbytes, i = nbytes / 1024, i + 1
    return f"{nbytes:.0f} B" if i == 0 else f"{nbytes:.1f} {units[i]}"


#: what a refusal of a file's declared size suggests
DAMAGED = "the file is damaged or not the published one, or this node is too small"


def check_memory(need: float, what: str, hint: str = DAMAGED) -> None:
    """Refuse ``what`` when it would take more than :func:`memory_bound`.

    Args:
        need: bytes it would take once read (an estimate from declared shapes).
        what: the file, the client and what they declare, e.g. ``"x.h5: client 'a': 10^9
            rows"`` (the message's start).
        hint: what to do, the message's end.
    Raises:
        DataError: one line naming ``what``, the bytes and the memory available.
        ConfigError: a bad ``MPIFL_MEMORY_LIMIT_MB``.
    """
    bound, source = memory_bound()
    if need > bound:
        raise DataError(f"{what} would take {size_text(need)} in memory, more than the "
                        f"{size_text(bound)} available ({source}; {LIMIT_VAR} sets it): {hint}")
