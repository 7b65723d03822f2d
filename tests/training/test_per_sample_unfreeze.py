"""A layer frozen at build and unfrozen later under a per_sample rule, in the Trainer (one
process and DDP) and in one's own loop: the step after it trains is each example's gradient
of every parameter that trains, clipped and summed, against ``torch.func``'s ``vmap(grad)``.

The model switches ``requires_grad`` in its own ``forward`` (as a model with no callback
must): at the stage's trace of the first forward too, where it freezes the layer again.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, spawn_ranks
from torch import nn
from torch.func import functional_call, grad, vmap

from gradmod.data import Data
from gradmod.hooks import attach
from gradmod.training.callbacks import Callback
from gradmod.training.trainer import Trainer, TrainerSettings

MAX_NORM, N = 0.3, 16
UNFROZEN_AT = 2  # optimizer steps done when the first layer starts training


class SwitchesItself(nn.Sequential):
    """An MLP whose training forward sets its first layer's ``requires_grad`` to ``train_first``."""

    train_first = False

    def forward(self, x):
        if self.training:
            self[0].requires_grad_(self.train_first)
        return super().forward(x)


def model(switches: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = (nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    m = (SwitchesItself if switches else nn.Sequential)(*layers).double()
    m[0].requires_grad_(False)  # frozen at build
    return m


def rules() -> dict:
    clip = {"name": "per_sample_clip", "max_norm": MAX_NORM, "noise_multiplier": 0.0}
    return {"dp": {"params": "*", "transforms": [clip]}}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def per_example(m: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of the parameters ``names`` (those that train), by ``vmap(grad)``."""
    plain = nn.Sequential(*m)  # the same layers, no switching
    params = {n: p.detach() for n, p in plain.named_parameters() if n in names}
    rest = {n: p.detach() for n, p in plain.named_parameters() if n not in names}

    def loss(ps, xi, yi):
        return F.cross_entropy(functional_call(plain, {**ps, **rest}, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def norms(per: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in per.values()))


def clipped_mean(m: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """By hand: those per-example gradients flat-clipped over all of them, summed, divided by the examples."""
    per = per_example(m, names, x, y)
    factor = (MAX_NORM / (norms(per) + 1e-6)).clamp(max=1.0)
    return {n: torch.tensordot(factor, g, 1) / len(y) for n, g in per.items()}


class Unfreeze(Callback):
    """Unfreezes the first layer before step ``UNFROZEN_AT`` (by the model's flag, or by hand)
    and keeps each step's gradients and parameters as the optimizer gets them."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, dict]] = []

    def on_step_start(self, trainer) -> None:
        if trainer.step == UNFROZEN_AT:
            m = trainer.model
            if isinstance(m, SwitchesItself):
                m.train_first = True
            else:
                m[0].requires_grad_(True)

    def on_before_optimizer_step(self, trainer) -> bool:
        named = list(trainer.model.named_parameters())
        grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
        self.seen.append((grads, {n: p.detach().clone() for n, p in named}))
        return False


def training(step: int) -> list[str]:
    """The parameters that train at ``step``: the head alone before the unfreeze."""
    return ["0.weight", "0.bias", "2.weight", "2.bias"] if step >= UNFROZEN_AT else ["2.weight", "2.bias"]


def at(params: dict) -> nn.Module:
    m = model(False)
    m.load_state_dict(params)
    return m


def check(seen: list[tuple[dict, dict]], x: torch.Tensor, y: torch.Tensor) -> None:
    """Frozen before the unfreeze (no gradient), then every parameter clipped with the rule."""
    assert len(seen) == UNFROZEN_AT + 2
    for step, (grads, params) in enumerate(seen):
        names = training(step)
        want = clipped_mean(at(params), names, x, y)
        assert sorted(grads) == sorted(names), step
        for n in names:
            torch.testing.assert_close(grads[n], want[n], rtol=1e-10, atol=1e-12, msg=f"{n} at step {step}")


def trainer(m: nn.Module, cb: Unfreeze, world: int = 1, keep: dict | None = None, **kw) -> Trainer:
    settings = TrainerSettings(batch_size=N // world, eval_batch_size=N, log_every=2**62)
    hooks = attach(m, keep or rules())
    return Trainer(m, torch.optim.SGD(m.parameters(), lr=0.5), settings, hooks=hooks, callbacks=[cb], **kw)


@pytest.mark.parametrize("switches", [True, False], ids=["by_its_forward", "by_a_callback"])
def test_the_trainer_clips_a_layer_unfrozen_during_training_with_its_rule(switches):
    x, y = data()
    cb = Unfreeze()
    trainer(model(switches), cb).fit(Data("random", x, y, x, y), UNFROZEN_AT + 2)  # one step an epoch
    check(cb.seen, x, y)


def test_scores_follow_a_layer_unfrozen_by_its_forward():
    """``scores`` (no clipping): autograd's gradient unchanged, each example's GraNd over what
    trains at its step, also the steps after the one that unfroze (hung calls, probes)."""
    x, y = data()
    m, cb = model(True), Unfreeze()
    t = trainer(m, cb, keep={"scores": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}})
    t.fit(Data("random", x, y, x, y), UNFROZEN_AT + 3)
    taken = t.hooks.stage("per_sample").take_scores()
    for step, (grads, params) in enumerate(cb.seen):
        names = training(step)
        per = per_example(at(params), names, x, y)
        assert sorted(grads) == sorted(names), step
        for n in names:
            torch.testing.assert_close(grads[n], per[n].mean(0), rtol=1e-10, atol=1e-12, msg=f"{n} at step {step}")
        rows = slice(step * N, (step + 1) * N)
        grand = torch.empty(N, dtype=torch.float64).index_copy_(0, taken["index"][rows], taken["grand"][rows])
        torch.testing.assert_close(grand, norms(per), rtol=1e-10, atol=1e-12, msg=f"GraNd at step {step}")


def test_ones_own_loop_clips_a_layer_its_forward_unfreezes_with_its_rule():
    x, y = data()
    m = model(True)
    hooks = attach(m, rules())
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    seen = []
    for step in range(UNFROZEN_AT + 2):
        m.train_first = step >= UNFROZEN_AT
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        hooks.after_backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        seen.append((grads, {n: p.detach().clone() for n, p in m.named_parameters()}))
        opt.step()
    check(seen, x, y)


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    from gradmod.training.distributed.strategy import Dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        m, cb = model(True), Unfreeze()
        x, y = data()
        t = trainer(m, cb, world, dist=dist, net=dist.wrap(m))
        for _ in range(UNFROZEN_AT + 2):  # each rank's half of the examples, one step an epoch
            t.train_epoch(x, y)
        torch.save(cb.seen, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.mark.slow
def test_under_ddp_a_layer_its_forward_unfreezes_is_clipped_over_both_ranks(tmp_path):
    spawn_ranks(_ddp_worker, 2, free_port(), str(tmp_path))
    x, y = data()
    for rank in range(2):  # both ranks' halves: the whole set each step
        check(torch.load(tmp_path / f"rank{rank}.pt"), x, y)
