"""A stop signal during a long round's training is acted on at the next local step (the
trainers' :func:`mpifl.clients.trainer.check_stop`, armed by the runtime around a round's
training), not when the round's training ends, and the resumed run equals an uninterrupted one.

Promptness is measured in steps trained, never in seconds: the signal is sent (a real SIGTERM
to this process, recorded by the real :class:`mpifl.runtime.signals.StopRequest`) from inside
step k's computation, and exactly k steps are trained. The one-process run is driven through
``mpifl.run`` with a plugin model that counts its training forwards and signals at a chosen
one.
"""

from __future__ import annotations

import math
import signal
import sys
import textwrap
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.nn.utils import parameters_to_vector

import mpifl
from mpifl.clients import DittoTrainer, LoopTrainer, VmapTrainer
from mpifl.clients.interface import TrainOptions
from mpifl.clients.trainer import TrainingStopped, stop_between_steps
from mpifl.core.layout import ParamLayout
from mpifl.models import build_model
from mpifl.runtime.signals import StopRequest

SIZES = (30, 45, 12, 60)
IDS = np.array([3, 0, 7, 5])
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture
def stop():
    """A real, installed StopRequest; the previous handlers come back afterwards."""
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        yield StopRequest().install()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def data(shape=(5,), classes=3):
    g = torch.Generator().manual_seed(3)
    n = sum(SIZES)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y, np.split(np.random.default_rng(3).permutation(n), np.cumsum(SIZES)[:-1])


def signal_at(k: int, calls: list[int]):
    """A step counter that SIGTERMs this process during the k-th step's computation."""
    def count(*_args) -> None:
        calls.append(1)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGTERM)
    return count


@pytest.mark.parametrize("kind", ["vmap", "loop", "ditto"])
def test_a_stop_during_training_ends_it_at_the_next_step(kind, stop):
    net = build_model("mlp", (5,), 3, hidden=(8,), seed=0)
    x, y, idx = data()
    options = TrainOptions(epochs=4, batch_size=5)
    layout = ParamLayout.from_module(net)
    trainer = {"vmap": VmapTrainer, "loop": LoopTrainer,
               "ditto": DittoTrainer}[kind](net, layout, x, y, options)
    per_client = [4 * math.ceil(n / 5) for n in SIZES]
    # all steps of the round: one batched step per step index (vmap; Ditto twice, its global
    # and its personal models), one per client and step (loop)
    total = {"vmap": max(per_client), "ditto": 2 * max(per_client), "loop": sum(per_client)}[kind]
    k = total // 3
    calls: list[int] = []
    if kind == "loop":  # a forward in train mode is one step
        trainer.net.register_forward_pre_hook(signal_at(k, calls))
    else:
        step = trainer._step_grad
        count = signal_at(k, calls)
        trainer._step_grad = lambda *a: (count(), step(*a))[1]
    w = parameters_to_vector(net.parameters()).detach()
    state = w.expand(len(IDS), -1).clone() if kind == "ditto" else None  # personal models
    with stop_between_steps(lambda: stop.requested), pytest.raises(TrainingStopped):
        trainer.run_round(w, 2, 0.1, IDS, idx, None, state)
    assert stop.reason == "SIGTERM"
    assert len(calls) == k < total  # the step under way ended, no other began
    # disarmed (outside the block), the same trainer trains the whole round
    calls.clear()
    trainer.run_round(w, 2, 0.1, IDS, idx, None, state)
    assert len(calls) == total


def test_a_stop_requested_before_training_trains_no_step(stop):
    net = build_model("mlp", (5,), 3, hidden=(8,), seed=0)
    x, y, idx = data()
    trainer = VmapTrainer(net, ParamLayout.from_module(net), x, y,
                          TrainOptions(epochs=1, batch_size=5))
    calls: list[int] = []
    step = trainer._step_grad
    trainer._step_grad = lambda *a: (calls.append(1), step(*a))[1]
    stop.request("test")
    with stop_between_steps(lambda: stop.requested), pytest.raises(TrainingStopped):
        trainer.run_round(parameters_to_vector(net.parameters()).detach(), 0, 0.1, IDS, idx)
    assert calls == []


# --------------------------------------------------------------------------- a whole run

PLUGIN = '''
import os
import signal

import torch
from torch import nn

from mpifl.plugin import register_model

#: one entry per forward in train mode (a local step of the loop trainer)
CALLS = []
#: SIGTERM this process during this training forward (None: never)
SIGNAL_AT = None


class Probe(nn.Module):
    def __init__(self, d, classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, classes))

    def forward(self, x):
        if self.training:
            CALLS.append(len(x))
            if len(CALLS) == SIGNAL_AT:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.net(x)


@register_model("stop_probe")
def stop_probe(input_shape, num_classes, *, seed, **params):
    torch.manual_seed(seed)
    d = 1
    for s in input_shape:
        d *= s
    return Probe(d, num_classes)
'''

JOB = {
    "run": {"name": "prompt", "seed": 4, "rounds": 2, "eval_every": 1, "checkpoint_every": 1},
    "data": {"dataset": "synthetic", "partition": "natural", "num_clients": 8},
    "model": {"name": "stop_probe"},
    "client": {"epochs": 2, "batch_size": 16, "lr": 0.05, "trainer": "loop"},
    "server": {"algorithm": "fedavg", "clients_per_round": 8},
}
MEASURED = ("time_", "peak_rss", "bytes")


def datasets(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def test_a_stopped_round_is_abandoned_within_a_step_and_resume_is_exact(tmp_path):
    (tmp_path / "stop_probe_plugin.py").write_text(textwrap.dedent(PLUGIN))
    job = {**JOB, "plugins": {"modules": ["stop_probe_plugin"], "path": [str(tmp_path)]}}
    ref, out = tmp_path / "ref.h5", tmp_path / "stopped.h5"

    mpifl.run(job, out=ref, progress=False)
    probe = sys.modules["stop_probe_plugin"]
    with h5py.File(ref, "r") as f:
        sizes = f["clients/num_train"][()]
    # every client trains every round: E * ceil(n / B) steps each, counted by hand
    per_round = int(sum(2 * math.ceil(n / 16) for n in sizes))
    setup = len(probe.CALLS) - 2 * per_round  # training forwards outside the rounds, if any
    assert setup >= 0

    probe.CALLS.clear()
    probe.SIGNAL_AT = setup + per_round + per_round // 2  # halfway through round 2's training
    try:
        with pytest.raises(mpifl.RunStopped, match="SIGTERM"):
            mpifl.run(job, out=out, progress=False)
        trained = len(probe.CALLS) - setup - per_round
        probe.SIGNAL_AT = None
        # the step under way ended and none began after it: half the round, not all of it
        assert trained == per_round // 2
        with h5py.File(out, "r") as f:  # round 2 dropped, round 1 checkpointed and kept
            assert f["rounds/round"][()].tolist() == [0]
        probe.CALLS.clear()
        mpifl.run(job, out=out, mode="resume", progress=False)
    finally:
        probe.SIGNAL_AT = None
    assert len(probe.CALLS) == setup + per_round  # round 2, trained again from the start

    a, b = datasets(out), datasets(ref)
    assert set(a) == set(b) and {"model/global", "eval/client_accuracy"} <= set(a)
    for name, x in a.items():
        if not any(m in name for m in MEASURED):
            y = b[name]
            if x.dtype.kind == "f":
                x, y = x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
            np.testing.assert_array_equal(x, y, err_msg=name)
