"""Models by name: the articles' MNIST CNN and torchvision ResNets (``weights=None``).

``norm``: the ResNets' normalisation layers, ``batch`` (torchvision's BatchNorm) or ``group``
(``GroupNorm(min(32, C), C)``, which treats every example on its own, as per-example
gradients need). The MNIST CNN has no normalisation layer: ``norm`` changes nothing there.
"""

from __future__ import annotations

import torch.nn.functional as F
import torchvision
from torch import Tensor, nn


class MnistCNN(nn.Module):
    """The article's ``Net``: two 3x3 convs with ReLU and 2x2 max-pooling, one Linear.

    ReLU and pooling are functional, as in the article, so ``summary`` shows three layers
    and the parameter names are ``conv1.*``, ``conv2.*``, ``l1.*`` (25,258 parameters).
    The Linear layer's size assumes 28x28 inputs.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, kernel_size=3, padding=1)
        self.l1 = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.l1(h.flatten(1))



NORMS = ("batch", "group")


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with at most 32 groups (Wu and He 2018's default); ResNet widths divide by it."""
    return nn.GroupNorm(min(32, channels), channels)


def _resnet(name: str, in_channels: int, num_classes: int, image_size: int, norm: str) -> nn.Module:
    norm_layer = group_norm if norm == "group" else None  # None: torchvision's BatchNorm2d
    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes, norm_layer=norm_layer)
    if in_channels != 3 or image_size < 64:
        # Small images (MNIST's 28x28) lose everything to the 7x7/2 stem: use a 3x3/1 stem.
        # The max-pool stays, halving the cost of every later block on the CPU.
        small = image_size < 64
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3 if small else 7,
                                stride=1 if small else 2, padding=1 if small else 3, bias=False)
    return model


MODELS = ("mnist_cnn", "resnet18", "resnet50")


def build_model(name: str, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                norm: str = "batch") -> nn.Module:
    """Build a model by name, adapted to the data's channels, image size and classes."""
    if norm not in NORMS:
        raise ValueError(f"model.norm={norm!r} is not allowed; allowed: {', '.join(NORMS)}")
    if name == "mnist_cnn":
        if image_size != 28:
            raise ValueError(f"model 'mnist_cnn' needs 28x28 images, got {image_size}x{image_size}; "
                             "use data=mnist or data=mnist_sample, or model=resnet18")
        return MnistCNN(in_channels, num_classes)
    if name in ("resnet18", "resnet50"):
        return _resnet(name, in_channels, num_classes, image_size, norm)
    raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
