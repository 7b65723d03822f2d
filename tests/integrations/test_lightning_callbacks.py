"""The Lightning callback as a new user meets it: docs/guide/lightning.md's example runs as written
from another folder; several callbacks share one model; hooks live only while a stage runs;
rule state resumes bit for bit per callback; what cannot work is refused in one line."""

from __future__ import annotations

import re

import lightning as L  # the optional extra gradmod[lightning], part of gradmod[dev]
import pytest
import torch
import torch.nn.functional as F
from helpers import lightning_args
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, TensorDataset

from gradmod.integrations.lightning import GradmodCallback

N, BATCH = 32, 8


def test_the_docs_example_runs_as_written_from_another_folder(tmp_path, monkeypatch):
    from helpers import ROOT

    doc = (ROOT / "docs" / "guide" / "lightning.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    seen = []  # every optimizer step, observed from outside: the gradients it has just used
    handle = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: seen.extend(
            (p.dim(), p.grad.abs().max().item()) for g in opt.param_groups for p in g["params"]
        )
    )
    monkeypatch.chdir(tmp_path)  # the example's files (lightning_logs/) land here
    try:
        ns = {"__name__": "__main__"}
        exec(compile(code, str(ROOT / "docs" / "guide" / "lightning.md"), "exec"), ns)
    finally:
        handle.remove()
    weights, biases = [m for d, m in seen if d > 1], [m for d, m in seen if d == 1]
    assert len(weights) == 8 and max(weights) <= 0.01 and max(biases) == 0
    model, images, labels = ns["model"], ns["images"], ns["labels"]
    F.cross_entropy(model.net(images[:32]), labels[:32]).backward()  # after fit: the plain gradient again
    assert model.net[1].weight.grad.abs().max() > 0.01 and model.net[1].bias.grad.abs().max() > 0


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.seen_hooks: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def test_step(self, batch, batch_idx):
        self.seen_hooks.append(
            all(cb.hooks is not None for cb in self.trainer.callbacks if isinstance(cb, GradmodCallback))
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 6, generator=g) * 4, torch.randint(3, (N,), generator=g))
    return DataLoader(data, batch_size=BATCH)


def trainer(tmp_path, callbacks, epochs: int = 1) -> L.Trainer:
    return L.Trainer(**lightning_args(tmp_path, max_epochs=epochs, callbacks=callbacks))


def plain_gradients(module: Module) -> bool:
    """A backward outside Lightning: every gradient non-zero and some above 0.01, so no hook acted."""
    module.zero_grad(set_to_none=True)
    x, y = next(iter(loader()))
    F.cross_entropy(module.net(x), y).backward()
    return (
        all(p.grad.count_nonzero() > 0 for p in module.parameters())
        and max(p.grad.abs().max() for p in module.parameters()) > 0.01
    )


ZERO = {"zero": {"params": "net.2.*", "transforms": ["zero"]}}
CLAMP = {"clip": {"params": "net.0.*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}


@pytest.mark.parametrize("fit_first", [False, True])
def test_hooks_live_only_while_a_stage_runs(tmp_path, fit_first):
    module, callbacks = Module(), [GradmodCallback(ZERO), GradmodCallback(CLAMP)]
    t = trainer(tmp_path, callbacks)
    if fit_first:
        start = module.net[2].weight.detach().clone()
        t.fit(module, loader())
        assert torch.equal(module.net[2].weight, start)  # zeroed gradients under momentum: no move at all
        assert plain_gradients(module)
    t.test(module, loader())
    assert module.seen_hooks and all(module.seen_hooks)  # attached during test
    assert all(cb.hooks is None for cb in callbacks) and plain_gradients(module)


def test_callbacks_on_one_tensor_are_refused_and_leave_nothing_attached(tmp_path):
    module, callbacks = (
        Module(),
        [GradmodCallback(CLAMP), GradmodCallback({"z": {"params": "net.0.bias", "transforms": ["zero"]}})],
    )
    with pytest.raises(
        ValueError,
        match=r"^Lightning: two GradmodCallbacks on the same tensors \(net.0.bias\); give "
        r"one callback several rule sources instead: "
        r"GradmodCallback\(\[\{'clip': ...\}, \{'z': ...\}\]\)$",
    ):
        trainer(tmp_path, callbacks).fit(module, loader())
    assert all(cb.hooks is None for cb in callbacks) and plain_gradients(module)


def test_two_callbacks_of_shipped_files_on_one_model_name_the_one_callback_to_use(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"\(net.0.weight, net.0.bias, net.2.weight and more\); give one callback "
        r"several rule sources instead: GradmodCallback\(\['clip', 'log'\]\)$",
    ):
        trainer(tmp_path, [GradmodCallback("clip"), GradmodCallback("log")]).fit(Module(), loader())


def test_zclip_skip_is_refused_at_setup(tmp_path):
    rules = {"z": {"params": "*", "stage": "fused", "transforms": [{"name": "zclip", "on_spike": "skip"}]}}
    with pytest.raises(
        ValueError,
        match=r"^hooks.z: zclip\(on_spike='skip'\) cannot skip an optimizer step "
        r"under Lightning; use on_spike: clip$",
    ):
        trainer(tmp_path, [GradmodCallback(rules)]).fit(Module(), loader())


def test_hook_stage_rules_under_fp16_are_refused_and_fused_ones_run(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fp16(rules) -> L.Trainer:  # the GradScaler Lightning uses for 16-mixed on a GPU, here on the CPU
        t = trainer(tmp_path, [GradmodCallback(rules)])
        t.strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        return t

    with pytest.raises(
        ValueError,
        match=r"^hooks.clip: hook-stage rules would see fp16's scaled gradients; "
        r"use stage: fused \(it runs after unscaling\)$",
    ):
        fp16(CLAMP).fit(Module(), loader())
    fused = {"clip": {**CLAMP["clip"], "stage": "fused"}}
    module, seen = Module(), []
    handle = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: seen.append(max(p.grad.abs().max().item() for p in module.net[0].parameters()))
    )
    try:
        fp16(fused).fit(module, loader())
    finally:
        handle.remove()
    # Clamped after unscaling: the step uses gradients at the bound, not the bound over the scale.
    assert len(seen) == N // BATCH and all(m == pytest.approx(0.01) for m in seen)
    assert plain_gradients(module)


def zclips() -> list[GradmodCallback]:
    """Two callbacks with running state, one per layer: spikes get clipped after 2 steps of warm-up."""
    return [
        GradmodCallback(
            {
                name: {
                    "params": f"net.{i}.*",
                    "stage": "fused",
                    "transforms": [{"name": "zclip", "warmup_steps": 2, "z_threshold": 0.5, "alpha": 0.9}],
                }
            }
        )
        for i, name in ((0, "a"), (2, "b"))
    ]


def test_two_stateful_callbacks_resume_bit_identically(tmp_path):
    straight = Module()
    trainer(tmp_path, zclips(), epochs=2).fit(straight, loader())

    first, callbacks = Module(), zclips()
    t = trainer(tmp_path, callbacks)
    t.fit(first, loader())
    assert {cb.state_key for cb in callbacks} == {
        "GradmodCallback{'rules': 'a', 'stage': 'hook'}",
        "GradmodCallback{'rules': 'b', 'stage': 'hook'}",
    }
    t.save_checkpoint(tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=False)["callbacks"]
    assert [saved[cb.state_key]["group"][f"{r}/zclip"]["steps"] for cb, r in zip(callbacks, "ab")] == [4, 4]

    resumed = Module()
    trainer(tmp_path, zclips(), epochs=2).fit(resumed, loader(), ckpt_path=tmp_path / "half.ckpt")
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    clipped = Module()  # the state mattered: without it the resumed run differs
    trainer(tmp_path, zclips(), epochs=1).fit(clipped, loader())
    assert any(not torch.equal(p, q) for p, q in zip(straight.parameters(), clipped.parameters()))


def test_log_reads_once_per_step_under_accumulation(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    t = L.Trainer(
        **lightning_args(
            tmp_path,
            max_epochs=1,
            logger=CSVLogger(tmp_path, name="run", version=0),
            accumulate_grad_batches=2,
            log_every_n_steps=1,
            callbacks=[GradmodCallback("log", log_every=2)],
        )
    )
    t.fit(Module(), DataLoader(TensorDataset(torch.randn(64, 6), torch.randint(3, (64,))), batch_size=BATCH))
    rows = [
        r
        for r in csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv"))
        if r.get("grad/net.0.weight/calls")
    ]
    assert [(int(r["step"]), float(r["grad/net.0.weight/calls"])) for r in rows] == [(2, 4.0), (4, 4.0)]
