"""Peer benchmark: a simulated FedAvg round in mpifl against Apple's pfl-research, interleaved.

Workload W1 (docs/BENCHMARKS.md, "Peer benchmark"): FedAvg on Fashion-MNIST split into 2 label
shards per client, 100 clients, 10 per round, MLP 784-200-200-10, B = 50, E = 1, lr 0.1, one
process. mpifl runs jobs/fmnist-fedfv.toml with ``server.algorithm = "fedavg"`` and a large
``run.eval_every``; pfl-research 0.6.0 runs its PyTorch simulation (``SimulatedBackend``,
``FederatedAveraging``, ``PyTorchModel``) on the same clients, the same per-client samples,
the same initial model and the same clients in every round, weighted by sample count.

The two are interleaved round by round in one process: pfl's training loop calls back after
each of its rounds, and the callback runs one mpifl round (timed on its own); a pfl round is
the time between two callbacks minus the mpifl round inside. The first ``--warmup`` rounds of
each are left out; the median of the rest is each one's "steady round".

What an mpifl round is here: the server's round (client selection, local training of the 10
clients, aggregation, model update: ``Server._round``) and ``observe_params``, with the trainer
and rule a ``mpifl run`` builds for the config. Results writing (rank 0's HDF5 file, which the
benchmark does not measure) and evaluation (``eval_every`` large) are not in it; pfl's round does
no evaluation either (``evaluation_frequency`` large) and writes nothing.

Install pfl-research first (an optional extra; it must not replace the installed torch):

    echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > /tmp/c.txt
    pip install -e ".[peers]" -c /tmp/c.txt      # or: pip install "pfl[pytorch]==0.6.0" -c /tmp/c.txt

Run (2 threads, as in docs/BENCHMARKS.md):

    python analysis/peer_bench.py --rounds 40 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "jobs" / "fmnist-fedfv.toml"
OVERRIDES = ['server.algorithm="fedavg"', "run.eval_every=1000000", "run.checkpoint_every=0"]


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


class MpiflRounds:
    """mpifl's server loop for W1, one round per call (what ``mpifl run`` runs, one process)."""

    def __init__(self, rounds: int, out: Path):
        from mpifl import aggregators
        from mpifl.experiment.assemble import build_parts, make_trainer
        from mpifl.experiment.config import load_config
        from mpifl.runtime.backends import LocalClients
        from mpifl.runtime.server import Server, select_clients
        from mpifl.store.results import ResultsWriter

        cfg = load_config(CONFIG, [*OVERRIDES, f"run.rounds={rounds}"])
        self.cfg, self.parts = cfg, build_parts(cfg)
        dev = torch.device("cpu")
        self.trainer = make_trainer(cfg, self.parts, dev)
        clients = LocalClients(self.trainer, self.parts.fed, dev)
        agg = aggregators.create(cfg.server.algorithm, seed=cfg.run.seed, **cfg.algorithm_params())
        writer = ResultsWriter(out, cfg.to_json(), world_size=1,
                               num_clients=self.parts.fed.num_clients,
                               num_layers=len(self.parts.layout.layers),
                               algorithm=cfg.server.algorithm)
        self.server = Server(cfg, self.parts.fed, self.parts.layout, clients, agg, writer, dev)
        self.w = self.parts.w0.clone()
        self.rnd = 0
        self.select = lambda t: select_clients(cfg.run.seed, t, self.parts.fed.num_train,
                                               cfg.server.clients_per_round, cfg.server.sampling)

    def round(self) -> tuple[float, dict]:
        t0 = time.perf_counter()
        self.w, row = self.server._round(self.rnd, self.w)
        self.server.aggregator.observe_params(self.w)
        dt = time.perf_counter() - t0
        self.rnd += 1
        return dt, row


class PflMLP(nn.Module):
    """The MLP of mpifl's model zoo (same layers, same initial parameters) with the ``loss`` and
    ``metrics`` methods pfl's PyTorchModel asks for."""

    def __init__(self, template: nn.Module):
        super().__init__()
        self.net = _clone(template)

    def forward(self, x):
        return self.net(x)

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y)

    def metrics(self, x, y, eval=False):
        from pfl.metrics import Weighted
        with torch.no_grad():
            loss = nn.functional.cross_entropy(self(x), y, reduction="sum").item()
        return {"loss": Weighted(loss, len(y))}


def _clone(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


def pfl_setup(mp: MpiflRounds, rounds: int):
    """pfl-research's objects for W1, on the same data, model and client schedule."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    fed, c = mp.parts.fed, mp.cfg.client
    x, y = torch.from_numpy(fed.x).float(), torch.from_numpy(fed.y).long()
    # Each client's training samples, as contiguous tensors (pfl slices them in order).
    data = {k: (x[fed.train_indices(k)].contiguous(), y[fed.train_indices(k)].contiguous())
            for k in range(fed.num_clients)}
    # The same clients in the same rounds as mpifl (pfl draws cohort_size ids per round).
    schedule = iter([int(k) for t in range(rounds + 1) for k in mp.select(t)])
    dataset = FederatedDataset(lambda k: Dataset(raw_data=list(data[k]), user_id=k),
                               user_sampler=lambda: next(schedule))
    net = PflMLP(mp.parts.model)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    backend = SimulatedBackend(training_data=dataset, val_data=None,
                               postprocessors=[WeightByDatapoints()])
    params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=10**9,
                               train_cohort_size=mp.cfg.server.clients_per_round,
                               val_cohort_size=0)
    train = NNTrainHyperParams(local_learning_rate=c.lr, local_num_epochs=c.epochs,
                               local_batch_size=c.batch_size)
    return FederatedAveraging(), params, backend, model, train, NNEvalHyperParams(local_batch_size=1000)


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = []
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        torch.mm(a, b)
        if k:
            times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="rounds of each (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="first rounds left out (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from pfl.callback.base import TrainingProcessCallback
        from pfl.metrics import Metrics
        import pfl
    except ImportError:
        sys.exit("peer_bench: pfl-research is not installed; see this script's docstring "
                 "(pip install -e '.[peers]' with a torch==<installed> constraint)")
    from mpifl.bench.simulate import model_flops

    print(f"load average at start: {loadavg()}  (cpus: {os.cpu_count()}, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, pfl {pfl.__version__})")
    with tempfile.TemporaryDirectory() as tmp:
        mp = MpiflRounds(args.rounds, Path(tmp) / "w1.h5")
        algo, params, backend, model, train, evalp = pfl_setup(mp, args.rounds)
        t_mp, t_pfl, rows = [], [], []
        mark = [0.0]

        class Interleave(TrainingProcessCallback):
            def on_train_begin(self, *, model):
                mark[0] = time.perf_counter()
                return Metrics()

            def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
                t_pfl.append(time.perf_counter() - mark[0])
                dt, row = mp.round()
                t_mp.append(dt)
                rows.append(row)
                mark[0] = time.perf_counter()
                return False, Metrics()

        algo.run(algorithm_params=params, backend=backend, model=model, model_train_params=train,
                 model_eval_params=evalp, callbacks=[Interleave()], send_metrics_to_platform=False)

    fed = mp.parts.fed
    sizes = [int(fed.num_train[mp.select(t)].sum()) for t in range(args.rounds)]
    flops = model_flops(mp.parts.model, fed.input_shape)
    w = args.warmup
    med_mp, med_pfl = statistics.median(t_mp[w:]), statistics.median(t_pfl[w:])
    train_flops = statistics.mean(sizes[w:]) * mp.cfg.client.epochs * flops["train"]
    gemm = gemm_rate()
    steps = [sum(-(-int(n) // mp.cfg.client.batch_size) for n in fed.num_train[mp.select(t)])
             for t in range(args.rounds)]
    print(f"workload W1: {fed.num_clients} clients, {mp.cfg.server.clients_per_round} per round, "
          f"B={mp.cfg.client.batch_size}, E={mp.cfg.client.epochs}, lr={mp.cfg.client.lr}, "
          f"d={mp.parts.layout.d}; mean samples/round {statistics.mean(sizes):.0f}, "
          f"minibatches/round {statistics.mean(steps):.1f}, "
          f"training GFLOP/round {train_flops / 1e9:.2f}")
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


if __name__ == "__main__":
    raise SystemExit(main())
