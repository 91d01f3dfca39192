"""Where a W2 round goes (docs/BENCHMARKS.md, "Peer benchmark W2"): the per-client loop trainer
against a plain torch loop on the same model and minibatches, and a torch.profiler table of one
loop round. Synthetic inputs of Fashion-MNIST's shape: 10 clients x 560 samples, B = 50, E = 1.

    python analysis/w2_profile.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from mpifl.clients.interface import TrainOptions
from mpifl.clients.loop import LoopTrainer
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    x, y = torch.randn(5600, 1, 28, 28), torch.randint(0, 10, (5600,))
    model = build_model("cnn_mnist", (1, 28, 28), 10)
    layout = ParamLayout.from_module(model)
    w = layout.flatten_module(model)
    idx = [np.arange(i * 560, (i + 1) * 560) for i in range(10)]
    trainer = LoopTrainer(model, layout, x, y,
                          TrainOptions(epochs=1, batch_size=50, pretrain_losses=False))
    trainer.run_round(w, 0, 0.1, np.arange(10), idx)  # warm-up

    def plain() -> None:  # what any per-client simulator runs: SGD on contiguous minibatches
        net = trainer.net
        for ix in idx:
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            xs, ys = x[ix], y[ix]
            for s in range(0, len(ix), 50):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xs[s:s + 50]), ys[s:s + 50]).backward()
                opt.step()

    for r in range(3):  # interleaved
        t0 = time.perf_counter()
        trainer.run_round(w, r + 1, 0.1, np.arange(10), idx)
        a = time.perf_counter() - t0
        t0 = time.perf_counter()
        plain()
        b = time.perf_counter() - t0
        print(f"round {r}: mpifl loop {a:.3f} s, plain torch loop {b:.3f} s, ratio {b / a:.3f}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.run_round(w, 9, 0.1, np.arange(10), idx)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
