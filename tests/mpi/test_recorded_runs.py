"""The recorded runs on real ranks: today's runs (the rule jobs in one process, then main,
sharded and resumed on 3 ranks, all in the real-rank tier's shared MPI world, tests/world.py)
bit for bit against the old code's digests on this kind of machine, and the replay of the old
code from git (``replay``), which makes the recording again under ``mpiexec -n 3``. Recording
this machine's set (what tests/inprocess/test_recorded_runs.py describes) is this module run as
a script::

    python -m tests.mpi.test_recorded_runs
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

from tests.helpers import mpiexec
from tests.inprocess.test_recorded_runs import (BEFORE, HOW, MAIN, RECORDING, RUNS, SMALL,
                                                _extract, _rule_jobs, _sets)
from tests.world import world_run

#: a figure of the machine, not of the computation
#: and the wire's size, not the computation: an evaluation's header and its workers' progress
#: messages (stop at the next window, mpifl/runtime/protocol.py) came after the recording
VOLATILE = ("time_", "peak_rss", "bytes_moved")


def machine() -> str:
    """The kind of machine a recording holds for: CPU vendor, torch's CPU capability (the
    vector kernels it picks), torch's version."""
    import torch

    vendor = next((line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), "unknown")
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()} torch {torch.__version__}"


def _recording(kind: str | None = None) -> dict[str, dict[str, str]] | None:
    """{run: {dataset: digest}} of :data:`RECORDING` for the machine ``kind`` (default: this
    one), or None when the file holds none for it."""
    return json.loads(RECORDING.read_text())["machines"].get(kind or machine())


RUNNER = """
import json, sys
from mpifl.cli import main
for name, argv in json.loads(sys.argv[1]):
    status = main([*argv, "--out", f"{sys.argv[2]}/{name}.h5", "--no-progress"])
    if status:
        sys.exit(f"{name}: exit {status}")
"""


MAIN_SETS = ["run.rounds=3", "run.eval_every=3"]


SHARD_SETS = ["run.rounds=2", "run.eval_every=2", "data.num_clients=12",
              "server.clients_per_round=4", "model.hidden=[32]", "server.shards=2"]


# a run stopped after 2 of 4 rounds (its last checkpoint), then resumed to the end
RESUMED_SETS = ["run.rounds=2", "run.checkpoint_every=1", *SMALL[1:]]


def _world_runs() -> dict[str, list]:
    """Today's runs, in the shared world: {recorded run: its world runs (a resume last)}."""
    runs = {name: [world_run(f"rec-{name}", [*argv, "--out", f"{{dir}}/rec-{name}.h5",
                                             "--no-progress"], ranks=1, for_mpi=True)]
            for name, argv in _rule_jobs()}
    runs["main"] = [world_run("rec-main", ["run", str(MAIN), "--out", "{dir}/rec-main.h5",
                                           "--no-progress", *_sets(MAIN_SETS)],
                               for_mpi=True)]
    runs["sharded"] = [world_run("rec-sharded", ["run", str(MAIN), "--out",
                                                 "{dir}/rec-sharded.h5", "--no-progress",
                                                 *_sets(SHARD_SETS)], for_mpi=True)]
    runs["resumed"] = [world_run("rec-resumed", ["run", str(MAIN), "--out",
                                                 "{dir}/rec-resumed.h5", "--no-progress",
                                                 *_sets(RESUMED_SETS)], for_mpi=True),
                       world_run("rec-resumed-end", ["resume", "{dir}/rec-resumed.h5",
                                                     "--rounds", "4", "--no-progress"],
                                 for_mpi=True)]
    return runs


WORLD = _world_runs()


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


def _digest(path: Path) -> dict[str, str]:
    """{dataset: sha256 of its dtype, shape and bytes} of one results file."""
    return {k: hashlib.sha256(f"{v.dtype.str}{v.shape}".encode() + v.tobytes()).hexdigest()
            for k, v in sorted(_datasets(path).items())}


def _digests(folder: Path) -> dict[str, dict[str, str]]:
    """{run: digests} of every recorded run made by :func:`_record` into ``folder``."""
    return {run: _digest(folder / f"{run}.h5") for run in [name for name, _ in _rule_jobs()] + RUNS}


def _datasets(path: Path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset) and not any(v in name for v in VOLATILE):
            found[name] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def _compare(before: dict[str, str], after: dict[str, str], run: str) -> None:
    assert "model/global" in after and any(k.startswith("eval/") for k in after)
    want = {k: v for k, v in before.items() if not any(x in k for x in VOLATILE)}
    assert sorted(want) == sorted(after)
    differ = [k for k in after if want[k] != after[k]]
    assert not differ, f"{run}: {differ}"


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


@pytest.mark.mpi  # replays the old code under mpiexec on a machine the recording lacks
@pytest.mark.parametrize("run", sorted(WORLD))
def test_runs_are_bit_identical_to_the_recording(world, before, run):
    """Today's run (the shared world) against the old code's digests on this machine."""
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
@pytest.mark.parametrize("run", sorted(WORLD))
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
