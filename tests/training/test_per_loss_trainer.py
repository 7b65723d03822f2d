"""The trainer with several named losses: one step's parameters under DDP (2 gloo processes)
equal one process on the joined batch, and under bf16 and fp16 (GradScaler) equal fp32's,
for the plain sum and for every per_loss method this build registers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, per_loss_method, spawn_ranks
from torch import nn

from gradmod.hooks import attach
from gradmod.labels import Labels
from gradmod.training.distributed.strategy import Dist, unwrap
from gradmod.training.precision import Precision
from gradmod.training.trainer import Trainer, TrainerSettings

BATCH = 6  # per rank
LR = 0.3
# None: no rule (the trainer sums the losses); the rest: a per_loss rule on the trunk, once registered.
METHODS = [
    None,
    "sum",
    "mean",
    "pcgrad",
    "mgda",
    "cagrad",
    "upgrad",
    "imtl_g",
    "aligned_mtl",
    "dualproj",
    "famo",
    "uw",
    "dwa",
    "geometric_mean",
]


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 4)

    def forward(self, x):
        h = self.trunk(x)
        return {"a": self.a(h), "b": self.b(h)}


def data(n: int) -> tuple[torch.Tensor, Labels]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g) * 2
    return x, Labels({"a": torch.randint(0, 3, (n,), generator=g), "b": torch.randint(0, 4, (n,), generator=g)})


def registered(method: str | None) -> bool:
    return method is None or per_loss_method(method)


def rules(method: str | None) -> dict:
    return {} if method is None else {"mtl": {"params": "trunk.*", "transforms": [method]}}


def one_step(
    method: str | None, dist: Dist | None = None, batch: int = 2 * BATCH, precision: str = "fp32"
) -> dict[str, torch.Tensor]:
    """One SGD step of the Trainer on the 2 * BATCH examples (each rank its share)."""
    model = TwoTasks()
    hooks = attach(model, rules(method))
    net = dist.wrap(model) if dist is not None else model
    amp = Precision(precision, torch.device("cpu"))
    if amp.scaler is not None:  # a scale whose gradients fit in fp16: the step is taken, not skipped
        amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        TrainerSettings(batch_size=batch, log_every=2**62),
        hooks=hooks,
        dist=dist,
        net=net,
        amp=amp,
        generator=torch.Generator().manual_seed(5),
    )
    trainer.train_epoch(*data(2 * BATCH))
    hooks.remove()
    return {n: p.detach().clone() for n, p in unwrap(model).named_parameters()}


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        results = {str(m): one_step(m, dist, batch=BATCH) for m in METHODS if registered(m)}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.fixture(scope="module")
def ddp_params(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_tasks")
    spawn_ranks(_ddp_worker, 2, free_port(), str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_summed_losses_step_is_the_hand_computed_step():
    got = one_step(None)
    model = TwoTasks()
    x, y = data(2 * BATCH)
    out = model(x)
    loss = F.cross_entropy(out["a"], y["a"]) + F.cross_entropy(out["b"], y["b"])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for (name, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(got[name], p.detach() - LR * g, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_two_ddp_processes_equal_one_on_the_joined_batch(ddp_params, method):
    if not registered(method):
        pytest.skip(f"the per_loss transform {method!r} is not registered in this build")
    single = one_step(method)
    rank0, rank1 = (p[str(method)] for p in ddp_params)
    moved = [n for n in single if not torch.equal(single[n], TwoTasks().state_dict()[n])]
    assert any(n.startswith("trunk.") for n in moved), "the step must move the trunk"
    for name in single:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between ranks"
        torch.testing.assert_close(rank0[name], single[name], rtol=0, atol=1e-6, msg=f"{method}: {name}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "method", [None, "sum", "pcgrad", "mgda", "upgrad", "cagrad", "nash_mtl", "famo", "uw"], ids=str
)
def test_mixed_precision_steps_like_fp32(method, precision):
    """fp16's GradScaler scales each loss; the step (and any aggregate) sees the unscaled
    gradients, so the step equals fp32's up to half precision's rounding."""
    if not registered(method):
        pytest.skip(f"the per_loss transform {method!r} is not registered in this build")
    start = TwoTasks().state_dict()
    full, half = one_step(method), one_step(method, precision=precision)
    for name in full:
        step_full, step_half = full[name] - start[name], half[name] - start[name]
        assert torch.isfinite(step_half).all(), name
        scale = step_full.abs().max().item()
        torch.testing.assert_close(step_half, step_full, rtol=0, atol=0.03 * scale + 1e-6, msg=f"{method}: {name}")


def test_fp16_hands_the_hooks_each_loss_scaled():
    seen = {}

    class Recorder:
        grad_scale = None

        def set_grad_scale(self, scale):
            self.grad_scale = scale

        def backward(self, losses):
            seen.update(losses)
            sum(losses.values()).backward()

    amp = Precision("fp16", torch.device("cpu"))
    w = torch.ones(3, requires_grad=True)
    hooks = Recorder()
    amp.backward({"a": (w * 2).sum(), "b": w.sum()}, hooks)
    scale = hooks.grad_scale.item()
    assert scale == amp.scale() > 1
    assert seen["a"].item() == pytest.approx(6 * scale) and seen["b"].item() == pytest.approx(3 * scale)
    assert torch.equal(w.grad, torch.full((3,), 3 * scale))


def test_the_trainer_updates_famo_from_the_same_batch_after_the_step():
    """Three full-batch steps of the Trainer against torchjd's FAMO updated, as its authors do,
    from the same batch's losses after each step (a forward without gradients)."""
    import torchjd.scalarization as tjs

    x, y = data(2 * BATCH)
    model = TwoTasks()
    hooks = attach(model, {"w": {"params": "*", "transforms": ["famo"]}})
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        TrainerSettings(batch_size=2 * BATCH, log_every=2**62),
        hooks=hooks,
        generator=torch.Generator().manual_seed(5),
    )
    for _ in range(3):
        trainer.train_epoch(x, y)
    ref, famo = TwoTasks(), tjs.FAMO(2)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)

    def losses():
        out = ref(x)
        return torch.stack([F.cross_entropy(out["a"], y["a"]), F.cross_entropy(out["b"], y["b"])])

    for _ in range(3):
        opt.zero_grad()
        famo(losses()).backward()
        opt.step()
        with torch.no_grad():
            famo.update(losses())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
    assert not torch.equal(hooks.stage("per_loss").rules[0].method.logits, torch.zeros(2))  # it learned
