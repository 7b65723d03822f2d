"""A user's data: ``make(**data args)`` returns ``(train, test)``.

``train`` is a map-style dataset of ``(input, label)`` pairs; ``test`` a pair of tensors:
gradmod accepts either form for each part.
"""

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """Gaussian blobs in ``dim`` dimensions, one per class, drawn with a fixed seed."""

    def __init__(self, n: int, dim: int, classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0)) * 1.5
        self.y = torch.randint(classes, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, dim, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def make(n_train: int = 512, n_test: int = 128, dim: int = 16, classes: int = 4):
    test = Blobs(n_test, dim, classes, seed=2)
    return Blobs(n_train, dim, classes, seed=1), (test.x, test.y)
