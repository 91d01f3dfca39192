"""Results that scale to a million clients (docs/RESULTS.md, "Storage" and "Lazy loading"):
per-client arrays chunked and deflate-compressed, read back bit for bit; ``mpifl.load`` of a
large-K file leaves them in the file (lazy) and reads one evaluation row or one client's column
without the rest; contiguous files (older mpifl, small arrays) load as before; checkpoints hold
the same chunked history. K = 200,000 here; the K = 1e6 sizes are in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpifl
from mpifl.core.errors import OutputError
from mpifl.metrics.summary import SUMMARY_KEYS
from mpifl.store import checkpoint, encoding, results
from mpifl.store.results import (CHUNK_ELEMENTS, LazyArray, MetricSet, ResultsWriter,
                                 read_results)

K, C, M, LAYERS = 200_000, 10, 1_000, 3
ROUNDS, EVERY = 16, 2  # 8 evaluations: 2 x 8 x K float64 + 12 K int64 = 44 MB of per-client data


def _fake_run(path, k=K, rounds=ROUNDS, seed=0):
    """A results file written by ResultsWriter from fake rows (no training). Returns the
    per-client arrays it was given: accuracy (E, k), loss (E, k) float64, clients (k,)/(k, C)."""
    rng = np.random.default_rng(seed)
    n_test = np.maximum(1, rng.poisson(20, k))
    clients = {"num_train": np.maximum(1, rng.poisson(100, k)), "num_test": n_test,
               "label_counts": rng.multinomial(100, np.full(C, 1 / C), size=k)}
    w = ResultsWriter(path, json.dumps({"run": {"seed": seed}}), MetricSet(k, LAYERS),
                      world_size=1, algorithm="fedavg", clients=clients)
    acc, loss = [], []
    for t in range(rounds):
        if (t + 1) % EVERY == 0:
            acc.append(rng.binomial(n_test, rng.beta(8, 3, k)) / n_test)
            acc[-1][::1000] = np.nan  # clients without test data
            loss.append(rng.gamma(2.0, 0.3, k))
            w.append_eval(t + 1, acc[-1], loss[-1], {key: 0.5 for key in SUMMARY_KEYS})
        sel = np.sort(rng.choice(k, M, replace=False))
        w.append_round({**{name: 0 for name in results.ROUND_COLUMNS}, "round": t, "lr": 0.1,
                        "conflicts_layer": np.zeros(LAYERS, np.int64), "selected": sel,
                        "aggregated": np.ones(M, bool)})
    return {"client_accuracy": np.stack(acc), "client_loss": np.stack(loss), **clients}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("scale") / "big.h5"
    return path, _fake_run(path)


def test_large_k_file_is_chunked_compressed_and_reads_back_bit_for_bit(big):
    path, want = big
    with h5py.File(path) as f:
        for name in ("eval/client_accuracy", "eval/client_loss"):
            d = f[name]
            assert d.chunks == (1, CHUNK_ELEMENTS) and d.compression == "gzip"
            assert d.shuffle == name.endswith("loss")  # accuracies: plain deflate (smaller)
            assert d.id.get_storage_size() < d.nbytes
        assert f["clients/num_train"].chunks == (CHUNK_ELEMENTS,)
        assert f["clients/label_counts"].chunks == (CHUNK_ELEMENTS // C, C)
        counts = f["clients/label_counts"]
        assert counts.id.get_storage_size() < counts.nbytes / 4
        assert f["rounds/lr"].chunks is None  # small datasets stay contiguous
        assert f["eval/client_accuracy"].dtype == np.float64  # names, shapes, dtypes unchanged
    res = read_results(path)
    for name in ("client_accuracy", "client_loss"):
        np.testing.assert_array_equal(res["eval"][name], want[name])  # NaN == NaN, bit for bit
        assert res["eval"][name].view(np.int64).tolist() == want[name].view(np.int64).tolist()
    for name in ("num_train", "num_test", "label_counts"):
        assert res["clients"][name].dtype == np.int64
        np.testing.assert_array_equal(res["clients"][name], want[name])


@pytest.mark.parametrize("backend", ["xarray", "dask"])
def test_load_of_a_large_k_file_is_lazy_and_reads_only_what_is_indexed(big, backend,
                                                                        monkeypatch):
    if backend == "dask":
        pytest.importorskip("dask.array")
    else:
        monkeypatch.setitem(sys.modules, "dask.array", None)  # as if dask were not installed
    path, want = big
    reads = []
    real = LazyArray.__getitem__

    def counted(self, key):
        out = real(self, key)
        reads.append((self.name, out.size))
        return out

    monkeypatch.setattr(LazyArray, "__getitem__", counted)
    mpifl.load(path).close()  # imports and caches out of the measurement
    reads.clear()
    tracemalloc.start()
    try:
        ds = mpifl.load(path)  # "auto": 44 MB of per-client arrays >= LAZY_MIN_BYTES
        load_peak = tracemalloc.get_traced_memory()[1]
        assert reads == []  # nothing per-client was read
        # 44.8 MB of per-client arrays; the peak (~15 MB) is the seal's streamed SHA-256
        # (4 MiB reads), the client coordinates and the rounds table
        assert load_peak < sum(a.nbytes for a in want.values()) / 2
        assert ds["accuracy"].dtype == np.float64 and ds["label_counts"].dtype == np.int64
        assert dict(ds.sizes)["client"] == K and dict(ds.sizes)["eval_round"] == 8
        tracemalloc.reset_peak()
        row = ds["accuracy"].isel(run=0, eval_round=5).values  # one evaluation
        assert tracemalloc.get_traced_memory()[1] < 4 * K * 8
        assert reads == [("eval/client_accuracy", K)]  # that row: its 7 chunks, nothing else
        column = ds["loss"].sel(run="big", client=123_456).values  # one client, every eval
        assert reads[1:] and sum(n for _, n in reads[1:]) == 8
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(row, want["client_accuracy"][5])
    np.testing.assert_array_equal(column, want["client_loss"][:, 123_456])
    picked = ds["label_counts"].isel(run=0, client=[199_999, 7, 7, 150_000]).values
    np.testing.assert_array_equal(picked, want["label_counts"][[199_999, 7, 7, 150_000]])
    eager = mpifl.load(path, lazy=False)
    assert isinstance(eager["accuracy"].variable._data, np.ndarray)
    assert not isinstance(ds["accuracy"].variable._data, np.ndarray)
    import xarray as xr

    xr.testing.assert_identical(ds.compute(), eager)  # everything, read lazily = read eagerly
    ds.close()


def test_lazy_runs_of_different_k_align_and_pad(big, tmp_path):
    path, want = big
    small = tmp_path / "small.h5"
    got = _fake_run(small, k=40_000, rounds=6, seed=1)
    ds = mpifl.load([path, small], lazy=True)
    eager = mpifl.load([path, small], lazy=False)
    try:
        assert ds["num_train"].dtype == eager["num_train"].dtype == np.float64  # NaN-padded
        # rounds 2, 6, 10 of client 39,999 (the small run evaluated after 2, 4, 6) and 40,000
        part = ds["accuracy"].isel(run=1, eval_round=[0, 2, 4], client=[39_999, 40_000]).values
        np.testing.assert_array_equal(part[:, 0], [*got["client_accuracy"][[0, 2], 39_999], np.nan])
        assert np.isnan(part[:, 1]).all()
        import xarray as xr

        xr.testing.assert_identical(ds.compute(), eager)
    finally:
        ds.close()
    with pytest.raises(OutputError, match="closed"):
        _ = ds["loss"].isel(run=0, eval_round=0, client=0).values


def test_contiguous_files_of_older_mpifl_still_load(tmp_path, monkeypatch):
    old = tmp_path / "old.h5"
    monkeypatch.setattr(encoding, "COMPRESS_MIN_BYTES", 1 << 62)  # store as mpifl did before
    want = _fake_run(old, k=50_000, rounds=4)
    monkeypatch.undo()
    with h5py.File(old) as f:
        assert f["eval/client_accuracy"].chunks is None and f["clients/label_counts"].chunks is None
    import xarray as xr

    lazy = mpifl.load(old, lazy=True)
    np.testing.assert_array_equal(lazy["loss"].isel(run=0, eval_round=1).values,
                                  want["client_loss"][1])
    xr.testing.assert_identical(lazy.compute(), mpifl.load(old, lazy=False))
    lazy.close()
    schema1 = Path(__file__).resolve().parents[1] / "data" / "schema1" / "run.h5"  # mpifl b375632
    with mpifl.load(schema1, lazy=True) as ds:
        xr.testing.assert_identical(ds.compute(), mpifl.load(schema1))


def test_unsealed_file_opened_lazily_is_value_checked_in_blocks(big, tmp_path):
    path, _ = big
    plain = tmp_path / "plain.h5"  # no checksum, as files before sealing: values are checked
    with h5py.File(path) as src, h5py.File(plain, "w") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        for name in src:
            src.copy(name, dst)
        dst["eval/client_accuracy"][6, 77_777] = 1.5
    with pytest.raises(OutputError) as err:
        mpifl.load(plain, lazy=True)
    assert "/eval/client_accuracy holds an impossible value" in str(err.value)
    assert "1.5" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(OutputError, match="lazy='sometimes': expected True, False or 'auto'"):
        mpifl.load(path, lazy="sometimes")


def test_rewrites_compress_only_new_evaluation_rows(tmp_path, monkeypatch):
    encoded = []
    real = encoding._encode
    monkeypatch.setattr(encoding, "_encode", lambda block, *a: encoded.append(block.shape) or
                        real(block, *a))
    k = 3 * CHUNK_ELEMENTS
    w = ResultsWriter(tmp_path / "r.h5", "{}", MetricSet(k, 1), world_size=1,
                      algorithm="fedavg")
    for e in range(3):
        encoded.clear()
        w.append_eval(e + 1, np.full(k, 0.5), np.full(k, 0.1 * e), dict.fromkeys(SUMMARY_KEYS, 0.5))
        w.flush()
        assert encoded == [(1, CHUNK_ELEMENTS)] * 6  # this row's 3 chunks of accuracy and loss
    with h5py.File(tmp_path / "r.h5") as f:
        assert f["eval/client_loss"][:, -1].tolist() == [0.0, 0.1, 0.2]


def test_checkpoint_history_is_chunked_and_exact(big, tmp_path):
    path, want = big
    res = read_results(path)
    h = results.MetricHistory(MetricSet(K, LAYERS))
    for i, rnd in enumerate(res["eval"]["round"]):
        h.add_eval(rnd, want["client_accuracy"][i], want["client_loss"][i],
                   {key: 0.5 for key in SUMMARY_KEYS})
    ckpt = checkpoint.Checkpoint(round=16, w=np.arange(5, dtype=np.float32), aggregator={},
                                 history=h, config_json="{}", world_size=1, path=tmp_path)
    saved = checkpoint.save(tmp_path / "ckpt", ckpt)
    with h5py.File(saved) as f:
        assert f["history/eval/client_loss"].compression == "gzip"
    back = checkpoint.read(saved).history
    for got, wanted in ((back.accuracy, want["client_accuracy"]), (back.loss, want["client_loss"])):
        assert np.stack(got).view(np.int64).tolist() == wanted.view(np.int64).tolist()
