"""Rules that change over training, in the hook core: scheduled arguments, windows,
freeze and the step clock in state_dict, each against an independent computation (a
hand-written reversal Function, clip_grad_norm_ with the scheduled values, a loop that
sets .grad = None under AdamW, an uninterrupted run)."""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach
from gradmod.testing.opcount import OpCounter


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g) * 2, torch.randint(0, 3, (n,), generator=g)


class Reverse(torch.autograd.Function):
    """The DANN gradient reversal layer, by hand: identity forward, -lambda * grad backward."""

    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.lam * grad, None


def dann_lambda(t: int, total: int) -> float:
    p = t / total
    return 2.0 / (1.0 + math.exp(-10.0 * p)) - 1.0


def test_dann_ramp_on_a_module_output_equals_a_reversal_function():
    total = 12
    rules = {
        "grl": {
            "modules": "2",
            "transforms": [{"name": "scale", "factor": {"schedule": "dann", "start": 0.0, "end": -1.0}}],
        }
    }
    ours, ref = model(), model()
    hooks = attach(ours, rules, total_steps=total)
    for t in range(total):
        x, y = batch(t)
        ours.zero_grad(set_to_none=True)
        F.cross_entropy(ours(x), y).backward()
        hooks.after_backward()
        ref.zero_grad(set_to_none=True)
        h = Reverse.apply(ref[2](ref[1](ref[0](x))), dann_lambda(t, total))
        F.cross_entropy(ref[4](ref[3](h)), y).backward()
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), (t, n)
    assert hooks.step == total


def test_scheduled_max_norm_equals_clip_grad_norm_with_the_same_values():
    rules = {
        "c": {
            "params": "*",
            "transforms": [
                {
                    "name": "global_norm_clip",
                    "max_norm": {"schedule": "linear", "start": 2.0, "end": 0.5, "until": "2ep"},
                }
            ],
        }
    }
    ours, ref = model(), model()
    hooks = attach(ours, rules, steps_per_epoch=3)
    for t in range(8):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            for micro in range(2):  # two micro-batches: both see the step's value
                x, y = batch(10 * t + micro)
                F.cross_entropy(m(x), y).backward()
        hooks.after_backward()
        max_norm = 2.0 + (0.5 - 2.0) * min(t / 6, 1.0)
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), t
    assert hooks.read_stats()["c/global_norm_clip.max_norm"] == {"value": 0.5}


def adamw_run(rules, steps: int, frozen) -> list[torch.Tensor]:
    """AdamW steps with ``rules`` attached (or, with ``rules`` None, ``frozen(t, name)``
    saying which parameters the loop sets to .grad = None itself)."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)
    hooks = attach(m, rules, steps_per_epoch=2) if rules else None
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(t)
        F.cross_entropy(m(x), y).backward()
        if hooks is not None:
            hooks.after_backward()
        else:
            for n, p in m.named_parameters():
                if frozen(t, n):
                    p.grad = None
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def test_freeze_window_is_a_grad_none_loop_under_adamw():
    rules = {"f": {"params": "*", "exclude": "4.*", "transforms": ["freeze"], "active": {"until": "2ep"}}}
    got = adamw_run(rules, 7, None)
    want = adamw_run(None, 7, lambda t, n: t < 4 and not n.startswith("4."))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    start = [p.detach() for p in model().parameters()]
    moved = adamw_run(None, 7, lambda t, n: False)
    assert not torch.equal(moved[0], start[0]) and not torch.equal(got[0], moved[0])  # it did something
    # A zero gradient is not a freeze: weight decay and the moments still move the weights.
    zero = {"z": {"params": "*", "exclude": "4.*", "transforms": ["zero"], "active": {"until": "2ep"}}}
    assert not torch.equal(adamw_run(zero, 4, None)[0], start[0])
    assert torch.equal(adamw_run(rules, 4, None)[0], start[0])


def test_outside_its_window_a_rule_does_nothing_and_logs_nothing():
    rules = {
        "w": {
            "params": "0.weight",
            "transforms": ["log", {"name": "clamp", "bound": 1e-3}],
            "active": {"from": 2, "until": 4},
        },
    }
    ours, ref = model(), model()
    hooks = attach(ours, rules)
    for t in range(6):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            x, y = batch(t)
            F.cross_entropy(m(x), y).backward()
        if 2 <= t < 4:
            ref[0].weight.grad.clamp_(-1e-3, 1e-3)
        assert torch.equal(ours[0].weight.grad, ref[0].weight.grad), t
        hooks.after_backward()
    stats = hooks.read_stats()
    assert stats["0.weight/pre"]["calls"] == 2  # steps 2 and 3 only
    assert stats["w/active"] == {"value": 0.0}
    assert "active steps [2ba, 4ba)" in hooks.format_plan()


def noisy_rules():
    return {
        "n": {"params": "2.*", "transforms": [{"name": "noise", "std": 0.5, "decay": 1.0}]},
        "c": {
            "params": "*",
            "stage": "fused",
            "transforms": [{"name": "global_norm_clip", "max_norm": {"schedule": "cosine", "start": 3.0, "end": 0.2}}],
        },
        "f": {"params": "0.*", "transforms": ["freeze"], "active": {"from": 3, "until": 6}},
        "z": {"params": "4.*", "transforms": [{"name": "zclip", "warmup_steps": 2}]},
    }


def train(m, hooks, opt, steps: range) -> None:
    for t in steps:
        torch.manual_seed(1000 + t)  # the noise's draws, as a checkpointed generator would give them
        opt.zero_grad(set_to_none=True)
        x, y = batch(t)
        F.cross_entropy(m(x), y).backward()
        hooks.after_backward()
        opt.step()


def test_killed_and_resumed_ends_bitwise_equal():
    whole = model()
    opt = torch.optim.AdamW(whole.parameters(), lr=0.02, weight_decay=0.1)
    train(whole, attach(whole, noisy_rules(), total_steps=10), opt, range(10))

    first = model()
    opt1 = torch.optim.AdamW(first.parameters(), lr=0.02, weight_decay=0.1)
    hooks1 = attach(first, noisy_rules(), total_steps=10)
    train(first, hooks1, opt1, range(4))
    saved = copy.deepcopy((first.state_dict(), opt1.state_dict(), hooks1.state_dict()))
    assert saved[2]["clock"]["t"] == 4

    second = model(seed=9)  # a fresh process: other weights until the checkpoint loads
    opt2 = torch.optim.AdamW(second.parameters(), lr=0.02, weight_decay=0.1)
    hooks2 = attach(second, noisy_rules(), total_steps=10)
    second.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    hooks2.load_state_dict(saved[2])
    assert hooks2.step == 4 and "f" not in hooks2.timed.inactive  # inside the window it resumed in
    train(second, hooks2, opt2, range(4, 10))
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)


def test_noise_counts_optimizer_steps_not_calls():
    m = model()
    hooks = attach(m, {"n": {"params": "*", "transforms": [{"name": "noise", "std": 1.0, "decay": 1.0}]}})
    noise = hooks.targets[0].steps[0].fn
    for t in range(3):
        for micro in range(4):
            x, y = batch(micro)
            F.cross_entropy(m(x), y).backward()
            assert noise.sigma == 1.0 / (1 + t)  # every micro-batch of step t
        hooks.after_backward()
    assert hooks.state_dict()["clock"]["t"] == 3


def test_a_scheduled_argument_adds_no_op_per_step():
    def ops(factor) -> int:
        m = model()
        hooks = attach(
            m,
            {"s": {"params": "*", "stage": "fused", "transforms": [{"name": "scale", "factor": factor}]}},
            total_steps=5,
        )
        x, y = batch(0)
        F.cross_entropy(m(x), y).backward()
        hooks.after_backward()  # past the first step: the value has changed once
        F.cross_entropy(m(x), y).backward()
        with OpCounter() as c:
            hooks.after_backward()
        return c.count

    assert ops({"schedule": "linear", "start": 1.0, "end": 0.0}) == ops(0.5)


def test_plan_and_hook_plan_show_schedules():
    m = model()
    hooks = attach(
        m,
        {
            "grl": {
                "modules": "2",
                "transforms": [{"name": "scale", "factor": {"schedule": "dann", "start": 0.0, "end": -1.0}}],
            }
        },
        total_steps=4,
    )
    assert hooks.describe()[0]["transforms"] == ["scale(factor=dann(start=0, end=-1, gamma=10, until=end))"]


@pytest.mark.parametrize(
    "rules, kwargs, words",
    [
        (
            {
                "r": {
                    "params": "*",
                    "transforms": [{"name": "scale", "factor": {"schedule": "linear", "start": 1, "end": 0}}],
                }
            },
            {},
            ["hooks.r.transforms.0.factor", "total_steps"],
        ),
        (
            {"r": {"params": "*", "transforms": ["freeze"], "active": {"until": "1ep"}}},
            {},
            ["hooks.r.active.until=1ep", "steps_per_epoch"],
        ),
        (
            {"r": {"params": "*", "transforms": [{"name": "scale", "factor": {"schedule": "ramp", "start": 1}}]}},
            {},
            ["schedule='ramp'", "allowed"],
        ),
        (
            {
                "r": {
                    "params": "*",
                    "transforms": [
                        {"name": "norm_clip", "max_norm": {"schedule": "linear", "start": 1, "end": 0, "until": 5}}
                    ],
                }
            },
            {},
            ["max_norm=0", "> 0"],
        ),
        (
            {"r": {"params": "*", "transforms": ["zero"], "active": {"from": 5, "until": 2}}},
            {},
            ["until=2ba must be after from=5ba"],
        ),
        ({"r": {"params": "*", "transforms": ["zero"]}}, {"total_steps": 0}, ["total_steps=0", ">= 1"]),
    ],
)
def test_bad_schedules_and_windows_are_refused_at_attach(rules, kwargs, words):
    with pytest.raises(ValueError) as e:
        attach(model(), rules, **kwargs)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def _freeze_window_run(m: nn.Module, wrap, rank: int, world: int) -> list[torch.Tensor]:
    """Attach (the window open from step 0), then wrap: the trainer's order under DDP."""
    rules = {"f": {"params": "*", "exclude": "4.*", "transforms": ["freeze"], "active": {"until": 3}}}
    hooks = attach(m, rules)
    net = wrap(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)
    for t in range(6):
        opt.zero_grad(set_to_none=True)
        x, y = batch(t)
        F.cross_entropy(net(x[rank::world]), y[rank::world]).backward()
        hooks.after_backward()
        opt.step()
    hooks.remove()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in m.parameters()]


def _ddp_freeze_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ddp = partial(nn.parallel.DistributedDataParallel, find_unused_parameters=True)
        torch.save(_freeze_window_run(model(), ddp, rank, world), os.path.join(out, f"ddp{rank}.pt"))
        try:  # a plain DDP's reducer waits for every gradient
            _freeze_window_run(model(), nn.parallel.DistributedDataParallel, rank, world)
            refused = ""
        except ValueError as e:
            refused = str(e)
        torch.save(refused, os.path.join(out, f"refused{rank}.pt"))
        m = model()
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        torch.save(_freeze_window_run(m, lambda m: m, rank, world), os.path.join(out, f"fsdp{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_freeze_window_under_ddp_and_fsdp2_is_the_grad_none_loop(tmp_path):
    """Two ranks, each half the batch: the same weights as one process that averages the
    halves' gradients and sets .grad = None for the frozen ones. The frozen tensors have
    requires_grad off during the window: DDP built with find_unused_parameters=True follows
    it, one built without is refused in one line before the first step; FSDP2 follows it."""
    from helpers import free_port, spawn_ranks

    spawn_ranks(_ddp_freeze_worker, 2, free_port(), str(tmp_path))
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    for t in range(6):
        x, y = batch(t)
        halves = [torch.autograd.grad(F.cross_entropy(ref(x[r::2]), y[r::2]), list(ref.parameters())) for r in range(2)]
        for (n, p), gs in zip(ref.named_parameters(), zip(*halves)):
            p.grad = None if t < 3 and not n.startswith("4.") else (gs[0] + gs[1]) / 2
        opt.step()
    for r in range(2):
        for kind in ("ddp", "fsdp"):
            for got, want in zip(torch.load(tmp_path / f"{kind}{r}.pt"), ref.parameters()):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=kind)
        refused = torch.load(tmp_path / f"refused{r}.pt")
        assert "find_unused_parameters=True" in refused and "\n" not in refused


def test_a_per_loss_methods_argument_follows_its_schedule_and_keeps_its_state():
    m = model()
    beta = {"schedule": "linear", "start": 0.1, "end": 0.9, "until": 4}
    hooks = attach(m, {"m": {"params": "0.*", "transforms": [{"name": "gradvac", "beta": beta}]}})
    method = hooks.targets[0].steps[0].fn
    seen = []
    for t in range(6):
        m.zero_grad(set_to_none=True)
        x, y = batch(t)
        out = m(x)
        hooks.backward({"a": F.cross_entropy(out, y), "b": out.pow(2).mean()})
        seen.append(method.beta)
        phi = method.phi
        hooks.after_backward()
        assert method.phi is phi  # its running state is kept when the value changes
    assert seen == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9, 0.9])


def test_a_window_on_a_stage_that_cannot_skip_a_step_is_refused():
    rules = {"m": {"params": "0.*", "transforms": ["pcgrad"], "active": {"until": 3}}}
    with pytest.raises(
        ValueError, match=r"^hooks.m.active: a window is for rules at stage penalty, hook or fused; a per_loss"
    ):
        attach(model(), rules)


@pytest.mark.parametrize("given", ["by_name", "listed"])
def test_a_task_weight_follows_its_schedule_and_resumes(given):
    """``fixed`` with an auxiliary task's weight ramped (an entry of a mapping or list
    argument may be a schedule): each step's gradient is autograd's of ``L_main + w(t) L_aux``
    with the dann ramp's ``w(t)``, logged, and a run resumed at step 3 ends bitwise equal."""
    ramp = {"schedule": "dann", "start": 0.0, "end": 1.0}
    weights = {"main": 1.0, "aux": ramp} if given == "by_name" else [1.0, ramp]
    rules = {"w": {"params": "*", "transforms": [{"name": "fixed", "weights": weights}]}}

    def losses(m, t):
        x, y = batch(t)
        out = m(x)
        return {"main": F.cross_entropy(out, y), "aux": out.pow(2).mean()}

    def run(m, hooks, opt, steps, check=False):
        for t in steps:
            opt.zero_grad(set_to_none=True)
            if check:
                ref = copy.deepcopy(m)
                L = losses(ref, t)
                (L["main"] + dann_lambda(t, 6) * L["aux"]).backward()
            hooks.backward(losses(m, t))
            if check:
                for p, q in zip(m.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
            hooks.after_backward()
            if check:  # the step's weights, and the schedule's value for the step just completed
                stats = hooks.read_stats()
                assert stats["w/fixed"]["weight/aux"] == pytest.approx(dann_lambda(t, 6))
                assert (
                    stats[f"w/fixed.weights.{'aux' if given == 'by_name' else 1}"]["value"]
                    == stats["w/fixed"]["weight/aux"]
                )
            opt.step()

    whole = model()
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    run(whole, attach(whole, rules, total_steps=6), opt, range(6), check=True)
    first = model()
    opt1 = torch.optim.SGD(first.parameters(), lr=0.1)
    hooks1 = attach(first, rules, total_steps=6)
    run(first, hooks1, opt1, range(3))
    saved = copy.deepcopy((first.state_dict(), opt1.state_dict(), hooks1.state_dict()))
    second = model(seed=9)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1)
    hooks2 = attach(second, rules, total_steps=6)
    second.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    hooks2.load_state_dict(saved[2])
    run(second, hooks2, opt2, range(3, 6))
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)
    assert str(hooks2.targets[0].steps[0]).startswith("fixed(weights=")
    assert "dann(start=0, end=1" in str(hooks2.targets[0].steps[0])


def test_a_bad_schedule_inside_a_mapping_argument_names_its_path():
    rules = {"w": {"params": "*", "transforms": [{"name": "fixed", "weights": {"a": 1.0, "b": {"schedule": "ramp"}}}]}}
    with pytest.raises(ValueError, match=r"^hooks\.w\.transforms\.0\.weights\.b\.schedule='ramp'") as e:
        attach(model(), rules)
    assert "\n" not in str(e.value)
