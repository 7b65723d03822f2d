"""gradmod's rules inside a real ``lightning.Trainer``: equal to gradmod's own Trainer and to
Lightning's ``gradient_clip_val``; ``log`` statistics reach the Lightning logger."""

from __future__ import annotations

import csv

import lightning as L  # the optional extra gradmod[lightning], part of gradmod[dev]
import pytest
import torch
import torch.nn.functional as F
from helpers import lightning_args, tiny_mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradmod.hooks import attach
from gradmod.integrations.lightning import GradmodCallback
from gradmod.testing.epochs import bare_epoch

N, BATCH, SEED, BOUND = 64, 8, 3, 0.01
CLIP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -BOUND, "max": BOUND}]}}


class Module(L.LightningModule):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _net() -> nn.Module:
    return tiny_mlp(6, 16, 3, act=nn.Tanh)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g) * 4, torch.randint(3, (N,), generator=g)


def _lightning(tmp_path, callbacks=(), **trainer_args) -> dict[str, torch.Tensor]:
    x, y = _data()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()  # gradmod's epoch order
    module = Module(_net())
    trainer = L.Trainer(**lightning_args(tmp_path, max_epochs=1, callbacks=list(callbacks), **trainer_args))
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=order))
    return {k: v.clone() for k, v in module.net.state_dict().items()}


def _gradmod(rules, stage: str) -> dict[str, torch.Tensor]:
    x, y = _data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    with attach(net, rules, stage=stage) as hooks:
        bare_epoch(net, opt, x, y, batch_size=BATCH, generator=torch.Generator().manual_seed(SEED), hooks=hooks)
    return net.state_dict()


def _equal(a, b) -> None:
    assert a.keys() == {f"net.{k}" for k in b} or a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k.removeprefix("net.")] if k not in b else b[k]), k


@pytest.mark.parametrize("stage", ["hook", "fused"])
def test_clip_equals_gradmods_trainer_and_gradient_clip_val(tmp_path, stage):
    ours = _lightning(tmp_path, [GradmodCallback(CLIP, stage=stage)])
    _equal(ours, _gradmod(CLIP, stage))
    _equal(ours, _lightning(tmp_path, gradient_clip_val=BOUND, gradient_clip_algorithm="value"))
    plain = _lightning(tmp_path)
    assert any(not torch.equal(plain[k], ours[k]) for k in ours)  # the clip really acted


def test_global_norm_clip_equals_gradient_clip_val_norm(tmp_path):
    max_norm = 0.5
    rules = {
        "gnc": {"params": "*", "stage": "fused", "transforms": [{"name": "global_norm_clip", "max_norm": max_norm}]}
    }
    ours = _lightning(tmp_path, [GradmodCallback(rules)])
    ref = _lightning(tmp_path, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
    for k in ours:
        torch.testing.assert_close(ours[k], ref[k], rtol=0, atol=1e-6)


def test_rules_from_a_hook_file_and_log_statistics_reach_the_logger(tmp_path):
    from helpers import CONF
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run", version=0)
    callback = GradmodCallback(CONF / "hooks" / "log.yaml", log_every=4)
    _lightning(tmp_path, [callback], logger=logger)
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    logged = [r for r in rows if r.get("grad/net.0.weight/norm")]
    assert [int(r["step"]) for r in logged] == [4, 8]  # 8 steps of 8 images: a read every 4
    assert all(float(r["grad/net.0.weight/calls"]) == 4 for r in logged)  # each read covers its 4 steps
    assert all(float(r["grad/net.2.bias/norm"]) > 0 for r in logged)
    assert callback.hooks is None  # removed at the end of fit


def test_per_sample_rules_are_refused_in_one_line_when_the_callback_is_made():
    with pytest.raises(
        ValueError,
        match=r"^hooks.dp: per_sample rules .* are refused under Lightning: [^\n]*own loop \(gradmod.PoissonSampler",
    ):
        GradmodCallback("dp")


SAM = {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.1}]}}


def test_sam_rules_are_refused_in_one_line_at_setup(tmp_path):
    with pytest.raises(ValueError, match=r"^hooks.sam: sharpness rules \(SAM\) are refused under Lightning: [^\n]*$"):
        _lightning(tmp_path, [GradmodCallback(SAM)])


def test_penalty_rules_are_refused_in_one_line_at_setup(tmp_path):
    with pytest.raises(
        ValueError, match=r"^hooks.grad_penalty: penalty rules \(a term [^\n]*\) are refused under Lightning: [^\n]*$"
    ):
        _lightning(tmp_path, [GradmodCallback("grad_penalty")])


class ManualSam(Module):
    """SAM under Lightning's manual optimisation: the rules attached in the module, the
    closure recomputing the batch's loss."""

    def __init__(self, net: nn.Module):
        super().__init__(net)
        self.automatic_optimization = False
        self.hooks = attach(net, SAM)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()

        def loss():
            return F.cross_entropy(self(x), y)

        self.hooks.backward(loss(), closure=loss)
        self.hooks.after_backward()
        opt.step()


def test_sam_under_manual_optimisation_equals_gradmods_trainer(tmp_path):
    x, y = _data()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    module = ManualSam(_net())
    trainer = L.Trainer(**lightning_args(tmp_path, max_epochs=1))
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=order))
    _equal({k: v.clone() for k, v in module.net.state_dict().items()}, _gradmod(SAM, "hook"))


class ClipByHand(L.Callback):
    """clip_grad_norm_ with a linear ramp over Lightning's global step (the reference)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        t = trainer.global_step
        torch.nn.utils.clip_grad_norm_(list(pl_module.parameters()), 1.0 + (0.1 - 1.0) * min(t / 4, 1.0))


def test_a_schedule_follows_the_global_step_under_accumulation(tmp_path):
    rules = {
        "ramp": {
            "params": "*",
            "stage": "fused",
            "transforms": [{"name": "global_norm_clip", "max_norm": {"schedule": "linear", "start": 1.0, "end": 0.1}}],
        }
    }
    callback = GradmodCallback(rules)
    ours = _lightning(tmp_path, [callback], accumulate_grad_batches=2)  # 8 batches: 4 steps, the whole run
    _equal(ours, _lightning(tmp_path, [ClipByHand()], accumulate_grad_batches=2))
    assert callback._state["clock"]["t"] == 4


CURVATURE = {
    "curv": {
        "params": ["net.0.*", "net.2.bias"],
        "transforms": [{"name": "curvature", "every": 2, "k": 2, "iterations": 200, "tol": 1e-10, "batch": 5}],
    }
}


def _fit64(tmp_path, callbacks=(), logger=False) -> tuple[Module, dict[str, torch.Tensor]]:
    """4 SGD steps in float64 (batches of 8 in gradmod's epoch order); the module and its first weights."""
    x, y = _data()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    module = Module(_net().double())
    first = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(**lightning_args(tmp_path, max_steps=4, logger=logger, callbacks=list(callbacks)))
    trainer.fit(module, DataLoader(TensorDataset(x.double(), y), batch_size=BATCH, sampler=order))
    return module, first


def test_a_curvature_rule_estimates_the_exact_hessian_and_leaves_training_as_it_was(tmp_path):
    """Estimates at steps 0, 2 and 4 (the last): those at 0 and 4 against eigvalsh of torch.func's
    Hessian at the first and the final weights, on the first batch's first 5 examples."""
    from helpers import hessian_top
    from lightning.pytorch.loggers import CSVLogger

    callback = GradmodCallback([CURVATURE, CLIP], loss_fn=F.cross_entropy)
    logger = CSVLogger(tmp_path, name="run", version=0)
    module, first = _fit64(tmp_path, [callback], logger)
    plain, _ = _fit64(tmp_path, [GradmodCallback(CLIP)])
    _equal(module.state_dict(), plain.state_dict())  # bit for bit: the estimates changed nothing
    rows = callback.curvature_rows
    assert [(r["step"], r["group"]) for r in rows] == [(s, g) for s in (0, 2, 4) for g in ("net.0.*", "net.2.bias")]
    x, y = _data()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED))[:5]
    probe = x.double()[order], y[order]
    names = {"net.0.*": ["net.0.weight", "net.0.bias"], "net.2.bias": ["net.2.bias"]}
    worst = 0.0
    for step, weights in ((0, first), (4, module.state_dict())):
        reference = Module(_net().double())
        reference.load_state_dict(weights)
        for row in (r for r in rows if r["step"] == step):
            k = min(2, sum(reference.get_parameter(n).numel() for n in names[row["group"]]))
            exact = hessian_top(
                reference, lambda call: F.cross_entropy(call(probe[0]), probe[1]), names[row["group"]], k
            )
            got = [row[f"top{i + 1}"] for i in range(k)]
            worst = max(worst, *(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, exact)))
            assert got == pytest.approx(exact, rel=1e-8, abs=1e-10), (step, row["group"], got, exact)
    print(f"largest relative error {worst:.2e}")
    logged = [r for r in csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")) if r["curv/net.0.*/top1"]]
    assert [(int(r["step"]), float(r["curv/net.0.*/top1"])) for r in logged] == [
        (r["step"], r["top1"]) for r in rows if r["group"] == "net.0.*"
    ]


def test_a_curvature_rule_without_a_loss_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^hooks.curv: a curvature rule under Lightning needs its loss: [^\n]*$"):
        GradmodCallback(CURVATURE)


def test_a_curvature_glob_matching_nothing_is_refused_in_one_line_at_setup(tmp_path):
    rules = {"curv": {"params": "conv*", "transforms": ["curvature"]}}
    with pytest.raises(ValueError, match=r"^hooks.curv.params: 'conv\*' matches no trainable parameter[^\n]*$"):
        _fit64(tmp_path, [GradmodCallback(rules, loss_fn=F.cross_entropy)])
