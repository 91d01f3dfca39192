"""pfl-research's ``simple_cnn`` as an mpifl plugin model, for the peer benchmark's workload W3
(analysis/peer_bench.py, ``--model pfl_simple_cnn``).

The CNN of pfl-research's CIFAR-10 benchmark (apple/pfl-research,
``benchmarks/model/pytorch/cnn.py``, ``simple_cnn``; ``benchmarks/image_classification/configs/
baseline.yaml`` picks it): Conv(32, 3x3) ReLU -> Conv(64, 3x3) ReLU -> MaxPool2 -> Dropout(0.25)
-> Flatten -> FC 128 ReLU -> Dropout(0.5) -> FC C, no padding, Glorot-uniform weights (pfl
matches its TensorFlow model that way), PyTorch's default biases. On (3, 32, 32) images and 10
classes d = 1,626,442. pfl's model takes channels-last images and starts with a transpose; this
one takes mpifl's channels-first (C, H, W) samples, so it has the same parameters and arithmetic
without the transpose (peer_bench gives pfl's copy its transpose back).

A plugin rather than a zoo model: the zoo's built-ins are Dropout-free ``nn.Sequential`` stacks
that ``torch.func.vmap`` trains (mpifl/models/zoo.py); Dropout sends this one to the per-client
loop (:mod:`mpifl.clients.select`). Use it in a job with::

    [plugins]
    path = ["analysis"]          # relative to the job file's folder
    modules = ["pfl_models"]
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from mpifl.core.errors import ConfigError
from mpifl.plugin import register_model


@register_model("pfl_simple_cnn", size="meta")
def pfl_simple_cnn(shape: tuple[int, ...], c: int, *, seed: int = 0,
                   hidden: object = None) -> nn.Sequential:
    if len(shape) != 3:
        raise ConfigError(f"pfl_simple_cnn needs input_shape (C, H, W), got {tuple(shape)}")
    ch, h, w = (int(s) for s in shape)
    fh, fw = (h - 4) // 2, (w - 4) // 2  # two unpadded 3x3 convolutions, then a 2x2 max-pool
    if fh < 1 or fw < 1:
        raise ConfigError(f"pfl_simple_cnn needs images of at least 6x6, got {h}x{w}")
    model = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(ch, 32, 3), relu1=nn.ReLU(),
        conv2=nn.Conv2d(32, 64, 3), relu2=nn.ReLU(),
        pool=nn.MaxPool2d(2), drop1=nn.Dropout(0.25),
        flatten=nn.Flatten(),
        fc1=nn.Linear(64 * fh * fw, 128), relu3=nn.ReLU(), drop2=nn.Dropout(0.5),
        out=nn.Linear(128, c),
    ))
    for m in model.modules():  # mpifl seeds torch's RNG around the factory
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
    return model
