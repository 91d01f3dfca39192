"""FedFV's blocked projection recursion split over shard ranks, against the one-rank rule:
``mpiexec -n 3 python tests/mpi/test_fedfv_batched.py`` runs :func:`_mpi_main` on every rank
(its test starts it), with the inputs of tests/inprocess/test_fedfv_batched.py. Real ranks,
because the shards' collectives are MPI's own (MPIShardCollectives on COMM_WORLD).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if __name__ == "__main__":  # a script on every rank: the repository root, for ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mpifl.aggregators import RoundUpdates, create  # noqa: E402
from mpifl.aggregators import fedfv as fedfv_mod  # noqa: E402
from mpifl.aggregators.fedfv import internal_coefficients  # noqa: E402
from mpifl.aggregators.fedfv_batched import BATCHED_MIN_CLIENTS, row_block  # noqa: E402
from tests.inprocess.test_fedfv_batched import OLD, case, rounds  # noqa: E402


@pytest.mark.mpi
def test_sharded_recursion_equals_the_one_rank_rule():
    from tests.helpers import mpiexec

    out = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(Path(__file__).resolve())],
                         capture_output=True, text=True, timeout=240,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith(("OK", "FAIL"))]
    assert len(lines) == 3 and all(x.startswith("OK") for x in lines), out.stdout


def _mpi_main() -> int:
    """Under mpiexec -n 3: each rank is a shard of a sharded FedFV (blocked recursion, rows split
    over the shards); rank 0 compares against the one-rank rule (the GEMV loop) and checks that
    every shard derived the same coefficient sums. Prints three OK/FAIL lines on rank 0."""
    from mpi4py import MPI

    from mpifl.aggregators.shards import ShardGroup
    from mpifl.runtime.shard_comm import MPIShardCollectives

    comm = MPI.COMM_WORLD
    m = BATCHED_MIN_CLIENTS + 45
    group = ShardGroup(MPIShardCollectives(comm), d=256)     # as wide as low_rank's updates
    results = []
    # 1. coefficient sums from the same Gram on every rank: each shard solves a third of the
    #    rows; all must hold the same bits, close to the loop
    G, po, kept = case("many_conflicts", m, 0.1, 11)
    r0 = RoundUpdates(0, np.arange(m), torch.zeros(m, group.hi - group.lo), np.ones(m),
                      np.ones(m, dtype=np.int64), 0.1, shards=group)
    solved = []                    # the row blocks this shard's rule solved
    real = fedfv_mod.coefficient_column_sums
    fedfv_mod.coefficient_column_sums = lambda G, po, n, lo, hi: (solved.append((lo, hi))
                                                                   or real(G, po, n, lo, hi))
    sums = create("fedfv").coefficient_sums(G, po, kept, r0)
    every, blocks = comm.gather(sums, root=0), comm.gather(solved, root=0)
    if comm.Get_rank() == 0:
        oracle = internal_coefficients(G, po, kept).sum(axis=0)
        err = float(np.abs(sums - oracle).max() / np.abs(oracle).max())
        same = all(np.array_equal(s, sums) for s in every)
        tiles = [b for bs in blocks for b in bs] == [row_block(m - int(kept.sum()), 3, j)
                                                      for j in range(3)]
        results.append((same and tiles and err <= 1e-12,
                        f"sums identical on every shard {same}, vs loop {err:.1e}, "
                        f"row blocks {blocks} tile the free rows {tiles}"))
    # 2./3. whole steps over rounds with history, float32 and float64 updates
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-6)):   # gathered as float32
        sharded, oracle_rule = create("fedfv", tau=2), create("fedfv", tau=2)
        oracle_rule.batched_from = OLD
        worst = 0.0
        for r in rounds(m, count=3, dtype=dtype, seed=5, kind="low_rank"):
            full = r.updates
            assert full.shape[1] == group.d
            block = RoundUpdates(r.round, r.client_ids, group.block(full).contiguous(), r.losses,
                                 r.num_samples, r.lr, shards=group)
            step = group.gather(sharded.aggregate(block).to(torch.float32).numpy())
            if comm.Get_rank() == 0:
                ref = oracle_rule.aggregate(r).to(torch.float32).numpy()
                worst = max(worst, float(np.linalg.norm(step - ref) / np.linalg.norm(ref)))
        if comm.Get_rank() == 0:
            results.append((worst <= tol, f"{dtype} steps vs one rank {worst:.1e}"))
    failed = False
    for ok, text in results:
        failed |= not ok
        print(f"{'OK' if ok else 'FAIL'} {text}", flush=True)
    return int(comm.bcast(failed, root=0))


if __name__ == "__main__":
    sys.exit(_mpi_main())
