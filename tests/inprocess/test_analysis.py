"""Results a researcher analyses in their own tools: the schema-1 file and checkpoint written
before schema 2 (tests/data/schema1, made by mpifl at commit b375632), ``mpifl.load`` (xarray),
the long-form tables, ``mpifl export``, ``mpifl report`` over seeds and ``mpifl plot``."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

import mpifl
from mpifl.cli import main
from mpifl.report.load import tables
from mpifl.store.results import read_results
from tests.helpers import small_fmnist_job, write_fmnist_job

OLD = Path(__file__).resolve().parents[1] / "data" / "schema1"


def test_schema1_file_is_read_in_todays_units():
    res = read_results(OLD / "run.h5")
    with h5py.File(OLD / "run.h5") as f:
        assert f.attrs["schema_version"] == 1
        np.testing.assert_allclose(res["eval"]["std"], f["eval/std"][()] / 100)  # pp -> fraction
        acc = f["eval/client_accuracy"][()]
    np.testing.assert_allclose(res["eval"]["std"], acc.std(axis=1))  # the definition
    assert res["clients"] == {} and "selected" not in res["rounds"]
    ds = mpifl.load(OLD / "run.h5")
    assert dict(ds.sizes) == {"run": 1, "round": 4, "layer": 2, "eval_round": 2, "client": 10}
    np.testing.assert_array_equal(ds["accuracy"].values[0], acc)


def test_schema1_checkpoint_resumes_into_a_schema2_file(tmp_path):
    shutil.copytree(OLD, tmp_path / "old")
    run = tmp_path / "old" / "run.h5"
    assert main(["resume", str(run), "--rounds", "6", "--no-progress"]) == 0
    with h5py.File(run) as f:
        assert f.attrs["schema_version"] == 2 and f.attrs["status"] == "complete"
        selected = f["rounds/selected"][()]
    assert selected.shape == (6, 4) and (selected[:2] == -1).all()  # not recorded before
    assert ((selected[2:] >= 0) & (selected[2:] < 10)).all()
    old = read_results(OLD / "run.h5")["eval"]
    new = read_results(run)["eval"]
    np.testing.assert_allclose(new["std"][:1], old["std"][:1])  # the round-2 evaluation, carried


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Tiny one-process runs: FedAvg seeds 0 and 1 (4 rounds) and FedFV seed 0 (6 rounds)."""
    job = write_fmnist_job(tmp_path_factory, "tiny.toml", small_fmnist_job(
        "tiny", seed=0, rounds=4, eval_every=2, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg"))
    out = {}
    for name, sets in {"fedavg-s0": [], "fedavg-s1": ["run.seed=1"],
                       "fedfv-s0": ["server.algorithm=fedfv", "run.rounds=6"]}.items():
        out[name] = job.parent / f"{name}.h5"
        args = [x for s in sets for x in ("--set", s)]
        assert main(["run", str(job), "--out", str(out[name]), "--no-progress", *args]) == 0
    return out


def test_load_aligns_runs_and_equals_the_files(runs):
    ds = mpifl.load(list(runs.values()))
    assert list(ds["run"].values) == list(runs)
    assert list(ds["algorithm"].values) == ["fedavg", "fedavg", "fedfv"]
    assert list(ds["seed"].values) == [0, 1, 0] and list(ds["run.rounds"].values) == [4, 4, 6]
    assert list(ds["eval_round"].values) == [2, 4, 6] and ds.sizes["round"] == 6
    for name, path in runs.items():
        res = read_results(path)
        one = ds.sel(run=name)
        n = len(res["eval"]["round"])
        np.testing.assert_array_equal(one["accuracy"].values[:n], res["eval"]["client_accuracy"])
        np.testing.assert_array_equal(one["mean"].values[:n], res["eval"]["mean"])
        assert np.isnan(one["mean"].values[n:]).all()  # padding of the shorter runs
        np.testing.assert_array_equal(one["label_counts"].values, res["clients"]["label_counts"])
        r = len(res["rounds"]["round"])
        np.testing.assert_array_equal(one["selected"].values[:r], res["rounds"]["selected"])
        assert (one["selected"].values[r:] == -1).all()


def test_sweep_folder_with_a_key_swept_for_some_runs_only(runs, tmp_path):
    """A grid like jobs/sweep-uga-map.toml sweeps fedfv.alpha for FedFV only: every run gets the
    coordinate, from its params where swept and from its config elsewhere."""
    import json
    index = {"runs": {}}
    for name, path in runs.items():
        shutil.copy(path, tmp_path / path.name)
        params = {"server.algorithm": name.split("-")[0]}
        if name.startswith("fedfv"):
            params["fedfv.alpha"] = 0.25
        index["runs"][name] = {"results": path.name, "params": params}
    (tmp_path / "index.json").write_text(json.dumps(index))
    ds = mpifl.load(tmp_path)
    default = read_results(runs["fedavg-s0"])["config"]["fedfv"]["alpha"]
    assert list(ds["fedfv.alpha"].values) == [default, default, 0.25]


def test_long_tables_one_row_per_observation(runs):
    t = tables(mpifl.load(list(runs.values())))
    assert len(t["rounds"]) == 4 + 4 + 6 and len(t["evals"]) == 2 + 2 + 3
    assert len(t["clients"]) == (2 + 2 + 3) * 10
    row = t["clients"].query("run == 'fedfv-s0' and eval_round == 6 and client == 3").iloc[0]
    assert row["accuracy"] == read_results(runs["fedfv-s0"])["eval"]["client_accuracy"][-1, 3]
    assert {"algorithm", "seed", "run.rounds"} <= set(t["evals"].columns)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_round_trip(runs, tmp_path, fmt):
    assert main(["export", *map(str, runs.values()), f"--{fmt}", str(tmp_path / "x")]) == 0
    read = pd.read_csv if fmt == "csv" else pd.read_parquet
    want = tables(mpifl.load(list(runs.values())))
    for name, frame in want.items():
        got = read(tmp_path / "x" / f"{name}.{fmt}")
        pd.testing.assert_frame_equal(got, frame, check_dtype=False)


def test_report_averages_last_evaluations_and_seeds(runs, capsys):
    a, b = runs["fedavg-s0"], runs["fedavg-s1"]
    assert main(["report", str(a), str(b), "--last", "2", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    last2 = [read_results(p)["eval"]["worst5"][-2:].mean() for p in (a, b)]  # fractions
    assert [r["worst5"] for r in out["runs"]] == pytest.approx(last2)
    (g,) = out["over_seeds"]
    assert g["seeds"] == 2 and g["worst5"] == pytest.approx(np.mean(last2))
    assert g["worst5_sd"] == pytest.approx(np.std(last2, ddof=1))
    assert main(["report", str(a), str(b), str(runs["fedfv-s0"])]) == 0
    text = capsys.readouterr().out
    assert "over seeds (mean ± sample std)" in text and "fedavg-s*" in text and " ± " in text


def test_report_and_export_errors_are_one_line(runs, tmp_path, capsys):
    assert main(["report", str(runs["fedavg-s0"]), "--last", "0"]) == 2
    assert main(["export", str(tmp_path / "nope.h5"), "--csv", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("mpifl: error: ") for line in err)
    assert not (tmp_path / "x").exists()  # nothing written before the input was read


@pytest.mark.parametrize("kind", ["curves", "clients"])
def test_plot_writes_a_png(runs, tmp_path, kind):
    out = tmp_path / f"{kind}.png"
    assert main(["plot", kind, *map(str, runs.values()), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_group_runs_that_differ_only_in_seed(runs):
    from mpifl.report.plots import _groups

    ds = mpifl.load(list(runs.values()))
    assert _groups(ds) == {"fedavg rounds=4": [0, 1], "fedfv rounds=6": [2]}
