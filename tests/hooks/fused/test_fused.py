"""The fused stage gives the hook stage's gradients (one backward per step), and the
`log` transform stays cheap and exact."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from gradmod.hooks import attach, registry
from gradmod.hooks import transforms as T
from gradmod.hooks.stats.grad_stats import GradStats
from gradmod.models import MnistCNN
from gradmod.testing.epochs import bare_epoch
from gradmod.testing.opcount import OpCounter


def _batch(n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _grads(model, rules, stage):
    """Gradients of one backward with ``rules`` at ``stage`` (fused: after_backward too)."""
    model = copy.deepcopy(model)
    with attach(model, rules, stage=stage) as hooks:
        x, y = _batch()
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}


# Every built-in transform with a foreach form, with bounds that bite on this model's gradients.
FUSED = {
    "clamp": {"name": "clamp", "min": -0.002, "max": 0.001},
    "zero": "zero",
    "min_zero": "min_zero",
    "scale": {"name": "scale", "factor": -0.25},
    "sign": "sign",
}


def test_every_builtin_with_a_foreach_form_is_covered():
    assert sorted(FUSED) == sorted(n for n in T.names() if registry.entry(n).foreach is not None)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_hook_and_fused_give_identical_gradients(name):
    torch.manual_seed(0)
    model = MnistCNN()
    rules = {name: {"params": "*", "transforms": [FUSED[name]]}}
    plain = _grads(model, {}, "hook")
    hook, fused = _grads(model, rules, "hook"), _grads(model, rules, "fused")
    expected_fn = T.build(FUSED[name])  # independent: the plain function on the raw gradient
    for n, g in plain.items():
        assert torch.equal(hook[n], fused[n]), f"{name}: {n} differs between stages"
        assert torch.equal(hook[n], expected_fn(g)), f"{name}: {n} is not {name} of the raw gradient"
    assert any(not torch.equal(hook[n], plain[n]) for n in plain), f"{name} changed nothing: a vacuous test"


CHAIN = {
    "clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.003, "max": 0.003}]},
    "half": {"params": "conv*", "transforms": [{"name": "scale", "factor": 0.5}]},
    "nonneg": {"params": "*.bias", "transforms": ["min_zero"]},
    "signs": {"params": "l1.weight", "transforms": ["sign", {"name": "scale", "factor": 1e-3}]},
    "frozen": {"params": "conv2.bias", "transforms": ["zero"]},
}


def test_a_chain_of_rules_is_identical_in_both_stages_and_applied_in_config_order():
    torch.manual_seed(1)
    model = MnistCNN()
    plain = _grads(model, {}, "hook")
    hook, fused = _grads(model, CHAIN, "hook"), _grads(model, CHAIN, "fused")
    clip = lambda g: g.clamp(-0.003, 0.003)  # noqa: E731
    expected = {
        "conv1.weight": clip(plain["conv1.weight"]) * 0.5,
        "conv1.bias": (clip(plain["conv1.bias"]) * 0.5).clamp(min=0),
        "conv2.weight": clip(plain["conv2.weight"]) * 0.5,
        "conv2.bias": torch.zeros_like(plain["conv2.bias"]),
        "l1.weight": torch.sign(clip(plain["l1.weight"])) * 1e-3,
        "l1.bias": clip(plain["l1.bias"]).clamp(min=0),
    }
    for n in plain:
        assert torch.equal(hook[n], fused[n]), n
        assert torch.equal(hook[n], expected[n]), n


def test_mixed_stages_per_rule_match_all_hook():
    """`hooks.<rule>.stage` overrides the default stage for that rule only."""
    torch.manual_seed(2)
    model = MnistCNN()
    rules = {"clip": {**CHAIN["clip"], "stage": "fused"}, "nonneg": CHAIN["nonneg"]}
    # Hook rules run first, during backward, so config order must put fused rules last for
    # the stages to agree; here clip (fused) then min_zero (hook) commute.
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _grads(model, rules, "hook").values(),
            _grads(model, {"clip": CHAIN["clip"], "nonneg": CHAIN["nonneg"]}, "hook").values(),
        )
    )


def test_training_with_fused_clip_matches_hook_clip():
    """Through the trainer (Adam, three steps): the same parameters either way."""
    torch.manual_seed(3)
    base = MnistCNN()
    x = torch.randint(0, 256, (24, 1, 28, 28), dtype=torch.uint8)
    y = torch.randint(0, 10, (24,))
    params = {}
    for stage in ("hook", "fused"):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with attach(model, {"clip": CHAIN["clip"]}, stage=stage) as hooks:
            bare_epoch(model, opt, x, y, batch_size=8, generator=torch.Generator().manual_seed(0), hooks=hooks)
        params[stage] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params["hook"], params["fused"]))
    assert not all(torch.equal(a, b) for a, b in zip(params["hook"], base.parameters()))


def test_log_statistics_are_the_same_in_both_stages():
    torch.manual_seed(4)
    model = MnistCNN()
    stats = {}
    for stage in ("hook", "fused"):
        m = copy.deepcopy(model)
        with attach(m, {"clip": CHAIN["clip"], "log": {"params": "*", "transforms": ["log"]}}, stage=stage) as hooks:
            for seed in range(3):
                x, y = _batch(seed=seed)
                m.zero_grad(set_to_none=True)
                F.cross_entropy(m(x), y).backward()
                hooks.after_backward()
            stats[stage] = hooks.read_stats()
    assert stats["hook"] == stats["fused"]
    assert stats["hook"]["l1.weight"]["calls"] == 3
    assert stats["hook"]["l1.weight"]["max"] == pytest.approx(0.003)  # log sees the clipped gradient


def test_stateful_transform_keeps_one_state_per_tensor_in_both_stages():
    """`noise` anneals with its own call count per tensor. With decay=50 only a tensor's
    first call adds noise of order std (later calls: std / 2**50 and less), so after one
    step every tensor has noise and after the next none has more, in either stage."""
    torch.manual_seed(5)
    model = MnistCNN()
    plain = _grads(model, {}, "hook")
    rules = {"noisy": {"params": "*", "transforms": [{"name": "noise", "std": 1.0, "decay": 50.0}]}}
    for stage in ("hook", "fused"):
        m = copy.deepcopy(model)
        with attach(m, rules, stage=stage) as hooks:
            for call in range(3):
                m.zero_grad(set_to_none=True)
                x, y = _batch()
                F.cross_entropy(m(x), y).backward()
                hooks.after_backward()
                for n, p in m.named_parameters():
                    added = (p.grad - plain[n]).abs().max().item()
                    if call == 0:
                        assert added > 1e-2, f"{stage}: {n} got no noise on its first call"
                    else:
                        assert added < 1e-6, f"{stage}: {n} got noise of std {added} on call {call + 1}"


def test_log_rows_of_many_tensors_cost_one_op_each_plus_a_few():
    """A regression guard for the `log` cost at the hook stage (it was 27 aten ops per
    call, then 9): the rows of one backward are computed together."""
    from gradmod.hooks.stats.rows import stat_rows

    gs = [torch.randn(32, 32, 3, 3), torch.randn(32), torch.randn(10, 32), torch.randn(10)] * 5
    stat_rows(gs)  # the layout's segment lengths are built once
    with OpCounter() as count:
        table, order, _ = stat_rows(gs)
        rows = dict(zip(order, table.unbind(0)))
    rows = [rows[i] for i in range(len(gs))]
    assert count.count <= 2 * len(gs) + 18, count.by_op  # a detach and a flattening view per tensor
    reads = sum(n for op, n in count.by_op.items() if "item" in op or "_local_scalar" in op)
    assert reads == 1  # on the CPU: whether to count non-finite entries
    for g, row in zip(gs, rows):
        assert row[0].item() == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-6)
        assert (row[1].item(), row[2].item()) == (g.min().item(), g.max().item())


def test_log_statistics_survive_folding_against_hand_computation():
    """More calls than COMPACT_AT fold rows on the device; the result is still exact."""
    obs = T.build("log").fn
    calls = GradStats.COMPACT_AT * 2 + 7
    values = [torch.tensor([float(i), -1.0, 0.5, 2.0]) for i in range(calls)]
    values[5] = torch.tensor([math.inf, -math.inf, math.nan, -3.0])
    for v in values:
        obs(v)
    assert len(obs._rows) <= GradStats.COMPACT_AT
    s = obs.read()
    finite = [v for i, v in enumerate(values) if i != 5]
    assert s["calls"] == calls
    assert s["nonfinite"] == 3
    assert math.isnan(s["min"]) and math.isnan(s["max"])  # NaN propagates, as torch.min/max do
    assert not math.isfinite(s["norm"])  # one call saw a non-finite gradient
    assert s["frac_negative"] == pytest.approx((sum((v < 0).float().mean().item() for v in finite) + 0.5) / calls)
    again = T.build("log").fn
    for v in finite:
        again(v)
    s = again.read()
    assert s["norm"] == pytest.approx(sum(v.norm().item() for v in finite) / len(finite), rel=1e-5)  # float32 sums
    assert s["mean"] == pytest.approx(sum(v.mean().item() for v in finite) / len(finite), rel=1e-5)  # float32 sums
    assert (s["min"], s["max"], s["nonfinite"]) == (-1.0, float(calls - 1), 0)
    assert obs.read() is None  # the window was taken


def test_log_window_continues_exactly_through_state_dict():
    """A checkpoint saves the window in progress; a restored observer reads the same numbers."""
    values = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    whole, first = T.build("log").fn, T.build("log").fn
    for v in values:
        whole(v)
    for v in values[:4]:
        first(v)
    resumed = T.build("log").fn
    resumed.load_state_dict(first.state_dict(), torch.device("cpu"))
    for v in values[4:]:
        resumed(v)
    assert resumed.read() == whole.read()
    empty = T.build("log").fn
    assert empty.state_dict() == {"calls": 0, "window": None}
    empty.load_state_dict(empty.state_dict())
    assert empty.read() is None
