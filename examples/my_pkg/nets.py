"""A user's model: gradmod calls ``TinyNet(**model args)`` and nothing else."""

from torch import nn


class TinyNet(nn.Module):
    """An MLP over flattened inputs: ``fc1`` -> ReLU -> ``bn`` -> ``fc2``."""

    def __init__(self, in_features: int = 784, width: int = 32, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x.flatten(1)).relu()))
