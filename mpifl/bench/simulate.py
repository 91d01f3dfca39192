"""Benchmark of local training (``mpifl bench simulate``): the vectorised trainer against a
per-client sequential loop, on the same workload in the same run.

The workload is a federated dataset and model built exactly as a run builds them
(:func:`mpifl.experiment.build_parts`), by default from ``jobs/fmnist-fedfv.toml`` (real
Fashion-MNIST, shards partition, MLP 784-200-200-10, B = 50, E = 1, lr 0.1), with 100 clients
per round. Each timed round trains the same m clients from the same global parameters w twice:

- **vectorised**: :meth:`mpifl.clients.VmapTrainer.run_round` (stacked parameters, one
  ``vmap(grad)`` step for all clients of a chunk per step index, padded minibatches);
- **sequential**: :func:`sequential_train`, what other simulators do — one client at a time,
  a ``torch.optim.SGD`` on one ``nn.Module``, the same minibatch order
  (:func:`mpifl.clients.minibatches.client_minibatches`).

Both report the updates ``u_k = w - w_k`` and each client's loss of w before training; their
largest difference is printed (they must agree to float rounding). The round's w then moves by
the mean update (FedAvg), so later rounds train from a new model. A "round" here is local
training only: no aggregation, no communication, no evaluation.

FLOPs are counted analytically per sample (:func:`model_flops`): a Linear layer's forward is
``2 * in * out`` multiply-adds per output position, a Conv2d's ``2 * (Cin/groups) * kh * kw`` per
output element; the backward costs the same again for the weight gradient and again for the
input gradient, except at the first layer (its input needs none). For the MLP this is about
6 flops per weight per training sample (``6 * params - 2 * first layer``). Elementwise work
(bias, ReLU, softmax, SGD update) is not counted. A round's useful FLOPs are
``sum_k n_k * (E * train + forward)`` (training plus the pre-training loss): the padding the
vectorised path computes is not counted. The machine's GEMM rate is a 2048 x 2048 float32
``torch.mm`` timed in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector
from tqdm.auto import tqdm

from mpifl.bench.aggregation import bench_device, machine_info, torch_threads
from mpifl.clients.minibatches import client_minibatches
from mpifl.clients.interface import TrainOptions
from mpifl.clients.trainer import VmapTrainer
from mpifl.core.rng import BENCH_SIMULATE_TAG

#: the main job, the default base of the workload (when the repository's jobs/ is at hand)
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "jobs" / "fmnist-fedfv.toml"
GEMM_N = 2048


def sequential_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, *,
                     round: int, lr: float, client_ids: Sequence[int],
                     sample_idx: Sequence[np.ndarray], epochs: int, batch_size: int,
                     momentum: float = 0.0, weight_decay: float = 0.0,
                     seed: int = 0, order: str = "pcg64") -> tuple[torch.Tensor, torch.Tensor]:
    """Local SGD one client at a time (the baseline): ``torch.optim.SGD`` on ``model``.

    Same contract as the updates and losses of :meth:`mpifl.clients.VmapTrainer.run_round`:
    client ``client_ids[i]`` trains for ``epochs`` epochs of minibatches of ``batch_size`` (0: full
    batch) in the order of :func:`~mpifl.clients.minibatches.client_minibatches` (drawn by
    ``order``, ``client.minibatch_order``), starting from w; ``model`` is overwritten (its parameters are set from w for every client).

    Returns:
        updates (m, d) float32 ``w - w_k`` and losses (m,) float32, each client's mean
        cross-entropy of w on its samples before training.
    """
    params = list(model.parameters())
    updates, losses = [], []
    for cid, idx in zip(client_ids, sample_idx):
        idx = torch.as_tensor(np.asarray(idx, dtype=np.int64), device=x.device)
        with torch.no_grad():
            _load(params, w)              # copies (vector_to_parameters would alias w)
            losses.append(F.cross_entropy(model(x[idx]), y[idx]))
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        for pos in client_minibatches(seed, round, int(cid), len(idx), epochs, batch_size,
                                      order=order):
            batch = idx[torch.as_tensor(pos, device=x.device)]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
        with torch.no_grad():
            updates.append(w - parameters_to_vector(params))
    return torch.stack(updates), torch.stack(losses).float()


def model_flops(model: nn.Module, input_shape: Sequence[int]) -> dict[str, int]:
    """Analytic FLOPs of one sample (see the module docstring): ``forward`` and ``train``
    (forward + backward), counting Linear and Conv2d layers only, and ``params``."""
    layers: list[int] = []

    def hook(mod, _inputs, out):
        if isinstance(mod, nn.Linear):
            layers.append(2 * mod.in_features * out.numel())
        elif isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1]
            layers.append(2 * (mod.in_channels // mod.groups) * k * out.numel())

    hooks = [m.register_forward_hook(hook) for m in model.modules()
             if isinstance(m, (nn.Linear, nn.Conv2d))]
    try:
        p = next(model.parameters())
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=p.device, dtype=p.dtype))
    finally:
        for h in hooks:
            h.remove()
    fwd = sum(layers)
    train = 3 * fwd - (layers[0] if layers else 0)
    return dict(forward=int(fwd), train=int(train),
                params=int(sum(q.numel() for q in model.parameters())))


def gemm_flops(device: torch.device, n: int = GEMM_N, repeats: int = 5) -> float:
    """Measured float32 GEMM rate (flop/s): median of ``repeats`` n x n ``torch.mm``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    times = []
    for k in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        if k:
            times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times)


def bench_simulate(*, config: str | Path | None = None, overrides: Sequence[str] = (),
                   clients_per_round: int = 100, batch_size: int | None = None,
                   epochs: int | None = None, rounds: int = 3, model: str | None = None,
                   device: str = "cpu", threads: int | None = None,
                   progress: bool = False) -> dict[str, Any]:
    """Time ``rounds`` rounds of local training through both paths (module docstring).

    Args:
        config: TOML experiment file for data, model, client and seed (default
            :data:`DEFAULT_CONFIG` if present, else the built-in defaults, which are the same).
        overrides: ``section.key=value`` strings, as ``mpifl run --set``.
        clients_per_round: m; ``data.num_clients`` is raised to m if smaller.
        batch_size, epochs, model: override ``client.batch_size``, ``client.epochs``,
            ``model.name`` when given.
        rounds: timed rounds (each path); one untimed warm-up call of each path comes first.
        device: ``"cpu"`` or ``"cuda[:N]"``. progress: a tqdm bar on stderr.
        threads: ``torch.set_num_threads`` for the whole benchmark (None: torch's default).
            On a shared machine, small per-client kernels with 2 OpenMP threads can be 30x
            slower than with 1 (threads spin waiting for a busy core): record the load.

    Returns:
        One JSON-serialisable dict: ``vectorised_rounds_per_s``, ``sequential_rounds_per_s``,
        ``speedup`` (their ratio), ``*_client_updates_per_s``, ``*_round_s`` (median seconds),
        ``*_flops_per_s`` (useful FLOPs, module docstring), ``gemm_flops_per_s`` and the
        ``*_gemm_fraction`` of it achieved, ``max_abs_diff_updates`` / ``max_abs_diff_losses``
        between the paths, ``flops_per_sample`` and ``flops_per_round``, ``workload`` and
        ``machine``.

    Raises:
        ValueError: a count out of range or an unavailable device.
        mpifl.core.errors.ConfigError / DataError: a bad config or missing data (one line).
    """
    if clients_per_round < 1 or rounds < 1 or (batch_size is not None and batch_size < 0) \
            or (epochs is not None and epochs < 1) or (threads is not None and threads < 1):
        raise ValueError(f"need clients >= 1, rounds >= 1, batch size >= 0, epochs >= 1, "
                         f"threads >= 1; got {clients_per_round}, {rounds}, {batch_size}, "
                         f"{epochs}, {threads}")
    dev = bench_device(device)
    with torch_threads(threads):
        return _simulate(config, overrides, clients_per_round, batch_size, epochs, rounds, model,
                         dev, progress)


def _simulate(config, overrides, clients_per_round, batch_size, epochs, rounds, model, dev,
              progress) -> dict[str, Any]:
    from mpifl.experiment.config import load_config
    from mpifl.experiment.assemble import build_parts
    from mpifl.experiment.plan import make_plan

    path = config if config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    extra = [f"client.batch_size={batch_size}"] if batch_size is not None else []
    extra += [f"client.epochs={epochs}"] if epochs is not None else []
    extra += [f'model.name="{model}"'] if model is not None else []
    cfg = load_config(path, [*overrides, *extra])
    if cfg.data.num_clients < clients_per_round:
        cfg = load_config(path, [*overrides, *extra, f"data.num_clients={clients_per_round}"])
    parts = build_parts(make_plan(cfg))
    fed, layout = parts.fed, parts.layout
    K, m, c = fed.num_clients, clients_per_round, cfg.client
    seed = cfg.run.seed
    x = torch.from_numpy(fed.x).to(dev)
    y = torch.from_numpy(fed.y).to(dev)
    trainer = VmapTrainer(parts.model, layout, x, y, TrainOptions(
        epochs=c.epochs, batch_size=c.batch_size, momentum=c.momentum,
        weight_decay=c.weight_decay, seed=seed, memory_budget_mb=c.memory_budget_mb, device=dev,
        minibatch_order=c.minibatch_order))
    net = _clone_module(parts.model).to(dev)
    flops = model_flops(net, fed.input_shape)
    seq_kw = dict(epochs=c.epochs, batch_size=c.batch_size, momentum=c.momentum,
                  weight_decay=c.weight_decay, seed=seed, order=c.minibatch_order)
    machine = machine_info(dev)
    gemm = gemm_flops(dev)

    # warm-up (untimed): a few clients through each path
    w = parts.w0.to(dev)
    few = list(range(min(m, 4)))
    idx_few = [fed.train_indices(k) for k in few]
    trainer.run_round(w, 0, c.lr, np.array(few), idx_few)
    sequential_train(net, x, y, w, round=0, lr=c.lr, client_ids=few, sample_idx=idx_few, **seq_kw)

    t_vec, t_seq, diff_u, diff_l, round_flops, samples = [], [], 0.0, 0.0, [], []
    for t in tqdm(range(rounds), disable=not progress, desc="simulate", unit="round"):
        ids = _select(seed, t, K, m)
        idx = [fed.train_indices(int(k)) for k in ids]
        n = np.array([len(i) for i in idx], dtype=np.int64)
        samples.append(int(n.sum()))
        round_flops.append(int(n.sum()) * (c.epochs * flops["train"] + flops["forward"]))
        _sync(dev)
        t0 = time.perf_counter()
        u_vec, l_vec, _ = trainer.run_round(w, t, c.lr, ids, idx)
        _sync(dev)
        t_vec.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        u_seq, l_seq = sequential_train(net, x, y, w, round=t, lr=c.lr, client_ids=ids,
                                        sample_idx=idx, **seq_kw)
        _sync(dev)
        t_seq.append(time.perf_counter() - t0)
        diff_u = max(diff_u, float((u_vec - u_seq).abs().max()))
        diff_l = max(diff_l, float((l_vec - l_seq).abs().max()))
        w = w - u_vec.mean(dim=0)

    total_flops = float(sum(round_flops))
    vec, seq = sum(t_vec), sum(t_seq)
    return {
        "benchmark": "simulate",
        "vectorised_rounds_per_s": rounds / vec,
        "sequential_rounds_per_s": rounds / seq,
        "speedup": seq / vec,
        "vectorised_client_updates_per_s": rounds * m / vec,
        "sequential_client_updates_per_s": rounds * m / seq,
        "vectorised_round_s": statistics.median(t_vec),
        "sequential_round_s": statistics.median(t_seq),
        "vectorised_round_times_s": t_vec,
        "sequential_round_times_s": t_seq,
        "vectorised_flops_per_s": total_flops / vec,
        "sequential_flops_per_s": total_flops / seq,
        "gemm_flops_per_s": gemm,
        "vectorised_gemm_fraction": total_flops / vec / gemm,
        "sequential_gemm_fraction": total_flops / seq / gemm,
        "max_abs_diff_updates": diff_u,
        "max_abs_diff_losses": diff_l,
        "flops_per_sample": flops,
        "flops_per_round": statistics.mean(round_flops),
        "workload": {
            "config": str(path) if path is not None else None, "overrides": list(overrides),
            "dataset": cfg.data.dataset, "partition": cfg.data.partition, "num_clients": K,
            "clients_per_round": m, "batch_size": c.batch_size, "epochs": c.epochs,
            "lr": c.lr, "model": cfg.model.name, "hidden": list(cfg.model.hidden),
            "d": layout.d, "rounds": rounds, "samples_per_round": statistics.mean(samples),
            "seed": seed,
        },
        "machine": machine | {"loadavg_end": machine_info(dev)["loadavg_start"]},
    }


def format_simulate(res: dict[str, Any]) -> str:
    """A short human-readable report of :func:`bench_simulate`."""
    wl, mi = res["workload"], res["machine"]
    g = res["gemm_flops_per_s"]
    lines = [
        f"workload: {wl['dataset']} ({wl['partition']}, K={wl['num_clients']}), {wl['model']} "
        f"d={wl['d']}, m={wl['clients_per_round']} clients/round, B={wl['batch_size']}, "
        f"E={wl['epochs']}, {wl['samples_per_round']:.0f} samples/round, {wl['rounds']} rounds",
        f"{'path':<11}{'rounds/s':>10}{'round s':>10}{'updates/s':>11}{'GFLOP/s':>10}"
        f"{'of GEMM':>9}",
    ]
    for p in ("vectorised", "sequential"):
        lines.append(f"{p:<11}{res[f'{p}_rounds_per_s']:>10.3f}{res[f'{p}_round_s']:>10.3f}"
                     f"{res[f'{p}_client_updates_per_s']:>11.1f}"
                     f"{res[f'{p}_flops_per_s'] / 1e9:>10.2f}"
                     f"{100 * res[f'{p}_gemm_fraction']:>8.1f}%")
    lines += [
        f"speedup (vectorised / sequential rounds/s): {res['speedup']:.2f}x",
        f"max |difference| between the paths: updates {res['max_abs_diff_updates']:.1e}, "
        f"losses {res['max_abs_diff_losses']:.1e}",
        f"GEMM ({GEMM_N}x{GEMM_N} float32 torch.mm): {g / 1e9:.1f} GFLOP/s; useful FLOPs per "
        f"sample: train {res['flops_per_sample']['train']:,}, forward "
        f"{res['flops_per_sample']['forward']:,}",
        f"machine: {mi['device_name']} ({mi['device']}), {mi['torch_threads']} torch threads, "
        f"{mi['affinity_cpus']} usable CPUs, torch {mi['torch_version']}, load average "
        f"{mi['loadavg_start'][0]:.2f} -> {mi['loadavg_end'][0]:.2f}",
    ]
    return "\n".join(lines)


# ---- internals -------------------------------------------------------------------------------

def _select(seed: int, rnd: int, K: int, m: int) -> np.ndarray:
    """m distinct clients of K for round ``rnd`` (sorted), the same for both paths."""
    if m >= K:
        return np.arange(K, dtype=np.int64)
    rng = np.random.default_rng([seed, rnd, BENCH_SIMULATE_TAG])
    return np.sort(rng.choice(K, size=m, replace=False)).astype(np.int64)


def _load(params: list[torch.Tensor], w: torch.Tensor) -> None:
    """Copy the flat w into the parameters' own storage."""
    start = 0
    for p in params:
        p.copy_(w[start:start + p.numel()].view_as(p))
        start += p.numel()


def _clone_module(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
