"""Behaviour did not change with the build-once redesign (issue 25): runs made by the code from
before it began (commit :data:`BEFORE`, extracted with ``git archive``) and by today's code equal
each other bit for bit on this machine: every rule on a small job, the main job under mpiexec -n 3
(3 rounds), a sharded server (``server.shards = 2``) and a killed-and-resumed run.

"Equal" means every HDF5 dataset of the results files (the rounds table, every evaluation's
per-client arrays, the final model) holds the same bytes, except wall-clock times and memory
figures, which no two runs share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.aggregators import available
from tests.helpers import mpiexec

ROOT = Path(__file__).resolve().parents[1]
#: The last commit before issue 25's redesign began (its first change was the rule's needs).
BEFORE = "99b66da"
MAIN = ROOT / "jobs" / "fmnist-fedfv.toml"
ADULT = ROOT / "jobs" / "mfairfl-adult.toml"
SMALL = ["run.rounds=2", "run.eval_every=1", "data.dataset=synthetic", "data.partition=natural",
         "data.num_clients=12", "server.clients_per_round=4", "model.hidden=[16]"]
EXTRA = {"afl": ["server.sampling=all"]}
#: a figure of the machine, not of the computation
VOLATILE = ("time_", "peak_rss")


def _sets(words: list[str]) -> list[str]:
    return [x for s in words for x in ("--set", s)]


def _rule_jobs() -> list[tuple[str, list[str]]]:
    """(name, argv after ``mpifl``) of every rule's small single-process run."""
    jobs = []
    for name in sorted(available()):
        if name == "mfairfl":  # needs a sensitive attribute: Adult, 5 clients
            words = ["run.rounds=2", "client.epochs=1", "model.hidden=[16]",
                     f"data.data_root={ROOT.parent / 'shared' / 'data'}"]
            jobs.append((name, ["run", str(ADULT), *_sets(words)]))
            continue
        words = [*SMALL, f"server.algorithm={name}", *EXTRA.get(name, [])]
        jobs.append((name, ["run", str(MAIN), *_sets(words)]))
    return jobs


RUNNER = """
import json, sys
from mpifl.cli import main
for name, argv in json.loads(sys.argv[1]):
    status = main([*argv, "--out", f"{sys.argv[2]}/{name}.h5", "--no-progress"])
    if status:
        sys.exit(f"{name}: exit {status}")
"""


def _record(src: Path | None, out: Path) -> None:
    """Run every recorded job with the code in ``src`` (None: today's) into ``out``."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src is not None:  # ahead of the editable install on sys.path
        env["PYTHONPATH"] = str(src)

    def run(cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                              cwd=out)
        assert proc.returncode == 0, f"{cmd}: {proc.stderr[-3000:]}"

    run([sys.executable, "-c", RUNNER, json.dumps(_rule_jobs()), str(out)])
    mpi = [mpiexec(), "-n", "3", sys.executable, "-m", "mpifl"]
    run([*mpi, "run", str(MAIN), "--out", str(out / "main.h5"), "--no-progress",
         *_sets(["run.rounds=3", "run.eval_every=3"])])
    shard_words = ["run.rounds=2", "run.eval_every=2", "data.num_clients=12",
                   "server.clients_per_round=4", "model.hidden=[32]", "server.shards=2"]
    run([*mpi, "run", str(MAIN), "--out", str(out / "sharded.h5"), "--no-progress",
         *_sets(shard_words)])
    # a run stopped after 2 of 4 rounds (its last checkpoint), then resumed to the end
    resumed = ["run.rounds=2", "run.checkpoint_every=1", *SMALL[1:]]
    run([*mpi, "run", str(MAIN), "--out", str(out / "resumed.h5"), "--no-progress",
         *_sets(resumed)])
    run([*mpi, "resume", str(out / "resumed.h5"), "--rounds", "4", "--no-progress"])


def _datasets(path: Path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset) and not any(v in name for v in VOLATILE):
            found[name] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("recorded")
    src = base / "before"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE], capture_output=True)
    assert archive.returncode == 0, (f"git archive {BEFORE}: {archive.stderr.decode()[-500:]} "
                                     "(the test needs the project's git history: a full clone)")
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    _record(src, base / "runs-before")
    _record(None, base / "runs-after")
    return base / "runs-before", base / "runs-after"


def test_the_before_code_is_the_one_that_ran(recorded):
    """The recording really comes from the old tree: a process with its PYTHONPATH imports the
    extracted package, not the editable install."""
    before, _ = recorded
    probe = subprocess.run([sys.executable, "-c", "import mpifl; print(mpifl.__file__)"],
                           capture_output=True, text=True, cwd=before,
                           env={**os.environ, "PYTHONPATH": str(before.parent / "before")})
    assert probe.stdout.strip().startswith(str(before.parent / "before"))


@pytest.mark.parametrize("run", [name for name, _ in _rule_jobs()]
                         + ["main", "sharded", "resumed"])
def test_runs_are_bit_identical_to_the_recording(recorded, run):
    before, after = (_datasets(folder / f"{run}.h5") for folder in recorded)
    assert sorted(before) == sorted(after)
    assert "model/global" in after and any(k.startswith("eval/") for k in after)
    differ = [k for k in after if before[k].dtype != after[k].dtype
              or before[k].shape != after[k].shape
              or before[k].tobytes() != after[k].tobytes()]
    assert not differ, f"{run}: {differ}"
