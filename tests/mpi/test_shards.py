"""Every shard-supporting rule's sharded step against the same rule on one rank, under real
mpiexec on 2 to 4 ranks (tests/ranks/shard_steps.py runs on every rank, with blocking and
nonblocking collectives). Real ranks, because the shards' collectives are MPI's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import mpiexec

SCRIPT = Path(__file__).resolve().parents[1] / "ranks" / "shard_steps.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,flags", [(2, []), (3, []), (4, []), (3, ["--nonblocking"])])
def test_sharded_steps_equal_the_one_rank_steps(ranks, flags):
    out = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), *flags],
                         capture_output=True, text=True, timeout=300)
    lines = [l for l in out.stdout.splitlines() if l.startswith(("OK", "FAIL"))]
    assert out.returncode == 0 and len(lines) == 10 and all(l.startswith("OK") for l in lines), \
        out.stdout + out.stderr
