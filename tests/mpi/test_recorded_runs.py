"""The recorded runs on real ranks: on a kind of machine that RECORDING lacks, today's runs
(the rule jobs in one process, then main, sharded and resumed on 3 ranks, in the real-rank
tier's shared MPI world, tests/world.py) bit for bit against the old code replayed from git
under ``mpiexec -n 3`` (on a recorded machine tests/inprocess/test_recorded_runs.py compares
them with the recording instead, and these tests skip); and the replay itself (``replay``),
which makes the recording again. Recording
this machine's set (what tests/inprocess/test_recorded_runs.py describes) is this module run as
a script::

    python -m tests.mpi.test_recorded_runs
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import mpiexec
from tests.inprocess.test_recorded_runs import (BEFORE, HOW, MAIN, MAIN_SETS, NAMES, RECORDED,
                                                RECORDING, RESUMED_SETS, RUNS, SHARD_SETS,
                                                _compare, _digest, _extract,
                                                _recording, _rule_jobs, _sets, _world_runs,
                                                machine)

RUNNER = """
import json, sys
from mpifl.cli import main
for name, argv in json.loads(sys.argv[1]):
    status = main([*argv, "--out", f"{sys.argv[2]}/{name}.h5", "--no-progress"])
    if status:
        sys.exit(f"{name}: exit {status}")
"""


#: today's runs, here only where RECORDING lacks this kind of machine (else compared in-process)
WORLD = {} if RECORDED else _world_runs(for_mpi=True)


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
         *_sets(MAIN_SETS)])
    run([*mpi, "run", str(MAIN), "--out", str(out / "sharded.h5"), "--no-progress",
         *_sets(SHARD_SETS)])
    run([*mpi, "run", str(MAIN), "--out", str(out / "resumed.h5"), "--no-progress",
         *_sets(RESUMED_SETS)])
    run([*mpi, "resume", str(out / "resumed.h5"), "--rounds", "4", "--no-progress"])


def _digests(folder: Path) -> dict[str, dict[str, str]]:
    """{run: digests} of every recorded run made by :func:`_record` into ``folder``."""
    return {run: _digest(folder / f"{run}.h5") for run in [name for name, _ in _rule_jobs()] + RUNS}


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The old code's digests on this kind of machine: recorded, else replayed from git."""
    if (recorded := _recording()) is not None:
        return recorded
    base = tmp_path_factory.mktemp("recorded")
    if not _extract(base / "before"):
        pytest.fail(f"{RECORDING} holds no runs for {machine()!r} and no git history holds "
                    f"{BEFORE} to replay: record them with python -m tests.mpi.test_recorded_runs "
                    "on a full clone", pytrace=False)
    _record(base / "before", base / "runs-before")
    return _digests(base / "runs-before")


@pytest.mark.parametrize("run", NAMES)
def test_runs_are_bit_identical_to_the_replayed_old_code(world, before, run):
    """Where RECORDING lacks this kind of machine: today's run (the shared world) against the
    old code replayed from git (on a recorded machine, tests/inprocess/test_recorded_runs.py
    compares with the recording instead)."""
    if RECORDED:
        pytest.skip("this machine's recording is compared by tests/inprocess/test_recorded_runs.py")
    path = world.file(WORLD[run][-1], f"rec-{run}.h5")
    _compare(before[run], _digest(path), run)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The old code's digests, from its runs made now (from git history)."""
    base = tmp_path_factory.mktemp("recorded")
    if not _extract(base / "before"):
        pytest.fail(f"no git history holds {BEFORE}: the replay needs it")
    _record(base / "before", base / "runs-before")
    return _digests(base / "runs-before")


@pytest.mark.replay
@pytest.mark.mpi
@pytest.mark.parametrize("run", NAMES)
def test_the_old_code_still_makes_the_recording(replayed, run):
    recorded = _recording()
    if recorded is None:
        pytest.fail(f"{RECORDING} holds no runs for {machine()!r}", pytrace=False)
    _compare(recorded[run], replayed[run], run)


if __name__ == "__main__":  # rewrite RECORDING from the old code's runs
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        assert _extract(Path(tmp) / "before"), f"git archive {BEFORE} failed"
        _record(Path(tmp) / "before", Path(tmp) / "runs")
        recording = json.loads(RECORDING.read_text())
        recording["_recorded"] = HOW
        recording.setdefault("machines", {})[machine()] = _digests(Path(tmp) / "runs")
        RECORDING.write_text(json.dumps(recording, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORDING} for {machine()}")
