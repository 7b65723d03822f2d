"""The sharpness stage against hand-written SAM loops and pytorch-optimizer's SAM."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from sam_reference import hand_sam as _hand_sam
from sam_reference import mlp as _mlp
from sam_reference import shift as _shift
from torch import nn

import gradmod.hooks as H


def _data(n: int = 24, dtype=torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def _rule(name: str = "sam", params="*", **args) -> dict:
    return {name: {"params": params, "transforms": [{"name": name.split("_")[0], **args}]}}


def _train(model, rules, x, y, steps: int, opt=None, micro: int = 1):
    """gradmod's loop: hooks.backward(loss, closure=...), after_backward, step."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    hooks = H.attach(model, rules)
    for _ in range(steps):
        opt.zero_grad()
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):

            def loss(xb=xb, yb=yb):
                return F.cross_entropy(model(xb), yb) / micro

            hooks.backward(loss(), closure=loss)
        hooks.after_backward()
        opt.step()
    hooks.remove()
    return model


def _close(a: nn.Module, b: nn.Module, tol: float) -> float:
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert worst <= tol, worst
    return worst


def test_sam_equals_hand_written_float64():
    x, y = _data()
    ours = _train(_mlp(), _rule(rho=0.05), x, y, steps=10)
    ref = _hand_sam(_mlp(), x, y, steps=10, rho=0.05)
    _close(ours, ref, 1e-10)
    plain = _train(_mlp(), {}, x, y, steps=10)  # the comparison can fail: SAM is not plain SGD here
    assert max((p - q).abs().max().item() for p, q in zip(ours.parameters(), plain.parameters())) > 1e-4


def test_scheduled_rho_equals_hand_written_float64():
    """rho follows its schedule step by step: linear 0.1 -> 0 over 6 steps, then plain SGD."""
    x, y = _data()
    ramp = {"schedule": "linear", "start": 0.1, "end": 0.0, "until": "6ba"}
    ours = _train(_mlp(), _rule(rho=ramp), x, y, steps=10)
    ref = _hand_sam(_mlp(), x, y, steps=10, rho=lambda t: 0.1 * (1 - min(t / 6, 1.0)))
    _close(ours, ref, 1e-10)
    constant = _hand_sam(_mlp(), x, y, steps=10, rho=0.1)  # the comparison can fail
    assert max((p - q).abs().max().item() for p, q in zip(ours.parameters(), constant.parameters())) > 1e-6


def test_asam_with_eta_equals_hand_written_float64():
    x, y = _data()
    ours = _train(_mlp(), _rule("asam", rho=0.5, eta=0.01), x, y, steps=10)
    ref = _mlp()
    named = dict(ref.named_parameters())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(10):
        params = list(named.values())
        g = torch.autograd.grad(F.cross_entropy(ref(x), y), params)
        e = _shift(params, g, 0.5, adaptive=True, eta=0.01)
        with torch.no_grad():
            saved = [p.clone() for p in params]
            for p, d in zip(params, e):
                p.add_(d)
        g2 = torch.autograd.grad(F.cross_entropy(ref(x), y), params)
        with torch.no_grad():
            for p, s, gi in zip(params, saved, g2):
                p.copy_(s)
                p.grad = gi
        opt.step()
    _close(ours, ref, 1e-10)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_equals_pytorch_optimizer_sam(adaptive, base):
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason="pytorch-optimizer is a test dependency")
    x, y = _data(dtype=torch.float32)
    kwargs = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4} if base == "sgd" else {"lr": 1e-2}
    cls = torch.optim.SGD if base == "sgd" else torch.optim.AdamW
    ref = _mlp(torch.float32)
    sam = pytorch_optimizer.SAM(ref.parameters(), cls, rho=0.1, adaptive=adaptive, **kwargs)

    def closure():
        sam.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        return loss

    for _ in range(10):
        closure()
        sam.step(closure)
    ours = _mlp(torch.float32)
    name = "asam" if adaptive else "sam"
    _train(ours, _rule(name, rho=0.1), x, y, steps=10, opt=cls(ours.parameters(), **kwargs))
    _close(ours, ref, 1e-5)


def test_batchnorm_statistics_equal_the_bypass():
    x, y = _data()
    ours = _train(_mlp(norm=True), _rule(rho=0.05), x, y, steps=5)
    ref = _hand_sam(_mlp(norm=True), x, y, steps=5, rho=0.05)
    _close(ours, ref, 1e-10)
    # davda54's bypass: momentum 0 on the second forward.
    bypass = _mlp(norm=True)
    opt = torch.optim.SGD(bypass.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    bn = bypass[1]
    for _ in range(5):
        params = list(bypass.parameters())
        g = torch.autograd.grad(F.cross_entropy(bypass(x), y), params)
        e = _shift(params, g, 0.05)
        with torch.no_grad():
            for p, d in zip(params, e):
                p.add_(d)
        bn.momentum = 0.0
        g2 = torch.autograd.grad(F.cross_entropy(bypass(x), y), params)
        bn.momentum = 0.1
        with torch.no_grad():
            for p, d, gi in zip(params, e, g2):
                p.sub_(d)
                p.grad = gi
        opt.step()
    assert torch.allclose(ours[1].running_mean, bn.running_mean, rtol=0, atol=1e-12)
    assert torch.allclose(ours[1].running_var, bn.running_var, rtol=0, atol=1e-12)
    assert ours[1].num_batches_tracked.item() == 5  # the bypass counts 10: one per forward
    assert bn.num_batches_tracked.item() == 10


def test_sam_on_moves_only_its_parameters():
    x, y = _data()
    model = _mlp(norm=True)
    seen = {}

    def spy(module, args):
        if "first" in seen:
            seen["second"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            seen["first"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    handle = model.register_forward_pre_hook(spy)
    _train(model, _rule("sam_on", params="1.*", rho=0.05), x, y, steps=1)
    handle.remove()
    first, second = seen["first"], seen["second"]
    for n in first:
        same = torch.equal(first[n], second[n])
        assert same == (not n.startswith("1.")), n
    x2 = _data(seed=3)
    ours = _train(_mlp(norm=True), _rule("sam_on", params="1.*", rho=0.05), *x2, steps=6)
    ref = _hand_sam(_mlp(norm=True), *x2, steps=6, rho=0.05, moved=["1.weight", "1.bias"])
    _close(ours, ref, 1e-10)


def test_every_n_equals_a_hand_loop():
    x, y = _data()
    ours = _train(_mlp(), _rule(rho=0.05, every=3), x, y, steps=7)
    ref = _hand_sam(_mlp(), x, y, steps=7, rho=0.05, every=3)
    _close(ours, ref, 1e-10)


def test_each_micro_batch_takes_its_own_two_passes():
    x, y = _data()
    ours = _train(_mlp(norm=True), _rule(rho=0.05), x, y, steps=4, micro=2)
    ref = _hand_sam(_mlp(norm=True), x, y, steps=4, rho=0.05, micro=2)
    _close(ours, ref, 1e-10)


def test_parameters_come_back_bitwise_even_when_the_second_pass_raises():
    model, (x, y) = _mlp(torch.float32), _data(dtype=torch.float32)
    hooks = H.attach(model, _rule(rho=0.3))
    before = copy.deepcopy(model.state_dict())
    hooks.backward(F.cross_entropy(model(x), y), closure=lambda: F.cross_entropy(model(x), y))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def broken():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hooks.backward(F.cross_entropy(model(x), y), closure=broken)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_hook_stage_sees_both_passes_fused_the_gradient_at_w_plus_e():
    x, y = _data()
    rules = {
        **_rule(rho=0.05),
        "cut": {"params": "*", "stage": "hook", "transforms": [{"name": "clamp", "bound": 0.02}]},
        "clip": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.05}]},
    }
    ours = _train(_mlp(), rules, x, y, steps=5)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(5):
        params = list(ref.parameters())
        g = [gi.clamp(-0.02, 0.02) for gi in torch.autograd.grad(F.cross_entropy(ref(x), y), params)]
        e = _shift(params, g, 0.05)
        with torch.no_grad():
            saved = [p.clone() for p in params]
            for p, d in zip(params, e):
                p.add_(d)
        g2 = torch.autograd.grad(F.cross_entropy(ref(x), y), params)
        with torch.no_grad():
            for p, s, gi in zip(params, saved, g2):
                p.copy_(s)
                p.grad = gi.clamp(-0.02, 0.02)
        torch.nn.utils.clip_grad_norm_(params, 0.05)
        opt.step()
    _close(ours, ref, 1e-10)
    m = _mlp()
    g = torch.autograd.grad(F.cross_entropy(m(x), y), list(m.parameters()))
    bent = _shift(list(m.parameters()), [gi.clamp(-0.02, 0.02) for gi in g], 1)
    assert max((a - b).abs().max().item() for a, b in zip(_shift(list(m.parameters()), g, 1), bent)) > 1e-3


def test_state_dict_carries_the_step_count():
    model, (x, y) = _mlp(), _data()
    hooks = H.attach(model, _rule(rho=0.05, every=2))
    calls = []

    def closure():
        calls.append(1)
        return F.cross_entropy(model(x), y)

    for _ in range(3):
        hooks.backward(F.cross_entropy(model(x), y), closure=closure)
        hooks.after_backward()
    assert len(calls) == 1 and hooks.state_dict()["sharpness"] == {"step": 3}
    again = H.attach(_mlp(), _rule(rho=0.05, every=2))
    again.load_state_dict(hooks.state_dict())
    assert again.stage("sharpness").step == 3 and again.stage("sharpness").due()


@pytest.mark.parametrize(
    "rules, message",
    [
        (_rule(rho=-1), "rho=-1 must be >= 0"),
        (_rule(rho=0.05, every=0), "every=0 must be a whole number from 1 to"),
        (_rule("asam", rho=0.05, eta=float("nan")), "eta=nan must be a finite number"),
        (
            {"s": {"params": "*", "stage": "fused", "transforms": [{"name": "sam", "rho": 0.1}]}},
            "runs at stage 'sharpness' only",
        ),
        ({"s": {"modules": "0", "transforms": [{"name": "sam", "rho": 0.1}]}}, "needs params"),
        (
            {"s": {"params": "*", "transforms": [{"name": "sam", "rho": 0.1}, {"name": "asam", "rho": 0.1}]}},
            "holds exactly one of",
        ),
        ({**_rule(rho=0.1), **_rule("sam_b", params="0.*", rho=0.1)}, "is also in sharpness rule 'sam'"),
        (
            {**_rule(rho=0.1), "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}},
            "a per_sample rule does not combine with sharpness rule 'sam'",
        ),
    ],
)
def test_bad_rules_are_one_line(rules, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        H.attach(_mlp(), rules)
    assert "\n" not in str(info.value)


def test_a_plain_backward_or_a_missing_closure_is_refused():
    model, (x, y) = _mlp(), _data()
    hooks = H.attach(model, _rule(rho=0.05))
    with pytest.raises(RuntimeError, match="needs its loss through hooks.backward"):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="call hooks.backward\\(loss, closure=fn\\)"):
        hooks.backward(F.cross_entropy(model(x), y))


def test_running_statistics_frozen_on_every_kind_of_norm_layer():
    from gradmod.hooks.sharpness import running_stats_frozen

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4, momentum=None), nn.InstanceNorm1d(4, track_running_stats=True)).double()
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    model(x)  # statistics that are not the initial ones
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with running_stats_frozen(model):
        out = model(x * 3 + 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model[0].track_running_stats and model[1].momentum == 0.1
    bypass = copy.deepcopy(model)  # davda54's: momentum 0 (it then counts the batch)
    bypass[0].momentum = bypass[1].momentum = 0.0
    assert torch.equal(out, bypass(x * 3 + 1))
    assert bypass[0].num_batches_tracked.item() == 2 and model[0].num_batches_tracked.item() == 1


def test_peak_memory_is_plain_plus_one_copy_of_the_moved_parameters():
    """Bytes of live tensors, counted per op (deterministic): SAM's peak over plain's is one
    copy of the parameters, give or take scalars (the first pass's loss)."""
    from benchmarks.peak_memory import live_tensor_peak

    x, y = torch.randn(64, 6), torch.randint(0, 4, (64,))

    def steps(rules):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 256), nn.BatchNorm1d(256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        hooks = H.attach(model, rules)

        def run():
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                hooks.backward(F.cross_entropy(model(x), y), closure=lambda: F.cross_entropy(model(x), y))
                hooks.after_backward()
                opt.step()

        return live_tensor_peak(run), sum(p.numel() * p.element_size() for p in model.parameters())

    (plain, _), (sam, copy_bytes) = steps({}), steps(_rule(rho=0.05))
    assert copy_bytes <= sam - plain <= copy_bytes + 1024


def _hand_steps(model, loss_fn, steps: int, rho: float, moved: list[str]):
    """SAM on any model: move ``moved`` by rho g/||g|| (their norm), gradient of every
    parameter there, move back, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    named = dict(model.named_parameters())
    for _ in range(steps):
        ps = [named[n] for n in moved]
        e = _shift(ps, torch.autograd.grad(loss_fn(model), ps), rho)
        with torch.no_grad():
            saved = [p.clone() for p in ps]
            for p, d in zip(ps, e):
                p.add_(d)
        g2 = torch.autograd.grad(loss_fn(model), list(named.values()))
        with torch.no_grad():
            for p, s in zip(ps, saved):
                p.copy_(s)
        for p, g in zip(named.values(), g2):
            p.grad = g
        opt.step()
    return model


def _ours(model, loss_fn, steps: int, rules):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hooks = H.attach(model, rules)
    for _ in range(steps):
        opt.zero_grad()
        hooks.backward(loss_fn(model), closure=lambda: loss_fn(model))
        hooks.after_backward()
        opt.step()
    return model


@pytest.mark.slow  # transformers' first model build takes ~15 s on 2 loaded cores
def test_sam_on_a_transformer_from_a_config_with_tied_embeddings():
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    first = transformers.GPT2LMHeadModel(config).double()

    def build():
        return copy.deepcopy(first)

    def loss_fn(m):
        return m(input_ids=ids, labels=ids).loss

    model = build()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one parameter, moved once
    names = [n for n, _ in model.named_parameters()]
    for params in ("*", "*ln_*"):  # SAM, and SAM-ON on the LayerNorms
        moved = names if params == "*" else [n for n in names if ".ln_" in n or n.startswith("transformer.ln_f")]
        ours = _ours(build(), loss_fn, 3, _rule(params=params, rho=0.05))
        _close(ours, _hand_steps(build(), loss_fn, 3, 0.05, moved), 1e-10)


def test_sam_on_an_lstm():
    x, y = torch.randn(4, 7, 5, dtype=torch.float64), torch.randint(0, 3, (4,))

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.rnn = nn.LSTM(5, 8, batch_first=True, num_layers=2).double()
            self.head = nn.Linear(8, 3).double()

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    def loss_fn(m):
        return F.cross_entropy(m(x), y)

    names = [n for n, _ in Tagger().named_parameters()]
    _close(_ours(Tagger(), loss_fn, 4, _rule(rho=0.1)), _hand_steps(Tagger(), loss_fn, 4, 0.1, names), 1e-10)


def test_a_hook_stage_log_counts_both_passes_on_moved_parameters_only():
    model, (x, y) = _mlp(), _data()
    hooks = H.attach(
        model, {**_rule(params="0.*", rho=0.05), "log": {"params": "*", "stage": "hook", "transforms": ["log"]}}
    )
    for _ in range(3):
        hooks.backward(F.cross_entropy(model(x), y), closure=lambda: F.cross_entropy(model(x), y))
        hooks.after_backward()
    calls = {k: v["calls"] for k, v in hooks.read_stats().items()}
    assert calls == {"0.weight": 6, "0.bias": 6, "2.weight": 3, "2.bias": 3}
