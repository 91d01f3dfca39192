"""``mpifl.run`` (mpifl/api.py): the command line's run from Python, with its validation as
exceptions of one line, returning what ``mpifl.load`` returns; the same numbers as
``python -m mpifl run``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

import mpifl
from mpifl.core.errors import ConfigError, OutputError
from tests.helpers import small_fmnist_job, write_fmnist_job

ROOT = Path(__file__).resolve().parents[2]
JOB = small_fmnist_job("api", seed=1, rounds=4, eval_every=2, checkpoint_every=0,
                       partition='partition = "shards"', algorithm="fedavg")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return write_fmnist_job(tmp_path_factory, "api.toml", JOB)


@pytest.fixture(scope="module")
def cli_run(job):
    """The same job through the command line, in its own process."""
    out = job.parent / "cli.h5"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mpifl", "run", str(job), "--out", str(out),
                           "--set", "server.algorithm=fedfv", "--set", "run.threads=1",
                           "--no-progress"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return mpifl.load(out)


def _same(a, b) -> None:
    for name in ("accuracy", "loss", "mean", "worst5", "train_loss"):
        assert np.array_equal(a[name].values, b[name].values, equal_nan=True), name


def test_run_from_a_file_equals_the_command_line(job, cli_run):
    ds = mpifl.run(job, out=job.parent / "api.h5", progress=False,
                   overrides={"server.algorithm": "fedfv", "run.threads": 1})
    assert ds.sizes["run"] == 1 and ds.sizes["round"] == 4 and ds.sizes["client"] == 10
    assert str(ds.algorithm.values[0]) == "fedfv"
    _same(ds, cli_run)


def test_run_from_a_mapping_equals_the_file(job, cli_run, tmp_path):
    tables = tomllib.loads(JOB)
    tables["server"]["algorithm"] = "fedfv"
    ds = mpifl.run(tables, out=tmp_path / "map.h5", overrides=["run.threads=1"],
                   progress=False)
    _same(ds, cli_run)


def test_a_mistake_is_one_line_and_writes_nothing(job, tmp_path):
    out = tmp_path / "bad.h5"
    with pytest.raises(ConfigError) as err:
        mpifl.run(job, out=out, overrides={"server.algoritm": "fedfv"}, progress=False)
    assert "did you mean 'server.algorithm'" in str(err.value)
    assert "\n" not in str(err.value) and not out.exists()
    with pytest.raises(ConfigError, match="client.lr"):
        mpifl.run(job, out=out, overrides={"client.lr": -1.0}, progress=False)
    with pytest.raises(ConfigError, match="mode="):
        mpifl.run(job, out=out, mode="append", progress=False)
    assert not out.exists()


def test_an_existing_run_is_neither_replaced_nor_touched(job, tmp_path):
    out = tmp_path / "kept.h5"
    mpifl.run(job, out=out, overrides={"run.rounds": 2}, progress=False)
    before = out.read_bytes()
    with pytest.raises(OutputError, match="already exists"):
        mpifl.run(job, out=out, overrides={"run.rounds": 2}, progress=False)
    assert out.read_bytes() == before
    ds = mpifl.run(job, out=out, overrides={"run.rounds": 3}, mode="resume", progress=False)
    assert ds.sizes["round"] == 3  # resumed and extended, as `mpifl resume --rounds` does


def test_the_callers_signal_handlers_come_back(job, tmp_path):
    def mine(signum, frame):  # a notebook's own handler
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, mine)
    interrupt = signal.getsignal(signal.SIGINT)  # Python's, or an earlier in-process run's
    try:
        mpifl.run(job, out=tmp_path / "sig.h5", overrides={"run.rounds": 1}, progress=False)
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_callers_thread_counts_come_back(job, tmp_path):
    """The run sets its own thread count (run.threads); the notebook's comes back after it."""
    from threadpoolctl import threadpool_info

    before = torch.get_num_threads()
    def blas():  # the BLAS libraries loaded (a run may load more: compare those loaded before)
        return {lib["filepath"]: lib["num_threads"] for lib in threadpool_info()
                if lib["user_api"] == "blas"}

    before_blas = blas()
    theirs = 1 if before != 1 else 2
    torch.set_num_threads(theirs)
    try:
        mpifl.run(job, out=tmp_path / "threads.h5", progress=False,
                  overrides={"run.rounds": 1, "run.threads": 3 - theirs})
        assert torch.get_num_threads() == theirs
        after = blas()
        assert {path: after[path] for path in before_blas} == before_blas
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_readmes_example_runs(tmp_path):
    """The "From Python" block of docs/guides/running.md, as a newcomer would paste it (20 rounds
    of the main job)."""
    readme = (ROOT / "docs" / "guides" / "running.md").read_text()
    block = readme.split("## From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    mean, worst = map(float, re.fullmatch(r"mean (\S+), worst 5% (\S+)\n", proc.stdout).groups())
    assert 0.5 < mean <= 1 and 0 <= worst < mean  # 20 rounds of FedAvg learn Fashion-MNIST
    assert (tmp_path / "runs" / "notebook.h5").is_file()
