"""Run under ``mpiexec -n P``: every shard-supporting rule's sharded step against the same rule
on one rank (the oracle), over several rounds of synthetic updates with partial participation
(so FedFV's and FedLF's sharded history rings are used). Prints one ``OK rule max_rel`` line per
rule on rank 0, or ``FAIL ...`` and exits 1.

    mpiexec -n 3 python tests/ranks/shard_steps.py [--rounds 6] [--nonblocking]

``--nonblocking``: the shards' collectives in their nonblocking forms, completed by the
runtime's peer-timeout wait (as with ``run.peer_timeout_s > 0``).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregators import RoundUpdates, create
from mpifl.aggregators.shards import ShardGroup, local_layers
from mpifl.runtime.comm import wait_idle
from mpifl.runtime.shard_comm import MPIShardCollectives

#: (rule, parameters): the supporting rules, with history on where a rule keeps one
RULES = [("fedavg", {}), ("fedprox", {}), ("drfl", {}), ("uga", {"eta_g": 1.5}),
         ("qfedavg", {"q": 1.0}), ("fedmgda_plus", {"eps": 0.3}),
         ("fedfv", {"alpha": 0.2, "tau": 2}), ("fedfv", {"alpha": 0.0, "tau": 3, "order": "random",
                                                        "external_window": "flgo"}),
         ("fedlf", {}), ("mfairfl", {"alpha": 0.5, "beta": 0.3, "num_groups": 2})]
K, M, LAYERS = 12, 5, [37, 200, 11, 300, 40, 3]   # clients, clients per round, layer sizes


def rounds(d: int, count: int, seed: int = 0):
    """Synthetic rounds (same on every rank): ids, updates (m, d) float32 with a shared
    direction plus conflicting noise, losses, sample counts, mFairFL's constraints."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=d)
    for t in range(count):
        ids = np.sort(rng.choice(K, size=M, replace=False))
        U = 0.3 * base + rng.normal(size=(M, d)) * rng.uniform(0.5, 2.0, size=(M, 1))
        yield (t, ids, U.astype(np.float32), rng.uniform(0.2, 2.0, M).astype(np.float32),
               rng.integers(10, 100, M), rng.normal(0.0, 0.1, (M, 2)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--nonblocking", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    bounds = np.cumsum([0, *LAYERS])
    layers = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    d = int(bounds[-1])
    wait = (lambda req: wait_idle(req, max_sleep=0.0, timeout=120.0,
                                  waiting_for="another shard rank")) if args.nonblocking else None
    group = ShardGroup(MPIShardCollectives(comm, wait), d)
    failed = False
    for name, params in RULES:
        sharded, oracle = create(name, **params), create(name, **params)
        worst = 0.0
        for t, ids, U, losses, n, cons in rounds(d, args.rounds):
            stats = {"constraints": cons} if name == "mfairfl" else {}
            full = torch.from_numpy(U)
            block = RoundUpdates(t, ids, group.block(full).contiguous(), losses, n, 0.1,
                                 local_layers(layers, group.lo, group.hi), stats=stats,
                                 shards=group)
            step = group.gather(sharded.aggregate(block).numpy())
            if comm.Get_rank() == 0:
                ref = oracle.aggregate(RoundUpdates(t, ids, full, losses, n, 0.1, layers,
                                                    stats=stats)).numpy()
                rel = float(np.linalg.norm(step - ref) / max(np.linalg.norm(ref), 1e-30))
                worst = max(worst, rel)
        if comm.Get_rank() == 0:
            ok = worst <= 1e-5
            failed |= not ok
            print(f"{'OK' if ok else 'FAIL'} {name} {params} {worst:.2e}", flush=True)
    return int(comm.bcast(failed, root=0))


if __name__ == "__main__":
    sys.exit(main())
