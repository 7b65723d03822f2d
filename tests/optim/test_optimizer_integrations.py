"""gradmod.optimizer(model, spec) in Lightning's configure_optimizers and in
transformers.Trainer(optimizers=...): several optimizers train, schedule and resume there as
one, equal to a plain loop (Lightning) and to one torch optimizer doing the same (HF)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import lightning_args
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradmod

N, BATCH = 32, 8
SPEC = {  # AdamW on the first layer, SGD with momentum on the last
    "_target_": "torch.optim.AdamW",
    "lr": 1e-2,
    "weight_decay": 0.1,
    "groups": [{"params": "@last_layer", "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}}],
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g), torch.randint(3, (N,), generator=g)


def halving(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)


def test_lightning_trains_as_a_plain_loop_with_the_same_optimizers():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = gradmod.optimizer(self, SPEC)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "step"}}

    module = Module()
    L.Trainer(**lightning_args(max_epochs=1)).fit(module, DataLoader(TensorDataset(*data()), batch_size=BATCH))

    plain = net()
    pair = [
        torch.optim.AdamW(plain[0].parameters(), lr=1e-2, weight_decay=0.1),
        torch.optim.SGD(plain[2].parameters(), lr=0.1, momentum=0.9),
    ]
    scheds = [halving(o) for o in pair]
    x, y = data()
    for xb, yb in zip(x.split(BATCH), y.split(BATCH)):
        for o in pair:
            o.zero_grad()
        F.cross_entropy(plain(xb), yb).backward()
        for o, s in zip(pair, scheds):
            o.step()
            s.step()
    for a, b in zip(module.net.parameters(), plain.parameters()):
        assert torch.equal(a, b)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = net()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = data()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def hf_trainer(tmp_path, make_optimizer, **overrides):
    transformers = pytest.importorskip("transformers")
    model = Tiny()
    opt = make_optimizer(model)
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        max_steps=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_grad_norm=0.0,
    )
    return transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**{**args, **overrides}),
        train_dataset=Rows(),
        optimizers=(opt, halving(opt)),
    )


def params(t):
    return [p.detach().clone() for p in t.model.parameters()]


def test_hf_trainer_trains_and_resumes_with_several_optimizers_as_one(tmp_path):
    """AdamW on both layers, split in two optimizers (no foreach: each tensor's own update),
    trains as one AdamW; a run resumed from HF's checkpoint (optimizer.pt) ends bitwise equal."""
    split = {
        "_target_": "torch.optim.AdamW",
        "lr": 1e-2,
        "foreach": False,
        "groups": [
            {"params": "@last_layer", "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-2, "foreach": False}}
        ],
    }
    ours = hf_trainer(tmp_path / "a", lambda m: gradmod.optimizer(m, split))
    assert isinstance(ours.optimizer, gradmod.optim.CombinedOptimizer)
    ours.train()
    one = hf_trainer(tmp_path / "b", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False))
    one.train()
    assert all(torch.equal(p, q) for p, q in zip(params(ours), params(one)))
    assert not torch.equal(params(ours)[0], net()[0].weight)

    hf_trainer(tmp_path / "c", lambda m: gradmod.optimizer(m, SPEC), save_strategy="steps", save_steps=2).train()
    straight = hf_trainer(tmp_path / "d", lambda m: gradmod.optimizer(m, SPEC))
    straight.train()
    resumed = hf_trainer(tmp_path / "e", lambda m: gradmod.optimizer(m, SPEC))
    resumed.train(resume_from_checkpoint=str(tmp_path / "c" / "checkpoint-2"))
    assert all(torch.equal(p, q) for p, q in zip(params(straight), params(resumed)))
