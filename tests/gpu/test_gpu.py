"""mpifl on a CUDA device (``pytest -m gpu``; tools/gpu_check.sh runs them on a GPU node).

What is checked, with ``run.deterministic = true`` (the default, mpifl/runtime/determinism.py):

* every trainer path on the device — the vmapped step (``cnn_mnist``), its batched-matmul form
  for the MLP family (``mlp``) and the per-client loop (every model, and alone a BatchNorm +
  Dropout ResNet, examples/models/) — against the loop on the device (vmap: ``ATOL_PATHS``)
  and against the same path on the CPU (``ATOL_DEVICES``; Dropout's masks come from another
  generator on the GPU, so there the loop is compared with the written-out loop instead);
* the same clients trained in reverse order: bit-identical rows (a BatchNorm + Dropout model
  on CUDA once was not, before deterministic kernels);
* a worker's staging of a round's buffers (pinned, reused, ``non_blocking``) and the sample
  store kept in (pinned) host memory (``client.samples_on = "host"``) against the store on
  the device: the same updates, bit for bit;
* whole runs (``mpifl run ... --set server.device=cuda``) of the ResNet, the MLP (with the
  counter minibatch order) and the FedAvg CNN: bit-identical on 1 and 3 ranks (the ResNet on 5
  too: four workers sharing one GPU; the vectorised MLP within float rounding, its kernels'
  shapes change with the ranks: ``ACROSS_RANKS``) and after SIGKILL + resume; a checkpoint written on the
  CPU resumed on the GPU and the reverse (the rounds before the checkpoint exactly, the model
  after it within ``ATOL_RUN`` of the run that never changed device).

Without CUDA the module is skipped; ``MPIFL_GPU_TEST_DEVICE=cpu`` runs it on the CPU instead,
which checks the tests themselves and the code paths (there "the other device" is the CPU too,
so every comparison is exact). The MPI tests skip when no mpiexec is found.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpifl.clients.interface import TrainOptions
from mpifl.clients.loop import LoopTrainer, step_seed
from mpifl.clients.minibatches import client_minibatches, minibatch_schedule
from mpifl.clients.trainer import VmapTrainer
from mpifl.core.layout import ParamLayout
from mpifl.experiment.assemble import build_parts, make_trainer
from mpifl.experiment.config import load_config
from mpifl.experiment.plan import make_plan
from mpifl.models import build_model, get_loss
from mpifl.runtime.determinism import Determinism, apply_determinism
from mpifl.runtime.protocol import TRAIN, Request
from mpifl.runtime.staging import Staging
from mpifl.runtime.worker import Worker
from tests.helpers import kill_tree, train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "models"
RESNET_JOB = EXAMPLES / "resnet.toml"
MAIN_JOB = ROOT / "jobs" / "fmnist-fedfv.toml"

#: where the tests run: "cuda" (default) or "cpu" (to check the tests on a machine without GPU)
DEVICE = os.environ.get("MPIFL_GPU_TEST_DEVICE", "cuda")
#: vmap against the loop on one device: differently shaped kernels, float32 rounding
ATOL_PATHS = 1e-5
#: one path on the GPU against the CPU: other kernels (TF32 off), float32 rounding over a few
#: SGD steps
ATOL_DEVICES = 1e-4
#: a whole run whose rounds after a checkpoint ran on the other device (the final model)
ATOL_RUN = 1e-4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="no CUDA device (torch.cuda.is_available() is False); "
                              "MPIFL_GPU_TEST_DEVICE=cpu runs these tests on the CPU"),
]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
#: wall-clock and memory figures, never equal between two runs
VOLATILE = ("time_", "peak_rss", "bytes_moved")


@pytest.fixture(scope="module", autouse=True)
def exact_kernels():
    """run.deterministic's settings for the in-process tests, as a run makes them."""
    before = Determinism.now()
    apply_determinism(True)
    sys.path.insert(0, str(EXAMPLES))
    import mpifl_models  # noqa: F401  (registers small_resnet, cifar_like, smoothed_ce)
    yield
    sys.path.remove(str(EXAMPLES))
    before.restore()


def _mpiexec() -> str:
    exe = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(exe).exists():
        pytest.skip("mpiexec not found (pip install mpi4py mpich, or carry their wheels in "
                    ".whl/: tools/gpu_wheels.sh)")
    return exe


# --------------------------------------------------------------------------- trainer paths


@pytest.mark.parametrize("order", ["pcg64", "counter"])
def test_the_minibatch_plan_drawn_on_the_device_equals_the_host_plan(order):
    # the counter order's hash runs on the device (mpifl/core/counter.py): same bits as numpy
    sizes = np.array([5, 130, 64, 1, 77])
    ids = np.array([0, 2**31 - 1, 17, 4, 99])
    on_device = minibatch_schedule(3, 8, ids, sizes, 3, 16, order=order, device=DEVICE)
    on_host = minibatch_schedule(3, 8, ids, sizes, 3, 16, order=order, device="cpu")
    assert on_device.rows.device.type == torch.device(DEVICE).type
    assert torch.equal(on_device.rows.cpu(), on_host.rows)
    assert torch.equal(on_device.weights.cpu(), on_host.weights)


def _data(n, shape, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _clients(sizes):
    bounds = np.cumsum([0, *sizes])
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


#: (model, input shape, factory keywords, trainer options): the MLP takes the batched-matmul
#: form of the vmapped step, the CNN the vmapped step itself
VMAP_MODELS = [
    ("mlp", (12,), dict(hidden=(16,)), dict(momentum=0.9, weight_decay=1e-3)),
    ("mlp", (12,), dict(hidden=(16,)), dict(prox_mu=0.5, pretrain_losses=False)),
    ("cnn_mnist", (1, 12, 12), dict(), dict(momentum=0.5)),
    ("mlp", (12,), dict(hidden=(16,)), dict(momentum=0.9, minibatch_order="counter")),
]
IDS = np.array([3, 1, 7])


def _train(cls, model, x, y, device, **kw):
    layout = ParamLayout.from_module(model)
    w = layout.flatten_module(model).to(device)
    trainer = cls(model, layout, x, y, TrainOptions(device=device, epochs=2, batch_size=8, **kw))
    updates, losses = train(trainer, w, 5, 0.1, IDS, _clients((13, 40, 37)))
    return updates.cpu(), losses.cpu()


@pytest.mark.parametrize("name,shape,params,options", VMAP_MODELS)
def test_vmap_paths_equal_the_loop_on_the_device_and_themselves_on_the_cpu(name, shape, params,
                                                                            options):
    model = build_model(name, shape, 4, seed=1, **params)
    x, y = _data(90, shape, 4)
    got = _train(VmapTrainer, model, x, y, DEVICE, **options)
    loop = _train(LoopTrainer, model, x, y, DEVICE, **options)
    cpu = _train(VmapTrainer, model, x, y, "cpu", **options)
    assert got[0].abs().max() > 1e-3  # training moved the parameters: not vacuous
    for a, b in zip(got, loop):
        torch.testing.assert_close(a, b, atol=ATOL_PATHS, rtol=0)
    for a, b in zip(got, cpu):
        torch.testing.assert_close(a, b, atol=ATOL_DEVICES, rtol=0)


def _resnet(dropout: float):
    return build_model("small_resnet", (3, 8, 8), 3, seed=2, channels=4, stages=2,
                       dropout=dropout)


def test_loop_with_batchnorm_equals_itself_on_the_cpu():
    """BatchNorm without Dropout: the same computation on both devices, up to rounding; the
    running statistics travel in the update like the parameters."""
    model = _resnet(0.0)
    x, y = _data(90, (3, 8, 8), 3)
    got = _train(LoopTrainer, model, x, y, DEVICE, momentum=0.9)
    cpu = _train(LoopTrainer, model, x, y, "cpu", momentum=0.9)
    layout = ParamLayout.from_module(model)
    stats = [layout.unflatten(got[0][0])[n] for n in layout.names if "running" in n]
    assert stats and all(s.abs().sum() > 0 for s in stats)
    for a, b in zip(got, cpu):
        torch.testing.assert_close(a, b, atol=ATOL_DEVICES, rtol=0)


def _written_out_loop(model, x, y, w, cid, idx, device, *, rnd=5, lr=0.1, epochs=2, batch=8):
    """One client's local SGD on ``device`` as anyone would write it: a copy of the module in
    train mode, torch's generators seeded per step from the documented key
    (:func:`mpifl.clients.loop.step_seed`), torch.optim.SGD."""
    layout = ParamLayout.from_module(model)
    net = copy.deepcopy(model).to(device).train()
    state = dict(net.named_parameters()) | dict(net.named_buffers())
    with torch.no_grad():
        for name, value in layout.unflatten(w.to(device)).items():
            state[name].copy_(value)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loss = get_loss("cross_entropy")
    xs, ys = x.to(device), y.to(device)
    for step, pos in enumerate(client_minibatches(0, rnd, cid, len(idx), epochs, batch)):
        torch.manual_seed(step_seed(0, rnd, cid, step))
        rows = torch.as_tensor(idx[pos], device=device)
        opt.zero_grad()
        loss.per_sample(net(xs[rows]), ys[rows]).mean().backward()
        opt.step()
    return layout.flatten_module(net).cpu()


def test_loop_with_batchnorm_and_dropout_is_the_written_out_loop_on_the_device():
    model = _resnet(0.3)
    x, y = _data(90, (3, 8, 8), 3)
    layout = ParamLayout.from_module(model)
    w = layout.flatten_module(model)
    updates, _ = _train(LoopTrainer, model, x, y, DEVICE)
    for row, cid, idx in zip(updates, IDS, _clients((13, 40, 37))):
        want = _written_out_loop(model, x, y, w, int(cid), idx, DEVICE)
        torch.testing.assert_close(w - row, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["small_resnet", "cnn_mnist", "mlp"])
def test_clients_in_reverse_order_train_the_same_updates(name):
    if name == "small_resnet":  # BatchNorm + Dropout: the loop
        model, shape, cls = _resnet(0.3), (3, 8, 8), LoopTrainer
    else:
        shape = (1, 12, 12) if name == "cnn_mnist" else (12,)
        model, cls = build_model(name, shape, 3, hidden=(16,), seed=1), VmapTrainer
    x, y = _data(90, shape, 3)
    layout = ParamLayout.from_module(model)
    w = layout.flatten_module(model).to(DEVICE)
    trainer = cls(model, layout, x, y, TrainOptions(device=DEVICE, epochs=2, batch_size=8,
                                                    momentum=0.9))
    idx = _clients((30, 30, 30))  # equal sizes: the vmapped chunks hold the same shapes
    forward = train(trainer, w, 4, 0.1, IDS, idx)
    backward = train(trainer, w, 4, 0.1, IDS[::-1].copy(), idx[::-1])
    for a, b in zip(forward, backward):
        if cls is LoopTrainer:  # one client at a time: nothing may differ
            assert torch.equal(a.flip(0).cpu(), b.cpu())
        else:  # one batched kernel over the chunk: each client's slice, up to its position
            torch.testing.assert_close(a.flip(0).cpu(), b.cpu(), atol=1e-6, rtol=0)


def test_evaluation_on_the_device_equals_the_cpu():
    model = _resnet(0.3)
    x, y = _data(90, (3, 8, 8), 3)
    layout = ParamLayout.from_module(model)
    w = layout.flatten_module(model)
    idx = _clients((13, 40, 37))
    on = LoopTrainer(model, layout, x, y, TrainOptions(device=DEVICE, epochs=1, batch_size=8))
    off = LoopTrainer(model, layout, x, y, TrainOptions(device="cpu", epochs=1, batch_size=8))
    acc, loss = on.evaluate(w.to(DEVICE), idx)
    acc_cpu, loss_cpu = off.evaluate(w, idx)
    # a near-tie of two logits may break the other way: at most one sample a client
    np.testing.assert_allclose(acc, acc_cpu, atol=1 / 13 + 1e-12, rtol=0)
    np.testing.assert_allclose(loss, loss_cpu, atol=ATOL_DEVICES, rtol=0)


# --------------------------------------------------------------------------- whole runs

#: the BatchNorm + Dropout ResNet (the loop) on generated images, small
RESNET = ["run.rounds=4", "run.eval_every=2", "run.checkpoint_every=1", "client.epochs=1",
          "data.params.num_samples=600", "data.num_clients=10", "server.clients_per_round=5"]
#: the main job's rule (FedFV, its aggregation on rank 0's device) on generated data, the MLP
#: (vmapped: the batched-matmul form)
FEDFV = ["run.rounds=4", "run.eval_every=1", "run.checkpoint_every=1", "data.dataset=synthetic",
         "data.partition=natural", "data.num_clients=12", "server.clients_per_round=4",
         "model.hidden=[16]"]


def _command(ranks: int, *args: str, sets=(), device: str = DEVICE) -> list[str]:
    cmd = [sys.executable, "-m", "mpifl", *args, "--no-progress",
           *[x for s in [*sets, f"server.device={device}"] for x in ("--set", s)]]
    return [_mpiexec(), "-n", str(ranks), *cmd] if ranks > 1 else cmd


def _run(ranks: int, *args: str, sets=(), device: str = DEVICE) -> None:
    proc = subprocess.run(_command(ranks, *args, sets=sets, device=device), capture_output=True,
                          text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _contents(path: Path) -> dict[str, np.ndarray]:
    """Every dataset a run computes (timings and memory aside); the run is complete."""
    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete" and bool(f.attrs["deterministic"])
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset)
                     and not any(v in name for v in VOLATILE) else None)
    return found


def _assert_same(a: Path, b: Path, atol: float = 0.0) -> None:
    """Every dataset equal; floats within ``atol`` when given (0: bit for bit)."""
    x, y = _contents(a), _contents(b)
    assert x.keys() == y.keys() and "model/global" in x
    for key in x:
        floats = np.asarray(x[key]).dtype.kind == "f"
        if floats and atol:
            np.testing.assert_allclose(x[key], y[key], atol=atol, rtol=0, err_msg=key)
        else:
            assert np.array_equal(x[key], y[key], equal_nan=floats), key


#: the whole-run checks' jobs: the BatchNorm + Dropout ResNet (loop), the MLP (vmapped) with the
#: counter minibatch order drawn on the device, and the FedAvg CNN (cnn_mnist, the loop) on
#: Fashion-MNIST (300 training samples a client)
RUNS = {
    "resnet": (RESNET_JOB, RESNET),
    "mlp": (MAIN_JOB, [*FEDFV, "client.minibatch_order=counter"]),
    "cnn": (MAIN_JOB, ["run.rounds=4", "run.eval_every=4", "run.checkpoint_every=1",
                       "model.name=cnn_mnist", "data.num_clients=200", "data.partition=iid",
                       "server.clients_per_round=4", "server.algorithm=fedavg"]),
}
#: across world sizes, the vectorised path's float rounding: each worker trains and evaluates
#: its own block of clients, so the batched kernels' shapes (chunk of clients, padded
#: minibatch, rows of an evaluation block) change with the ranks, and with them the order of
#: float sums; the per-client loop (the ResNet, the CNN) runs one client at a time, the same
#: kernels on any number of ranks, bit for bit. A resume keeps the shapes: exact for all three.
ACROSS_RANKS = {"resnet": 0.0, "mlp": ATOL_PATHS, "cnn": 0.0}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Each job of RUNS on one rank, run when first asked for."""
    folder, done = tmp_path_factory.mktemp("one"), {}

    def get(name: str) -> Path:
        if name not in done:
            job, sets = RUNS[name]
            done[name] = folder / f"{name}.h5"
            _run(1, "run", str(job), "--out", str(done[name]), sets=sets)
        return done[name]

    return get


@pytest.mark.mpi
@pytest.mark.parametrize("name,ranks", [("resnet", 3), ("resnet", 5), ("mlp", 3), ("cnn", 3)])
def test_runs_on_any_number_of_ranks_are_the_same(one_rank, tmp_path, name, ranks):
    """Bit for bit on the loop's models, within rounding on the vectorised path
    (:data:`ACROSS_RANKS`); 5 ranks: four workers share the one GPU."""
    job, sets = RUNS[name]
    out = tmp_path / f"ranks{ranks}.h5"
    _run(ranks, "run", str(job), "--out", str(out), sets=sets)
    _assert_same(out, one_rank(name), atol=ACROSS_RANKS[name])


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(RUNS))
def test_a_killed_run_resumes_bit_identically(tmp_path, name):
    """SIGKILL every process of a 3-rank run once its first checkpoint exists, then resume."""
    job, sets = RUNS[name]
    out = tmp_path / "killed.h5"
    sets = [*sets, "run.rounds=12"]
    reference = tmp_path / "whole.h5"
    _run(3, "run", str(job), "--out", str(reference), sets=sets)
    proc = subprocess.Popen(_command(3, "run", str(job), "--out", str(out), sets=sets),
                            env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    folder = Path(f"{out}.ckpt")
    deadline = time.monotonic() + 300
    while not any(folder.glob("round-*.h5")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.02)
    kill_tree(proc.pid)  # mpiexec, its proxy and every rank (each in its own session)
    proc.wait()
    with h5py.File(out, "r") as f:  # killed mid-run, not after the end
        assert f.attrs["status"] == "running"
    _run(3, "run", str(job), "--out", str(out), "--resume", sets=sets)
    _assert_same(out, reference)


@pytest.mark.parametrize("first,then", [("cpu", DEVICE), (DEVICE, "cpu")])
def test_a_checkpoint_moves_between_the_cpu_and_the_device(tmp_path, first, then):
    """2 rounds on one device, resumed for 2 more on the other: the first rounds as written,
    the final model within ATOL_RUN of 4 rounds on the second device alone (other kernels
    round differently; exact when both are the CPU)."""
    moved, whole = tmp_path / "moved.h5", tmp_path / "whole.h5"
    _run(1, "run", str(MAIN_JOB), "--out", str(moved), sets=[*FEDFV, "run.rounds=2"],
         device=first)
    before = _contents(moved)
    _run(1, "run", str(MAIN_JOB), "--out", str(moved), "--resume", sets=FEDFV, device=then)
    _run(1, "run", str(MAIN_JOB), "--out", str(whole), sets=FEDFV, device=then)
    after, alone = _contents(moved), _contents(whole)
    for key in (k for k in before if k.startswith("rounds/") and k != "rounds/round"):
        np.testing.assert_array_equal(after[key][:2], before[key][:2], err_msg=key)
    np.testing.assert_allclose(after["model/global"], alone["model/global"], atol=ATOL_RUN,
                               rtol=0)
    if first == then:  # both on the CPU (MPIFL_GPU_TEST_DEVICE=cpu): nothing to round apart
        _assert_same(moved, whole)


# --------------------------------------------------------------------------- staging and the store


def test_staging_reuses_pinned_buffers_and_returns_complete_arrays():
    """Several rounds of w in and (m_r, d) updates out: every array equals what was computed
    (the one synchronisation happened before they were read); on CUDA the buffers are pinned,
    reused by a smaller block and grown for a larger one."""
    staging = Staging(DEVICE)
    assert staging.pinned == (torch.device(DEVICE).type == "cuda")
    g = torch.Generator().manual_seed(0)
    pointers = []
    for rows in (6, 4, 9):
        w = torch.randn(33, generator=g).numpy()
        on = staging.to_device(w)
        assert on.device.type == torch.device(DEVICE).type and np.array_equal(on.cpu(), w)
        updates = on.expand(rows, -1) * torch.arange(1, rows + 1, device=on.device)[:, None]
        losses = updates.sum(1).double()
        stats = torch.empty(rows, 0, device=on.device)
        u, loss, st = staging.to_host(updates, losses, stats)
        assert u.shape == (rows, 33) and loss.dtype == np.float64 and st.shape == (rows, 0)
        np.testing.assert_array_equal(u, updates.cpu().numpy())
        np.testing.assert_array_equal(loss, losses.cpu().numpy())
        pointers.append(u.__array_interface__["data"][0])
    if staging.pinned:
        assert all(b.is_pinned() for b in staging._buffers.values())
        assert pointers[1] == pointers[0] != pointers[2]  # reused (4 <= 6 rows), grown (9)
        assert staging.nbytes >= 9 * 33 * 4


@pytest.mark.parametrize("samples_on", ["host", "device"])
def test_a_store_in_host_memory_trains_what_the_store_on_the_device_does(samples_on):
    def block(on: str):
        over = ["data.dataset=synthetic", "data.partition=natural", "data.num_clients=20",
                "model.hidden=[16]", "client.epochs=2", "client.batch_size=8",
                f"client.samples_on={on}", f"server.device={DEVICE}"]
        plan = make_plan(load_config(None, over))
        assert plan.samples_on == on
        parts = build_parts(plan)
        device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
        trainer = make_trainer(plan, parts, device)
        worker = Worker(1, 1, trainer, parts.fed, device)
        got = worker.train(Request(TRAIN, 3, 0.1, np.array([1, 6, 12, 19]),
                                   parts.w0.numpy().copy()))
        return trainer, got

    trainer, got = block(samples_on)
    if samples_on == "host":
        assert trainer.x.device.type == "cpu"
        assert trainer.x.is_pinned() == (DEVICE == "cuda")
    else:
        assert trainer.x.device.type == torch.device(DEVICE).type
    _, other = block("device" if samples_on == "host" else "host")
    assert np.abs(got.updates).max() > 0
    np.testing.assert_array_equal(got.updates, other.updates)
    np.testing.assert_array_equal(got.losses, other.losses)
