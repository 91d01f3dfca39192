"""Benchmarks (``mpifl bench aggregation|simulate``, ``analysis/agg_scaling.py``): structure and
correctness of what they report. Never a timing assertion."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpifl import aggregators
from mpifl.aggregators import Aggregator
from mpifl.aggregators.base import RULES
from mpifl.bench.aggregation import (BASELINE, COLUMNS, H5_BASELINE_DATASETS, H5_DATASETS, bench_aggregation,
                         format_report, format_table, read_hdf5, write_hdf5)
from mpifl.cli import main
from mpifl.bench.simulate import bench_simulate, model_flops
from mpifl.models import build_model
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]
# a tiny real workload: synthetic data (no files needed), 6 of 10 clients, a 16-unit MLP
TINY_SIM = ["data.dataset=synthetic", "data.partition=natural", "data.num_clients=10",
            "model.hidden=[16]"]


def test_tiny_benchmark_rows(capsys):
    res = bench_aggregation(["fedfv", "fedavg"], [4, 8], 1000, repeats=1, progress=True)
    rows = res.rows
    assert [(r["algorithm"], r["form"], r["m"]) for r in rows] == [
        ("fedfv", "gram", 4), ("fedfv", "direct", 4), ("fedavg", "default", 4),
        ("fedfv", "gram", 8), ("fedfv", "direct", 8), ("fedavg", "default", 8)]
    for r in rows:
        assert list(r) == list(COLUMNS)
        assert r["d"] == 1000
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["iqr_s"] == 0.0
    fv = [r for r in rows if r["algorithm"] == "fedfv"]
    for r in fv:
        assert r["tau"] == 1 and r["bytes"] == 4 * 1000 * 2 * r["m"]   # m updates + tau*m rows
        assert r["ratio"] > 0 and r["max_abs_diff"] < 1e-4
    assert fv[0]["ratio"] == pytest.approx(fv[1]["median_s"] / fv[0]["median_s"])
    assert fv[1]["ratio"] == 1.0 and fv[1]["max_abs_diff"] == 0.0
    avg = rows[2]
    assert avg["tau"] is None and avg["ratio"] is None and avg["max_abs_diff"] is None
    assert avg["bytes"] == 4 * 1000 * 4
    assert res.skipped == {}
    json.dumps(res.to_json())                           # the CLI's --json output
    assert "aggregation" in capsys.readouterr().err     # the progress bar went to stderr


def test_grid_of_d_and_tau():
    res = bench_aggregation(["fedfv", "qfedavg"], [3], [50, 80], tau=[0, 2], repeats=2, warmup=0)
    got = [(r["algorithm"], r["form"], r["d"], r["tau"]) for r in res.rows]
    assert got == [("fedfv", "gram", 50, 0), ("fedfv", "direct", 50, 0),
                   ("fedfv", "gram", 50, 2), ("fedfv", "direct", 50, 2),
                   ("qfedavg", "default", 50, None),
                   ("fedfv", "gram", 80, 0), ("fedfv", "direct", 80, 0),
                   ("fedfv", "gram", 80, 2), ("fedfv", "direct", 80, 2),
                   ("qfedavg", "default", 80, None)]
    for r in res.rows:
        assert r["iqr_s"] >= 0
        if r["form"] == "gram":
            assert r["max_abs_diff"] < 1e-5


def test_every_registered_rule_is_benchmarked_or_skipped():
    res = bench_aggregation(None, [3], 64, repeats=1, warmup=0)
    done = {r["algorithm"] for r in res.rows}
    assert done | set(res.skipped) == set(aggregators.available())
    assert not done & set(res.skipped)
    for name, why in res.skipped.items():
        assert isinstance(why, str) and why and "\n" not in why, name
    # the rules with extra inputs run: AFL (all K clients per round), mFairFL (constraints)
    assert {"afl", "mfairfl", "fedavg", "fedfv"} <= done
    text = format_report(res)
    assert "machine:" in text and all(f"skipped {n}:" in text for n in res.skipped)


class _NeedsSomethingElse(Aggregator):
    """A rule the benchmark cannot feed: it must be skipped with its reason, not crash."""

    def aggregate(self, r):
        raise ValueError("needs stats['nope']\nsecond line")


def test_unbuildable_rule_is_skipped(monkeypatch):
    monkeypatch.setitem(RULES._entries, "zz_needs", _NeedsSomethingElse)
    res = bench_aggregation(["fedavg", "zz_needs"], [2, 3], 20, repeats=1, warmup=0)
    assert {r["algorithm"] for r in res.rows} == {"fedavg"}
    assert res.skipped["zz_needs"].startswith("m=2 d=20: ValueError: needs stats['nope']")
    assert "\n" not in res.skipped["zz_needs"]


def test_format_table_is_aligned():
    rows = bench_aggregation(["fedfv"], [3], 50, tau=0, repeats=2, warmup=0).rows
    lines = format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].split() == list(COLUMNS)
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split()[:5] == ["fedfv", "gram", "3", "50", "0"]
    assert lines[3].split()[-2:] == ["1", "0.0e+00"]


def test_no_baseline_repeats_leaves_the_direct_form_out():
    rows = bench_aggregation(["fedfv"], [3], 50, tau=0, repeats=1, warmup=0,
                             baseline_repeats=0).rows
    assert [r["form"] for r in rows] == ["gram"] and rows[0]["ratio"] is None
    both = bench_aggregation(["fedfv"], [3], 50, tau=0, repeats=1, warmup=0).rows
    assert [r["form"] for r in both] == ["gram", "direct"]


@pytest.mark.parametrize("kw", [dict(algorithms=["nope"]), dict(algorithms=[]), dict(ms=[0]),
                                dict(d=0), dict(d=[]), dict(repeats=0), dict(warmup=-1),
                                dict(tau=-1), dict(tau=[]), dict(baseline_repeats=-1),
                                dict(device="tpu"), dict(threads=0)])
def test_bad_arguments(kw):
    args = dict(algorithms=["fedavg"], ms=[2], d=10) | kw
    with pytest.raises(ValueError):
        bench_aggregation(args.pop("algorithms"), args.pop("ms"), args.pop("d"), **args)


def _small_results(path: Path, algorithms=("fedfv", "fedavg", "afl")):
    res = bench_aggregation(list(algorithms), [3, 6], [40, 120], tau=[1], repeats=1, warmup=0)
    res.skipped["zz_fake"] = "a reason"
    write_hdf5(res, path)
    return res


def test_hdf5_layout(tmp_path):
    path = tmp_path / "agg.h5"
    res = _small_results(path)
    with h5py.File(path, "r") as f:
        assert f.attrs["benchmark"] == "aggregation"
        for key in ("cpu_count", "affinity_cpus", "cpu_model", "torch_version", "device",
                    "device_name", "torch_threads", "loadavg_start", "loadavg_end", "repeats",
                    "warmup", "seed"):
            assert key in f.attrs, key
        assert list(f.attrs["skipped_names"]) == ["zz_fake"]
        assert set(f) == {"fedfv", BASELINE, "fedavg", "afl"}
        for name, g in f.items():
            n = len(g["m"])
            assert n == 4                                  # 2 m x 2 d
            for k in H5_DATASETS:
                assert g[k].ndim == 1 and len(g[k]) == n, (name, k)
            assert all(k in g for k in H5_BASELINE_DATASETS) == (name in ("fedfv", BASELINE))
        assert f["fedfv"].attrs["form"] == "gram" and f[BASELINE].attrs["form"] == "direct"
        assert list(f["fedavg"]["tau"]) == [-1] * 4 and not f["fedavg"].attrs["tau_applies"]
        assert f["fedfv"]["bytes"].dtype == np.int64
    groups, attrs = read_hdf5(path)
    fv = [r for r in res.rows if r["form"] == "gram"]
    np.testing.assert_allclose(groups["fedfv"]["median_s"], [r["median_s"] for r in fv])
    np.testing.assert_array_equal(groups["fedfv"]["ratio"], [r["ratio"] for r in fv])
    assert attrs["torch_threads"] == res.machine["torch_threads"]


def test_read_hdf5_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_text("not hdf5")
    with pytest.raises(ValueError, match="cannot read as HDF5"):
        read_hdf5(bad)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["benchmark"] = "something else"
    with pytest.raises(ValueError, match="not an aggregation benchmark"):
        read_hdf5(other)


def test_cli_aggregation_json_and_out(tmp_path, capsys):
    out = tmp_path / "r.h5"
    rc = main(["bench", "aggregation", "--algorithms", "fedfv,afl", "--m", "3", "--d", "40,60",
               "--tau", "1", "--repeats", "1", "--warmup", "0", "--json", "--out", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"benchmark", "machine", "settings", "rows", "skipped"}
    assert doc["benchmark"] == "aggregation" and doc["skipped"] == {}
    assert {(r["algorithm"], r["form"]) for r in doc["rows"]} == {
        ("fedfv", "gram"), ("fedfv", "direct"), ("afl", "default")}
    assert set(read_hdf5(out)[0]) == {"fedfv", BASELINE, "afl"}


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "aggregation", "--algorithms", "nope", "--m", "2", "--d", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mpifl: error: bench aggregation:") and "\n" not in err
    assert main(["bench", "aggregation", "--algorithms", "fedavg", "--m", "2", "--d", "5",
                 "--out", str(tmp_path / "missing" / "r.h5")]) == 2
    assert "cannot write" in capsys.readouterr().err


# ---- analysis/agg_scaling.py -------------------------------------------------------------------

def _run_scaling(*args):
    return subprocess.run([sys.executable, str(ROOT / "analysis" / "agg_scaling.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_agg_scaling_plots_and_fits(tmp_path):
    path, png = tmp_path / "agg.h5", tmp_path / "scaling.png"
    _small_results(path)
    proc = _run_scaling(str(path), "--out", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["algorithm", "tau", "exp"]
    table = {ln.split()[0]: ln.split() for ln in lines[2:] if not ln.startswith("wrote")}
    assert set(table) == {"fedfv", BASELINE, "fedavg", "afl"}
    for name, cells in table.items():
        exp_m, exp_d = cells[2], cells[5]
        assert math.isfinite(float(exp_m)) and math.isfinite(float(exp_d)), name


@pytest.fixture(scope="module")
def agg_scaling():
    sys.path.insert(0, str(ROOT / "analysis"))
    try:
        import agg_scaling
    finally:
        sys.path.pop(0)
    return agg_scaling


def test_agg_scaling_exponent_is_the_log_log_slope(agg_scaling):
    x = np.array([10.0, 60.0, 200.0])
    assert agg_scaling.exponent(x, 3e-6 * x ** 2) == pytest.approx(2.0)
    assert math.isnan(agg_scaling.exponent(x[:1], x[:1]))


@pytest.mark.parametrize("content", [None, b"garbage"])
def test_agg_scaling_bad_file(tmp_path, capsys, agg_scaling, content):
    path = tmp_path / "x.h5"
    if content is not None:
        path.write_bytes(content)
    assert agg_scaling.main([str(path), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agg_scaling: error:") and err.count("\n") == 1
    assert not (tmp_path / "p.png").exists()


# ---- mpifl bench simulate ----------------------------------------------------------------------

def test_simulate_paths_agree():
    res = bench_simulate(overrides=TINY_SIM, clients_per_round=6, rounds=2, batch_size=20)
    assert res["max_abs_diff_updates"] <= 1e-5 and res["max_abs_diff_losses"] <= 1e-5
    for key in ("vectorised_rounds_per_s", "sequential_rounds_per_s", "speedup",
                "vectorised_client_updates_per_s", "sequential_client_updates_per_s",
                "vectorised_flops_per_s", "sequential_flops_per_s", "gemm_flops_per_s",
                "vectorised_gemm_fraction", "sequential_gemm_fraction"):
        assert res[key] > 0, key
    assert res["speedup"] == pytest.approx(res["vectorised_rounds_per_s"]
                                           / res["sequential_rounds_per_s"])
    wl = res["workload"]
    assert (wl["dataset"], wl["clients_per_round"], wl["batch_size"], wl["rounds"]) == (
        "synthetic", 6, 20, 2)
    assert len(res["vectorised_round_times_s"]) == 2
    json.dumps(res)


def test_simulate_cli_json_with_momentum(capsys):
    args = ["bench", "simulate", "--clients", "4", "--rounds", "1", "--epochs", "2", "--json",
            "--threads", "1"]
    for s in [*TINY_SIM, "client.momentum=0.9", "client.weight_decay=0.001"]:
        args += ["--set", s]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"vectorised_rounds_per_s", "sequential_rounds_per_s", "speedup"} <= set(doc)
    assert doc["max_abs_diff_updates"] <= 1e-5
    assert doc["workload"]["epochs"] == 2 and doc["machine"]["torch_threads"] == 1


def test_simulate_bad_arguments(capsys):
    assert main(["bench", "simulate", "--clients", "0"]) == 2
    assert "bench simulate" in capsys.readouterr().err
    with pytest.raises(ValueError):
        bench_simulate(overrides=TINY_SIM, clients_per_round=2, rounds=1, device="cuda:7"
                       if not torch.cuda.is_available() else "tpu")


def test_model_flops_of_the_mlp():
    model = build_model("mlp", (1, 28, 28), 10, hidden=(200, 200))
    f = model_flops(model, (1, 28, 28))
    weights = 784 * 200 + 200 * 200 + 200 * 10
    assert f["forward"] == 2 * weights
    assert f["train"] == 6 * weights - 2 * 784 * 200      # no input gradient at the first layer
    assert f["params"] == weights + 200 + 200 + 10


# ---- mpifl bench aggregation --shards (docs/ARCHITECTURE.md, "Sharded server") ----------------

def test_shard_inputs_are_the_same_matrix_whatever_the_blocks():
    from mpifl.aggregators.shards import shard_bounds
    from mpifl.bench.sharded import CHUNK, block_rounds

    m, d = 5, 2 * CHUNK + 1000  # blocks that cut through generated chunks
    whole = block_rounds(m, d, 2, 0, d, seed=3)
    for P in (2, 3, 7):
        b = shard_bounds(d, P)
        parts = [block_rounds(m, d, 2, int(b[j]), int(b[j + 1]), seed=3) for j in range(P)]
        for t in range(2):
            joined = torch.cat([p[t]["updates"] for p in parts], dim=1)
            assert torch.equal(joined, whole[t]["updates"])
            assert all(torch.equal(p[t]["losses"], whole[t]["losses"]) for p in parts)
    assert not torch.equal(whole[0]["updates"], whole[1]["updates"])


#: the sharded benchmark at P = 1 and P = 2 (one shard a rank), tiny sizes, in the shared world
#: (tests/world.py)
SHARDED = {P: world_run(f"bench-sharded-p{P}", [
    "bench", "aggregation", "--algorithms", "fedavg,fedfv,fedlf", "--m", "12,24", "--d", "3000",
    "--repeats", "2", "--tau", "2", "--shards", str(P), "--out", f"{{dir}}/bench-sharded-p{P}.h5"],
    ranks=P) for P in (1, 2)}


@pytest.fixture(scope="module")
def sharded_files(world):
    out = {}
    for P, run in SHARDED.items():
        out[P] = world.file(run)
        printed = world.output(run)  # every rank's: only rank 0 writes
        assert f"wrote {out[P]}" in printed and printed.count("wrote") == 1, printed[-3000:]
    return out


def test_sharded_bench_rows_split_and_agree_with_one_rank(sharded_files):
    from mpifl.bench.sharded import read_sharded_hdf5

    groups, attrs = read_sharded_hdf5(sharded_files[2])
    assert attrs["shards"] == 2 and set(groups) == {"fedavg", "fedfv", "fedlf"}
    g = groups["fedfv"]
    assert list(g["m"]) == [12, 24] and list(g["tau"]) == [2, 2]
    assert g["peak_rss_mb"].shape == (2, 2) and (g["peak_rss_mb"] > 0).all()
    assert (g["max_rel_diff"] < 1e-5).all()  # the gathered step against P = 1
    assert (g["allsum_s"] > 0).all() and (groups["fedavg"]["allsum_s"] == 0).all()
    parts = g["local_s"] + g["allsum_s"] + g["apply_s"]
    assert (parts <= g["median_s"] * 1.5 + 1e-3).all()
    one, attrs1 = read_sharded_hdf5(sharded_files[1])
    assert attrs1["shards"] == 1 and (one["fedfv"]["allsum_s"] == 0).all()


def test_agg_scaling_takes_p_as_an_axis(sharded_files, tmp_path):
    png = tmp_path / "p.png"
    proc = _run_scaling("--sharded", str(sharded_files[1]), str(sharded_files[2]),
                        "--sharded-out", str(png), "--predict", "1000,100000,4")
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [l.split() for l in proc.stdout.splitlines() if l.startswith("fedfv ")]
    assert [(r[1], r[4]) for r in rows] == [("12", "1"), ("12", "2"), ("24", "1"), ("24", "2")]
    assert rows[0][10] == "1.00x"
    assert any(l.startswith("  fedfv (4 rows): a = ") and "P = 4:" in l
               for l in proc.stdout.splitlines())


def test_agg_scaling_cost_model_recovers_its_coefficients(agg_scaling):
    rows = [dict(algorithm="x", m=m, d=d, P=P, tau=1, gather=0.0, server_mb=0.0,
                 time=2e-10 * m * m * d / P + 3e-9 * m * d / P + (P > 1) * 1e-7 * m * m)
            for m in (50, 100, 400) for d in (10_000, 100_000) for P in (1, 2, 4)]
    model = agg_scaling.fit_cost_model(rows)
    assert model["a"] == pytest.approx(2e-10, rel=1e-6)
    assert model["b"] == pytest.approx(3e-9, rel=1e-6)
    assert model["c"] == pytest.approx(1e-7, rel=1e-6) and model["e"] == pytest.approx(0, abs=1e-15)


def test_sharded_bench_errors_are_one_line(capsys):
    assert main(["bench", "aggregation", "--shards", "2", "--m", "4", "--d", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--shards 2 runs one shard per MPI rank: start it with mpiexec -n 2" in err
    assert "\n" not in err
    assert main(["bench", "aggregation", "--shards", "1", "--algorithms", "ditto", "--m", "4",
                 "--d", "100"]) == 2
    assert "ditto does not run on a sharded server" in capsys.readouterr().err
