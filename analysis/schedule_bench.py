"""The minibatch plan of a round's clients: numpy's keyed order on the host (``pcg64``, a loop
over clients) against the counter-based order drawn on the device (``counter``), same run,
alternating, median of ``--repeats``; prints each and the ratio.

The plan is what a vectorised trainer builds before its first step
(:func:`mpifl.clients.minibatches.minibatch_schedule`): every client's epoch orders, cut into
minibatches and padded. Client sizes are Synthetic(1, 1)'s (the sizes of jobs/scale-1m.toml,
:func:`mpifl.data.synthetic.client_sizes`). On a GPU the device's work is synchronised before
the clock stops.

    python analysis/schedule_bench.py --clients 10000 --device cuda
    python analysis/schedule_bench.py --clients 2000 --device cpu --epochs 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import numpy as np
import torch

from mpifl.clients.minibatches import minibatch_schedule
from mpifl.data.synthetic import client_sizes


def timed(fn, device: torch.device) -> float:
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10_000, help="clients in the round")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("schedule_bench: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    sizes = client_sizes(args.clients, seed=0)
    ids = np.arange(args.clients, dtype=np.int64)
    times: dict[str, list[float]] = {"pcg64": [], "counter": []}
    for order in times:  # warm-up: allocator, kernels
        minibatch_schedule(0, 0, ids, sizes, args.epochs, args.batch_size, order=order,
                           device=device)
    for r in range(args.repeats):
        for order in (("pcg64", "counter") if r % 2 == 0 else ("counter", "pcg64")):
            times[order].append(timed(functools.partial(
                minibatch_schedule, 0, r + 1, ids, sizes, args.epochs, args.batch_size,
                order=order, device=device), device))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.clients} clients, {int(sizes.sum())} samples, E = {args.epochs}, "
          f"B = {args.batch_size}, device {device}, torch threads {torch.get_num_threads()}")
    for k, v in med.items():
        print(f"  {k:8s} median {v * 1e3:8.1f} ms  (min {min(times[k]) * 1e3:.1f}, "
              f"max {max(times[k]) * 1e3:.1f}, {args.repeats} runs)")
    print(f"  pcg64 / counter: {med['pcg64'] / med['counter']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
