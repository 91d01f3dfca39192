"""The benchmark jobs as a new user runs them: files in the published formats (LEAF's JSON,
TFF's h5) in the documented folders of a data root, each job shrunk with ``--set`` only, on 3
MPI ranks of the shared world (tests/world.py), stopped after half its rounds and resumed bit
for bit."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.core.errors import ConfigError
from mpifl.data.leaf import ALL_LETTERS
from mpifl.experiment.budget import check_budget, estimate
from mpifl.experiment.config import load_config

from .test_published_readers import _h5, _leaf_dir, _leaf_file
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]
WORDS = "how do i merge two sorted lists in python without a loop".split()


def write_published(root: Path) -> Path:
    """12 writers, roles, users or clients of LEAF's FEMNIST and Shakespeare (all_data JSON)
    and TFF's StackOverflow and FedCIFAR100 (h5), in the data root ``root``."""
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


def _model(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["model/global"][()]


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


#: The world's ``files`` are text files beside its runs; TFF's files are binary and every format
#: sits in sub-folders. So a first world run (``mpifl check`` of FedAvg: a second on one rank)
#: imports this plugin from its working directory, the world's folder, and the plugin writes
#: the data root there.
MAKER = """from pathlib import Path

from tests.inprocess.test_benchmark_jobs import PUBLISHED, write_published

write_published(Path(__file__).parent / PUBLISHED)
"""
PUBLISHED = "bench-jobs-published"
DATA = world_run("bench-jobs-data", ["check", "fedavg", "--plugins", "bench_jobs_data",
                                     "--rounds", "2", "--split", "1"],
                 ranks=1, files={"bench_jobs_data.py": MAKER})


def _runs(job: str) -> tuple:
    """The job on 3 ranks: all 4 rounds, 2 of them, and those 2 resumed to 4."""
    name = f"bench-jobs-{Path(job).stem}"
    sets = [a for kv in [f"data.data_root='{{dir}}/{PUBLISHED}'", "run.rounds=4",
                         "run.eval_every=2", "run.checkpoint_every=2", *SHRUNK[job]]
            for a in ("--set", kv)]
    whole, part = (world_run(f"{name}-{kind}", ["run", str(ROOT / "jobs" / job), *sets, *extra,
                                                "--out", f"{{dir}}/{name}-{kind}.h5",
                                                "--no-progress"])
                   for kind, extra in (("whole", []), ("part", ["--set", "run.rounds=2"])))
    resumed = world_run(f"{name}-resumed", ["resume", f"{{dir}}/{name}-part.h5", "--rounds", "4",
                                            "--no-progress"])
    return whole, part, resumed


RUNS = {job: _runs(job) for job in SHRUNK}


@pytest.mark.parametrize("job", list(SHRUNK))
def test_a_benchmark_job_on_published_files_resumes_exactly(job, world):
    assert world.status(DATA) == 0, world.output(DATA)[-3000:]
    whole, part, resumed = RUNS[job]
    assert world.status(part) == 0, world.output(part)[-3000:]
    stopped = world.file(resumed, f"{part.name}.h5")
    assert np.array_equal(_model(stopped), _model(world.file(whole)))
    with h5py.File(world.file(whole), "r") as f:
        assert np.isfinite(f["eval/mean"][()]).all()


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
