"""Fault injection with a fixed seed and a bounded time: random byte flips of results
files and checkpoints, SIGKILLs at random moments and in the middle of writes, concurrent
starts on the same run. Every case must be either detected with a one-line error or resume to
exactly the model of the run left alone. Counts are printed.

Real processes, real HDF5 files on real Fashion-MNIST; about a dozen process starts in all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.errors import OutputError
from mpifl.store import checkpoint
from mpifl.store.results import read_results
from tests.helpers import kill_tree, small_fmnist_job, write_fmnist_job

pytestmark = pytest.mark.slow  # whole runs in every module fixture: left out of make check

SEED = 19
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
ROUNDS = 8
COUNTS: Counter = Counter()
DURATION: list[float] = []


def cmd(*args) -> list[str]:
    quiet = ["--no-progress"] if args[0] in ("run", "resume") else []
    return [sys.executable, "-m", "mpifl", *map(str, args), *quiet]


def run(*args, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd(*args), capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("mpifl: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def model(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        return f["model/global"][()]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return write_fmnist_job(tmp_path_factory, "fi.toml", small_fmnist_job(
        "fi", seed=11, rounds=ROUNDS, eval_every=2, checkpoint_every=2, partition=
        'partition = "shards"', algorithm="fedfv"))


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ref.h5"
    t0 = time.monotonic()
    run("run", job, "--out", out)
    DURATION.append(time.monotonic() - t0)  # kills at random moments are drawn within it
    return out


def flip(raw: bytes, rng: np.random.Generator) -> bytes:
    bad = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(len(bad)))
        bad[pos] ^= 1 << int(rng.integers(8))
    return bytes(bad)


def test_random_byte_flips_are_detected_or_fall_back(reference, tmp_path):
    rng = np.random.default_rng(SEED)
    raw = reference.read_bytes()
    for i in range(60):
        path = tmp_path / f"r{i}.h5"
        path.write_bytes(flip(raw, rng))
        with pytest.raises(OutputError) as err:
            read_results(path)
        assert "\n" not in str(err.value)
        COUNTS["results flips detected"] += 1
    folder = checkpoint.folder_for(reference)
    newest, previous = checkpoint._listed(folder)[:2]
    want = checkpoint.read(previous)
    ckpt_raw = newest.read_bytes()
    for i in range(60):
        work = tmp_path / f"c{i}"
        work.mkdir()
        shutil.copy2(previous, work / previous.name)
        (work / newest.name).write_bytes(flip(ckpt_raw, rng))
        got = checkpoint.load_latest(work)
        assert got.round == want.round and np.array_equal(got.w, want.w)
        assert got.config_json == want.config_json
        COUNTS["checkpoint flips fell back"] += 1
        shutil.rmtree(work)


def test_damaged_newest_checkpoint_and_results_resume_to_the_same_model(reference, tmp_path):
    rng = np.random.default_rng(SEED + 1)
    out = tmp_path / "run.h5"
    shutil.copy2(reference, out)
    shutil.copytree(checkpoint.folder_for(reference), checkpoint.folder_for(out))
    newest = checkpoint._listed(checkpoint.folder_for(out))[0]
    newest.write_bytes(flip(newest.read_bytes(), rng))
    out.write_bytes(flip(out.read_bytes(), rng))
    proc = run("report", out, code=2)
    one_line(proc.stderr)
    proc = run("resume", out)  # falls back to round 6, rebuilds the results
    assert "skipping damaged checkpoint" in proc.stderr
    assert np.array_equal(model(out), model(reference))
    COUNTS["damaged run resumed exactly"] += 1


def _kill_when(proc: subprocess.Popen, predicate, limit: float) -> bool:
    """SIGKILL ``proc`` as soon as ``predicate()`` holds (polled every millisecond), or after
    ``limit`` seconds; False if it ended first."""
    deadline = time.monotonic() + limit
    while proc.poll() is None:
        if predicate() or time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.wait()
            return True
        time.sleep(0.001)
    return False


def test_kills_at_random_points_and_during_writes_then_resume_is_exact(job, reference, tmp_path):
    rng = np.random.default_rng(SEED + 2)
    out = tmp_path / "k.h5"
    folder = checkpoint.folder_for(out)

    def tmp_in(where: Path, prefix: str):
        return lambda: where.is_dir() and any(p.name.startswith(prefix) and ".tmp-" in p.name
                                              for p in where.iterdir())

    # mid checkpoint write, mid results write, then twice at a random moment of the next start
    targets = [("during a checkpoint write", tmp_in(folder, ".round-"), 120),
               ("during a results write", tmp_in(tmp_path, ".k.h5"), 120),
               ("at a random moment", lambda: False, float(rng.uniform(0.3, 0.9)) * DURATION[0]),
               ("at a random moment", lambda: False, float(rng.uniform(0.3, 0.9)) * DURATION[0])]
    first = True
    for what, predicate, limit in targets:
        args = ("run", job, "--out", out) + (() if first else ("--resume",))
        proc = subprocess.Popen(cmd(*args), env=ENV, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = False
        if _kill_when(proc, predicate, limit):
            COUNTS[f"killed {what}"] += 1
            left = [p for p in list(tmp_path.iterdir()) + (list(folder.iterdir())
                    if folder.is_dir() else []) if ".tmp-" in p.name]
            COUNTS["temporaries left by kills"] += len(left)
        else:
            err = proc.stderr.read()
            assert proc.returncode == 0, err[-3000:]
            COUNTS["finished before the kill"] += 1
        if out.exists():  # whatever the kill hit, the results file is whole and verified
            read_results(out)
    run("run", job, "--out", out, "--resume")
    assert np.array_equal(model(out), model(reference))
    assert not [p for p in list(tmp_path.iterdir()) + list(folder.iterdir()) if ".tmp-" in p.name]
    COUNTS["killed runs resumed exactly"] += 1


def test_concurrent_starts_leave_one_writer(job, reference, tmp_path):
    out = tmp_path / "c.h5"
    procs = [subprocess.Popen(cmd("run", job, "--out", out, "--resume"), env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    codes = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        codes.append(proc.returncode)
        if proc.returncode == 2:
            assert "in use by a live run" in one_line(err)
            COUNTS["concurrent starts refused"] += 1
        else:
            assert proc.returncode == 0, err[-3000:]
            COUNTS["concurrent starts that ran"] += 1
    assert codes.count(0) >= 1
    assert np.array_equal(model(out), model(reference))
    assert not out.with_name(out.name + ".lock").exists()


def test_counts(capsys):
    """Print what was injected (last in this module) and check that every case was seen."""
    line = f"fault injection (seed {SEED}): " + ", ".join(f"{k} {v}" for k, v in
                                                          sorted(COUNTS.items()))
    with capsys.disabled():
        print("\n" + line)
    assert COUNTS["results flips detected"] == 60 and COUNTS["checkpoint flips fell back"] == 60
    assert COUNTS["killed during a checkpoint write"] + COUNTS["killed during a results write"] == 2
    assert COUNTS["killed runs resumed exactly"] == 1 and COUNTS["damaged run resumed exactly"] == 1
    assert COUNTS["concurrent starts that ran"] >= 1
