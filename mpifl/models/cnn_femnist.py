"""``cnn_femnist``: LEAF's FEMNIST CNN.

Caldas et al., "LEAF: A Benchmark for Federated Settings" (2018), the model of
TalwalkarLab/leaf ``models/femnist/cnn.py``: on a (1, 28, 28) image,
Conv(32, 5x5, 'same') ReLU MaxPool2 -> Conv(64, 5x5, 'same') ReLU MaxPool2 -> Dense(2048) ReLU
-> Dense(C). At C = 62 classes it has 6,603,710 parameters, LEAF's published count.

Initial weights are PyTorch's defaults (LEAF's TensorFlow code uses Glorot-uniform kernels and
zero biases); the architecture, and so the parameter vector's size and layout, is LEAF's.
The flatten runs over (C, H, W) (PyTorch's layout), not TensorFlow's (H, W, C): the same
parameter count, a permuted first dense layer.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from mpifl.core.errors import ConfigError
from mpifl.models.zoo import register_model

__all__ = ["cnn_femnist"]


def _grey_image(shape: tuple[int, ...]) -> tuple[OrderedDict[str, nn.Module], int, int]:
    """Leading layers turning (b, *shape) into (b, 1, H, W), and H, W."""
    if len(shape) == 2:
        return OrderedDict(unsqueeze=nn.Unflatten(1, (1, shape[0]))), shape[0], shape[1]
    if len(shape) == 3 and shape[0] == 1:
        return OrderedDict(), shape[1], shape[2]
    raise ConfigError(f"cnn_femnist needs grey images of input_shape (1, H, W) or (H, W), "
                      f"got {shape}")


@register_model("cnn_femnist")
def cnn_femnist(input_shape: tuple[int, ...], num_classes: int, *, seed: int = 0,
                hidden: int = 2048) -> nn.Sequential:
    """LEAF's FEMNIST CNN (Caldas et al., 2018).

    Args:
        input_shape: (1, H, W) or (H, W) float32 images, H and W >= 4 (LEAF: 28 x 28).
        num_classes: C outputs (LEAF's FEMNIST: 62). seed: unused (mpifl seeds torch before).
        hidden: width of the dense layer (LEAF: 2048).

    Returns:
        ``nn.Sequential`` mapping (b, *input_shape) float32 to (b, C) logits; no buffers.

    Raises:
        ConfigError: another input shape, images under 4 x 4, or hidden < 1.
    """
    layers, h, w = _grey_image(tuple(input_shape))
    if h < 4 or w < 4 or int(hidden) < 1:
        raise ConfigError(f"cnn_femnist needs images of at least 4x4 and hidden >= 1, got "
                          f"{h}x{w} and hidden {hidden}")
    layers.update(
        conv1=nn.Conv2d(1, 32, 5, padding="same"), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(32, 64, 5, padding="same"), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(64 * (h // 4) * (w // 4), int(hidden)), relu3=nn.ReLU(),
        out=nn.Linear(int(hidden), int(num_classes)),
    )
    return nn.Sequential(layers)
