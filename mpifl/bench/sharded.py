"""The sharded server's aggregation cost (``mpiexec -n P python -m mpifl bench aggregation --shards P``).

Every rank of MPI_COMM_WORLD is one shard (:mod:`mpifl.runtime.sharding`): it builds
only its column block of the synthetic client updates (so the inputs never exist whole on one
rank), feeds the rule ``tau`` earlier rounds (its history ring fills with blocks), then times
the rule's ``aggregate()`` on its block with the shards summing their partial statistics
(:class:`~mpifl.aggregators.shards.ShardGroup`). Per case and rank it records:

* ``local_s``: the local work before each allsum (partial Grams, dot products, norms, and the
  coefficients computed from earlier sums), ``allsum_s``: inside the allsums (MPI Reduce +
  Bcast), ``apply_s``: after the last allsum (the step's block as a combination of rows);
  ``median_s`` is the whole ``aggregate()``; ``gather_s``: the step's blocks gathered to rank 0
  (what the runtime does next);
* ``peak_rss_mb``: the rank's peak resident memory during the case (VmHWM, reset at the
  case's start) and ``base_rss_mb`` its resident memory then (torch, MPI, and heap memory that
  earlier cases freed but the process keeps, :mod:`mpifl.runtime.allocator`), so
  ``peak - base`` is the server's part; with repeats > 1 it includes the copies of the rule's
  state that the earlier calls ran on, so measure memory with ``--repeats 1 --warmup 0``;
* ``max_rel_diff``: the gathered step against the same rule on one rank (P = 1, the oracle) on
  a check case of at most :data:`CHECK_M` clients and :data:`CHECK_D` parameters built from the
  same inputs, max |s_P - s_1| / max |s_1|.

Inputs are those of ``mpifl bench aggregation`` in kind (8 shared random directions plus small
full-rank noise, conflicting pairs, losses in [1, 2)), drawn in column chunks of
:data:`CHUNK` parameters keyed by (seed, m, d, round, chunk), so every P sees the same matrix.

HDF5 (``--out``; no pickle)::

    /                  attrs: benchmark="aggregation-sharded", shards, repeats, warmup, seed,
                       machine info (as ``mpifl bench aggregation``)
    /<algorithm>/      one entry per (m, d, tau) case
        m, d, tau                          int64
        median_s, local_s, allsum_s,       float64 rank 0's seconds, medians over the repeats
        apply_s, gather_s
        max_local_s, max_allsum_s          float64 the slowest rank's median
        peak_rss_mb, base_rss_mb           float64 (cases, P) per rank
        max_rel_diff                       float64 against P = 1 on the check case
        check_m, check_d                   int64   the check case's size
"""

from __future__ import annotations

import copy
import math
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpifl.aggregators import RoundUpdates, rule
from mpifl.aggregators.shards import ShardGroup
from mpifl.bench.aggregation import (Extras, _takes, aligned, extras_for, machine_info,
                                     torch_threads, write_attrs)
from mpifl.runtime.shard_comm import MPIShardCollectives

CHUNK = 1 << 14        # parameters per generated column chunk
_ROWS = 256            # rows generated at once (a 16 MiB transient)
CHECK_M, CHECK_D = 64, 50_000
_RANK = 8
COLUMNS = ("algorithm", "shards", "m", "d", "tau", "median_s", "local_s", "allsum_s", "apply_s",
           "gather_s", "max_local_s", "max_allsum_s", "peak_rss_mb", "base_rss_mb",
           "max_rel_diff")


@dataclass
class ShardedBench:
    """Result of :func:`bench_sharded` (rank 0; other ranks get ``rows == []``).

    Attributes:
        rows: one dict per (algorithm, m, d, tau) with keys :data:`COLUMNS` (peak_rss_mb and
            base_rss_mb are lists, one value per rank) plus ``check_m``, ``check_d``.
        machine, settings: as :class:`mpifl.bench.aggregation.AggregationBench`.
    """

    rows: list[dict]
    machine: dict[str, Any]
    settings: dict[str, Any]

    def to_json(self) -> dict:
        return {"benchmark": "aggregation-sharded", "machine": self.machine,
                "settings": self.settings, "rows": self.rows}


def rss_mb() -> float:
    """This process's resident memory now (MiB), from /proc (Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident memory since :func:`reset_peak` (MiB): VmHWM from
    /proc/self/status on Linux, else ``ru_maxrss`` (the whole process's life)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> None:
    """Start a new peak (Linux >= 4.0: writing 5 to /proc/self/clear_refs resets VmHWM to
    the current resident memory), so each case's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def block_rounds(m: int, d: int, rounds: int, lo: int, hi: int, seed: int,
                 ) -> list[dict[str, torch.Tensor]]:
    """Columns [lo, hi) of ``rounds`` rounds of synthetic updates (:func:`block_round`)."""
    return [block_round(m, d, t, lo, hi, seed) for t in range(rounds)]


def block_round(m: int, d: int, t: int, lo: int, hi: int, seed: int) -> dict[str, torch.Tensor]:
    """Columns [lo, hi) of round ``t``'s synthetic updates, the same whatever the block.

    Returns:
        ``updates`` (m, hi - lo) float32, ``losses`` (m,) float32 in [1, 2), ``num_samples``
        (m,) int64 in [50, 500) (the last two identical on every shard).
    """
    g = torch.Generator().manual_seed(_key(seed, m, d, t, -1))
    z = torch.randn(m, _RANK, generator=g)
    z[:, 0] = 1.0 + 0.3 * z[:, 0]                          # the direction clients share
    U = torch.empty(m, hi - lo)
    for c in range(lo // CHUNK, math.ceil(hi / CHUNK)):
        a, b = max(lo, c * CHUNK), min(hi, (c + 1) * CHUNK)
        if a >= b:
            continue
        gc = torch.Generator().manual_seed(_key(seed, m, d, t, c))
        width = min(d, (c + 1) * CHUNK) - c * CHUNK
        basis = torch.randn(_RANK, width, generator=gc) / math.sqrt(d)
        for i in range(0, m, _ROWS):  # a few rows at a time: small transients, no heap growth
            part = torch.randn(min(_ROWS, m - i), width, generator=gc).mul_(0.1 / math.sqrt(d))
            part.addmm_(z[i:i + _ROWS], basis)                # noise + z B
            U[i:i + _ROWS, a - lo:b - lo] = part[:, a - c * CHUNK:b - c * CHUNK]
            del part
    return dict(updates=U, losses=1.0 + torch.rand(m, generator=g),
                num_samples=torch.randint(50, 500, (m,), generator=g))


def _key(*parts: int) -> int:
    return int(np.random.SeedSequence([abs(int(p)) + (p < 0) * 2**40 for p in parts])
               .generate_state(1)[0])


def bench_sharded(comm, algorithms: Sequence[str], ms: Sequence[int], ds: Sequence[int], *,
                  tau: Sequence[int] = (1,), repeats: int = 3, warmup: int = 1, seed: int = 0,
                  threads: int | None = None, progress: bool = False) -> ShardedBench:
    """Time the sharded ``aggregate()`` of each rule over the grid, every rank of ``comm``
    one shard (collective: call it on every rank).

    Args:
        comm: the MPI communicator of the P shards (None: P = 1, this process alone).
        algorithms: rules that support shards (``needs.shards``).
        ms, ds, tau: clients per round, parameters, history lengths (for rules taking tau).
        repeats, warmup: timed and untimed calls; all but the last run on a copy of the
            rule's state (which holds the history: with repeats = 1 and warmup = 0 nothing
            is copied, the setting for memory measurements).
        threads: torch and BLAS threads per rank (None: their default).

    Raises:
        ValueError: a rule that does not support shards, or bad sizes or counts.
    """
    for alg in algorithms:
        if rule(alg).needs.shards is None:
            raise ValueError(f"{alg} does not run on a sharded server "
                             f"({rule(alg).needs.shards_note})")
    if not ms or not ds or min(ms) < 1 or min(ds) < 1 or repeats < 1 or warmup < 0 \
            or min(tau) < 0:
        raise ValueError(f"need m, d, repeats >= 1, warmup, tau >= 0; got m={list(ms)}, "
                         f"d={list(ds)}, repeats={repeats}, warmup={warmup}, tau={list(tau)}")
    rows = []
    with torch_threads(threads):
        machine = machine_info("cpu")
        cases = [(a, m, d, t) for a in algorithms for m in ms for d in ds
                 for t in (tau if _takes(a, "tau") else [None])]
        from tqdm.auto import tqdm

        rank = 0 if comm is None else comm.Get_rank()
        for alg, m, d, t in tqdm(cases, disable=not progress or rank != 0, desc="sharded",
                                 unit="case"):
            row = _case(comm, alg, m, d, t, repeats, warmup, seed)
            if row is not None:
                rows.append(row)
    settings = dict(shards=1 if comm is None else comm.Get_size(), repeats=repeats,
                    warmup=warmup, seed=seed)
    return ShardedBench(rows, machine, settings)


def _case(comm, alg: str, m: int, d: int, tau: int | None, repeats: int, warmup: int,
          seed: int) -> dict | None:
    group = _group(comm, d)
    reset_peak()
    base = rss_mb()
    fed = tau if tau is not None else 1
    agg, current = _fed_rule(group, alg, m, d, tau, fed, seed)
    times, split, step = [], [], None
    for k in range(warmup + repeats):
        fresh = agg if k == warmup + repeats - 1 else copy.deepcopy(agg)
        _barrier(comm)
        group.reset_timing()
        t0 = time.perf_counter()
        step = fresh.aggregate(current)
        t1 = time.perf_counter()
        full = group.gather(step.numpy())
        t2 = time.perf_counter()
        if k >= warmup:
            times.append(t1 - t0)
            split.append((group.local_seconds, group.allsum_seconds, t1 - group.last_allsum_end,
                          t2 - t1))
        del fresh
    del agg, current, full
    med = [statistics.median(s[i] for s in split) for i in range(4)]
    peak = _gather(comm, peak_rss_mb())
    base_all = _gather(comm, base)
    slowest = _gather(comm, med[0]), _gather(comm, med[1])
    check_m, check_d, diff = _check(comm, alg, m, d, tau, seed)
    if group.index != 0:
        return None
    return dict(algorithm=alg, shards=group.size, m=m, d=d, tau=tau,
                median_s=statistics.median(times), local_s=med[0], allsum_s=med[1],
                apply_s=med[2], gather_s=med[3], max_local_s=max(slowest[0]),
                max_allsum_s=max(slowest[1]), peak_rss_mb=peak, base_rss_mb=base_all,
                max_rel_diff=diff, check_m=check_m, check_d=check_d)


def _fed_rule(group: ShardGroup, alg: str, m: int, d: int, tau: int | None, fed: int,
              seed: int):
    """The rule after ``fed`` earlier rounds on this shard's block, and the timed round."""
    cls = rule(alg)
    ex: Extras = extras_for(cls)
    params = dict(ex.params, seed=seed)
    if tau is not None:
        params["tau"] = tau
    K = (fed + 1) * m
    if cls.needs.num_clients or _takes(alg, "num_clients"):
        params["num_clients"] = K
    agg = cls(**params)
    for t in range(fed + 1):  # one round's block at a time: fed, then dropped (the rule
        b = block_round(m, d, t, group.lo, group.hi, seed)  # keeps what it keeps)
        stats = {k: _stat(m, shape, seed, t) for k, shape in ex.stats.items()}
        r = RoundUpdates(round=t, client_ids=np.arange(t * m, (t + 1) * m),
                         updates=b["updates"], losses=b["losses"],
                         num_samples=b["num_samples"].numpy(), lr=0.01, stats=stats,
                         shards=group)
        del b
        if t == fed:
            return agg, r
        agg.aggregate(r)
        del r


def _stat(m: int, shape: tuple, seed: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000 + t)
    return 0.1 * torch.rand(m, *shape, generator=g) - 0.05


def _check(comm, alg, m, d, tau, seed) -> tuple[int, int, float]:
    """The sharded step against P = 1 on (min(m, CHECK_M), min(d, CHECK_D))."""
    cm, cd = min(m, CHECK_M), min(d, CHECK_D)
    fed = tau if tau is not None else 1
    group = _group(comm, cd)
    agg, current = _fed_rule(group, alg, cm, cd, tau, fed, seed)
    full = group.gather(agg.aggregate(current).numpy())
    if group.index != 0:
        return cm, cd, float("nan")
    one, cur = _fed_rule(ShardGroup(None, cd), alg, cm, cd, tau, fed, seed)
    want = one.aggregate(cur).numpy()
    return cm, cd, float(np.abs(full - want).max() / max(np.abs(want).max(), 1e-30))


def _group(comm, d: int) -> ShardGroup:
    """This rank's shard of ``comm`` (None: the one shard)."""
    return ShardGroup(None if comm is None else MPIShardCollectives(comm), d)


def _gather(comm, x: float) -> list[float]:
    return [float(x)] if comm is None else [float(v) for v in comm.allgather(float(x))]


def _barrier(comm) -> None:
    if comm is not None:
        comm.Barrier()


def format_sharded(result: ShardedBench) -> str:
    """A plain table of the rows plus the machine line."""
    head = ("algorithm", "P", "m", "d", "tau", "aggregate_s", "local_s", "allsum_s", "apply_s",
            "gather_s", "peak_MiB(max)", "server_MiB(max)", "rel_diff_vs_P1")
    cells = []
    for r in result.rows:
        server = max(p - b for p, b in zip(r["peak_rss_mb"], r["base_rss_mb"]))
        cells.append((r["algorithm"], str(r["shards"]), str(r["m"]), str(r["d"]),
                      "-" if r["tau"] is None else str(r["tau"]), f"{r['median_s']:.4g}",
                      f"{r['local_s']:.4g}", f"{r['allsum_s']:.4g}", f"{r['apply_s']:.4g}",
                      f"{r['gather_s']:.4g}", f"{max(r['peak_rss_mb']):.0f}", f"{server:.0f}",
                      f"{r['max_rel_diff']:.1e} (m={r['check_m']}, d={r['check_d']})"))
    lines = [aligned(head, cells, left={"algorithm"})]
    mi = result.machine
    lines.append(f"machine: {mi['device_name']}, {result.settings['shards']} rank(s) x "
                 f"{mi['torch_threads']} torch threads, {mi['affinity_cpus']} usable CPUs, "
                 f"load average {mi['loadavg_start'][0]:.2f} at the start")
    return "\n".join(lines)


def write_sharded_hdf5(result: ShardedBench, path: str | Path) -> None:
    """Write ``result`` in the layout of the module docstring (replacing ``path``)."""
    import h5py

    with h5py.File(path, "w") as f:
        write_attrs(f, "aggregation-sharded", {**result.settings, **result.machine})
        for alg in dict.fromkeys(r["algorithm"] for r in result.rows):
            rows = [r for r in result.rows if r["algorithm"] == alg]
            g = f.create_group(alg)
            for k in ("m", "d", "check_m", "check_d"):
                g.create_dataset(k, data=np.array([r[k] for r in rows], dtype=np.int64))
            g.create_dataset("tau", data=np.array([-1 if r["tau"] is None else r["tau"]
                                                   for r in rows], dtype=np.int64))
            for k in ("median_s", "local_s", "allsum_s", "apply_s", "gather_s", "max_local_s",
                      "max_allsum_s", "max_rel_diff"):
                g.create_dataset(k, data=np.array([r[k] for r in rows], dtype=np.float64))
            for k in ("peak_rss_mb", "base_rss_mb"):
                g.create_dataset(k, data=np.array([r[k] for r in rows], dtype=np.float64))


def read_sharded_hdf5(path: str | Path) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """Read a file of :func:`write_sharded_hdf5`: ``({algorithm: {dataset: array}}, attrs)``.

    Raises:
        ValueError: not HDF5, or not a sharded aggregation benchmark.
    """
    import h5py

    try:
        f = h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read as HDF5 ({exc})") from None
    with f:
        if f.attrs.get("benchmark") != "aggregation-sharded":
            raise ValueError(f"{path}: not a sharded aggregation benchmark")
        attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}
        return {name: {k: np.asarray(g[k]) for k in g} for name, g in f.items()}, attrs
