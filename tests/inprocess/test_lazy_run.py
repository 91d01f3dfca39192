"""A run on a lazy population (``data.lazy = true``): each rank draws only the
clients of each request (a worker's block of the round, a sampled evaluation, a window of a
streamed full evaluation) into its trainer's sample store.

The eager run of the same config is the oracle: every trained and evaluated value of the
results file is the same bit for bit, on 1 and 3 MPI ranks (runs of the shared MPI world,
tests/world.py), and a streamed evaluation in many windows equals the one-window evaluation.
Memory does not grow with K beyond O(K) small vectors: a measured slope, not a timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpifl.cli import main
from mpifl.experiment.assemble import build_parts, make_adapter, make_trainer
from mpifl.experiment.config import load_config
from mpifl.experiment.plan import make_plan
from mpifl.runtime import backends
from tests.world import world_run

JOB = """
[run]
name = "lazy"
seed = 5
rounds = 3
eval_every = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 60
[model]
name = "mlp"
hidden = [16]
[client]
epochs = 1
batch_size = 10
lr = 0.05
[server]
algorithm = "fedfv"
clients_per_round = 12
"""
#: What differs between two runs of one config: wall times, peak memory, bytes moved.
MEASURED = ("time_", "peak_rss", "bytes")


def run(name: str, *sets: str, ranks: int = 1, job: str = "lazy.toml"):
    """A world run (tests/world.py) of the job file ``job`` into ``{dir}/<name>.h5``."""
    return world_run(name, ["run", f"{{dir}}/{job}", "--out", f"{{dir}}/{name}.h5",
                            "--no-progress", *[a for s in sets for a in ("--set", s)]],
                     ranks=ranks, files={"lazy.toml": JOB, **EXTRA_FILES})


BN_MODULE = '''
import torch.nn as nn


def mlp_bn(input_shape, num_classes, **kw):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 16), nn.BatchNorm1d(16),
                         nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, num_classes))
'''
#: the loop trainer's job: a plugin model (a module name unique in the world's interpreters)
BN_JOB = JOB.replace("[data]", '[plugins]\npath = ["."]\n[data]').replace(
    'name = "mlp"\nhidden = [16]', 'name = "lazy_bnmods:mlp_bn"\nbatchnorm = "local"')
EXTRA_FILES = {"lazy-bn.toml": BN_JOB, "lazy_bnmods.py": BN_MODULE}

#: (algorithm, ranks) -> the lazy and the eager run
PAIRS = {(a, r): tuple(run(f"lazy-{a}-{r}-{kind}", *lazy, f"server.algorithm={a}", ranks=r)
                       for kind, lazy in (("lazy", ["data.lazy=true"]), ("eager", [])))
         for a, r in (("fedfv", 3), ("fedavg", 1))}
# Ditto's personal models, evaluation after local adaptation (the adapter's store is staged
# too), a sampled evaluation with a full one at round 2 and at the end
DITTO_SETS = ["server.algorithm=ditto", "run.adapt_epochs=1", "run.eval_clients=9",
              "run.full_eval_every=2", "run.rounds=4"]
DITTO = (run("lazy-ditto-lazy", "data.lazy=true", *DITTO_SETS),
         run("lazy-ditto-eager", *DITTO_SETS))
REFUSED = [(["data.dataset=fashion_mnist", "data.partition=shards"],
            "data.lazy: 'fashion_mnist' cannot be loaded lazily (lazy: cifar100_like, "),
           (["server.meta=true"], "data.lazy: FedMeta's meta step draws its meta set")]
REFUSALS = [run(f"lazy-refused-{i}", "data.lazy=true", *sets) for i, (sets, _) in
            enumerate(REFUSED)]
BN_SETS = ["server.algorithm=fedavg", "client.batch_size=0"]
BN = (run("lazy-bn-lazy", "data.lazy=true", *BN_SETS, job="lazy-bn.toml"),
      run("lazy-bn-eager", *BN_SETS, job="lazy-bn.toml"))


def datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def assert_same_results(lazy: Path, eager: Path) -> None:
    """Every dataset but the measured ones equal bit for bit (NaN where NaN); the lazy file
    lacks only /clients/label_counts (it would draw every client)."""
    a, b = datasets(lazy), datasets(eager)
    assert set(b) - set(a) == {"clients/label_counts"}
    compared = 0
    for name, x in a.items():
        if any(m in name for m in MEASURED):
            continue
        y = b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.dtype.kind == "f":
            np.testing.assert_array_equal(x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}"),
                                          err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)
        compared += 1
    assert {"model/global", "eval/client_accuracy", "rounds/train_loss"} <= set(a)
    assert compared >= 20


@pytest.mark.parametrize("algorithm, ranks", [("fedfv", 3), ("fedavg", 1)])
def test_a_lazy_run_equals_the_eager_run(world, ranks, algorithm):
    lazy, eager = (world.file(r) for r in PAIRS[algorithm, ranks])
    assert_same_results(lazy, eager)
    with h5py.File(lazy, "r") as f:
        acc = f["eval/client_accuracy"][()]
    assert acc.shape == (3, 60) and np.isfinite(acc).all()


def test_personal_models_adaptation_and_sampled_evaluation_draw_their_clients(world, capsys):
    lazy, eager = (world.file(r) for r in DITTO)
    assert_same_results(lazy, eager)
    with h5py.File(lazy, "r") as f:
        tested = np.isfinite(f["eval/client_accuracy"][()]).sum(axis=1)
        adapted = np.isfinite(f["eval/adapted/client_accuracy"][()]).sum(axis=1)
    np.testing.assert_array_equal(tested, [9, 60, 9, 60])  # rounds 1..4: full at 2 and 4
    np.testing.assert_array_equal(adapted, tested)

    def report(*args: str) -> str:
        capsys.readouterr()
        assert main(["report", str(lazy), *args]) == 0
        return capsys.readouterr().out

    # the report says which of the evaluations it averages were estimates
    assert "1 of the 3 evaluations used tested 9 of 60 clients" in report()
    assert "the ones used here tested all 60" in report("--last", "1")


def _parts(monkeypatch, lazy: bool):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(None, ["data.dataset=synthetic", "data.partition=natural",
                             "data.num_clients=40", "model.hidden=[8]", "run.adapt_epochs=1",
                             f"data.lazy={str(lazy).lower()}"])
    plan = make_plan(cfg)
    parts = build_parts(plan)
    trainer = make_trainer(plan, parts, torch.device("cpu"))
    return parts, trainer, make_adapter(plan, parts, torch.device("cpu"), trainer)


def test_a_streamed_evaluation_equals_the_eager_one_in_any_windows(monkeypatch):
    eager, trainer_e, adapter_e = _parts(monkeypatch, False)
    lazy, trainer_l, adapter_l = _parts(monkeypatch, True)
    assert trainer_l.x.shape == (0, 60)  # the lazy store is empty outside a request
    w = eager.w0 + 0.01 * torch.randn(eager.w0.shape, generator=torch.Generator().manual_seed(1))
    personal = w.expand(40, -1) * 1.5
    ids = np.arange(40, dtype=np.int64)
    whole = backends.evaluate_clients(trainer_e, eager.fed, w, ids, None, personal,
                                      adapter=adapter_e, adapt=(2, 0.05))
    for samples in (2**18, 1000, 1):  # one window, a few, one client each
        monkeypatch.setattr(backends, "STREAM_SAMPLES", samples)
        blocks = backends.stream_blocks(lazy.fed, ids)
        assert blocks[0][0] == 0 and blocks[-1][1] == 40
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert len(blocks) == (1 if samples > lazy.fed.sizes.sum() else
                               40 if samples == 1 else len(blocks))
        got = backends.evaluate_clients(trainer_l, lazy.fed, w, ids, None, personal,
                                        adapter=adapter_l, adapt=(2, 0.05))
        np.testing.assert_array_equal(got.accuracy, whole.accuracy)
        np.testing.assert_allclose(got.loss, whole.loss, rtol=1e-6)
        for mine, oracle in ((got.personal, whole.personal), (got.adapted, whole.adapted)):
            np.testing.assert_array_equal(mine[0], oracle[0])
            np.testing.assert_allclose(mine[1], oracle[1], rtol=1e-6)
        assert trainer_l.x.shape == (0, 60) and adapter_l.x.shape == (0, 60)  # restored
    assert len(backends.stream_blocks(lazy.fed, ids)) > 1


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_what_cannot_be_lazy_is_refused_in_one_line(world, case):
    output, message = world.output(REFUSALS[case]), REFUSED[case][1]
    assert world.status(REFUSALS[case]) == 2, output[-2000:]
    assert "Traceback" not in output
    lines = [ln for ln in output.splitlines() if ln.startswith("mpifl: error:")]
    assert len(lines) == 1 and message in lines[0], output[-2000:]
    assert not world.path(f"{REFUSALS[case].name}.h5").exists()


def _peak_mb(tmp: Path, k: int) -> float:
    """Peak RSS (MiB, GNU time's figure) of a one-round lazy run of K clients, 20 a round, a
    sampled evaluation of 20 clients."""
    path = tmp / "job.toml"
    path.write_text(JOB)
    sets = ["data.lazy=true", f"data.num_clients={k}", "run.rounds=1", "run.eval_clients=20",
            "server.clients_per_round=20", "server.algorithm=fedavg"]
    proc = subprocess.run(["/usr/bin/time", "-f", "peak_kb=%M", sys.executable, "-m", "mpifl",
                           "run", str(path), "--out", str(tmp / f"k{k}.h5"), "--no-progress",
                           *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=300, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stderr.rsplit("peak_kb=", 1)[1].split()[0]) / 1024


@pytest.mark.slow
def test_memory_does_not_grow_with_the_population_beyond_small_vectors(tmp_path):
    ks = [20_000, 200_000, 400_000]
    peaks = [_peak_mb(tmp_path, k) for k in ks]
    slope = np.polyfit(ks, np.array(peaks) * 2**20, 1)[0]  # bytes per client
    # eager synthetic holds ~237 samples x 256 bytes = ~60 KB a client; the lazy run keeps
    # (K,) count, selection and result vectors: a few hundred bytes
    assert slope < 1000, f"{slope:.0f} bytes a client (peaks {peaks} MiB at K = {ks})"


def test_the_loop_trainer_with_local_batchnorm_and_dropout_draws_its_clients(world):
    # the per-client loop (a model with buffers and random layers), each client's BatchNorm
    # statistics kept locally: the same staged store, the same bits
    lazy, eager = (world.file(r) for r in BN)
    assert_same_results(lazy, eager)
    with h5py.File(lazy, "r") as f:
        assert f.attrs["trainer"] == "loop"
