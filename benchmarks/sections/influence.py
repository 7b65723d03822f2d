"""The ``influence`` section of ``python -m benchmarks``: TracIn influence of training examples on
test examples against Captum's.

    gradmod       gradmod.analysis.influence.influence, exact (each example's gradient by
                  torch.func.vmap(grad), test gradients once per checkpoint, the dot products per batch,
                  summed over the parameter blocks)
    projected     the same, the gradients projected to 1024 dimensions
    captum_swg    captum.influence.TracInCP(..., sample_wise_grads_per_batch=True).influence
                  (per-example gradients from its layer hooks; loss reduction "sum")

1,000 training examples (batches of 100) on 8 test examples over 2 checkpoints of the MNIST CNN,
random images; target: gradmod <= 0.5x captum_swg. Captum's default mode (a backward per example)
is slower still and left out. Asked for by name.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from gradmod.analysis.influence import influence
from gradmod.analysis.self_influence import Checkpoint
from gradmod.models import MnistCNN

TRAIN, TEST, BATCH, RATES = 1000, 8, 100, (0.1, 0.01)
CONTENDERS = ("gradmod", "projected", "captum_swg")


def names() -> list[str]:
    return [f"mnist.{c}" for c in CONTENDERS]


def _checkpoints(folder: Path) -> list[Checkpoint]:
    torch.manual_seed(0)
    model, out = MnistCNN(), []
    for k, lr in enumerate(RATES):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        state = {n: v.clone() for n, v in model.state_dict().items()}
        torch.save({"model": state, "lr": lr}, folder / f"c{k}.pt")
        out.append(Checkpoint(folder / f"c{k}.pt", k, lr, state))
    return out


def setup(name: str, steps: int = 1, batch: int | None = None, device: str = "cpu") -> Callable[[], None]:
    """The contender's run (``steps``: one): every score of ``batch`` training examples (None:
    ``TRAIN``) on the test examples."""
    contender, train = name.split(".")[1], batch or TRAIN
    folder = Path(tempfile.mkdtemp(prefix="influence-bench-"))
    checkpoints = _checkpoints(folder)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(train, 1, 28, 28, generator=gen), torch.randint(0, 10, (train,), generator=gen)
    tx, ty = torch.rand(TEST, 1, 28, 28, generator=gen), torch.randint(0, 10, (TEST,), generator=gen)
    if contender != "captum_swg":
        projection = 1024 if contender == "projected" else None
        dev = torch.device(device)
        return lambda: influence(
            MnistCNN, checkpoints, (x, y), (tx, ty), projection=projection, batch_size=BATCH, device=dev
        )
    from captum.influence import TracInCP
    from torch.utils.data import TensorDataset

    def load(model, path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        model.eval()
        return state["lr"]

    tracin = TracInCP(
        MnistCNN().to(device),
        TensorDataset(x.to(device), y.to(device)),
        [str(c.path) for c in checkpoints],
        load,
        loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"),
        batch_size=BATCH,
        sample_wise_grads_per_batch=True,
    )
    return lambda: tracin.influence((tx.to(device), ty.to(device)), show_progress=False)
