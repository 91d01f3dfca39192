"""Long cluster runs as their users meet them: checkpoints by default (by wall time),
``mpifl report`` telling an interrupted run from a live one, progress lines in batch logs — all
on real MPI ranks (kills under real ``mpiexec``; runs only read come from the shared MPI world,
tests/world.py), real SIGKILLs and real files. The tests that start mpiexec themselves are in
tests/mpi/test_cluster_comforts.py."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import h5py
import pytest

from mpifl.runtime.progress import ProgressLog
from tests.helpers import FMNIST
from tests.world import world_run

JOB = """
[run]
name = "comfort"
seed = 3
rounds = 30
eval_every = 10
{extra}
[data]
dataset = "fashion_mnist"
partition = "shards"
num_clients = 10
[model]
name = "mlp"
hidden = [16]
[client]
batch_size = 0
[server]
algorithm = "fedavg"
clients_per_round = 4
"""


#: checkpoints and progress lines by wall time alone (progress lines on: no --no-progress)
TIMED = world_run("comfort-timed", ["run", "{dir}/comfort-timed.toml", "--out",
                                    "{dir}/comfort-timed.h5"],
                  files={"comfort-timed.toml": JOB.format(
                      extra="checkpoint_minutes = 0.0001\nprogress_every_s = 0.0001")})


def _job(tmp_path, extra=""):
    if not FMNIST.is_dir():
        pytest.fail(f"{FMNIST} missing: apt-get install dataset-fashion-mnist")
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(extra=extra))
    return path


def _report(*paths) -> str:
    return subprocess.run([sys.executable, "-m", "mpifl", "report", *map(str, paths)],
                          capture_output=True, text=True, check=True).stdout


def test_wall_time_checkpoints_and_progress_lines_on_3_ranks(world):
    out = world.file(TIMED)
    # the lines after a round ("round r/R (p%)"), not those inside a phase ("round r/R, training")
    lines = [x for x in world.output(TIMED).splitlines()
             if re.search(r"progress: round \d+/\d+ \(", x)]
    assert len(lines) >= 25 and "progress: round 30/30 (100%)" in lines[-1]
    assert all("s/round, ETA" in x and "GB/rank" in x for x in lines)
    assert any("mean acc" in x for x in lines[10:])  # the last evaluation's metrics ride along
    with h5py.File(out) as f:
        timed = f["rounds/time_checkpoint"][:-1]
    assert (timed > 0).sum() >= 10  # checkpoints between rounds, by wall time alone


def test_progress_lines_follow_the_interval_and_every_evaluation(caplog):
    now = [0.0]
    p = ProgressLog(total=10, start=2, every_s=5.0, clock=lambda: now[0])
    row = {"peak_rss_server_mb": 512.0, "peak_rss_worker_mb": 1024.0}
    with caplog.at_level(logging.INFO, logger="mpifl.server"):
        now[0] = 1.0
        assert not p.round_done(2, row, None)  # 1 s < 5 s
        now[0] = 2.0
        assert p.round_done(3, row, {"mean": 0.5, "worst5": 0.25})  # an evaluation: always
        now[0] = 6.0
        assert not p.round_done(4, row, None)
        now[0] = 7.5
        assert p.round_done(5, row, None)
    last = caplog.records[-1].getMessage()
    # 4 rounds in 7.5 s since the resume at round 2: 1.875 s a round, 4 left
    assert last == ("progress: round 6/10 (60%), 1.88 s/round, ETA 0:00:08, peak memory "
                    "1.00 GB/rank, mean acc 0.5000, worst5 0.2500")
    assert not ProgressLog(10, 0, 0.0).round_done(0, row, {"mean": 1.0, "worst5": 1.0})


@pytest.mark.slow
def test_report_lines_up_seed_folders_and_files_and_states_what_it_used(tmp_path):
    """Two ``--seeds`` folders and a single results file in one ``mpifl report``: every run
    listed, seeds averaged per setting, no "± 0.00" for a single run, and the number of
    evaluations actually used (2 here, though 3 are asked for)."""
    from tests.inprocess.test_resume import run

    job = _job(tmp_path, "checkpoint_every = 0").read_text()
    job = job.replace("rounds = 30", "rounds = 4").replace("eval_every = 10", "eval_every = 2")
    (tmp_path / "job.toml").write_text(job)
    cfg = str(tmp_path / "job.toml")
    a, b, single = tmp_path / "fedavg", tmp_path / "qffl", tmp_path / "one.h5"
    run(1, "run", cfg, "--seeds", "0-1", "--out", str(a))
    run(1, "run", cfg, "--seeds", "0-1", "--out", str(b), "--set", 'server.algorithm="qfedavg"')
    run(1, "run", cfg, "--out", str(single), "--set", 'server.algorithm="drfl"')
    out = _report(a, b, single, "--last", "3")
    table, _, seeds = out.partition("over seeds")
    assert table.splitlines()[0].split() == ["metric", "fedavg_seed0", "fedavg_seed1",
                                             "qfedavg_seed0", "qfedavg_seed1", "one"]
    assert "(metrics: mean of each run's last 2 evaluations)" in out
    rows = {line[:19].strip(): line[19:].split("  ") for line in seeds.splitlines()[3:]}
    cells = [c.strip() for c in rows["mean acc (%)"] if c.strip()]
    assert len(cells) == 3 and "±" in cells[0] and "±" in cells[1] and "±" not in cells[2]
    with pytest.raises(subprocess.CalledProcessError):
        _report(tmp_path / "empty-folder-does-not-exist")
