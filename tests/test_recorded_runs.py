"""Behaviour did not change with the build-once redesign (one frozen plan, ``Needs``): runs
made by the code from before it began (commit :data:`BEFORE`, extracted with ``git archive``) and by
today's code equal each other bit for bit on this machine: every rule on a small job, the main job
under mpiexec -n 3 (3 rounds), a sharded server (``server.shards = 2``) and a killed-and-resumed
run.

"Equal" means every HDF5 dataset of the results files (the rounds table, every evaluation's
per-client arrays, the final model) holds the same bytes, except wall-clock times and memory
figures, which no two runs share.

Without the project's git history (a shallow clone), today's runs are compared with
:data:`RECORDING`: the SHA-256 of every such dataset of the old code's runs, recorded on the
machine this project is developed and tested on (``python -m tests.test_recorded_runs``
rewrites it from the old code).
"""

from __future__ import annotations

import hashlib
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
#: The last commit before the build-once redesign began (its first change was the rule's needs).
BEFORE = "99b66da"
MAIN = ROOT / "jobs" / "fmnist-fedfv.toml"
ADULT = ROOT / "jobs" / "mfairfl-adult.toml"
SMALL = ["run.rounds=2", "run.eval_every=1", "data.dataset=synthetic", "data.partition=natural",
         "data.num_clients=12", "server.clients_per_round=4", "model.hidden=[16]"]
EXTRA = {"afl": ["server.sampling=all"]}
#: a figure of the machine, not of the computation
#: and the wire's size, not the computation: an evaluation's header and its workers' progress
#: messages (stop at the next window, mpifl/runtime/protocol.py) came after the recording
VOLATILE = ("time_", "peak_rss", "bytes_moved")
#: the old code's runs, as digests (used without git history)
RECORDING = ROOT / "tests" / "data" / f"recorded-{BEFORE}.json"
RUNS = ["main", "sharded", "resumed"]


def _sets(words: list[str]) -> list[str]:
    return [x for s in words for x in ("--set", s)]


def _rule_jobs() -> list[tuple[str, list[str]]]:
    """(name, argv after ``mpifl``) of the small single-process run of every rule the old code
    has (those in :data:`RECORDING`; a rule added since has no old run to equal)."""
    jobs = []
    old = set(json.loads(RECORDING.read_text()))
    for name in sorted(set(available()) & old):
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


def _digests(folder: Path) -> dict[str, dict[str, str]]:
    """{run: {dataset: sha256 of its dtype, shape and bytes}} of every recorded run."""
    return {run: {k: hashlib.sha256(f"{v.dtype.str}{v.shape}".encode() + v.tobytes()).hexdigest()
                  for k, v in sorted(_datasets(folder / f"{run}.h5").items())}
            for run in [name for name, _ in _rule_jobs()] + RUNS}


def _extract(dest: Path) -> bool:
    """The old code's tree at ``dest`` (False: no git history holds it)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE], capture_output=True)
    if archive.returncode != 0:
        return False
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return True


def _datasets(path: Path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset) and not any(v in name for v in VOLATILE):
            found[name] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[dict, Path]:
    """The old code's digests (run now from git history, else :data:`RECORDING`) and the
    folder of today's runs."""
    base = tmp_path_factory.mktemp("recorded")
    if _extract(base / "before"):
        _record(base / "before", base / "runs-before")
        before = _digests(base / "runs-before")
    else:
        before = json.loads(RECORDING.read_text())
    _record(None, base / "runs-after")
    return before, base / "runs-after"


def test_the_old_code_runs_from_its_own_tree(tmp_path):
    """A process with the extracted tree on its PYTHONPATH imports it, not the editable
    install (so the old runs really are the old code's)."""
    if not _extract(tmp_path / "before"):
        pytest.fail(f"no git history holds {BEFORE}: the runs are compared with {RECORDING}")
    probe = subprocess.run([sys.executable, "-c", "import mpifl; print(mpifl.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "before")})
    assert probe.stdout.strip().startswith(str(tmp_path / "before"))


@pytest.mark.mpi
@pytest.mark.parametrize("run", [name for name, _ in _rule_jobs()] + RUNS)
def test_runs_are_bit_identical_to_the_recording(recorded, run):
    before, folder = recorded
    after = _digests(folder)[run]
    assert "model/global" in after and any(k.startswith("eval/") for k in after)
    want = {k: v for k, v in before[run].items() if not any(x in k for x in VOLATILE)}
    assert sorted(want) == sorted(after)
    differ = [k for k in after if want[k] != after[k]]
    assert not differ, f"{run}: {differ}"


if __name__ == "__main__":  # rewrite RECORDING from the old code's runs
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        assert _extract(Path(tmp) / "before"), f"git archive {BEFORE} failed"
        _record(Path(tmp) / "before", Path(tmp) / "runs")
        RECORDING.write_text(json.dumps(_digests(Path(tmp) / "runs"), indent=1, sort_keys=True))
    print(f"wrote {RECORDING}")
