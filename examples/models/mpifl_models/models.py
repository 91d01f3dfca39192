"""``small_resnet``: a ResNet-style CNN (He et al., CVPR 2016) with BatchNorm and Dropout.

conv3x3(C) BN ReLU -> [residual block: conv3x3 BN ReLU conv3x3 BN, + identity, ReLU] per stage
(the channels double and a 1x1 strided projection joins the shortcut after the first stage)
-> global average pool -> Dropout(p) -> FC. BatchNorm keeps running statistics: mpifl carries
them in the model state and averages them like parameters (``model.batchnorm = "global"``);
Dropout masks are keyed by (seed, round, client, step). Both need the per-client loop trainer,
which ``client.trainer = "auto"`` picks.
"""

from __future__ import annotations

from torch import Tensor, nn

from mpifl.plugin import register_model


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out else
                         nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                       nn.BatchNorm2d(c_out)))

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(h)) + self.shortcut(x)).relu()


@register_model("small_resnet")
def small_resnet(input_shape: tuple[int, ...], num_classes: int, *, seed: int,
                 channels: int = 8, stages: int = 2, dropout: float = 0.2) -> nn.Module:
    """The model for images ``input_shape`` (C, H, W); ``[model.params]`` sets ``channels``
    (of the first stage), ``stages`` and ``dropout``."""
    layers: list[nn.Module] = [nn.Conv2d(input_shape[0], channels, 3, 1, 1, bias=False),
                               nn.BatchNorm2d(channels), nn.ReLU()]
    c = channels
    for stage in range(stages):
        out = channels * 2 ** stage
        layers.append(_Block(c, out, 1 if stage == 0 else 2))
        c = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
               nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)
