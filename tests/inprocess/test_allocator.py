"""mpifl.runtime.allocator: glibc keeps large freed blocks when asked, and the opt-out is honoured."""

from __future__ import annotations

import platform

from mpifl.runtime.allocator import keep_large_blocks


def test_applied_on_glibc_and_opt_out(monkeypatch):
    assert keep_large_blocks() == (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MPIFL_MALLOC_TUNING", "0")
    assert keep_large_blocks() is False
