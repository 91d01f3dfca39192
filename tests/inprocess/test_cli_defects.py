"""The command line a newcomer meets: every subcommand in --help, ``| head`` ends quietly,
``mpifl report`` without matplotlib, ``mpifl run --seeds`` and default output names that do
not collide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from mpifl.cli import build_parser, main
from mpifl.core.errors import ConfigError
from mpifl.experiment.naming import default_out
from tests.helpers import small_fmnist_job, write_fmnist_job

ROOT = Path(__file__).resolve().parents[2]


def mpifl_proc(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpifl", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, **kw)


def test_help_lists_every_subcommand():
    out = mpifl_proc("--help").stdout
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"    {name} " in out, name
    assert {"run", "resume", "sweep", "report", "export", "plot", "bench", "data"} <= set(sub.choices)


def test_a_closed_pipe_ends_quietly():
    # the reader is gone before mpifl writes a byte: its first write or flush meets EPIPE
    proc = subprocess.Popen([sys.executable, "-m", "mpifl", "sweep", "jobs/sweep-fedlf-baselines.toml",
                             "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err  # what a shell reports for SIGPIPE
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.slow
def test_sweep_report_without_matplotlib(tmp_path):
    # a finished sweep folder: the tiny one of mpifl run --seeds, then report with matplotlib gone
    job = tmp_path / "job.toml"
    job.write_text(small_fmnist_job("nomp", seed=0, rounds=2, eval_every=1, checkpoint_every=0,
                                    partition='partition = "shards"', algorithm="fedavg"))
    assert main(["run", str(job), "--seeds", "1", "--out", str(tmp_path / "s")]) == 0
    code = ("import sys; sys.modules['matplotlib'] = None; from mpifl.cli import main; "
            f"sys.exit(main(['report', {str(tmp_path / 's')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ("curves not drawn: matplotlib is not installed "
                                   "(pip install 'mpifl[plot]')")
    assert "| fedavg |" in proc.stdout and (tmp_path / "s" / "report.md").exists()
    code = code.replace("'report'", "'plot', 'curves'").replace("]))", ", '--out', 'x.png']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "mpifl: error: mpifl plot needs matplotlib: pip install 'mpifl[plot]'"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "tiny.toml", small_fmnist_job(
        "tiny", seed=0, rounds=3, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedfv"))


@pytest.mark.slow
def test_seeds_runs_one_sweep_run_per_seed(job, tmp_path, capsys):
    out = tmp_path / "seeds"
    sets = ["--set", "server.algorithm=fedavg", "--set", "client.lr=0.05"]
    assert main(["run", str(job), "--seeds", "0-1,4", *sets, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())["runs"]
    assert sorted(index) == ["fedavg_seed0", "fedavg_seed1", "fedavg_seed4"]
    for rid, run in index.items():
        with h5py.File(out / run["results"]) as f:
            cfg = json.loads(f.attrs["config"])
            assert f.attrs["status"] == "complete"
            assert cfg["run"]["seed"] == int(rid[-1]) and cfg["client"]["lr"] == 0.05
            assert cfg["server"]["algorithm"] == "fedavg"
    assert "| fedavg | - | 3/3 | 3 |" in printed and f"mpifl report {out}" in printed
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.h5")}
    assert main(["run", str(job), "--seeds", "0-1,4", *sets, "--out", str(out)]) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.h5")}  # none re-run


def test_seeds_refuses_overwrite_and_mpi(job, capsys, monkeypatch):
    assert main(["run", str(job), "--seeds", "0-1", "--overwrite"]) == 2
    monkeypatch.setenv("PMI_SIZE", "3")
    assert main(["run", str(job), "--seeds", "0-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "drop --overwrite/--resume" in err[0] and "without mpiexec/srun" in err[1]


def test_default_output_names_do_not_collide():
    a = default_out("fmnist-fedfv", ["server.algorithm=fedavg"])
    b = default_out("fmnist-fedfv", ["server.algorithm=fedfv"])
    c = default_out("fmnist-fedfv", ["server.algorithm=fedfv", "run.seed=1"])
    assert len({a, b, c, default_out("fmnist-fedfv")}) == 4
    assert c == Path("runs/fmnist-fedfv_fedfv_seed1.h5")  # the sweep's run-id rule
    assert default_out("x", ["run.name=x"]) == Path("runs/x.h5")
    with pytest.raises(ConfigError, match="not a plain file name"):
        default_out("../x")


def test_default_output_used_by_run(job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for algo in ("fedavg", "fedfv"):
        assert main(["run", str(job), "--set", f"server.algorithm={algo}", "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.h5")) == [
        "tiny_fedavg.h5", "tiny_fedfv.h5"]


@pytest.mark.parametrize("target", ["-1", "0", "200", "nan", "inf"])
def test_report_target_outside_a_percentage_is_one_line(target, tmp_path, capsys):
    """``--target`` is a mean accuracy in percent: outside (0, 100] it is refused in one line,
    before any file is read (the file need not exist)."""
    assert main(["report", str(tmp_path / "r.h5"), "--target", target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mpifl: error: --target {float(target)}"), err
