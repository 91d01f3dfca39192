"""Keep large freed blocks in the process heap (glibc), so that per-step buffers are reused.

Vectorised training allocates several (m, d) float32 tensors per SGD step (the vmapped
gradients, the masked step) and the server one (m, d) update buffer per round: tens of MiB
each. glibc serves such blocks with ``mmap`` and returns them to the kernel on ``free``, so every
step pays fresh page faults for memory it just released (measured on the 2-core VM: 2.9 s of
system time in three rounds of 100 clients, and the vectorised trainer 1.35x faster once
the blocks are kept; docs/BENCHMARKS.md). Raising glibc's mmap and trim thresholds keeps them in
the heap, as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` would; the price is that
freed memory is not handed back to the kernel while the process runs (peak RSS stays).

Set ``MPIFL_MALLOC_TUNING=0`` to keep the C library's defaults. Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from (and go back to) the heap


def keep_large_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when applied."""
    if os.environ.get("MPIFL_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, 2 * _THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
