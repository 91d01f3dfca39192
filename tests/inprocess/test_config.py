"""Config loading and validation: every bad config exits 2 with one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpifl.cli import main
from mpifl.experiment.config import load_config, parse_override

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = ROOT / "jobs" / "fmnist-fedfv.toml"


def test_main_job_loads_with_its_values():
    cfg = load_config(MAIN_JOB)
    assert cfg.data.num_clients == 100 and cfg.server.clients_per_round == 10
    assert cfg.model.hidden == [200, 200] and cfg.client.batch_size == 50
    assert cfg.algorithm_params() == {"alpha": 0.1, "tau": 1, "order": "loss",
                                      "external_window": "paper"}


def test_override_switches_algorithm_and_parses_toml_values():
    cfg = load_config(MAIN_JOB, ["server.algorithm=fedavg", "data.classes=[1,3]",
                                 "data.partition=one_class_per_client", "data.num_clients=2",
                                 "server.clients_per_round=2", "client.lr=0.05",
                                 "model.hidden=[64]"])
    assert cfg.server.algorithm == "fedavg"
    assert cfg.algorithm_params() == {"weighting": "samples"}
    assert cfg.data.partition_params == {"classes": [1, 3]}  # the old flat key, nested
    assert cfg.client.lr == 0.05 and cfg.model.hidden == [64]


def test_parse_override_keeps_bare_words_as_strings():
    assert parse_override("server.algorithm=fedfv") == (["server", "algorithm"], "fedfv")
    assert parse_override("fedfv.alpha=0.5") == (["fedfv", "alpha"], 0.5)


def test_every_job_file_is_valid():
    jobs = [j for j in sorted((ROOT / "jobs").glob("*.toml")) if not j.name.startswith("sweep-")]
    assert len(jobs) >= 2
    for job in jobs:  # sweep files are checked by the sweep tests
        load_config(job)


BAD = [
    (["server.algoritm=fedavg"], "unknown key 'server.algoritm' (did you mean 'server.algorithm'?)"),
    (["sever.algorithm=fedavg"], "unknown key 'sever' (did you mean 'server'?)"),
    (["run.rounds=ten"], "run.rounds: input should be a valid integer (got 'ten')"),
    (["run.rounds=2.5"], "run.rounds: input should be a valid integer"),
    (["run.rounds=0"], "run.rounds: input should be greater than or equal to 1"),
    (["fedfv.alpha=1.5"], "fedfv.alpha: input should be less than 1"),
    (["client.lr=-0.1"], "client.lr: input should be greater than 0"),
    (["data.partition=dirichlett"], "data.partition: unknown partition 'dirichlett' (did you mean 'dirichlet'?)"),
    (["model.name=mlpp"], "model.name: unknown model 'mlpp' (did you mean 'mlp'?)"),
    (["data.dataset=fashion-mnist"], "data.dataset: unknown data set 'fashion-mnist' (did you mean 'fashion_mnist'?)"),
    (["server.algorithm=nomod:Rule"], "server.algorithm: 'nomod:Rule': cannot import module 'nomod'"),
    (["plugins.modules=['no_such_plugin_mod']"], "plugins.modules: cannot import 'no_such_plugin_mod': ModuleNotFoundError"),
    (["run.seed=18446744073709551616"], "run.seed: input should be less than or equal to"),
    (["client.lr=inf"], "client.lr: input should be a finite number"),
    (["client.lr=1e308"], "client.lr: input should be less than or equal to 1000"),
    (["client.weight_decay=inf"], "client.weight_decay: input should be a finite number"),
    (["fedfv.tau=100000000"], "fedfv.tau: input should be less than or equal to 10000"),
    (["model.hidden=[10000000]"], "model.hidden.0: input should be less than or equal to"),
    (["client.memory_budget_mb=1e300"], "client.memory_budget_mb: input should be less than or equal to"),
    (["model.hidden=[200, \"a\"]"], "model.hidden.1: input should be a valid integer"),
    (["server.algorithm=fedfw"], "server.algorithm: unknown algorithm 'fedfw' (did you mean 'fedfv'?)"),
    (["server.clients_per_round=101"], "server.clients_per_round: 101 exceeds data.num_clients (100)"),
    (["data.partition=one_class_per_client"], "data.num_clients: one_class_per_client needs"),
    (["data.partition=natural"], "data.partition: 'natural' goes with the data sets that have their own clients ("),
    (["nosection"], "--set 'nosection': expected section.key=value"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_exits_2_with_one_line_naming_the_key(overrides, message, tmp_path, capsys):
    out = tmp_path / "out" / "run.h5"
    argv = ["run", str(MAIN_JOB), "--out", str(out)]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mpifl: error: ") and message in err[0], err[0]
    assert not (tmp_path / "out").exists(), "nothing may be written for a bad config"


def test_bad_toml_file_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nrounds = 3\n")
    assert main(["run", str(bad)]) == 2
    assert "TOML syntax error" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "nope.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_exit_status_and_no_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mpifl", "run", str(MAIN_JOB), "--set", "fedfv.tau=-1",
         "--out", str(tmp_path / "r.h5")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("mpifl: error: fedfv.tau: input should be greater than or "
                                   "equal to 0 (got -1)")
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_bench_cli_prints_ratio_and_json(capsys):
    assert main(["bench", "aggregation", "--m", "4,8", "--d", "500", "--repeats", "1", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    gram = [r for r in out["rows"] if r["form"] == "gram"]
    assert [r["m"] for r in gram] == [4, 8] and all(r["ratio"] > 0 for r in gram)
    assert all(r["max_abs_diff"] < 1e-4 for r in gram)
    assert main(["bench", "aggregation", "--algorithms", "nope", "--m", "4", "--d", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithms must be registered names" in err[0]


def test_algorithm_without_its_client_side_training_is_refused_up_front(tmp_path, capsys,
                                                                       monkeypatch):
    # A rule whose local training needs trainer options that do not exist (yet) is refused in
    # one line before any work, never with a TypeError from deep inside the trainer. Every
    # shipped rule has its client side now, so a made-up rule stands in.
    from mpifl.aggregators import base

    class NeedsMissingTraining(base.Aggregator):
        name = "needs_missing_training"

        @classmethod
        def client_options(cls, p):
            return {"no_such_trainer_option": 1.0}

    monkeypatch.setitem(base.RULES._entries, NeedsMissingTraining.name, NeedsMissingTraining)
    out = tmp_path / "r.h5"
    assert main(["run", str(MAIN_JOB), "--set", "server.algorithm=needs_missing_training",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("'needs_missing_training' needs local training that mpifl's "
                              "trainer does not have yet (no_such_trainer_option)") in err[0]
    assert not out.exists()


def test_config_stored_before_the_layers_still_loads_and_resumes():
    """A config JSON written by mpifl before the layer folders and per-rule Params (commit
    fc06367: the main job) is read back as the same experiment: a results file or checkpoint of
    that version can be reported and resumed."""
    from mpifl.experiment.config import config_diff, config_from_json

    old = config_from_json((ROOT / "tests" / "data" / "config_before_layers.json").read_text())
    assert config_diff(old, load_config(MAIN_JOB)) == []
    assert old.plugins.modules == [] and old.fedmeta.weighting == "samples"  # new keys: defaults


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_file_that_is_not_utf8_is_refused_in_one_line(command, tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    out = tmp_path / "out"
    argv = [command, str(bad), "--out", str(out / ("r.h5" if command == "run" else "sw"))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8 text" in err[0], err
    assert not out.exists()
