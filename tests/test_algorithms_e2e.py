"""Every registered algorithm that applies to Fashion-MNIST runs end to end under mpiexec -n 3
(mFairFL needs a sensitive attribute: tests/test_mfairfl_client.py runs it on Adult)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.aggregators import available
from mpifl.experiment.config import load_config
from mpifl.core.errors import ConfigError
from tests.helpers import mpiexec

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.mpi
@pytest.mark.parametrize("name", runnable())
def test_runs_under_mpiexec(name, tmp_path):
    out = tmp_path / f"{name}.h5"
    sets = [x for s in [*SMALL, f"server.algorithm={name}", *EXTRA.get(name, [])] for x in ("--set", s)]
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", "run", str(MAIN), "--out", str(out),
           "--no-progress", *sets]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "complete" and f.attrs["algorithm"] == name
        assert np.all(np.isfinite(f["model/global"][()]))
        assert f["eval/client_accuracy"].shape == (1, 12)
        assert np.all(f["rounds/num_clients"][()] > 0)
