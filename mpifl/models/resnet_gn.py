"""``resnet18_gn``: ResNet-18 with GroupNorm in place of BatchNorm.

The FedCIFAR100 model of Reddi et al., "Adaptive Federated Optimization" (ICLR 2021): ResNet-18
(He et al., CVPR 2016) whose BatchNorm layers are GroupNorm (Wu & He, ECCV 2018) with two
groups, on CIFAR-100 images cropped to 24 x 24 (TensorFlow Federated's preprocessing). GroupNorm
normalises each sample by itself, which suits non-IID clients (Hsieh et al., "The Non-IID Data
Quagmire of Decentralized Machine Learning", ICML 2020) and keeps no running statistics: the
model has no buffers.

Which ResNet-18: the residual layout of FedML's ``resnet_gn.resnet18`` (FedML-AI/FedML
``model/cv/resnet_gn.py``, its FedCIFAR100 reproduction of Reddi et al.): post-activation basic
blocks [2, 2, 2, 2] of 64/128/256/512 channels, stride 2 from the second stage, 1x1 conv +
GroupNorm shortcuts where the shape changes, global average pooling, Linear(512, C); its
initialisation (He-normal convolutions, GroupNorm weight 1 and bias 0, the second GroupNorm of
each block zero-initialised) and its ``group_norm = 2``. The stem: ``stem="imagenet"``
(default) is FedML's and google-research/federated's ``utils/models/resnet_models.py``
``create_resnet18``: Conv(64, 7x7, stride 2) GroupNorm ReLU MaxPool(3x3, stride 2);
``stem="cifar"`` is the usual CIFAR variant: Conv(64, 3x3, stride 1) GroupNorm ReLU, no
max-pool (more compute per image: 4x4 times the activations). google-research's Keras code is a
pre-activation (v2) ResNet that, as written, never strides inside its stages; this module
follows FedML's standard post-activation layout instead.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from mpifl.core.errors import ConfigError
from mpifl.models.zoo import register_model

__all__ = ["BasicBlockGN", "ResNetGN", "resnet18_gn"]

STEMS = ("imagenet", "cifar")


class BasicBlockGN(nn.Module):
    """conv3x3 GN ReLU conv3x3 GN, plus the (projected) input, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(groups, cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.gn1(self.conv1(x)))
        return self.relu(self.gn2(self.conv2(out)) + self.shortcut(x))


class ResNetGN(nn.Module):
    """ResNet of basic blocks with GroupNorm: (b, C_in, H, W) -> (b, num_classes) logits."""

    def __init__(self, in_channels: int, num_classes: int, blocks: tuple[int, ...],
                 width: int, groups: int, stem: str):
        super().__init__()
        if stem == "imagenet":
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
                                      nn.GroupNorm(groups, width), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                                      nn.GroupNorm(groups, width), nn.ReLU())
        stages, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            stages += [BasicBlockGN(cin if j == 0 else cout, cout, 2 if i and j == 0 else 1,
                                    groups) for j in range(n)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(cin, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """FedML resnet_gn's: He-normal (fan-out) convolutions, GroupNorm (1, 0), and each
        block's last GroupNorm weight 0 so that every block starts as its shortcut."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / n))
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, BasicBlockGN):
                nn.init.zeros_(m.gn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))))


@register_model("resnet18_gn")
def resnet18_gn(input_shape: tuple[int, ...], num_classes: int, *, seed: int = 0,
                groups: int = 2, width: int = 64, stem: str = "imagenet",
                blocks: tuple[int, ...] = (2, 2, 2, 2)) -> ResNetGN:
    """ResNet-18 with GroupNorm (Reddi et al., ICLR 2021; FedML's resnet18 with group_norm 2).

    Args:
        input_shape: (C, H, W) float32 images, e.g. (3, 24, 24) (TFF's cropped CIFAR-100) or
            (3, 32, 32).
        num_classes: C outputs (CIFAR-100: 100). seed: unused (mpifl seeds torch before).
        groups: GroupNorm groups (Reddi et al.: 2); must divide ``width``.
        width: channels of the stem and first stage (64; the stages double it).
        stem: ``"imagenet"`` (7x7 stride-2 conv + max-pool, as the references) or
            ``"cifar"`` (3x3 stride-1 conv, no max-pool).
        blocks: basic blocks per stage ((2, 2, 2, 2) is ResNet-18; smaller for tests).

    Returns:
        :class:`ResNetGN` mapping (b, *input_shape) to (b, C) logits; no buffers.

    Raises:
        ConfigError: input_shape not (C, H, W), an unknown stem, or sizes that do not fit.
    """
    shape = tuple(int(s) for s in input_shape)
    blocks = tuple(int(b) for b in blocks)
    if len(shape) != 3:
        raise ConfigError(f"resnet18_gn needs input_shape (C, H, W), got {shape}")
    if stem not in STEMS:
        raise ConfigError(f"resnet18_gn: unknown stem {stem!r}; choose 'imagenet' or 'cifar'")
    if int(width) < 1 or int(groups) < 1 or int(width) % int(groups) or not blocks \
            or min(blocks) < 1:
        raise ConfigError(f"resnet18_gn: groups {groups} must divide width {width}, and every "
                          f"stage needs >= 1 block, got blocks {blocks}")
    return ResNetGN(shape[0], int(num_classes), blocks, int(width), int(groups), stem)
