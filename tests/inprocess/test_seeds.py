"""``mpifl run JOB --seeds``: a number of seeds means seeds 0..N-1 (as Flower's and FLGo's
``num_seeds``), ranges and lists name seeds, and a ``--seeds`` folder's report, printed table and
``mpifl.load`` summarise exactly the seeds its ``seeds.toml`` lists, with a note on the others."""

from __future__ import annotations

import csv
import json
import tomllib
import warnings

import pytest

import mpifl
from mpifl.cli import build_parser, main
from mpifl.core.errors import ConfigError
from mpifl.store.results import read_results
from mpifl.sweep.seeds import parse_seeds

JOB = """
[run]
name = "tiny"
rounds = 2
eval_every = 1
checkpoint_every = 0
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 8
[model]
name = "logreg"
[client]
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 4
"""


@pytest.mark.parametrize("text,seeds", [
    ("3", [0, 1, 2]), ("1", [0]), (" 2 ", [0, 1]),          # a number of seeds
    ("0-2", [0, 1, 2]), ("3,5", [3, 5]), ("0-1,7", [0, 1, 7]),  # the seeds named
    ("5,", [5]), ("3-3", [3]), ("0, 2,", [0, 2])])             # one seed: with its comma
def test_a_number_is_a_count_and_a_list_names_seeds(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["0", "", ",", "5,,", ",5", "4-0", "1,1", "a", "-1", "1.5"])
def test_bad_seeds_are_one_line_errors(text, tmp_path, capsys):
    with pytest.raises(ConfigError):
        parse_seeds(text)
    (tmp_path / "job.toml").write_text(JOB)
    assert main(["run", str(tmp_path / "job.toml"), "--seeds", text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpifl: error: --seeds")


def test_help_says_what_a_number_means():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    text = " ".join(run.format_help().split())
    assert "N runs N seeds 0..N-1 (3: seeds 0, 1, 2)" in text and "5, with its comma" in text


@pytest.mark.slow
def test_a_folder_reports_the_seeds_asked_for_now(tmp_path, capsys):
    (tmp_path / "job.toml").write_text(JOB)
    job, out = str(tmp_path / "job.toml"), tmp_path / "seeds"
    assert main(["run", job, "--seeds", "3,", "--out", str(out)]) == 0  # seed 3 alone
    capsys.readouterr()
    assert main(["run", job, "--seeds", "1", "--out", str(out)]) == 0  # seed 0: one seed
    printed = capsys.readouterr().out
    spec = tomllib.loads((out / "seeds.toml").read_text())
    assert spec["grid"]["run.seed"] == [0]
    assert sorted(p.stem for p in (out / "runs").glob("*.h5")) == [
        "fedavg_seed0", "fedavg_seed3"]
    note = (f"note: 1 other run in this folder (seed 3) is not in seeds.toml's seeds [0]; "
            f"mpifl report {out}/runs/*.h5 shows all")
    # the oracle: seed 0's mean accuracy over its last 2 evaluations, read from its file
    finals = [100 * read_results(out / "runs" / f"fedavg_seed{s}.h5")["eval"]["mean"][-2:].mean()
              for s in (0, 3)]
    assert finals[0] != finals[1]  # so that a figure with seed 3 in it would show
    want = f"| fedavg | - | 1/1 | 2 | {finals[0]:.2f} |"
    assert want in printed and note in printed  # the table --seeds prints
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert want in printed and note in printed and note in (out / "report.md").read_text()
    (row,) = csv.DictReader((out / "report.csv").open())
    assert row["seeds"] == "1" and float(row["mean"]) == pytest.approx(finals[0])
    assert main(["report", str(out), "--json"]) == 0
    got = capsys.readouterr()
    (group,) = json.loads(got.out)
    assert group["seeds"] == 1 and group["mean"] == pytest.approx(finals[0] / 100)
    assert got.err.strip() == note
    with pytest.warns(UserWarning, match="seed 3"):
        ds = mpifl.load(out)
    assert list(ds["run"].values) == ["fedavg_seed0"]
    assert ds.attrs["note"] == note and list(ds["seed"].values) == [0]
    # every run, seed 3 too, from the files; and from the folder with a file beside it
    assert main(["report", *map(str, sorted((out / "runs").glob("*.h5")))]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == [
        "metric", "fedavg_seed0", "fedavg_seed3"]
    seed3 = out / "runs" / "fedavg_seed3.h5"
    assert main(["report", str(out), str(seed3), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in listed["runs"]] == ["fedavg_seed0", "fedavg_seed3"]
    assert listed["notes"] == [note]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a list of files: no note
        assert mpifl.load([seed3]).sizes["run"] == 1
