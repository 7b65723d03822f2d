"""The trainer's optimizer holds every parameter: a layer frozen at the start and unfrozen
during training trains exactly as in a plain PyTorch loop with optimizer(model.parameters())."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gradmod.data import Data
from gradmod.models import MnistCNN
from gradmod.run.config import AdamConfig
from gradmod.run.factories import model_optimizer
from gradmod.training.callbacks import Callback
from gradmod.training.loader import batches
from gradmod.training.trainer import Trainer, TrainerSettings

UNFREEZE_AT = 3  # optimizer steps done when conv1 starts training
EPOCHS, BATCH = 2, 16


class UnfreezeAt(Callback):
    def on_step_start(self, trainer) -> None:
        if trainer.step == UNFREEZE_AT:
            trainer.model.conv1.requires_grad_(True)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 1, 28, 28), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (64,), generator=g)
    return Data("random", x, y, x[:16], y[:16])


def frozen_model():
    torch.manual_seed(0)
    model = MnistCNN(1, 10)
    model.conv1.requires_grad_(False)
    return model


def test_a_layer_unfrozen_during_training_trains_as_in_a_plain_loop():
    d = data()
    ours = frozen_model()
    start = ours.conv1.weight.detach().clone()
    cfg = AdamConfig(_target_="torch.optim.AdamW", lr=1e-3, weight_decay=0.1)
    trainer = Trainer(
        ours,
        model_optimizer(cfg, ours),
        TrainerSettings(batch_size=BATCH, eval_batch_size=64),
        callbacks=[UnfreezeAt()],
        generator=torch.Generator().manual_seed(1),
    )
    trainer.fit(d, EPOCHS)

    plain = frozen_model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    generator, step = torch.Generator().manual_seed(1), 0
    for _ in range(EPOCHS):
        for xb, yb in batches(d.train_x, d.train_y, BATCH, generator):
            if step == UNFREEZE_AT:
                assert torch.equal(plain.conv1.weight, start)  # frozen with .grad None: no decay, no Adam step
                plain.conv1.requires_grad_(True)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(plain(xb), yb).backward()
            opt.step()
            step += 1
    assert trainer.step == step == EPOCHS * 64 // BATCH
    assert not torch.equal(ours.conv1.weight, start)  # it trained
    for (n, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n
