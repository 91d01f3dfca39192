"""Peer benchmark: a simulated FedAvg round in mpifl against Apple's pfl-research.

Workloads (docs/BENCHMARKS.md, "Peer benchmark" and "Peer benchmark W2"): FedAvg on
Fashion-MNIST split into 2 label shards per client, 100 clients, 10 per round, B = 50, E = 1,
lr 0.1, one process, with

- **W1** (``--model mlp``, the default): the MLP 784-200-200-10 (d = 199,210);
- **W2** (``--model cnn_mnist``): the FedAvg MNIST CNN of mpifl's model zoo (two 5x5 conv
  layers of 32 and 64 channels with 2x2 max-pooling, a 512 hidden layer; d = 1,663,370) on the
  same (1, 28, 28) images.
- **W3** (``--model pfl_simple_cnn``): the shape of pfl-research's own CIFAR-10 benchmark
  (apple/pfl-research ``benchmarks/image_classification``, ``configs/baseline.yaml``): its
  ``simple_cnn`` (two 3x3 conv layers of 32 and 64 channels, 2x2 max-pooling, Dropout, a 128
  hidden layer; d = 1,626,442; analysis/pfl_models.py, an mpifl plugin), (3, 32, 32) float32
  images and 10 classes, IID, 50 training samples a user, 1,000 users, 50 a round, B = 10,
  E = 1, local lr 0.1, central SGD lr 1, users weighted equally (pfl's ``WeightByUser``;
  mpifl's ``[fedavg] weighting = "uniform"``). The data: CIFAR-10 (``cifar10``) where mpifl
  finds it, else its generated stand-in ``cifar10_like`` (same shapes, mpifl/data/standins.py),
  60,000 images in 1,000 IID clients of 60, 5/6 of each for training. pfl's copy of the model
  takes channels-last images and transposes them first, as pfl's benchmark does.

mpifl runs jobs/fmnist-fedfv.toml with ``server.algorithm = "fedavg"``, a large
``run.eval_every``, ``model.name`` set to ``--model`` and ``client.trainer`` to ``--trainer``
(``auto``: what ``mpifl run`` picks, the per-client loop for the CNN on a CPU and the vectorised
trainer for the MLP; ``vmap`` or ``loop`` pin a path). pfl-research 0.6.0 runs its PyTorch
simulation (``SimulatedBackend``, ``FederatedAveraging``, ``PyTorchModel``) on the same clients,
the same per-client samples, the same initial model and the same clients in every round,
weighted by sample count.

What an mpifl round is here: the server's round (client selection, local training of the 10
clients, aggregation, model update: ``Server._round``) and ``observe_params``, with the trainer
and rule a ``mpifl run`` builds for the config. Results writing (rank 0's HDF5 file, which the
benchmark does not measure) and evaluation (``eval_every`` large) are not in it; pfl's round does
no evaluation either (``evaluation_frequency`` large) and writes nothing. The first
``--warmup`` rounds are left out; the median of the rest is the "steady round". Training FLOPs
per sample are counted by ``torch.utils.flop_counter.FlopCounterMode`` on one forward +
backward of the model (conv and matmul kernels, forward and both gradients, no input gradient
of the first layer); GFLOP/s are also given as a fraction of the measured 2048 x 2048 float32
GEMM rate.

Three modes:

- *interleaved* (the default): both in one process, round by round: pfl's training loop calls
  back after each of its rounds, and the callback runs one mpifl round (timed on its own); a
  pfl round is the time between two callbacks minus the mpifl round inside. A review reported
  pfl's round slower in one process than alone, which would flatter mpifl (not seen in the runs
  of docs/BENCHMARKS.md); ``--separate`` avoids the question.
- ``--only mpifl`` / ``--only pfl``: one simulator alone in this process; prints its rounds,
  the CPU other processes used during each round (cores: /proc/stat's busy time less this
  process's own) and a ``RESULT {json}`` line. ``--only mpifl`` needs no pfl-research.
- ``--separate N``: a driver that runs N cycles of child processes (``--only``), one per
  mpifl trainer in ``--trainer`` (comma-separated, e.g. ``auto,vmap``) and one of pfl, the
  order reversed every other cycle (A B C, C B A, ...), and prints each run's steady round, the
  median over runs, GFLOP/s, and the ratio pfl/mpifl per trainer.

On a shared machine (another process on the same cores slowed W2's rounds down 3-14x here) a
run's figure is the median of its *quiet* steady rounds, those during which other processes
used under 0.15 cores, where at least a third of them were quiet (else all, marked ``*``);
``--quiet-wait S`` also waits, before each child and before each round (outside the timed
interval), up to S seconds for a quiet window.

``--device cuda`` (default ``cpu``): both simulators train on the GPU. mpifl runs with
``server.device = "cuda"`` (trainer, samples and aggregation on the device, as ``mpifl run``
puts them); pfl picks its PyTorch device from ``PFL_PYTORCH_DEVICE`` (``pfl.internal.ops.
pytorch_ops.get_default_device``; unset, it takes CUDA whenever present), which this script sets
to ``--device`` in every mode, so a CPU run stays on the CPU on a GPU node too. On CUDA pfl's
clients' samples are put on the device once, as mpifl's are (pfl copies each host minibatch to
the device otherwise), and CUDA is synchronised before every clock read. Use ``--separate`` on
a GPU, so that each simulator has the device (and its caching allocator) to itself. The GEMM
reference rate is then the device's float32 GEMM.

Install pfl-research first (an optional extra; it must not replace the installed torch):

    echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > /tmp/c.txt
    pip install -e ".[peers]" -c /tmp/c.txt      # or: pip install "pfl[pytorch]==0.6.0" -c /tmp/c.txt

Run (2 threads, as in docs/BENCHMARKS.md):

    python analysis/peer_bench.py --rounds 40 --threads 2                       # W1, interleaved
    python analysis/peer_bench.py --separate 3 --rounds 40 --threads 2 --quiet-wait 120  # W1
    python analysis/peer_bench.py --model cnn_mnist --separate 3 --rounds 18 \\
        --warmup 3 --trainer auto,vmap --threads 2 --quiet-wait 120             # W2, separate
    python analysis/peer_bench.py --model pfl_simple_cnn --separate 1 --rounds 5 \\
        --threads 2                                                             # W3, separate
    python analysis/peer_bench.py --model pfl_simple_cnn --separate 1 --rounds 12 --device cuda
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "jobs" / "fmnist-fedfv.toml"
OVERRIDES = ['server.algorithm="fedavg"', "run.eval_every=1000000", "run.checkpoint_every=0"]
WORKLOADS = {"mlp": "W1", "cnn_mnist": "W2", "pfl_simple_cnn": "W3"}
TRAINERS = ("auto", "vmap", "loop")
# W3: pfl-research's CIFAR-10 benchmark (configs/baseline.yaml: cifar10_iid, 50 data points a
# user, cohort 50, B = 10, E = 1, local lr 0.1, WeightByUser) on analysis/pfl_models.py's CNN.
# 60,000 images in 1,000 IID clients of 60; round(60 * 5/6) = 50 of each train.
W3 = [f'plugins.path=["{Path(__file__).resolve().parent}"]', 'plugins.modules=["pfl_models"]',
      'data.partition="iid"', "data.num_clients=1000", f"data.train_fraction={5 / 6!r}",
      "server.clients_per_round=50", "client.batch_size=10", "client.epochs=1", "client.lr=0.1",
      'fedavg.weighting="uniform"']
W3_DATA = ["cifar10", "cifar10_like"]  # the real images where mpifl finds them, else the stand-in


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have spent busy (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def other_cores(seconds: float) -> float | None:
    """Cores' worth of CPU that processes other than this one used over ``seconds`` (sampled)."""
    b0, c0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
    time.sleep(seconds)
    b1, c1, t1 = busy_seconds(), time.process_time(), time.perf_counter()
    return None if b0 is None else max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0)


QUIET_CORES = 0.15  # a round (or a wait window) is "quiet" when others used less than this


class Meter:
    """Wall time of an interval and the cores' worth of CPU other processes used in it."""

    def start(self) -> None:
        self.b, self.c, self.t = busy_seconds(), time.process_time(), time.perf_counter()

    def stop(self) -> tuple[float, float]:
        b, c, t = busy_seconds(), time.process_time(), time.perf_counter()
        others = math.nan if b is None else max(0.0, (b - self.b) - (c - self.c)) / (t - self.t)
        return t - self.t, others


def wait_quiet(limit_s: float, below: float = QUIET_CORES, window_s: float = 5.0) -> str:
    """Wait (at most ``limit_s``) for a ``window_s`` window in which other processes use less
    than ``below`` cores; returns what was seen, for the log."""
    t0 = time.perf_counter()
    while True:
        used = other_cores(window_s)
        waited = time.perf_counter() - t0
        if used is None or used < below or waited >= limit_s:
            seen = "n/a" if used is None else f"{used:.2f}"
            return (f"other processes {seen} cores over the last {window_s:.0f} s "
                    f"(waited {waited:.0f} s{'' if used is None or used < below else ', gave up'})")


def overrides(model: str, trainer: str, rounds: int, device: str = "cpu",
              dataset: str | None = None) -> list[str]:
    """The ``--set`` overrides of jobs/fmnist-fedfv.toml for a workload (W3: on ``dataset``)."""
    extra = [] if model == "mlp" else [f'model.name="{model}"']
    if WORKLOADS[model] == "W3":
        extra += [*W3, f'data.dataset="{dataset or W3_DATA[-1]}"']
    return [*OVERRIDES, *extra, f'client.trainer="{trainer}"', f"run.rounds={rounds}",
            f'server.device="{device}"']


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it counts it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Workload:
    """The config, data, model and client schedule of W1 / W2 (no trainer)."""

    def __init__(self, model: str, trainer: str, rounds: int, device: str = "cpu"):
        from mpifl.core.errors import DataError
        from mpifl.experiment.assemble import build_parts
        from mpifl.experiment.config import load_config
        from mpifl.experiment.plan import make_plan
        from mpifl.runtime.server import select_clients

        for dataset in (W3_DATA if WORKLOADS[model] == "W3" else [None]):
            cfg = load_config(CONFIG, overrides(model, trainer, rounds, device, dataset))
            self.plan = make_plan(cfg)
            try:
                self.parts = build_parts(self.plan)
                break
            except DataError as exc:  # W3: CIFAR-10 absent here; its stand-in next
                if dataset == W3_DATA[-1] or dataset is None:
                    raise
                print(f"W3: {dataset} not found ({str(exc).splitlines()[0][:120]}); "
                      f"generated stand-in next", flush=True)
        self.name, self.cfg = WORKLOADS[model], cfg
        self.device = torch.device(device)
        self.select = lambda t: select_clients(cfg.run.seed, t, self.parts.fed.num_train,
                                               cfg.server.clients_per_round, cfg.server.sampling)

    def round_sizes(self, rounds: int) -> tuple[list[int], list[int]]:
        """Samples and minibatches of each round (E x ceil(n_k / B) per client)."""
        fed, c = self.parts.fed, self.cfg.client
        sizes = [int(fed.num_train[self.select(t)].sum()) for t in range(rounds)]
        steps = [c.epochs * sum(-(-int(n) // c.batch_size) for n in fed.num_train[self.select(t)])
                 for t in range(rounds)]
        return sizes, steps


class MpiflRounds:
    """mpifl's server loop for the workload, one round per call (what ``mpifl run`` runs, one
    process)."""

    def __init__(self, wl: Workload, out: Path):
        from mpifl import aggregators
        from mpifl.experiment.assemble import make_trainer, trainer_path
        from mpifl.runtime.backends import LocalClients
        from mpifl.runtime.server import Server, ServerSetup
        from mpifl.store.results import MetricSet, ResultsWriter

        from mpifl.experiment.assemble import device_for

        cfg, parts = wl.cfg, wl.parts
        self.cfg, self.parts, self.select = cfg, parts, wl.select
        self.device = dev = device_for(wl.plan, 0)  # server.device, as `mpifl run` picks it
        self.path, self.why = trainer_path(wl.plan, parts, dev)
        self.trainer = make_trainer(wl.plan, parts, dev)
        clients = LocalClients(self.trainer, parts.fed, dev)
        agg = aggregators.create(cfg.server.algorithm, seed=cfg.run.seed, **cfg.algorithm_params())
        writer = ResultsWriter(out, cfg.to_json(),
                               MetricSet(parts.fed.num_clients, len(parts.layout.layers)),
                               world_size=1, algorithm=cfg.server.algorithm)
        self.server = Server(wl.plan.rounds,
                             ServerSetup(parts.fed, parts.layout, clients, agg, writer, dev))
        self.w = parts.w0.clone().to(dev)  # Server.run moves w to server.device first
        self.rnd = 0

    def round(self) -> tuple[float, dict]:
        from mpifl.aggregators import ObservesParams

        sync(self.device)
        t0 = time.perf_counter()
        self.w, row = self.server._round(self.rnd, self.w)
        if isinstance(self.server.aggregator, ObservesParams):  # AFL keeps the parameters
            self.server.aggregator.observe_params(self.w)
        sync(self.device)
        dt = time.perf_counter() - t0
        self.rnd += 1
        return dt, row


class PflModule(nn.Module):
    """A model of mpifl's zoo (same layers, same initial parameters) with the ``loss`` and
    ``metrics`` methods pfl's PyTorchModel asks for."""

    def __init__(self, template: nn.Module, channels_last_input: bool = False):
        super().__init__()
        self.net = copy.deepcopy(template)
        self.channels_last_input = channels_last_input

    def forward(self, x):
        if self.channels_last_input:  # pfl's benchmark CNN: (N, H, W, C) -> (N, C, H, W) view
            x = x.permute(0, 3, 1, 2)
        return self.net(x)

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y)

    def metrics(self, x, y, eval=False):
        from pfl.metrics import Weighted
        with torch.no_grad():
            loss = nn.functional.cross_entropy(self(x), y, reduction="sum").item()
        return {"loss": Weighted(loss, len(y))}


PflMLP = PflModule  # the W1 name


def pfl_setup(wl: Workload, rounds: int):
    """pfl-research's objects for the workload, on the same data, model and client schedule."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    fed, c = wl.parts.fed, wl.cfg.client
    w3 = wl.name == "W3"
    x, y = torch.from_numpy(fed.x).float(), torch.from_numpy(fed.y).long()
    if w3:  # pfl's CIFAR-10 benchmark stores channels-last images (its CNN transposes them)
        x = x.permute(0, 2, 3, 1)
    # Each client's training samples, as contiguous tensors (pfl slices them in order), on the
    # device where pfl trains (mpifl's trainer holds its samples there too).
    dev = wl.device
    data = {k: (x[fed.train_indices(k)].contiguous().to(dev),
                y[fed.train_indices(k)].contiguous().to(dev))
            for k in range(fed.num_clients)}
    # The same clients in the same rounds as mpifl (pfl draws cohort_size ids per round).
    schedule = iter([int(k) for t in range(rounds + 1) for k in wl.select(t)])
    dataset = FederatedDataset(lambda k: Dataset(raw_data=list(data[k]), user_id=k),
                               user_sampler=lambda: next(schedule))
    net = PflModule(wl.parts.model, channels_last_input=w3)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    backend = SimulatedBackend(training_data=dataset, val_data=None,
                               postprocessors=[WeightByUser() if w3 else WeightByDatapoints()])
    params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=10**9,
                               train_cohort_size=wl.cfg.server.clients_per_round,
                               val_cohort_size=0)
    train = NNTrainHyperParams(local_learning_rate=c.lr, local_num_epochs=c.epochs,
                               local_batch_size=c.batch_size)
    return FederatedAveraging(), params, backend, model, train, NNEvalHyperParams(local_batch_size=1000)


def run_pfl(wl: Workload, rounds: int, mp: MpiflRounds | None = None, quiet_wait: float = 0):
    """pfl's rounds, timed between its ``after_central_iteration`` callbacks; with ``mp``, one
    mpifl round inside each callback (interleaved), timed on its own and left out of pfl's.
    Returns pfl's round times, the cores other processes used in each, mpifl's round times and
    rows. ``quiet_wait`` > 0 (pfl alone): before each round, wait up to that many seconds for
    quiet (:func:`wait_quiet`), outside the timed interval."""
    from pfl.callback.base import TrainingProcessCallback
    from pfl.metrics import Metrics

    algo, params, backend, model, train, evalp = pfl_setup(wl, rounds)
    t_mp, t_pfl, others, rows = [], [], [], []
    meter = Meter()

    class Timer(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            if quiet_wait:
                wait_quiet(quiet_wait, window_s=2.0)
            sync(wl.device)
            meter.start()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            sync(wl.device)
            dt, busy = meter.stop()
            t_pfl.append(dt)
            others.append(busy)
            if mp is not None:
                dt, row = mp.round()
                t_mp.append(dt)
                rows.append(row)
            if quiet_wait:
                wait_quiet(quiet_wait, window_s=2.0)
            sync(wl.device)
            meter.start()
            return False, Metrics()

    algo.run(algorithm_params=params, backend=backend, model=model, model_train_params=train,
             model_eval_params=evalp, callbacks=[Timer()], send_metrics_to_platform=False)
    return t_pfl, others, t_mp, rows


def train_flops_per_sample(model: nn.Module, input_shape, batch: int = 50) -> float:
    """Training FLOPs of one sample (forward + backward of the cross-entropy loss), counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on a minibatch of ``batch``."""
    from torch.utils.flop_counter import FlopCounterMode

    net = copy.deepcopy(model).train()
    x = torch.zeros(batch, *input_shape)
    y = torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / batch


def gemm_rate(n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """FLOP/s of an n x n float32 GEMM on ``device`` (median of ``repeats`` after one)."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    times = []
    for k in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        if k:
            times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times)


def describe(wl: Workload, rounds: int, warmup: int) -> float:
    """Print the workload line; return the mean training FLOPs of a steady round."""
    from mpifl.bench.simulate import model_flops

    fed, c = wl.parts.fed, wl.cfg.client
    sizes, steps = wl.round_sizes(rounds)
    per_sample = train_flops_per_sample(wl.parts.model, fed.input_shape, c.batch_size)
    analytic = model_flops(wl.parts.model, fed.input_shape)["train"]
    train_flops = statistics.mean(sizes[warmup:]) * c.epochs * per_sample
    print(f"workload {wl.name}: model {wl.cfg.model.name}, {fed.num_clients} clients, "
          f"{wl.cfg.server.clients_per_round} per round, B={c.batch_size}, E={c.epochs}, "
          f"lr={c.lr}, d={wl.parts.layout.d}, input {tuple(fed.input_shape)}; mean samples/round "
          f"{statistics.mean(sizes):.0f}, minibatches/round {statistics.mean(steps):.1f}, "
          f"training MFLOP/sample {per_sample / 1e6:.2f} (FlopCounterMode; analytic "
          f"{analytic / 1e6:.2f}), training GFLOP/round {train_flops / 1e9:.2f}")
    return train_flops


def header(args) -> None:
    try:
        import pfl
        from pfl.internal.ops.pytorch_ops import get_default_device
        peer = f"pfl {pfl.__version__}; pfl's device {get_default_device()}"
    except ImportError as exc:  # --only mpifl runs without it
        peer = f"pfl not importable ({exc})"
    dev = torch.device(args.device)
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    print(f"load average at start: {loadavg()}  (cpus: {os.cpu_count()}, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}; device {args.device}: "
          f"{where}; {peer})", flush=True)


def main_interleaved(args) -> int:
    trainer = args.trainer.split(",")[0]
    header(args)
    wl = Workload(args.model, trainer, args.rounds, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        mp = MpiflRounds(wl, Path(tmp) / "peer.h5")
        print(f"mpifl trainer: {mp.path} (client.trainer={trainer}: {mp.why})")
        t_pfl, _, t_mp, rows = run_pfl(wl, args.rounds, mp)
    w = args.warmup
    train_flops = describe(wl, args.rounds, w)
    med_mp, med_pfl = statistics.median(t_mp[w:]), statistics.median(t_pfl[w:])
    gemm = gemm_rate(device=wl.device)
    print("per round (ms), mpifl:", " ".join(f"{t * 1e3:.1f}" for t in t_mp))
    print("per round (ms), pfl:  ", " ".join(f"{t * 1e3:.1f}" for t in t_pfl))
    print(f"steady round (median of rounds {w}..{args.rounds - 1}): mpifl {med_mp * 1e3:.1f} ms, "
          f"pfl {med_pfl * 1e3:.1f} ms, ratio pfl/mpifl {med_pfl / med_mp:.2f}x")
    print(f"training GFLOP/s: mpifl {train_flops / med_mp / 1e9:.1f}, pfl "
          f"{train_flops / med_pfl / 1e9:.1f}; GEMM 2048^2 float32 {gemm / 1e9:.1f} GFLOP/s "
          f"(fractions {train_flops / med_mp / gemm:.2f}, {train_flops / med_pfl / gemm:.2f})")
    print(f"mpifl train_loss rounds 0..2: {[round(r['train_loss'], 4) for r in rows[:3]]}")
    print(f"load average at end: {loadavg()}")
    return 0


def main_only(args) -> int:
    """One simulator alone in this process; the last line is ``RESULT {json}``."""
    trainer = args.trainer.split(",")[0]
    header(args)
    load0 = os.getloadavg()[0]
    wl = Workload(args.model, trainer, args.rounds, args.device)
    path, rows = None, []
    if args.only == "mpifl":
        with tempfile.TemporaryDirectory() as tmp:
            mp = MpiflRounds(wl, Path(tmp) / "peer.h5")
            path = mp.path
            print(f"mpifl trainer: {mp.path} (client.trainer={trainer}: {mp.why})", flush=True)
            times, others, meter = [], [], Meter()
            for _ in range(args.rounds):
                if args.quiet_wait:
                    wait_quiet(args.quiet_wait, window_s=2.0)
                meter.start()
                _, row = mp.round()  # timed by the meter: the same interval as mp.round's own
                dt, busy = meter.stop()
                times.append(dt)
                others.append(busy)
                rows.append(row)
    else:
        times, others = run_pfl(wl, args.rounds, quiet_wait=args.quiet_wait)[:2]
    w = args.warmup
    train_flops = describe(wl, args.rounds, w)
    steady = statistics.median(times[w:])
    quiet = [t for t, o in zip(times[w:], others[w:]) if o < QUIET_CORES]
    steady_quiet = statistics.median(quiet) if len(quiet) >= max(3, (len(times) - w) // 3) else None
    gemm = gemm_rate(device=wl.device)
    print(f"per round (ms), {args.only}:", " ".join(f"{t * 1e3:.1f}" for t in times))
    print("other processes' cores per round:", " ".join(f"{o:.2f}" for o in others))
    print(f"steady round (median of rounds {w}..{args.rounds - 1}): {args.only} "
          f"{steady * 1e3:.1f} ms; training GFLOP/s {train_flops / steady / 1e9:.1f}; GEMM "
          f"2048^2 float32 {gemm / 1e9:.1f} GFLOP/s (fraction {train_flops / steady / gemm:.2f})")
    print(f"quiet steady rounds (other processes < {QUIET_CORES} cores): {len(quiet)} of "
          f"{len(times) - w}, median " + ("n/a (too few)" if steady_quiet is None else
                                          f"{steady_quiet * 1e3:.1f} ms"))
    if rows:
        print(f"mpifl train_loss rounds 0..2: {[round(r['train_loss'], 4) for r in rows[:3]]}")
    print(f"load average at end: {loadavg()}")
    result = dict(sim=args.only, trainer=trainer, path=path, workload=wl.name, times=times,
                  others=others, steady=steady, steady_quiet=steady_quiet, n_quiet=len(quiet),
                  train_flops=train_flops, gemm=gemm, load_start=load0,
                  load_end=os.getloadavg()[0])
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main_separate(args) -> int:
    """N cycles of child processes, one simulator each, alternating; the summary at the end."""
    variants = [("mpifl", t) for t in args.trainer.split(",")] + [("pfl", "auto")]
    print(f"separate processes: {args.separate} cycles of {len(variants)} "
          f"({', '.join(s if s == 'pfl' else f'mpifl[{t}]' for s, t in variants)}), workload "
          f"{WORKLOADS[args.model]}, {args.rounds} rounds each, warm-up {args.warmup}, "
          f"{args.threads} threads, device {args.device}; load average {loadavg()}", flush=True)
    # a SIGTERM (timeout(1)) raises SystemExit, so subprocess.run kills the running child too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    results: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
    for cycle in range(args.separate):
        for sim, trainer in (variants if cycle % 2 == 0 else variants[::-1]):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--only", sim,
                   "--model", args.model, "--trainer", trainer, "--rounds", str(args.rounds),
                   "--warmup", str(args.warmup), "--threads", str(args.threads),
                   "--quiet-wait", str(args.quiet_wait), "--device", args.device]
            quiet = wait_quiet(args.quiet_wait) if args.quiet_wait else ""
            print(f"\n=== cycle {cycle + 1}, {sim}" + ("" if sim == "pfl" else f"[{trainer}]")
                  + f": load average before {loadavg()}" + (f"; {quiet}" if quiet else ""),
                  flush=True)
            b0, t0 = busy_seconds(), time.perf_counter()
            c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            b1, t1 = busy_seconds(), time.perf_counter()
            sys.stdout.write(proc.stdout)
            if proc.returncode:
                sys.stdout.write(proc.stderr)
                print(f"child failed with status {proc.returncode}")
                return 1
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
            res = json.loads(line[len("RESULT "):])
            own = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
            res["others_run"] = None if b0 is None else max(0.0, (b1 - b0) - own) / (t1 - t0)
            if res["others_run"] is not None:
                print(f"other processes used {res['others_run']:.2f} cores on average during "
                      f"this child ({t1 - t0:.0f} s with its waits; the child itself "
                      f"{own / (t1 - t0):.2f})")
            results[(sim, trainer)].append(res)
    print(f"\n=== summary: workload {WORKLOADS[args.model]}, steady round = median of rounds "
          f"{args.warmup}..{args.rounds - 1} of each process; load average now {loadavg()}")
    gemm = statistics.median(r["gemm"] for rs in results.values() for r in rs)
    flops = statistics.median(r["train_flops"] for rs in results.values() for r in rs)
    print(f"training GFLOP/round {flops / 1e9:.2f}; GEMM 2048^2 float32 on {args.device}, "
          f"median over the processes {gemm / 1e9:.1f} GFLOP/s")
    print(f"a run's figure: the median of its quiet steady rounds (other processes < "
          f"{QUIET_CORES} cores during the round) where at least a third were quiet, else of all "
          f"its steady rounds (marked *: disturbed)")
    medians, figures = {}, {}
    for (sim, trainer), rs in results.items():
        name = "pfl" if sim == "pfl" else f"mpifl[{trainer}" + (
            f" = {rs[0]['path']}]" if trainer == "auto" else "]")
        figs = [r["steady_quiet"] if r["steady_quiet"] is not None else r["steady"] for r in rs]
        figures[(sim, trainer)] = figs
        med = medians[(sim, trainer)] = statistics.median(figs)
        runs = " ".join(f"{f * 1e3:.1f}" + ("" if r["steady_quiet"] is not None else "*")
                        + f" ({r['n_quiet']} quiet)" for f, r in zip(figs, rs))
        loads = " ".join(f"{r['load_start']:.2f}" for r in rs)
        print(f"{name:22s} runs (ms): {runs}; median {med * 1e3:.1f} ms; "
              f"{flops / med / 1e9:.1f} GFLOP/s, fraction of GEMM {flops / med / gemm:.2f}; "
              f"load average at starts {loads}")
    pfl_med = medians[("pfl", "auto")]
    for (sim, trainer), med in medians.items():
        if sim == "mpifl":
            per_cycle = [p / m for p, m in zip(figures[("pfl", "auto")], figures[(sim, trainer)])]
            print(f"ratio pfl/mpifl[{trainer}]: {pfl_med / med:.2f}x (of the medians); per "
                  f"cycle {' '.join(f'{q:.2f}' for q in per_cycle)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(WORKLOADS), default="mlp",
                    help="mlp: workload W1 (default); cnn_mnist: workload W2; pfl_simple_cnn: "
                         "workload W3 (pfl-research's CIFAR-10 benchmark shape)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where both simulators train (default cpu; cuda: mpifl's "
                         "server.device and pfl's PFL_PYTORCH_DEVICE)")
    ap.add_argument("--trainer", default="auto",
                    help="mpifl's client.trainer: auto (default), vmap or loop; with --separate "
                         "a comma-separated list, one child per trainer and cycle")
    ap.add_argument("--only", choices=("mpifl", "pfl"),
                    help="run one simulator alone in this process")
    ap.add_argument("--separate", type=int, default=0, metavar="N",
                    help="N alternating cycles of child processes (--only) of each")
    ap.add_argument("--quiet-wait", type=float, default=0, metavar="S",
                    help="with --separate or --only: before each child (5 s window) and each "
                         "round (2 s window), wait up to S seconds for other processes to use "
                         "under 0.15 cores (default 0: no wait)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of each (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="first rounds left out (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    for t in args.trainer.split(","):
        if t not in TRAINERS:
            ap.error(f"--trainer: {t!r} is not one of {', '.join(TRAINERS)}")
    if args.separate and args.only:
        ap.error("--separate runs --only children itself; give one of them")
    if args.rounds <= args.warmup:
        ap.error("--rounds must exceed --warmup")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    # pfl reads it at every tensor conversion; unset, it would take a present GPU even for a
    # CPU run. Children (--separate) inherit it.
    os.environ["PFL_PYTORCH_DEVICE"] = args.device
    try:
        import pfl.algorithm  # noqa: F401 -- what fails where a dependency (scipy) is missing
    except ImportError as exc:
        if args.only != "mpifl":
            sys.exit(f"peer_bench: pfl-research cannot be imported ({exc}); see this script's "
                     "docstring (pip install -e '.[peers]' with a torch==<installed> "
                     "constraint); --only mpifl runs without it")
    if args.separate:
        return main_separate(args)
    if args.only:
        return main_only(args)
    return main_interleaved(args)


if __name__ == "__main__":
    raise SystemExit(main())
