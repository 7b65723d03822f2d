"""Several optimizers as one: stepped, scheduled, scaled, saved and restored as the same
optimizers by hand, bitwise."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from gradmod.optim import CombinedOptimizer


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model


def pair(model):
    """AdamW on the first layer, SGD with momentum on the last."""
    return [
        torch.optim.AdamW(model[0].parameters(), lr=1e-2, weight_decay=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.05, momentum=0.9, nesterov=True),
    ]


def loss_of(model, i):
    g = torch.Generator().manual_seed(i)
    return model(torch.randn(5, 6, generator=g)).square().mean()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_one_object_steps_as_the_optimizers_by_hand():
    ours, theirs = make(), make()
    combined, by_hand = CombinedOptimizer(pair(ours)), pair(theirs)
    assert isinstance(combined, torch.optim.Optimizer)
    calls = []
    for i in range(4):

        def closure(i=i):
            calls.append(i)
            loss = loss_of(ours, i)
            loss.backward()
            return loss

        combined.zero_grad()
        returned = combined.step(closure)
        for o in by_hand:
            o.zero_grad()
        ref = loss_of(theirs, i)
        ref.backward()
        for o in by_hand:
            o.step()
        assert torch.equal(returned.detach(), ref.detach())
    assert calls == [0, 1, 2, 3]  # the closure runs once a step, not once per optimizer
    assert same(weights(ours), weights(theirs))
    assert all(p.grad is not None for p in ours.parameters())
    combined.zero_grad()
    assert all(p.grad is None for p in ours.parameters())


def test_a_scheduler_sets_every_group_as_on_each_optimizer_alone():
    ours, theirs = make(), make()
    combined, by_hand = CombinedOptimizer(pair(ours)), pair(theirs)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(combined, T_max=5)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5) for o in by_hand]
    for i in range(5):
        loss_of(ours, i).backward()
        combined.step()
        sched.step()
        loss_of(theirs, i).backward()
        for o, s in zip(by_hand, scheds):
            o.step()
            s.step()
        assert [g["lr"] for g in combined.param_groups] == [o.param_groups[0]["lr"] for o in by_hand]
    assert same(weights(ours), weights(theirs))


def test_grad_scaler_unscales_and_skips_every_optimizer_alike():
    ours, theirs = make(), make()
    combined, by_hand = CombinedOptimizer(pair(ours)), pair(theirs)
    scaler, scaler2 = (torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2))
    for i in range(4):
        blow = 1e38 if i == 1 else 1.0  # step 1 overflows: skipped, the scale halves
        combined.zero_grad()
        scaler.scale(loss_of(ours, i) * blow).backward()
        scaler.step(combined)
        scaler.update()
        for o in by_hand:
            o.zero_grad()
        scaler2.scale(loss_of(theirs, i) * blow).backward()
        for o in by_hand:
            scaler2.unscale_(o)
        for o in by_hand:
            scaler2.step(o)
        scaler2.update()
        assert scaler.get_scale() == scaler2.get_scale()
    assert scaler.get_scale() < 2.0**12  # the overflow was seen
    assert same(weights(ours), weights(theirs))


def test_state_dict_is_one_optimizers_and_a_restore_continues_bitwise():
    model = make()
    combined = CombinedOptimizer(pair(model))
    for i in range(3):
        combined.zero_grad()
        loss_of(model, i).backward()
        combined.step()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": combined.state_dict()}, saved)
    state = combined.state_dict()
    assert sorted(state["state"]) == [0, 1, 2, 3]  # indices count on across the two optimizers
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2, 3]]
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and set(state["state"][2]) == {"momentum_buffer"}

    def go_on(m, o):
        for i in range(3, 6):
            o.zero_grad()
            loss_of(m, i).backward()
            o.step()
        return weights(m)

    straight = go_on(model, combined)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    fresh = make(seed=1)
    fresh.load_state_dict(loaded["model"])
    restored = CombinedOptimizer(pair(fresh))
    restored.load_state_dict(loaded["opt"])
    assert same(go_on(fresh, restored), straight)


def test_dcp_state_dict_round_trip_continues_bitwise():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make()
    combined = CombinedOptimizer(pair(model))
    loss_of(model, 0).backward()
    combined.step()
    by_name = get_optimizer_state_dict(model, combined)
    assert set(by_name["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    twin = copy.deepcopy(model)
    other = CombinedOptimizer(pair(twin))
    set_optimizer_state_dict(twin, other, copy.deepcopy(by_name))  # as from a file: no tensor shared
    for m, o in ((model, combined), (twin, other)):
        o.zero_grad()
        loss_of(m, 1).backward()
        o.step()
    assert same(weights(model), weights(twin))


def test_state_is_each_parameters_own_and_groups_are_the_optimizers_dicts():
    model = make()
    adamw, sgd = pair(model)
    combined = CombinedOptimizer([adamw, sgd])
    assert combined.param_groups[1] is sgd.param_groups[0]
    assert model[0].weight not in combined.state and len(combined.state) == 0  # asking creates nothing
    loss_of(model, 0).backward()
    combined.step()
    assert combined.state[model[0].weight] is adamw.state[model[0].weight]
    assert combined.state[model[2].bias] is sgd.state[model[2].bias] and len(combined.state) == 4
    extra = nn.Parameter(torch.zeros(2))
    combined.add_param_group({"params": [extra]})
    assert adamw.param_groups[-1]["params"] == [extra] and len(combined.param_groups) == 3


def test_a_parameter_in_two_optimizers_is_refused():
    model = make()
    with pytest.raises(ValueError, match="optimizer 1 \\(SGD\\) holds a parameter another holds"):
        CombinedOptimizer([torch.optim.AdamW(model.parameters()), torch.optim.SGD(model[2].parameters(), lr=0.1)])


def test_one_step_costs_its_optimizers_steps_and_a_profiler_label():
    """The combined step dispatches its optimizers' ops and two more: the enter and exit of
    torch's record_function label every optimizer step carries."""
    from gradmod.testing.opcount import OpCounter

    model = make()
    combined = CombinedOptimizer(pair(model))
    loss_of(model, 0).backward()
    combined.step()  # the state exists: the counted steps are alike
    counts = []
    for step in (combined.step, *(o.step for o in combined.optimizers)):
        with OpCounter() as ops:
            step()
        counts.append(ops.count)
    assert counts[0] == sum(counts[1:]) + 2
