"""Long cluster runs as their users meet them: checkpoints by default (by wall time),
``mpifl report`` telling an interrupted run from a live one, progress lines in batch logs — all
on real MPI ranks (kills under real ``mpiexec``; runs only read come from the shared MPI world,
tests/world.py), real SIGKILLs and real files."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from mpifl.runtime.progress import ProgressLog
from tests.helpers import FMNIST, kill_tree
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


#: the uninterrupted run of the default-settings kill test
DEFAULTS = world_run("comfort-defaults", ["run", "{dir}/comfort.toml", "--out",
                                          "{dir}/comfort-defaults.h5", "--no-progress"],
                     files={"comfort.toml": JOB.format(extra="")}, for_mpi=True)
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


def _kill_when(cmd, ready, tmp_path) -> None:
    """Start ``cmd`` (an mpiexec job), SIGKILL it once ``ready()`` holds."""
    from tests.test_resume import ENV

    proc = subprocess.Popen(cmd, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, "the job ended before the kill point"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)
        proc.wait()


def _rounds_written(path) -> int:
    try:
        with h5py.File(path, "r") as f:
            return len(f["rounds/round"])
    except (OSError, KeyError):
        return 0


@pytest.mark.mpi
@pytest.mark.slow
def test_a_run_with_default_settings_is_resumable_after_sigkill(tmp_path, world):
    from mpifl.store.checkpoint import folder_for
    from tests.test_resume import command, contents, run

    job = _job(tmp_path)  # no checkpoint_every: the defaults alone
    want = world.file(DEFAULTS)
    out = tmp_path / "killed.h5"
    _kill_when(command(3, "run", str(job), "--out", str(out)),
               lambda: any(folder_for(out).glob("round-*.h5")) and _rounds_written(out) >= 3,
               tmp_path)
    status = _report(out)
    # the default checkpoints by rounds (2% of 30: every round, held to 4% of the time)
    assert "interrupted at round" in status and re.search(r"resumable from round \d+", status)
    run(3, "run", str(job), "--out", str(out), "--resume")
    got, ref = contents(out), contents(want)
    for key in (k for k in ref if k.startswith(("model/", "eval/"))):
        assert np.array_equal(got[key], ref[key], equal_nan=True), key
    assert "complete" in _report(out)


@pytest.mark.mpi
@pytest.mark.slow
def test_checkpoint_every_0_turns_periodic_checkpoints_off_and_report_says_not_resumable(
        tmp_path):
    from mpifl.store.checkpoint import folder_for
    from tests.test_resume import command

    job = _job(tmp_path, "checkpoint_every = 0")
    out = tmp_path / "off.h5"
    _kill_when(command(3, "run", str(job), "--out", str(out)),
               lambda: _rounds_written(out) >= 3, tmp_path)
    assert not any(folder_for(out).glob("round-*.h5"))
    assert "interrupted at round" in _report(out) and "(not resumable)" in _report(out)


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
    from tests.test_resume import run

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


@pytest.mark.mpi
@pytest.mark.slow
def test_recorded_peak_memory_is_the_ranks_os_peak_after_the_last_evaluation(tmp_path):
    """/rounds/peak_rss_*_mb of the last round (with its evaluation of every client) match
    the maximum RSS the OS reports for each rank's process (GNU time's %M), within the few MiB
    a rank allocates after its last evaluation (writing the results, exiting)."""
    from tests.helpers import mpiexec
    from tests.test_resume import ENV

    job = _job(tmp_path, "checkpoint_every = 0")
    out = tmp_path / "mem.h5"
    cmd = [mpiexec(), "-n", "3", "/usr/bin/time", "-f", "maxrss %M", sys.executable, "-m",
           "mpifl", "run", str(job), "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    os_peaks = sorted(int(x.split()[1]) / 1024 for x in proc.stderr.splitlines()
                      if x.startswith("maxrss "))  # MiB, one line per rank
    assert len(os_peaks) == 3
    with h5py.File(out) as f:
        server = f["rounds/peak_rss_server_mb"][()]
        worker = f["rounds/peak_rss_worker_mb"][()]
    assert (np.diff(server) >= 0).all() and (np.diff(worker) >= 0).all()  # peaks only grow
    recorded = max(server[-1], worker[-1])
    assert os_peaks[-1] - 32 <= recorded <= os_peaks[-1] + 1, (recorded, os_peaks)
