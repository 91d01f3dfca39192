"""The benchmark jobs as a new user runs them: files in the published formats (LEAF's JSON,
TFF's h5) in the documented folders of a data root, each job shrunk with ``--set`` only, on 3
MPI ranks, killed after half its rounds and resumed bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.errors import ConfigError
from mpifl.data.leaf import ALL_LETTERS
from mpifl.experiment.budget import check_budget, estimate
from mpifl.experiment.config import load_config

from .helpers import mpiexec
from .test_published_readers import _h5, _leaf_dir, _leaf_file

ROOT = Path(__file__).resolve().parents[1]
WORDS = "how do i merge two sorted lists in python without a loop".split()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """12 writers, roles, users or clients of LEAF's FEMNIST and Shakespeare (all_data JSON)
    and TFF's StackOverflow and FedCIFAR100 (h5)."""
    root = tmp_path_factory.mktemp("published")
    rng = np.random.default_rng(0)
    writers = {f"f{k:04d}": (rng.random((16, 784)).round(3).tolist(),
                             rng.integers(0, 62, 16).tolist()) for k in range(12)}
    _leaf_file(_leaf_dir(root, "femnist") / "all_data" / "all_data_0.json", writers)
    users = {f"{k:05d}": [" ".join(rng.choice(WORDS, rng.integers(3, 12)))
                          for _ in range(rng.integers(6, 14))] for k in range(12)}
    _h5(root / "tff" / "stackoverflow_train.h5", {u: {"tokens": t} for u, t in users.items()})
    _h5(root / "tff" / "stackoverflow_test.h5", {u: {"tokens": t[:2]} for u, t in users.items()})
    text = "".join(rng.choice(list(ALL_LETTERS[:40]), 2000))
    roles = {f"ROLE_{k}": ([text[i:i + 80] for i in range(k, k + 300, 20)],
                           [text[i + 80] for i in range(k, k + 300, 20)]) for k in range(12)}
    _leaf_file(_leaf_dir(root, "shakespeare") / "all_data" / "all_data_0.json", roles)
    images = {str(k): {"image": rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8),
                       "label": rng.integers(0, 100, 10), "coarse_label": rng.integers(0, 20, 10)}
              for k in range(12)}
    _h5(root / "tff" / "fed_cifar100_train.h5", images)
    _h5(root / "tff" / "fed_cifar100_test.h5", {"0": images["0"]})
    return root


def _run(args: list[str], cwd: Path) -> None:
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "mpifl", *args, "--no-progress"]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]


def _model(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["model/global"][()]


def _resumes_exactly(job: str, root: Path, tmp_path: Path, shrink: list[str]) -> np.ndarray:
    sets = [a for kv in [f"data.data_root={str(root)!r}", "run.rounds=4", "run.eval_every=2",
                         "run.checkpoint_every=2", *shrink] for a in ("--set", kv)]
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    _run(["run", str(ROOT / "jobs" / job), *sets, "--out", str(whole)], tmp_path)
    _run(["run", str(ROOT / "jobs" / job), *sets, "--set", "run.rounds=2", "--out", str(part)],
         tmp_path)
    _run(["resume", str(part), "--rounds", "4"], tmp_path)
    assert np.array_equal(_model(part), _model(whole))
    with h5py.File(whole, "r") as f:
        return f["eval/mean"][()]


#: job -> the --set shrinking it to a test's size (the data, the cohort, the model's widths)
SHRUNK = {
    "leaf-femnist.toml": ["data.num_clients=12", "server.clients_per_round=4",
                          "model.params.hidden=32"],
    "tff-stackoverflow.toml": ["data.num_clients=12", "server.clients_per_round=4",
                               "run.eval_clients=6", "data.params.vocab_size=20",
                               "model.params.embedding_size=16", "model.params.hidden_size=16",
                               "model.params.num_heads=2", "model.params.feedforward_size=32",
                               "model.params.num_layers=1"],
    "leaf-shakespeare.toml": ["data.num_clients=12", "server.clients_per_round=4",
                              "model.params.hidden_size=16"],
    "fedcifar100.toml": ["data.num_clients=12", "server.clients_per_round=4",
                         "model.params.width=8"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("job", list(SHRUNK))
def test_a_benchmark_job_on_published_files_resumes_exactly(job, data_root, tmp_path):
    acc = _resumes_exactly(job, data_root, tmp_path, SHRUNK[job])
    assert np.isfinite(acc).all()


def test_the_budget_sizes_the_benchmarks_before_loading(tmp_path):
    """StackOverflow's 342,477 users held eagerly would not fit a node: refused in one line
    before anything loads; lazily they cost their counts and one window."""
    cfg = load_config(ROOT / "jobs" / "tff-stackoverflow.toml")
    lazy = estimate(cfg, ranks=3, world=3)
    eager = estimate(cfg.model_copy(update={"data": cfg.data.model_copy(update={"lazy": False})}),
                     ranks=3, world=3)
    assert eager.total > 10 * lazy.total and eager.total > 3 * 40e9  # ~43 GB a rank
    with pytest.raises(ConfigError, match="data.dataset = tff_stackoverflow: the "
                                          "tff_stackoverflow data set holds"):
        check_budget(cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"lazy": False})}), available=64e9, ranks=3, world=3)
    femnist = estimate(load_config(ROOT / "jobs" / "leaf-femnist.toml"), ranks=1, world=1)
    assert 0.5e9 < femnist.total < 8e9  # 805,263 images of 28x28 float32, LEAF's CNN
