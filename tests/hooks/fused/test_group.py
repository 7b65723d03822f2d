"""Group transforms (global_norm_clip, agc, zclip) against independent computations:
torch.nn.utils.clip_grad_norm_, a unit-by-unit loop, a float-by-float ZClip reference."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, spawn_ranks
from torch import nn

import gradmod
from gradmod.hooks import attach
from gradmod.hooks.fused.norm_history import ZClip
from gradmod.testing.opcount import OpCounter


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.Linear(5, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 1, 6, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g)


def rule(transform: dict, **extra) -> dict:
    return {"g": {"params": "*", "transforms": [transform], **extra}}


def backward(model: nn.Module, step: int) -> None:
    model.zero_grad(set_to_none=True)
    x, y = batch(step)
    F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("norm_type", [2.0, math.inf, "inf", 1.0])
def test_global_norm_clip_is_clip_grad_norm(norm_type):
    model, ref = tiny_model(), tiny_model()
    hooks = attach(model, rule({"name": "global_norm_clip", "max_norm": 0.5, "norm_type": norm_type}), stage="fused")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    totals = []
    for step in range(5):
        backward(model, step)
        backward(ref, step)
        assert hooks.after_backward() is False
        totals.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type=float(norm_type)))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        opt.step()
        ref_opt.step()
    stats = hooks.read_stats()["g/global_norm_clip"]
    totals = torch.stack(totals)
    assert stats["calls"] == 5
    assert stats["norm"] == pytest.approx(totals.mean().item(), rel=1e-6)
    assert stats["norm_max"] == pytest.approx(totals.max().item(), rel=1e-6)
    coefs = (0.5 / (totals + 1e-6)).clamp(max=1)
    assert stats["clip_coef_min"] == pytest.approx(coefs.min().item(), rel=1e-6)
    assert stats["frac_clipped"] == pytest.approx((coefs < 1).float().mean().item())
    assert 0 < stats["frac_clipped"]  # the bound bites
    hooks.remove()


def test_log_around_a_group_transform_reports_before_and_after():
    model = tiny_model()
    rules = {"g": {"params": "*", "transforms": ["log", {"name": "global_norm_clip", "max_norm": 0.2}, "log"]}}
    hooks = attach(model, rules, stage="fused")
    backward(model, 0)
    before = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    total = math.sqrt(sum(v * v for v in before.values()))
    hooks.after_backward()
    stats = hooks.read_stats()
    coef = min(1.0, 0.2 / (total + 1e-6))
    assert stats["g/global_norm_clip"]["clip_coef"] == pytest.approx(coef, rel=1e-5)
    for name, norm in before.items():
        assert stats[f"{name}/pre"]["norm"] == pytest.approx(norm, rel=1e-5)
        assert stats[f"{name}/post"]["norm"] == pytest.approx(norm * coef, rel=1e-5)
    hooks.remove()


def test_global_norm_clip_chains_in_config_order():
    model, ref = tiny_model(), tiny_model()
    rules = {
        "g": {
            "params": "*",
            "transforms": [
                {"name": "scale", "factor": 3.0},
                {"name": "global_norm_clip", "max_norm": 0.3},
                {"name": "clamp", "min": -0.01, "max": 0.01},
            ],
        }
    }
    hooks = attach(model, rules, stage="fused")
    backward(model, 1)
    backward(ref, 1)
    hooks.after_backward()
    for p in ref.parameters():
        p.grad.mul_(3.0)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    hooks.remove()


def test_global_norm_clip_fp16_autocast_gradscaler_unscaled():
    model, ref = tiny_model(), tiny_model()
    hooks = attach(model, rule({"name": "global_norm_clip", "max_norm": 0.5}), stage="fused")
    runs = []
    for net, clip in (
        (model, hooks.after_backward),
        (ref, lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)),
    ):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # the clip sees unscaled gradients
            clip()
            scaler.step(opt)
            scaler.update()
        runs.append([p.detach().clone() for p in net.parameters()])
    for p, q in zip(*runs):
        assert torch.equal(p, q)
    assert hooks.read_stats()["g/global_norm_clip"]["calls"] == 3
    hooks.remove()


def agc_reference(model: nn.Module, grads: dict, clip_factor: float, eps: float) -> dict:
    """Unit by unit in float64: row i of a weight (all dims but the first) is one unit."""
    out = {}
    for name, p in model.named_parameters():
        w, g = p.detach().double(), grads[name].double()
        units = [(w, g)] if p.dim() <= 1 else [(w[i], g[i]) for i in range(p.shape[0])]
        rows = []
        for wu, gu in units:
            limit = clip_factor * max(wu.norm().item(), eps)
            n = gu.norm().item()
            rows.append(gu * (limit / n) if n > limit else gu)
        out[name] = rows[0] if p.dim() <= 1 else torch.stack(rows)
    return out


def test_agc_matches_a_unit_by_unit_computation():
    model = tiny_model()
    with torch.no_grad():
        model[0].weight[1].zero_()  # a unit whose weights are all zero: eps bounds it
    hooks = attach(model, rule({"name": "agc", "clip_factor": 0.6, "eps": 1e-3}), stage="fused")
    backward(model, 2)
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    hooks.after_backward()
    expected = agc_reference(model, raw, 0.6, 1e-3)
    same = []  # per unit: left as it was?
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[name], rtol=1e-5, atol=1e-9, msg=name)
        units = zip(p.grad, raw[name]) if p.dim() > 1 else [(p.grad, raw[name])]
        same += [torch.equal(a, b) for a, b in units]
    assert not all(same) and any(same)  # the clip bites on some units, not all
    hooks.remove()


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_agc_records_the_total_norms_before_and_after(norm_type):
    """From the unit norms (L2) or from the gradients (another order): the same numbers as
    the norm of all gradients before the clip and after it."""
    model = tiny_model()
    hooks = attach(model, rule({"name": "agc", "clip_factor": 0.6, "norm_type": norm_type}), stage="fused")
    backward(model, 2)
    raw = [p.grad.clone() for p in model.parameters()]
    hooks.after_backward()
    before = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in raw]))
    after = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in model.parameters()]))
    stats = hooks.read_stats()["g/agc"]
    assert stats["norm"] == pytest.approx(before.item(), rel=1e-6)
    assert stats["clip_coef"] == pytest.approx((after / before).item(), rel=1e-5)
    assert stats["clip_coef"] < 1  # the clip bites
    hooks.remove()


def test_agc_config_leaves_the_classifier_out():
    from helpers import ROOT

    from gradmod.hooks import load_rules
    from gradmod.models import MnistCNN

    rules = load_rules(ROOT / "gradmod" / "conf" / "hooks" / "agc.yaml")
    hooks = attach(MnistCNN(), rules)
    names = {d["tensor"] for d in hooks.describe()}
    assert names == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}
    assert {d["stage"] for d in hooks.describe()} == {"fused"}
    hooks.remove()


def zclip_reference(norms, alpha, z, warmup):
    """Float-by-float ZClip: the clipped norms and the indices of the spikes."""
    mean = var = None
    out, spikes = [], []
    for t, g in enumerate(norms):
        if t < warmup:
            out.append(g)
            if t == warmup - 1:
                mean = sum(norms[:warmup]) / warmup
                var = sum(v * v for v in norms[:warmup]) / warmup - mean * mean
            continue
        std = math.sqrt(var)
        if (g - mean) / (std + 1e-6) > z:
            g = mean + z * std
            spikes.append(t)
        out.append(g)
        mean = alpha * mean + (1 - alpha) * g
        var = alpha * var + (1 - alpha) * (g - mean) ** 2
    return out, spikes


def norm_series(n: int, spikes: dict[int, float]) -> list[float]:
    g = torch.Generator().manual_seed(3)
    base = (1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).tolist()
    return [spikes.get(t, v) for t, v in enumerate(base)]


@pytest.mark.parametrize("on_spike", ["clip", "skip"])
def test_zclip_matches_a_reference_on_planted_spikes(on_spike):
    planted = {30: 5.0, 31: 3.0, 45: 10.0, 60: 2.0}
    norms = norm_series(80, planted)
    expected, spikes = zclip_reference(norms, 0.97, 2.5, 25)
    assert set(planted) <= set(spikes) and len(spikes) <= len(planted) + 1  # the spikes, hardly more
    p = nn.Parameter(torch.zeros(3, 4))
    holder = nn.Module()
    holder.p = p
    direction = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    direction /= direction.norm()
    hooks = attach(holder, {"z": {"params": "p", "transforms": [{"name": "zclip", "on_spike": on_spike}]}})
    skipped = []
    for t, g in enumerate(norms):
        p.grad = direction * g
        if hooks.after_backward():
            skipped.append(t)
        assert p.grad.norm().item() == pytest.approx(expected[t], rel=1e-5), t
    assert skipped == (spikes if on_spike == "skip" else [])
    stats = hooks.read_stats()["z/zclip"]
    assert stats["frac_clipped"] == pytest.approx(len(spikes) / len(norms))
    hooks.remove()


def test_zclip_resumes_bit_identically():
    rules = rule({"name": "zclip", "warmup_steps": 3, "z_threshold": 1.0})

    def train(model, hooks, steps):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in steps:
            backward(model, step)
            hooks.after_backward()
            opt.step()

    whole = tiny_model()
    hooks = attach(whole, rules, stage="fused")
    train(whole, hooks, range(10))
    assert hooks.read_stats()["g/zclip"]["frac_clipped"] > 0  # the threshold bites
    first = tiny_model()
    hooks_a = attach(first, rules, stage="fused")
    train(first, hooks_a, range(6))
    state, weights = copy.deepcopy(hooks_a.state_dict()), copy.deepcopy(first.state_dict())
    assert state["group"]["g/zclip"]["steps"] == 6
    second = tiny_model(seed=9)
    second.load_state_dict(weights)
    hooks_b = attach(second, rules, stage="fused")
    hooks_b.load_state_dict(state)
    train(second, hooks_b, range(6, 10))
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)
    fresh = tiny_model()  # without the state the run differs: the test can fail
    fresh.load_state_dict(weights)
    train(fresh, attach(fresh, rules, stage="fused"), range(6, 10))
    assert any(not torch.equal(p, q) for p, q in zip(whole.parameters(), fresh.parameters()))


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"name": "global_norm_clip", "max_norm": 0}, ["max_norm=0", "> 0"]),
        ({"name": "global_norm_clip", "max_norm": 1, "norm_type": 0.5}, ["norm_type=0.5", "inf"]),
        ({"name": "agc", "clip_factor": -1}, ["clip_factor=-1", "> 0"]),
        ({"name": "zclip", "alpha": 1.5}, ["alpha=1.5", "(0, 1)"]),
        ({"name": "zclip", "warmup_steps": 0}, ["warmup_steps=0", ">= 1"]),
        ({"name": "zclip", "on_spike": "drop"}, ["on_spike='drop'", "clip, skip"]),
    ],
)
def test_bad_arguments_are_one_line(spec, words):
    with pytest.raises(ValueError) as e:
        attach(tiny_model(), rule(spec), stage="fused")
    assert "\n" not in str(e.value) and "hooks.g.transforms" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_group_transform_at_the_hook_stage_is_refused():
    with pytest.raises(ValueError, match=r"hooks.g.stage: group transform 'agc' .* 'fused' only"):
        attach(tiny_model(), rule({"name": "agc"}, stage="hook"))
    with pytest.raises(ValueError, match="needs params"):
        attach(tiny_model(), {"m": {"modules": "0", "transforms": [{"name": "global_norm_clip", "max_norm": 1}]}})
    with pytest.raises(TypeError, match="group transform"):
        ZClip()(torch.ones(2))


def test_zclip_state_round_trips_through_hookset_state_dict():
    model = tiny_model()
    hooks = attach(model, rule({"name": "zclip", "warmup_steps": 2}))
    for step in range(4):
        backward(model, step)
        hooks.after_backward()
    state = hooks.state_dict()["group"]["g/zclip"]
    zclip = hooks.stage("fused")._groups[0][1]
    assert state["steps"] == 4 and torch.equal(state["mean"], zclip.mean) and torch.equal(state["var"], zclip.var)
    hooks.remove()


# --- attach bookkeeping, register, fused-stage result checks -----------------------------

SCALE2 = {"s": {"params": "*", "transforms": [{"name": "scale", "factor": 2.0}]}}


def test_attach_through_another_root_is_refused():
    model = tiny_model()
    hooks = attach(model, SCALE2)
    with pytest.raises(
        ValueError,
        match=r"attach: 0\.0\.weight, 0\.0\.bias, 0\.3\.weight, 0\.3\.bias, 0\.4\.weight and 1 more already carry",
    ):
        attach(nn.Sequential(model), {"s": {"params": "*", "transforms": ["zero"]}})
    sub = tiny_model()
    sub_hooks = attach(sub[3], SCALE2)
    with pytest.raises(ValueError, match=r"attach: 3.weight, 3.bias already carry") as e:
        attach(sub, SCALE2)
    assert "\n" not in str(e.value)
    # The refused calls left the first hooks alone: scale 2 applied once, not twice.
    ref = tiny_model()
    backward(model, 0)
    backward(ref, 0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, 2 * q.grad)
    # Attaching again to the same model replaces; removing frees the tensors.
    again = attach(model, SCALE2)
    assert len(hooks) == 0 and len(again) == 6
    again.remove()
    wrapped = attach(nn.Sequential(model), SCALE2)
    wrapped.remove()
    sub_hooks.remove()
    attach(sub, SCALE2).remove()


def test_modules_rules_overlap_is_refused():
    model = tiny_model()
    hooks = attach(model, {"m": {"modules": "3", "transforms": ["log"]}})
    with pytest.raises(ValueError, match=r"attach: 0.3:output already carry"):
        attach(nn.Sequential(model), {"m": {"modules": "0.3", "transforms": ["log"]}})
    hooks.remove()
    attach(nn.Sequential(model), {"m": {"modules": "0.3", "transforms": ["log"]}}).remove()


def test_register_checks_its_arguments_at_once():
    from gradmod.hooks import transforms as T

    for args, kwargs, words in [
        ((42,), {}, "name must be a non-empty str"),
        (("",), {}, "name must be a non-empty str"),
        (("bad_factory", 5), {}, "factory must be callable"),
        (("bad_foreach", lambda: None), {"foreach": 3}, "foreach must be callable"),
    ]:
        with pytest.raises(TypeError, match=words):
            gradmod.register(*args, **kwargs)
    with pytest.raises(TypeError, match="factory must be callable"):
        gradmod.register("bad_decorated")(7)
    assert not {"bad_factory", "bad_foreach", "bad_decorated"} & set(T.names())


@pytest.mark.parametrize(
    "result, words",
    [
        ("shape", ["shape (1,)", "needs shape (4, 1, 3, 3)"]),
        ("dtype", ["dtype torch.float64", "dtype torch.float32"]),
        ("list", ["returned list"]),
    ],
)
def test_fused_result_is_checked_on_the_first_call(result, words):

    make = {"shape": lambda g: g.sum().reshape(1), "dtype": lambda g: g.double(), "list": lambda g: [g]}[result]
    gradmod.register(f"bad_{result}", lambda: make, overwrite=True)
    model = tiny_model()
    hooks = attach(model, {"r": {"params": "0.weight", "transforms": [f"bad_{result}"]}}, stage="fused")
    backward(model, 0)
    with pytest.raises(ValueError) as e:
        hooks.after_backward()
    for w in ["hooks.r", f"'bad_{result}'", "'0.weight'", *words]:
        assert w in str(e.value)
    hooks.remove()


# --- cost: aten ops per step, counted (deterministic, unlike timings) --------------------


def counted_step(model, opt, hooks=None) -> Counter[str]:
    """The aten ops of one step, by name without the overload (``_foreach_norm``)."""
    x, y = batch(0)
    with OpCounter() as count:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if hooks is not None:
            hooks.after_backward()
        opt.step()
    names: Counter[str] = Counter()
    for op, calls in count.by_op.items():  # "aten._foreach_norm.Scalar"
        names[op.split(".")[1]] += calls
    return names


def test_global_norm_clip_step_costs_a_few_ops_and_no_host_sync():
    bare, clipped = tiny_model(), tiny_model()
    hooks = attach(clipped, rule({"name": "global_norm_clip", "max_norm": 0.5}), stage="fused")
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1, foreach=True)
    clip_opt = torch.optim.SGD(clipped.parameters(), lr=0.1, foreach=True)
    counted_step(bare, bare_opt), counted_step(clipped, clip_opt, hooks)  # first steps build state
    base, ops = counted_step(bare, bare_opt), counted_step(clipped, clip_opt, hooks)
    extra = ops - base
    assert not base - ops, "the clipped step dispatches every op of the bare one"
    # _foreach_norm, stack, linalg_vector_norm, add, reciprocal, mul, clamp, _foreach_mul_, stack (record)
    assert sum(extra.values()) <= 10, extra
    assert extra["_foreach_norm"] == 1 and extra["_foreach_mul_"] == 1, extra
    assert "_local_scalar_dense" not in ops and "item" not in ops  # no host sync
    hooks.remove()


def _agc_extra_ops(layers: list[tuple[int, int]], norm_type: float = 2.0) -> tuple[int, int]:
    """(aten ops agc adds to an SGD step, tensors) on a stack of Linear(d_in, d_out) ``layers``."""
    bare = nn.Sequential(*[nn.Linear(i, o) for i, o in layers])
    clipped = copy.deepcopy(bare)
    hooks = attach(clipped, rule({"name": "agc", "norm_type": norm_type}), stage="fused")
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1, foreach=True)
    clip_opt = torch.optim.SGD(clipped.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(4, layers[0][0]), torch.randint(0, layers[-1][1], (4,))

    def step(model, opt, h=None):
        with OpCounter() as count:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if h is not None:
                h.after_backward()
            opt.step()
        return count.count

    step(bare, bare_opt), step(clipped, clip_opt, hooks)  # first steps build state
    extra = step(clipped, clip_opt, hooks) - step(bare, bare_opt)
    hooks.remove()
    return extra, 2 * len(layers)


def test_agcs_cost_is_the_one_docs_guide_clipping_md_states():
    """Per distinct shape, not per tensor: the numbers are read from the page."""
    import re

    from helpers import ROOT

    page = " ".join((ROOT / "docs" / "guide" / "clipping.md").read_text().split())
    m = re.search(
        r"(\d+) aten ops per shape plus (\d+) per step \((\d+) per shape plus (\d+) with `norm_type` other than 2\), "
        r"and (\d+) more for each shape that holds several tensors .* \(10 or 102 tensors\) adds (\d+) ops either way",
        page,
    )
    assert m, "docs/guide/clipping.md states agc's cost"
    per_shape, per_step, per_shape_l1, per_step_l1, stacked, repeated = map(int, m.groups())
    distinct = [(8 + i, 9 + i) for i in range(4)] + [(12, 3)]  # every tensor a shape of its own
    for norm_type, shape_ops, step_ops in ((2.0, per_shape, per_step), (1.0, per_shape_l1, per_step_l1)):
        ops, n = _agc_extra_ops(distinct, norm_type)
        assert ops == step_ops + shape_ops * n, (norm_type, ops, n)
    # 4 or 50 identical layers and a classifier: 4 shapes, two of them stacked
    for k in (4, 50):
        assert _agc_extra_ops([(8, 8)] * k + [(8, 3)]) == (repeated, 2 * k + 2)
    assert repeated == per_step + 4 * per_shape + 2 * stacked


# --- DDP: the fused stage sees the all-reduced (averaged) gradient -----------------------


def _ddp_clip_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_model()
        hooks = attach(model, rule({"name": "global_norm_clip", "max_norm": 0.5}), stage="fused")
        ddp = nn.parallel.DistributedDataParallel(model)
        x, y = batch(0)
        F.cross_entropy(ddp(x[rank::world]), y[rank::world]).backward()
        hooks.after_backward()
        torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_global_norm_clip_under_ddp_clips_the_averaged_gradient(tmp_path):
    spawn_ranks(_ddp_clip_worker, 2, free_port(), str(tmp_path))
    # Reference: each rank's local gradient, averaged (DDP's all-reduce), then clip_grad_norm_.
    ref = tiny_model()
    x, y = batch(0)
    local = [torch.autograd.grad(F.cross_entropy(ref(x[r::2]), y[r::2]), list(ref.parameters())) for r in range(2)]
    for p, gs in zip(ref.parameters(), zip(*local)):
        p.grad = (gs[0] + gs[1]) / 2
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    for r in range(2):
        grads = torch.load(tmp_path / f"rank{r}.pt")
        for name, q in ref.named_parameters():
            torch.testing.assert_close(grads[name], q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_zclip_an_infinite_norm_after_warm_up_leaves_the_running_statistics():
    from gradmod.hooks.fused.norm_history import ZClip

    zc = ZClip(warmup_steps=3)
    for norm in (1.0, 2.0, 3.0):
        zc.apply_([], [torch.tensor([norm])])
    mean, var = zc.mean.clone(), zc.var.clone()
    assert mean.item() == pytest.approx(2.0) and var.item() == pytest.approx(2 / 3)
    for bad in (math.inf, math.nan):
        zc.apply_([], [torch.tensor([bad])])
        assert torch.equal(zc.mean, mean) and torch.equal(zc.var, var), bad
    zc.apply_([], [torch.tensor([2.5])])  # a finite norm still updates them
    assert zc.mean.item() == pytest.approx(0.97 * 2.0 + 0.03 * 2.5)
