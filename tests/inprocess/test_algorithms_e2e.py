"""Every registered algorithm that applies to Fashion-MNIST runs end to end on 3 ranks of the
shared MPI world (tests/world.py;
mFairFL needs a sensitive attribute: tests/inprocess/test_mfairfl_client.py runs it on Adult)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.aggregators import available
from mpifl.experiment.config import load_config
from mpifl.core.errors import ConfigError
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "jobs" / "fmnist-fedfv.toml"
SMALL = ["run.rounds=2", "run.eval_every=2", "data.num_clients=12", "server.clients_per_round=4",
         "model.hidden=[32]"]
EXTRA = {"afl": ["server.sampling=all"]}


def runnable() -> list[str]:
    """Registered rules that a run on Fashion-MNIST accepts."""
    names = []
    for name in available():
        try:
            load_config(MAIN, [*SMALL, f"server.algorithm={name}", *EXTRA.get(name, [])])
            names.append(name)
        except ConfigError:
            pass
    return names


def test_the_main_rules_are_runnable():
    assert set(runnable()) == set(available()) - {"mfairfl"}


def _run(name: str):
    sets = [x for s in [*SMALL, f"server.algorithm={name}", *EXTRA.get(name, [])]
            for x in ("--set", s)]
    return world_run(f"e2e-{name}", ["run", str(MAIN), "--out", f"{{dir}}/e2e-{name}.h5",
                                     "--no-progress", *sets], ranks=3)


RUNS = {name: _run(name) for name in runnable()}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_runs_under_mpiexec(name, world):
    out = world.file(RUNS[name])
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "complete" and f.attrs["algorithm"] == name
        assert np.all(np.isfinite(f["model/global"][()]))
        assert f["eval/client_accuracy"].shape == (1, 12)
        assert np.all(f["rounds/num_clients"][()] > 0)
