"""``mpifl sweep`` with the local executor (real MPI runs under mpiexec) and ``mpifl report DIR``.

Grid expansion (both sweep files of jobs/), bad sweep files (exit 2, one line), the index, skipping
complete runs, resuming an unfinished one, and the seed-grouped table, CSV, Markdown and PNGs.
The SLURM side (submitit to a real one-node cluster, requeue) is tests/slurm/test_slurm.py.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.core.errors import ConfigError
from mpifl.sweep.job import MpiRun
from mpifl.sweep.launch import LAUNCHERS, LocalLauncher, SlurmLauncher, choose
from mpifl.sweep.plan import check, grid_points, results_path, select
from mpifl.sweep.spec import load_sweep
from tests.helpers import mpiexec

pytestmark = pytest.mark.slow  # whole runs in every module fixture: left out of make check

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

BASE = """
[run]
name = "tiny"
rounds = 6
eval_every = 2
checkpoint_every = 2
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

SWEEP = """
[sweep]
name = "tiny"
base = "base.toml"
ranks = 2
[set]
"run.eval_every" = 2
[grid]
"run.seed" = [0, 1]
[algorithms.fedavg]
[algorithms.fedfv]
"fedfv.alpha" = [0.2]
[local]
parallelism = 1
mpiexec = "{mpiexec}"
"""


def write_sweep(folder: Path, text: str = SWEEP, base: str = BASE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.toml").write_text(base)
    path = folder / "sweep.toml"
    path.write_text(text.replace("{mpiexec}", mpiexec()))
    return path


def mpifl(*args: str, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mpifl", *args], capture_output=True, text=True,
                          env=ENV, timeout=600, cwd=ROOT)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


# ----------------------------------------------------------------------------------------------
# Expansion


def test_smoke_sweep_expands_to_four_two_rank_runs():
    sweep = load_sweep(ROOT / "jobs" / "sweep-smoke.toml")
    points = grid_points(sweep)
    assert sweep.ranks == 2
    assert [p.id for p in points] == ["fedavg_seed0", "fedavg_seed1",
                                      "fedfv_alpha0.1_tau1_seed0", "fedfv_alpha0.1_tau1_seed1"]
    assert points[2].params == {"server.algorithm": "fedfv", "fedfv.alpha": 0.1, "fedfv.tau": 1,
                                "run.seed": 0}
    assert "model.hidden=[32]" in points[0].overrides
    for p in points:
        config, reason = check(sweep, p)
        assert reason is None, reason
        assert config["data"]["num_clients"] == 20 and config["run"]["seed"] == p.params["run.seed"]


def test_table2_sweep_expands_and_every_point_is_valid():
    sweep = load_sweep(ROOT / "jobs" / "sweep-fedfv-table2.toml")
    points = grid_points(sweep)
    per_algo: dict[str, int] = {}
    for p in points:
        per_algo[p.params["server.algorithm"]] = per_algo.get(p.params["server.algorithm"], 0) + 1
    assert per_algo == {"fedavg": 5, "qfedavg": 25, "fedfa": 20, "fedmgda_plus": 25, "fedfv": 60}
    assert len({p.id for p in points}) == 135
    fedfv = [p for p in points if p.params["server.algorithm"] == "fedfv"]
    assert {(p.params["fedfv.alpha"], p.params["fedfv.tau"]) for p in fedfv} == {
        (a, t) for a in (0.1, 0.2, 0.5) for t in (0, 1, 3, 10)}
    for p in points:
        config, reason = check(sweep, p)
        assert reason is None, (p.id, reason)
        assert config["run"]["rounds"] == 2000 and config["data"]["dataset"] == "cifar10"
    out = mpifl("sweep", "jobs/sweep-fedfv-table2.toml", "--dry-run").stdout
    assert "135 runs" in out


@pytest.mark.parametrize("name", ["sweep-fedfv-table1.toml", "sweep-fedlf-baselines.toml"])
def test_baseline_grids_expand_to_valid_runs(name):
    sweep = load_sweep(ROOT / "jobs" / name)
    points = grid_points(sweep)
    assert len({p.id for p in points}) == len(points) > 50
    for p in points:
        assert check(sweep, p)[1] is None, p.id


def test_only_selects_points(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path))
    chosen = select(grid_points(sweep), ["server.algorithm=fedfv", "run.seed=1"])
    assert [p.id for p in chosen] == ["fedfv_alpha0.2_seed1"]
    with pytest.raises(ConfigError, match="does not vary"):
        select(grid_points(sweep), ["client.lr=0.1"])


# ----------------------------------------------------------------------------------------------
# Bad sweep files: exit status 2 and one line, before anything runs

BAD = {
    "syntax": ("[sweep\nbase = 'base.toml'", "TOML syntax error"),
    "no base": ("[sweep]\nranks = 2", "needs base"),
    "missing base": ("[sweep]\nbase = 'nope.toml'", "no such experiment file"),
    "unknown table": ("[sweep]\nbase = 'base.toml'\n[grids]\n'run.seed' = [0]", "did you mean 'grid'"),
    "unknown key": ("[sweep]\nbase = 'base.toml'\nrank = 2", "did you mean 'sweep.ranks'"),
    "not a list": ("[sweep]\nbase = 'base.toml'\n[grid]\n'run.seed' = 3", "non-empty list"),
    "empty list": ("[sweep]\nbase = 'base.toml'\n[grid]\n'run.seed' = []", "non-empty list"),
    "bad key": ("[sweep]\nbase = 'base.toml'\n[grid]\nseed = [0, 1]", "section.key"),
    "bad ranks": ("[sweep]\nbase = 'base.toml'\nranks = 0", "sweep.ranks"),
    "nodes": ("[sweep]\nbase = 'base.toml'\nranks = 3\n[slurm]\nnodes = 2", "must divide"),
    "algorithm twice": ("[sweep]\nbase = 'base.toml'\n[grid]\n'server.algorithm' = ['fedfv']\n"
                        "[algorithms.fedavg]", "server.algorithm is set by"),
    "bad value": ("[sweep]\nbase = 'base.toml'\n[algorithms.fedfv]\n'fedfv.alpha' = [0.1, 2.0]",
                  "fedfv.alpha"),
    "unknown config key": ("[sweep]\nbase = 'base.toml'\n[grid]\n'client.lrr' = [0.1]",
                           "did you mean 'client.lr'"),
    "no algorithm": ("[sweep]\nbase = 'base.toml'\n[algorithms.fedbn]", "'fedbn' is not implemented"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sweep_file_is_one_line_and_exit_2(tmp_path, capsys, case):
    text, message = BAD[case]
    path = write_sweep(tmp_path, text)
    code = main(["sweep", str(path), "--executor", "local", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("mpifl: error: ") and "\n" not in err, err
    assert message in err, err
    assert not (tmp_path / "out" / "runs").exists()  # nothing ran


def test_bad_sweep_file_exit_status_from_the_shell(tmp_path):
    proc = mpifl("sweep", str(tmp_path / "missing.toml"), "--executor", "local", code=2)
    assert proc.stderr.strip().count("\n") == 0 and "sweep file not found" in proc.stderr


# ----------------------------------------------------------------------------------------------
# A real local sweep: index, skip, resume, report


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """The tiny sweep run with the local executor (2 MPI ranks per run); fedavg_seed0 was run
    for 3 of its 6 rounds beforehand, so the sweep must resume it."""
    folder = tmp_path_factory.mktemp("sweep")
    path = write_sweep(folder)
    out = folder / "out"
    point = grid_points(load_sweep(path))[0]
    assert point.id == "fedavg_seed0"
    sets = [x for o in point.overrides for x in ("--set", o)]
    mpifl("run", str(folder / "base.toml"), "--out", str(out / "runs" / "fedavg_seed0.h5"),
          *sets, "--set", "run.rounds=3", "--no-progress")
    first = mpifl("sweep", str(path), "--executor", "local", "--out", str(out))
    return path, out, first


def test_local_sweep_writes_index_and_complete_runs(local_sweep):
    _, out, first = local_sweep
    index = json.loads((out / "index.json").read_text())
    assert set(index["runs"]) == {"fedavg_seed0", "fedavg_seed1", "fedfv_alpha0.2_seed0",
                                  "fedfv_alpha0.2_seed1"}
    for rid, run in index["runs"].items():
        assert run["status"] == "complete", (rid, run)
        assert run["results"] == f"runs/{rid}.h5"
        assert run["config"]["run"]["seed"] == run["params"]["run.seed"]
        assert f"run.seed={run['params']['run.seed']}" in run["overrides"]
        with h5py.File(out / run["results"]) as f:
            assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 2
            assert f.attrs["algorithm"] == run["params"]["server.algorithm"]
            assert {2, 4, 6} <= set(f["eval/round"][:]) and f["eval/round"][-1] == 6
    assert "fedfv_alpha0.2_seed1  complete" in first.stdout


def test_unfinished_run_was_resumed_from_its_checkpoint(local_sweep):
    _, out, _ = local_sweep
    run = json.loads((out / "index.json").read_text())["runs"]["fedavg_seed0"]
    log = (out / run["log"].replace("_log.out", "_log.err")).read_text()
    assert "resuming after round 3" in log, log[-2000:]
    with h5py.File(out / "runs" / "fedavg_seed0.h5") as f:
        assert list(f["rounds/round"][:]) == list(range(6))


def test_rerun_skips_finished_runs(local_sweep):
    path, out, _ = local_sweep
    logs = sorted((out / "logs").iterdir())
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.h5")}
    again = mpifl("sweep", str(path), "--executor", "local", "--out", str(out))
    assert "starting 0" in again.stderr
    assert sorted((out / "logs").iterdir()) == logs  # no job started
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    subset = mpifl("sweep", str(path), "--executor", "local", "--out", str(out), "--only", "run.seed=1")
    assert "2 runs (2 complete); starting 0" in subset.stderr
    assert len(json.loads((out / "index.json").read_text())["runs"]) == 4  # the others are kept


def test_changed_config_of_a_started_run_is_refused(local_sweep, tmp_path, capsys):
    path, out, _ = local_sweep
    changed = tmp_path / "sweep.toml"
    changed.write_text(path.read_text().replace('base = "base.toml"', f'base = "{path.parent}/base.toml"')
                       .replace('"run.eval_every" = 2', '"run.eval_every" = 2\n"client.lr" = 0.01'))
    assert main(["sweep", str(changed), "--executor", "local", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "config changed since it was started (client.lr: 0.05 -> 0.01)" in err, err


def test_report_on_sweep_folder(local_sweep, capsys):
    _, out, _ = local_sweep
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fedfv | alpha=0.2 | 2/2 | 6 |" in printed
    assert (out / "report.md").read_text().strip() in printed
    rows = {r["algorithm"]: r for r in csv.DictReader((out / "report.csv").open())}
    assert set(rows) == {"fedavg", "fedfv"}
    for algo, prefix in (("fedavg", "fedavg_seed"), ("fedfv", "fedfv_alpha0.2_seed")):
        finals = []
        for seed in (0, 1):
            with h5py.File(out / "runs" / f"{prefix}{seed}.h5") as f:
                finals.append([100 * f[f"eval/{m}"][-3:].mean()  # --last 3 (the default)
                               for m in ("mean", "std", "worst5", "best5")])
        finals = np.array(finals)
        got = rows[algo]
        for i, metric in enumerate(("mean", "std", "worst5", "best5")):
            assert float(got[metric]) == pytest.approx(finals[:, i].mean(), abs=1e-9)
            assert float(got[metric + "_sd"]) == pytest.approx(finals[:, i].std(ddof=1), abs=1e-9)
        assert got["seeds"] == "2"
    for name in ("curves.png", "curves-fedavg.png", "curves-fedfv.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_one_file_still_works(local_sweep, capsys):
    _, out, _ = local_sweep
    assert main(["report", str(out / "runs" / "fedavg_seed1.h5")]) == 0
    assert "fedavg_seed1" in capsys.readouterr().out


def test_report_on_a_folder_that_is_not_a_sweep(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2  # neither a sweep index nor results files
    assert "a folder without results files (*.h5) or sweep runs" in capsys.readouterr().err


def test_print_args_lists_unfinished_runs_for_the_array_template(local_sweep, tmp_path):
    path, out, _ = local_sweep
    assert mpifl("sweep", str(path), "--out", str(out), "--print-args").stdout == ""
    lines = mpifl("sweep", str(path), "--out", str(tmp_path / "new"), "--print-args",
                  "--only", "run.seed=1").stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{path.parent / 'base.toml'} --out {tmp_path / 'new'}/runs/fedavg_seed1.h5")


def test_a_failed_launch_is_tried_again_but_not_bad_input(tmp_path):
    marker = tmp_path / "launched"
    flaky = ["sh", "-c", f"[ -e {marker} ] && exit 0; touch {marker}; exit 15"]
    run = MpiRun("flaky", flaky, "runs/x.h5", {}, slurm=False, retry_wait_s=0.0)
    assert run()["status"] == "complete" and marker.exists()
    bad = MpiRun("bad", ["sh", "-c", f"echo x >> {tmp_path / 'n'}; exit 2"], "r.h5", {}, False,
                 retry_wait_s=0.0)
    with pytest.raises(RuntimeError, match="exited with status 2"):
        bad()
    assert (tmp_path / "n").read_text() == "x\n"  # once: exit 2 is bad input, never retried
    always = MpiRun("always", ["sh", "-c", f"echo x >> {tmp_path / 'm'}; exit 1"], "r.h5", {},
                    False, retry_wait_s=0.0)
    with pytest.raises(RuntimeError, match="exited with status 1"):
        always()
    assert (tmp_path / "m").read_text() == "x\n" * 3


# ----------------------------------------------------------------------------------------------
# A damaged index and names that lead out of the sweep folder: one line, exit 2, nothing written

@pytest.mark.parametrize("text", ["[]", '{"runs": []}', '{"runs": {"a": 3}}', '{"sweep": "x"}',
                                  '{"runs": {"a": {"params": {}}}}'])
def test_malformed_index_is_one_line_and_exit_2(tmp_path, capsys, text):
    path = write_sweep(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "index.json").write_text(text)
    for argv in (["sweep", str(path), "--out", str(out), "--dry-run"],
                 ["sweep", str(path), "--out", str(out), "--executor", "local"],
                 ["report", str(out)]):
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, argv
        assert err.startswith("mpifl: error: ") and "\n" not in err, err
        assert "not a sweep index" in err, err
    assert (out / "index.json").read_text() == text and not (out / "runs").exists()


@pytest.mark.parametrize("name", ["../../../escaped", "ABSOLUTE", "a/b", ".."])
def test_sweep_name_that_leaves_the_sweeps_folder_is_refused(tmp_path, monkeypatch, capsys, name):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    name = str(tmp_path / "escaped") if name == "ABSOLUTE" else name
    # an algorithm this mpifl lacks: without the check the sweep made its folder, then stopped
    text = f'[sweep]\nname = "{name}"\nbase = "base.toml"\n[algorithms.fedbn]\n'
    path = write_sweep(tmp_path / "files", text)
    code = main(["sweep", str(path), "--executor", "local"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("mpifl: error: ") and "\n" not in err, err
    assert "sweep.name" in err and "not a plain folder name" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files", "work"]
    assert list(work.iterdir()) == []


def test_run_ids_stay_inside_the_runs_folder(tmp_path):
    text = ('[sweep]\nbase = "base.toml"\n[grid]\n"run.name" = ["../../x", "/abs/y"]\n'
            '"client.lr" = [0.1]\n')
    for p in grid_points(load_sweep(write_sweep(tmp_path, text))):
        out = (tmp_path / "out" / results_path(p.id)).resolve()
        assert out.parent == (tmp_path / "out" / "runs").resolve(), p.id


def test_auto_takes_the_launcher_that_fits_this_machine_best():
    best = choose("auto")
    assert best.fit()[0] == max(c.fit()[0] for c in LAUNCHERS.values()) > 0
    from mpifl.sweep.launch.slurm import controller

    assert (best is SlurmLauncher) == (shutil.which("sbatch") is not None and controller()[0])
    assert choose("local") is LocalLauncher and LocalLauncher.blocks and not SlurmLauncher.blocks


def test_a_job_pickled_under_the_old_module_path_still_loads():
    """Submitit jobs queued by mpifl before the sweep/ folder pickled MpiRun as
    ``mpifl.sweep.MpiRun``: such a pickle must still load into today's class."""
    import pickle

    run = MpiRun("old", ["true"], "runs/x.h5", {}, slurm=False)
    data = pickle.dumps(run, protocol=0)  # text opcodes: the class is "c<module>\n<name>\n"
    old = data.replace(b"cmpifl.sweep.job\nMpiRun\n", b"cmpifl.sweep\nMpiRun\n")
    assert old != data and b"mpifl.sweep.job" not in old
    back = pickle.loads(old)
    assert type(back) is MpiRun and vars(back) == vars(run)


def test_load_sweep_folder_one_dataset_with_swept_coordinates(local_sweep, tmp_path):
    import mpifl

    _, out, _ = local_sweep
    ds = mpifl.load(out)
    index = json.loads((out / "index.json").read_text())["runs"]
    assert sorted(ds["run"].values) == sorted(index)
    for rid, run in index.items():
        one = ds.sel(run=rid)
        assert one["algorithm"].item() == run["params"]["server.algorithm"]
        assert one["seed"].item() == run["params"]["run.seed"]
        with h5py.File(out / run["results"]) as f:  # the file, read directly
            # aligned on rounds: fedavg_seed0 also has the evaluation at its first end (round 3)
            at = one.sel(eval_round=f["eval/round"][()])
            np.testing.assert_array_equal(at["accuracy"].values, f["eval/client_accuracy"][()])
            np.testing.assert_array_equal(one["selected"].values, f["rounds/selected"][()])
    assert set(ds["fedfv.alpha"].values[ds["algorithm"].values == "fedfv"]) == {0.2}
    assert main(["plot", "curves", str(out), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_with_more_shards_than_ranks_is_refused_at_planning(tmp_path):
    text = SWEEP.replace('[grid]\n', '[grid]\n"server.shards" = [1, 2, 3]\n')
    sweep = load_sweep(write_sweep(tmp_path, text))
    reasons = {p.params["server.shards"]: check(sweep, p)[1] for p in grid_points(sweep)
               if p.params["server.algorithm"] == "fedavg" and p.params["run.seed"] == 0}
    assert reasons[1] is None and reasons[2] is None
    assert reasons[3] == ("server.shards = 3 needs at least 3 ranks per run; the sweep gives 2 "
                          "(sweep.ranks)")
