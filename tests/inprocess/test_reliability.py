"""Reliability around a run: one writer per run, bounded time to fail on any rank,
no results truncated before the resume point is known, full disks, checksums on read, SIGINT,
stale temporaries and path tricks. Real MPI ranks (mpiexec), real HDF5 files on real
Fashion-MNIST, a real small tmpfs for the full disk (mounted here as root, skipped otherwise).
The finished runs the tests copy, damage or compare with come from the shared MPI world
(tests/world.py). The tests that start mpiexec themselves are in tests/mpi/test_reliability.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.errors import OutputError
from mpifl.core.locking import RunLock, lock_path
from mpifl.store import checkpoint
from mpifl.store.results import MetricSet, ResultsWriter, read_results
from tests.helpers import mpiexec, small_fmnist_job, write_fmnist_job
from tests.world import world_run

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SHARDS = 'partition = "shards"'


def cmd(ranks: int, *args: str) -> list[str]:
    quiet = ["--no-progress"] if args[0] in ("run", "resume") else []
    line = [sys.executable, "-m", "mpifl", *map(str, args), *quiet]
    return [mpiexec(), "-n", str(ranks), *line] if ranks > 1 else line


def mpifl(ranks: int, *args, code: int | None = 0, timeout: float = 300,
          cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd(ranks, *args), capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=cwd)
    if code is not None:
        assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def error_line(stderr: str) -> str:
    """The one ``mpifl: error:`` line of a failed command (no traceback, no second message)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("mpifl: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def model_of(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        return f["model/global"][()]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


JOB = small_fmnist_job("rel", seed=4, rounds=4, eval_every=2, checkpoint_every=2,
                       partition=SHARDS, algorithm="fedfv")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "rel.toml", JOB)


def _world(name: str, *sets: str, for_mpi: bool = False):
    """The job in one process of the shared world, with ``--set`` words ``sets``."""
    return world_run(name, ["run", "{dir}/reliability.toml", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress", *[x for s in sets for x in ("--set", s)]],
                     ranks=1, files={"reliability.toml": JOB}, for_mpi=for_mpi)


#: the finished run (tests/mpi/test_reliability.py declares the same run for its tier)
FINISHED = _world("reliability-finished")
#: a run of another seed, whose checkpoints are put in a finished run's place
OTHER = _world("reliability-other", "run.seed=9", "run.rounds=2")


@pytest.fixture
def finished(world) -> Path:
    """A finished 4-round run (one process) with its checkpoints, copied by the tests (never
    changed: it is the world's)."""
    return world.file(FINISHED)


def copy_run(src: Path, dst_folder: Path, name: str = "run.h5") -> Path:
    import shutil

    dst = dst_folder / name
    shutil.copy2(src, dst)
    shutil.copytree(checkpoint.folder_for(src), checkpoint.folder_for(dst))
    return dst


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (root needed; skipped with the reason otherwise)."""
    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs (root needed): {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- 1. one writer per run ---------------------------------------------------------------------

def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    out = tmp_path / "r.h5"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from mpifl.core.locking import RunLock;"
        f"RunLock(Path({str(out)!r})).acquire(); print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputError, match=f"in use by a live run \\(pid {holder.pid} on "):
        RunLock(out).acquire()
    holder.kill()  # SIGKILL: the lock file stays behind, naming a dead pid
    holder.wait()
    assert lock_path(out).read_text().split()[1] == str(holder.pid)
    with RunLock(out) as lock:
        assert lock.held and lock_path(out).read_text().split()[1] == str(os.getpid())
    assert not lock_path(out).exists()


# -- 3. nothing truncated before the resume point is known -------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("how", ["missing", "a_file"])
def test_resume_without_a_checkpoint_refuses_and_keeps_the_results(finished, job, tmp_path, how):
    run = copy_run(finished, tmp_path)
    folder = checkpoint.folder_for(run)
    import shutil

    shutil.rmtree(folder)
    if how == "a_file":
        folder.write_text("not a folder")
    before = snapshot(tmp_path)
    for args in (("resume", run), ("run", job, "--out", run, "--resume")):
        proc = mpifl(1, *args, code=2)
        line = error_line(proc.stderr)
        assert "no checkpoint" in line or "not a checkpoint folder" in line, line
        assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_checkpoint_of_another_run_is_refused(finished, job, world, tmp_path):
    other = world.file(OTHER)
    run = copy_run(finished, tmp_path)
    import shutil

    shutil.rmtree(checkpoint.folder_for(run))
    shutil.copytree(checkpoint.folder_for(other), checkpoint.folder_for(run))
    before = snapshot(tmp_path)
    proc = mpifl(1, "resume", run, "--rounds", "6", code=2)
    assert "belongs to another run" in error_line(proc.stderr) and "run.seed" in proc.stderr
    proc = mpifl(1, "run", job, "--out", run, "--resume", "--set", "run.seed=9", code=2)
    assert "run.seed" in error_line(proc.stderr)
    assert snapshot(tmp_path) == before


# -- 4. full disks -----------------------------------------------------------------------------

ROW = {"round": 0, "num_clients": 3, "train_loss": 1.5, "lr": 0.1, "conflicts_model": 1,
       "dropped": 0, "rejected": 0, "bytes_moved": 10, "time_broadcast": 0.1, "time_train": 0.2,
       "time_gather": 0.0, "time_aggregate": 0.01, "time_eval": 0.0, "time_checkpoint": 0.02,
       "peak_rss_server_mb": 512.0, "peak_rss_worker_mb": 600.0,
       "conflicts_layer": np.array([1, 0])}
SUMMARY = {"mean": 0.5, "weighted_mean": 0.5, "std": 0.1, "worst5": 0.1, "best5": 0.9,
           "cf": 0.3, "fair_angle": 0.2}


def test_a_failed_results_write_on_a_full_disk_keeps_the_previous_file(tmpfs):
    mnt = tmpfs("1m")
    k = 2000  # wide /eval rows: a few evaluations fill the disk
    out = mnt / "r.h5"
    w = ResultsWriter(out, "{}", MetricSet(k, 2), world_size=1, algorithm="fedavg")
    rng = np.random.default_rng(0)
    written = 0
    with pytest.raises(OutputError, match="cannot write results file .*No space left"):
        for t in range(10_000):
            w.append_eval(t + 1, rng.uniform(size=k), rng.uniform(size=k), SUMMARY)
            w.append_round({**ROW, "round": t})
            written = t + 1
    res = read_results(out)  # verified: exactly the rows of the last complete write
    assert written > 2 and len(res["eval"]["round"]) == written
    assert list(res["eval"]["round"]) == list(range(1, written + 1))
    assert not [p for p in mnt.iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_a_failed_final_write_keeps_the_model_recoverable(job, tmpfs):
    """The final checkpoint fits, the results with the model do not: one line, status 2, and
    after space is freed the run resumes to the same model as a run left alone."""
    mnt = tmpfs("1400k")  # d = 203,530 floats (814 KB): checkpoint + results won't both fit
    out = mnt / "big.h5"
    args = ("run", job, "--out", out, "--set", "model.hidden=[256]", "--set", "run.rounds=2",
            "--set", "run.checkpoint_every=0", "--set", "run.eval_every=1",
            "--set", "server.algorithm=fedavg")  # no aggregator history: a checkpoint ~ d
    proc = mpifl(1, *args, code=2)
    assert "cannot write results file" in error_line(proc.stderr)
    assert read_results(out)["attrs"]["status"] == "running"
    assert checkpoint.load_latest(checkpoint.folder_for(out)).round == 2
    subprocess.run(["mount", "-o", "remount,size=8m", str(mnt)], check=True)
    mpifl(1, "resume", out)
    ref = mnt / "ref.h5"
    mpifl(1, *args[:3], ref, *args[4:])
    np.testing.assert_array_equal(model_of(out), model_of(ref))


# -- 6. checksums and impossible values ----------------------------------------------------------

def test_every_flipped_byte_of_a_results_file_is_reported_in_one_line(finished, tmp_path):
    raw = finished.read_bytes()
    rng = np.random.default_rng(6)
    for i, pos in enumerate(rng.integers(0, len(raw), size=40)):
        bad = bytearray(raw)
        bad[pos] ^= 1 << int(rng.integers(8))
        path = tmp_path / f"flip{i}.h5"
        path.write_bytes(bytes(bad))
        with pytest.raises(OutputError) as err:
            read_results(path)
        assert "\n" not in str(err.value)
    proc = mpifl(1, "report", path, code=2)
    error_line(proc.stderr)


def legacy_copy(src: Path, dst: Path) -> Path:
    """A results file as mpifl wrote them before checksums: no user block, same layout."""
    with h5py.File(src, "r") as a, h5py.File(dst, "w") as b:
        for key, value in a.attrs.items():
            b.attrs[key] = value
        for name in a:
            a.copy(a[name], b, name=name)
    return dst


def test_old_files_are_read_and_impossible_values_refused(finished, tmp_path):
    old = legacy_copy(finished, tmp_path / "old.h5")
    assert read_results(old)["eval"]["client_accuracy"].shape == (2, 10)
    with h5py.File(old, "r+") as f:
        f["eval/client_accuracy"][-1, 3] = -8.869  # what a byte flip printed as -886.9%
    proc = mpifl(1, "report", old, code=2)
    assert "client_accuracy holds an impossible value" in error_line(proc.stderr)
    with h5py.File(old, "r+") as f:
        f["eval/client_accuracy"][-1, 3] = 0.5
        f["eval/worst5"][0] = np.nan
        f["rounds/num_clients"][1] = -4
    with pytest.raises(OutputError, match="num_clients holds an impossible value"):
        read_results(old)


# -- 7. SIGINT, stale temporaries, path tricks ---------------------------------------------------

def interrupt_and_resume(finished: Path, job: Path, tmp_path: Path, ranks: int) -> None:
    """Ctrl-C: to the process, or to mpiexec's process group (hydra forwards it to the ranks)."""
    out = tmp_path / "int.h5"
    proc = subprocess.Popen(cmd(ranks, "run", job, "--out", out, "--set", "run.rounds=400",
                                "--set", "run.checkpoint_every=2"), start_new_session=True,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "round 2/400" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "stop requested (SIGINT)" in err
    mpifl(ranks, "resume", out, "--rounds", "4")  # stored rounds=400 -> the finished run's 4
    if ranks == 1:  # the same world size as `finished`: bit-exact
        np.testing.assert_array_equal(model_of(out), model_of(finished))
    else:  # another world size: equal to floating-point reduction order
        np.testing.assert_allclose(model_of(out), model_of(finished), atol=1e-5)


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow)])  # no mpiexec
def test_sigint_checkpoints_and_exits_3_then_resume_is_exact(finished, job, tmp_path, ranks):
    interrupt_and_resume(finished, job, tmp_path, ranks)


def test_stale_temporaries_of_killed_writers_are_removed(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    folder = checkpoint.folder_for(run)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone
    newest = checkpoint.load_latest(folder).path
    stale = [folder / f".round-000006.h5.tmp-{dead.pid}", tmp_path / f".run.h5.tmp-{dead.pid}"]
    live = folder / f".round-000006.h5.tmp-{os.getpid()}"  # a live writer's: kept
    for p in stale + [live]:
        p.write_bytes(newest.read_bytes()[:5000])  # killed mid-write
    mpifl(1, "resume", run, "--rounds", "6")
    assert not any(p.exists() for p in stale) and live.exists()


@pytest.mark.parametrize("name", ["../escape", "ABS", "a/../../b"])
def test_a_run_name_that_leaves_the_runs_folder_is_refused(job, tmp_path, name):
    work = tmp_path / "work"
    work.mkdir()
    outside = tmp_path / "abs-escape"  # an absolute name, in a folder no earlier run touched
    name = str(outside) if name == "ABS" else name
    proc = mpifl(1, "run", job, "--set", f"run.name={name}", code=2, cwd=work)
    assert "run.name" in error_line(proc.stderr)
    assert snapshot(tmp_path) == {} and not outside.with_suffix(".h5").exists()
