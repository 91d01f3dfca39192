"""The sharded server's aggregation (docs/ARCHITECTURE.md, "Sharded server"): coordinate
blocks, clipped layer maps, and every shard-supporting rule's sharded step against the same rule on
one rank, under real mpiexec. The tests that start mpiexec themselves are in
tests/mpi/test_shards.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpifl.aggregators import available, rule
from mpifl.aggregators.shards import ALIGN, local_layers, shard_bounds


@pytest.mark.parametrize("d,p", [(1, 1), (591, 2), (591, 3), (10_000, 4), (20, 3), (199_210, 7)])
def test_blocks_tile_the_vector(d, p):
    b = shard_bounds(d, p)
    assert len(b) == p + 1 and b[0] == 0 and b[-1] == d
    assert (np.diff(b) >= 0).all() and all(x % ALIGN == 0 for x in b[1:-1])
    if d >= 64 * p:  # large enough: blocks within one alignment unit of d / P
        assert np.abs(np.diff(b) - d / p).max() <= ALIGN


def test_bad_shard_counts_are_refused():
    with pytest.raises(ValueError, match="shards >= 1"):
        shard_bounds(10, 0)


def test_clipped_layers_tile_each_block_and_add_up():
    layers = [slice(0, 37), slice(37, 237), slice(237, 248), slice(248, 548)]
    b = shard_bounds(548, 3)
    per_layer = np.zeros(len(layers), dtype=int)
    for j in range(3):
        clipped = local_layers(layers, int(b[j]), int(b[j + 1]))
        pos = 0
        for l, s in enumerate(clipped):
            assert s.start == pos and s.stop >= s.start
            pos = s.stop
            per_layer[l] += s.stop - s.start
        assert pos == b[j + 1] - b[j]
    assert list(per_layer) == [37, 200, 11, 300]


def test_every_rule_says_whether_it_supports_shards():
    supported = {n for n in available() if rule(n).needs.shards is not None}
    assert {"fedavg", "fedprox", "drfl", "uga", "qfedavg", "fedmgda_plus", "fedfv", "fedlf",
            "mfairfl"} <= supported
    for name in set(available()) - supported:
        assert rule(name).needs.shards_note, name


def test_the_algorithms_doc_table_says_what_each_rule_does():
    text = (Path(__file__).resolve().parents[2] / "docs" / "ALGORITHMS.md").read_text()
    table = text.split("## Sharded server", 1)[1]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for name in cells[0].split(","):
                rows[name.strip().split()[0].strip("`")] = cells[1:]
    assert set(rows) == set(available())
    for name, (shards, state, why) in rows.items():
        r = rule(name)
        assert (shards == "yes") == (r.needs.shards is not None), name
        keys = [s.strip().strip("`").split("`")[0] for s in state.split(",")
                if s.strip() not in ("", "-")]
        assert keys == list(r.needs.sharded_state), name
        assert why == ("" if r.needs.shards is not None else r.needs.shards_note), name


def test_row_norms_in_chunks_equal_the_whole_float64_norms():
    import torch

    from mpifl.aggregators.shards import row_sq_norms

    X = torch.randn(37, 1000)
    X[3, 5] = float("nan")
    want = torch.linalg.vector_norm(X.double(), dim=1) ** 2
    got = row_sq_norms(X, chunk_bytes=8 * 1000 * 4)  # 4 rows a chunk
    assert torch.equal(got[:3], want[:3]) and torch.isnan(got[3]) and torch.equal(got[4:], want[4:])
    clean = torch.linalg.vector_norm(torch.nan_to_num(X).double(), dim=1) ** 2
    assert torch.equal(row_sq_norms(X, finite=True, chunk_bytes=1), clean)
