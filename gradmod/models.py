"""Models by name: the articles' MNIST CNN and torchvision ResNets (``weights=None``).

``norm``: the ResNets' normalisation layers, ``batch`` (torchvision's BatchNorm) or ``group``
(``GroupNorm(min(32, C), C)``, which treats every example on its own, as per-example
gradients need). The MNIST CNN has no normalisation layer: ``norm`` changes nothing there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmod.install import checked_torchvision

torchvision = checked_torchvision()  # a torchvision built for another torch: one line with the fix


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


class MultiLeNet(nn.Module):
    """MultiMNIST's shared-trunk LeNet (after Sener and Koltun 2018): ``trunk`` (two 5x5
    convs with max-pooling and a Linear to 50 features), shared by the heads ``left`` and
    ``right`` (two Linear layers each); forward returns ``{"left": logits, "right": logits}``.
    Sized for 36x36 inputs."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, tasks: tuple[str, ...] = ("left", "right")):
        super().__init__()
        self.trunk = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(in_channels, 10, kernel_size=5),
                pool1=nn.MaxPool2d(2),
                relu1=nn.ReLU(),
                conv2=nn.Conv2d(10, 20, kernel_size=5),
                pool2=nn.MaxPool2d(2),
                relu2=nn.ReLU(),
                flat=nn.Flatten(),
                fc=nn.Linear(20 * 6 * 6, 50),
                relu3=nn.ReLU(),
            )
        )
        self.tasks = tasks
        for task in tasks:
            self.add_module(task, nn.Sequential(nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, num_classes)))

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = self.trunk(x)
        return {task: getattr(self, task)(h) for task in self.tasks}


class Tap(nn.Module):
    """Identity, as a new tensor: a ``modules:`` rule on it (``grl``) sees the gradient of this
    branch only, not of every use of its input."""

    def forward(self, x: Tensor) -> Tensor:
        return x.view_as(x)


class DANNNet(nn.Module):
    """Domain-adversarial digits (Ganin and Lempitsky 2015): ``features`` (two 3x3 convs with
    pooling, a Linear to 64) shared by the ``digit`` head and the ``domain`` head (source or
    target), whose first module ``domain.reverse`` is where ``+hooks=grl`` reverses the
    gradient. Forward returns ``{"digit": logits, "domain": logits}``. Sized for 28x28."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
                relu1=nn.ReLU(),
                pool1=nn.MaxPool2d(2),
                conv2=nn.Conv2d(32, 32, kernel_size=3, padding=1),
                relu2=nn.ReLU(),
                pool2=nn.MaxPool2d(2),
                flat=nn.Flatten(),
                fc=nn.Linear(7 * 7 * 32, 64),
                relu3=nn.ReLU(),
            )
        )
        self.digit = nn.Linear(64, num_classes)
        self.domain = nn.Sequential(
            OrderedDict(reverse=Tap(), fc=nn.Linear(64, 64), relu=nn.ReLU(), out=nn.Linear(64, 2))
        )

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = self.features(x)
        return {"digit": self.digit(h), "domain": self.domain(h)}


class CharLM(nn.Module):
    """A small causal character model: an embedding, two causal 1-D convolutions (each
    position sees itself and the ``context - 1`` before it) and a Linear to the characters.
    Input N x T character ids; output N x classes x T logits (as ``cross_entropy`` takes
    them with N x T targets)."""

    def __init__(self, num_classes: int, width: int = 64, context: int = 4):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(num_classes, width)
        self.conv1 = nn.Conv1d(width, width, kernel_size=context)
        self.conv2 = nn.Conv1d(width, width, kernel_size=context)
        self.fc = nn.Conv1d(width, num_classes, kernel_size=1)  # per position: a Linear over the features

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x).transpose(1, 2)  # N x width x T
        h = F.relu(self.conv1(F.pad(h, (self.context - 1, 0))))  # left padding: no look ahead
        h = F.relu(self.conv2(F.pad(h, (self.context - 1, 0))))
        return self.fc(h)


class Attention(nn.Module):
    """Causal multi-head self-attention. Heads are counted from the projections' widths
    (``-1``), so under tensor parallelism each rank runs its share of the heads."""

    def __init__(self, width: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k, v = (f(x).view(n, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).reshape(n, t, -1))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a two-layer GELU MLP, each residual."""

    def __init__(self, width: int, head_dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, head_dim)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _own_storage(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    """A forward hook: the module's output as a tensor of its own (the same values and strides)."""
    return output.clone()


class TinyGPT(nn.Module):
    """A small causal transformer on characters: token and position embeddings, ``depth``
    pre-norm blocks, a final LayerNorm and a Linear to the characters. Input N x T ids,
    output N x classes x T logits (as ``CharLM``). ``tp_plan()``: its tensor-parallel plan."""

    def __init__(self, num_classes: int, width: int = 64, depth: int = 2, heads: int = 4, max_len: int = 256):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(num_classes, width)
        self.position = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, width // heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)
        # A Linear on N x T x W returns a view of its 2-D product, and a view returned by an
        # FSDP2 unit loses the unit's backward hook to any in-place op on it: own the storage.
        self.head.register_forward_hook(_own_storage)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] > self.max_len:
            raise ValueError(f"tiny_gpt: sequences of {x.shape[1]} characters; allowed: up to {self.max_len}")
        h = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)).transpose(1, 2).clone()  # the same strides, not a view (as above)

    def tp_plan(self) -> dict[str, Any]:
        """``parallelize_module``'s plan (Megatron's): q, k, v and the MLP's first layer cut
        by output columns, the attention's and the MLP's last layers by input rows; the
        embeddings, norms and head stay whole (on the data-parallel mesh only)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i in range(len(self.blocks)):
            for name in ("attn.q", "attn.k", "attn.v", "fc1"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.out", "fc2"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        return plan


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
        model.conv1 = nn.Conv2d(
            in_channels,
            64,
            kernel_size=3 if small else 7,
            stride=1 if small else 2,
            padding=1 if small else 3,
            bias=False,
        )
    return model


MODELS = ("mnist_cnn", "resnet18", "resnet50", "multi_lenet", "char_lm", "tiny_gpt", "dann")


def build_model(
    name: str, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, norm: str = "batch"
) -> nn.Module:
    """Build a model by name, adapted to the data's channels, image size and classes."""
    if norm not in NORMS:
        raise ValueError(f"model.norm={norm!r} is not allowed; allowed: {', '.join(NORMS)}")
    if name == "mnist_cnn":
        if image_size != 28:
            raise ValueError(
                f"model 'mnist_cnn' needs 28x28 images, got {image_size}x{image_size}; "
                "use data=mnist or data=mnist_sample, or model=resnet18"
            )
        return MnistCNN(in_channels, num_classes)
    if name == "multi_lenet":
        if image_size != 36:
            raise ValueError(
                f"model 'multi_lenet' needs 36x36 images, got {image_size}x{image_size}; use data=multi_mnist"
            )
        return MultiLeNet(in_channels, num_classes)
    if name == "char_lm":
        return CharLM(num_classes)
    if name == "tiny_gpt":
        return TinyGPT(num_classes)
    if name == "dann":
        if image_size != 28:
            raise ValueError(f"model 'dann' needs 28x28 images, got {image_size}x{image_size}; use data=dann_digits")
        return DANNNet(in_channels, num_classes)
    if name in ("resnet18", "resnet50"):
        return _resnet(name, in_channels, num_classes, image_size, norm)
    raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
