"""Behaviour did not change with the build-once redesign (one frozen plan, ``Needs``): runs
made by the code from before it began (commit :data:`BEFORE`) and by today's code equal each
other bit for bit on this machine: every rule on a small job (one process each), the main job on
3 ranks (3 rounds), a sharded server (``server.shards = 2``) and a stopped-and-resumed run.

"Equal" means every HDF5 dataset of the results files (the rounds table, every evaluation's
per-client arrays, the final model) holds the same bytes, except wall-clock times and memory
figures, which no two runs share.

The old code's runs are recorded as digests, :data:`RECORDING`: the SHA-256 of every such
dataset, with the commit and the command that made them under ``"_recorded"``, one set per
kind of machine (:func:`machine`: the CPU's vendor and vector extensions and torch's version,
since float kernels, and so the last bits, differ between them). Today's runs (in the shared
MPI world, tests/world.py) are compared with this machine's set in every ``make test``; on a
kind of machine the file does not know, the old code is replayed from git instead (as slow as
before, and as exact). Recording this machine's set is one command, which extracts
:data:`BEFORE` with ``git archive`` and runs it::

    python -m tests.mpi.test_recorded_runs

and the replay itself (the old code run from git, compared with the recording) is the tests
marked ``replay``: ``python -m pytest -m replay tests/inprocess/test_recorded_runs.py
tests/mpi/test_recorded_runs.py`` (needs the git history and mpiexec; left out of
``make test``). Where the file holds this kind of machine, today's runs are compared here,
from the in-process tier's world; elsewhere tests/mpi/test_recorded_runs.py compares them with
the old code replayed under mpiexec.
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
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]
#: The last commit before the build-once redesign began (its first change was the rule's needs).
BEFORE = "99b66da"
MAIN = ROOT / "jobs" / "fmnist-fedfv.toml"
ADULT = ROOT / "jobs" / "mfairfl-adult.toml"
SMALL = ["run.rounds=2", "run.eval_every=1", "data.dataset=synthetic", "data.partition=natural",
         "data.num_clients=12", "server.clients_per_round=4", "model.hidden=[16]"]
EXTRA = {"afl": ["server.sampling=all"]}
#: the old code's runs, as digests (used without git history)
RECORDING = ROOT / "tests" / "data" / f"recorded-{BEFORE}.json"
RUNS = ["main", "sharded", "resumed"]
#: how RECORDING was made (its "_recorded" entry)
HOW = {"commit": BEFORE, "command": "python -m tests.mpi.test_recorded_runs",
       "runs": "the rule jobs in one process, then main, sharded and resumed under mpiexec -n 3"}


def _sets(words: list[str]) -> list[str]:
    return [x for s in words for x in ("--set", s)]


def _rule_jobs() -> list[tuple[str, list[str]]]:
    """(name, argv after ``mpifl``) of the small single-process run of every rule the old code
    has (those in :data:`RECORDING`; a rule added since has no old run to equal)."""
    jobs = []
    old = {"afl", "ditto", "drfl", "fedavg", "fedfa", "fedfv", "fedlf", "fedmdfg", "fedmeta",
           "fedmgda_plus", "fedprox", "mfairfl", "qfedavg", "uga"}  # the rules of BEFORE
    for name in sorted(set(available()) & old):
        if name == "mfairfl":  # needs a sensitive attribute: Adult, 5 clients
            words = ["run.rounds=2", "client.epochs=1", "model.hidden=[16]",
                     f"data.data_root={ROOT.parent / 'shared' / 'data'}"]
            jobs.append((name, ["run", str(ADULT), *_sets(words)]))
            continue
        words = [*SMALL, f"server.algorithm={name}", *EXTRA.get(name, [])]
        jobs.append((name, ["run", str(MAIN), *_sets(words)]))
    return jobs


def _extract(dest: Path) -> bool:
    """The old code's tree at ``dest`` (False: no git history holds it)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE], capture_output=True)
    if archive.returncode != 0:
        return False
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return True


def test_the_recording_says_how_it_was_made():
    recording = json.loads(RECORDING.read_text())
    assert recording["_recorded"] == HOW
    for kind, runs in recording["machines"].items():
        assert set(runs) == {name for name, _ in _rule_jobs()} | set(RUNS), kind


@pytest.mark.replay
def test_the_old_code_runs_from_its_own_tree(tmp_path):
    """A process with the extracted tree on its PYTHONPATH imports it, not the editable
    install (so the old runs really are the old code's)."""
    if not _extract(tmp_path / "before"):
        pytest.fail(f"no git history holds {BEFORE}: the replay needs it")
    probe = subprocess.run([sys.executable, "-c", "import mpifl; print(mpifl.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "before")})
    assert probe.stdout.strip().startswith(str(tmp_path / "before"))


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


MAIN_SETS = ["run.rounds=3", "run.eval_every=3"]


SHARD_SETS = ["run.rounds=2", "run.eval_every=2", "data.num_clients=12",
              "server.clients_per_round=4", "model.hidden=[32]", "server.shards=2"]


# a run stopped after 2 of 4 rounds (its last checkpoint), then resumed to the end
RESUMED_SETS = ["run.rounds=2", "run.checkpoint_every=1", *SMALL[1:]]


def _world_runs(for_mpi: bool) -> dict[str, list]:
    """Today's runs, in the shared world: {recorded run: its world runs (a resume last)}."""
    runs = {name: [world_run(f"rec-{name}", [*argv, "--out", f"{{dir}}/rec-{name}.h5",
                                             "--no-progress"], ranks=1, for_mpi=for_mpi)]
            for name, argv in _rule_jobs()}
    runs["main"] = [world_run("rec-main", ["run", str(MAIN), "--out", "{dir}/rec-main.h5",
                                           "--no-progress", *_sets(MAIN_SETS)],
                               for_mpi=for_mpi)]
    runs["sharded"] = [world_run("rec-sharded", ["run", str(MAIN), "--out",
                                                 "{dir}/rec-sharded.h5", "--no-progress",
                                                 *_sets(SHARD_SETS)], for_mpi=for_mpi)]
    runs["resumed"] = [world_run("rec-resumed", ["run", str(MAIN), "--out",
                                                 "{dir}/rec-resumed.h5", "--no-progress",
                                                 *_sets(RESUMED_SETS)], for_mpi=for_mpi),
                       world_run("rec-resumed-end", ["resume", "{dir}/rec-resumed.h5",
                                                     "--rounds", "4", "--no-progress"],
                                 for_mpi=for_mpi)]
    return runs


def _digest(path: Path) -> dict[str, str]:
    """{dataset: sha256 of its dtype, shape and bytes} of one results file."""
    return {k: hashlib.sha256(f"{v.dtype.str}{v.shape}".encode() + v.tobytes()).hexdigest()
            for k, v in sorted(_datasets(path).items())}


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


#: every recorded run's name
NAMES = sorted([name for name, _ in _rule_jobs()] + RUNS)
#: whether RECORDING holds this kind of machine: then today's runs are compared here, from the
#: in-process tier's world; else tests/mpi/test_recorded_runs.py replays the old code
RECORDED = _recording() is not None
WORLD = _world_runs(for_mpi=False) if RECORDED else {}


@pytest.mark.parametrize("run", NAMES)
def test_runs_are_bit_identical_to_this_machines_recording(world, run):
    """Today's run (the shared world) against the old code's digests recorded on this kind of
    machine (on another kind the replay in tests/mpi/test_recorded_runs.py compares instead)."""
    if not RECORDED:
        pytest.skip(f"{RECORDING} holds no runs for {machine()!r}: "
                    "tests/mpi/test_recorded_runs.py replays the old code instead")
    path = world.file(WORLD[run][-1], f"rec-{run}.h5")
    _compare(_recording()[run], _digest(path), run)
