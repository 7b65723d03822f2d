"""``freeze`` takes its tensors out of the backward: ``requires_grad`` is off while the rule
acts and back on at its window's end, the same backward as one with ``requires_grad=False``
set by hand (aten ops counted, AccumulateGrad nodes of the graph), bitwise unchanged under
AdamW with weight decay, and a resume before, inside or after a window bitwise equal to the
uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach, registry
from gradmod.hooks.fused.group import GroupTransform
from gradmod.testing.opcount import OpCounter

WINDOW = {"f": {"params": ["0.*", "2.*"], "transforms": ["freeze"], "active": {"from": 3, "until": 6}}}


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def accumulating(loss: torch.Tensor) -> set[int]:
    """The ids of the leaves the backward of ``loss`` writes a gradient into (AccumulateGrad nodes)."""
    seen, stack, out = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            out.add(id(node.variable))
        stack.extend(f for f, _ in node.next_functions)
    return out


def backward_ops(m: nn.Module, step: int) -> tuple[int, set[int]]:
    x, y = batch(step)
    loss = F.cross_entropy(m(x), y)
    leaves = accumulating(loss)
    with OpCounter() as ops:
        loss.backward()
    return ops.count, leaves


def test_a_frozen_tensor_takes_no_part_in_the_backward():
    ours, by_hand = model(), model()
    hooks = attach(ours, WINDOW)
    hooks.set_step(3)  # inside the window: the next forward sees the switch
    for n, p in by_hand.named_parameters():
        p.requires_grad_(not n.startswith(("0.", "2.")))
    count, leaves = backward_ops(ours, 3)
    want, want_leaves = backward_ops(by_hand, 3)
    assert leaves == {id(ours[4].weight), id(ours[4].bias)}
    assert len(want_leaves) == 2 and count == want
    hooks.after_backward()
    assert all(p.grad is None for p in [*ours[0].parameters(), *ours[2].parameters()])
    assert torch.equal(ours[4].weight.grad, by_hand[4].weight.grad)
    hooks.set_step(6)  # the window's end: every tensor trains again
    count, leaves = backward_ops(ours, 6)
    assert leaves == {id(p) for p in ours.parameters()} and count > want
    assert all(p.requires_grad for p in ours.parameters())


def run(rules, steps: range, m=None, opt=None, hooks=None, set_to_none: bool = True):
    """AdamW with weight decay over ``steps``; returns (model, optimizer, hooks)."""
    m = m if m is not None else model()
    opt = opt if opt is not None else torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.1)
    hooks = hooks if hooks is not None else attach(m, rules, total_steps=10)
    for t in steps:
        opt.zero_grad(set_to_none=set_to_none)
        x, y = batch(t)
        F.cross_entropy(m(x), y).backward()
        hooks.after_backward()
        opt.step()
    return m, opt, hooks


@pytest.mark.parametrize("set_to_none", [True, False])
def test_frozen_tensors_stay_bitwise_still_under_adamw_with_weight_decay(set_to_none):
    """``zero_grad(set_to_none=False)`` leaves a zero ``.grad`` that weight decay would act
    on: the rule drops it too."""
    m, _, _ = run(WINDOW, range(3), set_to_none=set_to_none)
    before = [p.detach().clone() for p in m.parameters()]
    m, opt, hooks = run(WINDOW, range(3), set_to_none=set_to_none)
    run(WINDOW, range(3, 6), m, opt, hooks, set_to_none=set_to_none)
    assert all(torch.equal(a, b) for a, b in zip(m[0].parameters(), before[:2]))
    assert all(torch.equal(a, b) for a, b in zip(m[2].parameters(), before[2:4]))
    assert not torch.equal(m[4].weight, before[4])  # the head trained
    run(WINDOW, range(6, 7), m, opt, hooks, set_to_none=set_to_none)
    assert not torch.equal(m[0].weight, before[0])  # and the window's end lets them train


@pytest.mark.parametrize("at", [2, 4, 7])
def test_resumed_before_inside_or_after_the_window_ends_bitwise_equal(at):
    whole, _, _ = run(WINDOW, range(10))
    first, opt1, hooks1 = run(WINDOW, range(at))
    saved = copy.deepcopy((first.state_dict(), opt1.state_dict(), hooks1.state_dict()))
    second = model(seed=9)  # a fresh process: its own weights until the checkpoint loads
    opt2 = torch.optim.AdamW(second.parameters(), lr=0.02, weight_decay=0.1)
    hooks2 = attach(second, WINDOW, total_steps=10)
    second.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    hooks2.load_state_dict(saved[2])
    second(batch(at)[0])  # the next forward takes the window's state
    assert second[0].weight.requires_grad == (not 3 <= at < 6)
    run(WINDOW, range(at, 10), second, opt2, hooks2)
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), second.parameters()))


def test_attaching_again_inside_a_window_and_removing_give_requires_grad_back():
    m = model()
    m[4].bias.requires_grad_(False)  # frozen by the user: stays frozen
    rules = {"f": {"params": "*", "exclude": "4.weight", "transforms": ["freeze"], "active": {"until": 2}}}
    attach(m, rules)
    m(batch(0)[0])
    assert [p.requires_grad for p in m.parameters()] == [False, False, False, False, True, False]
    hooks = attach(m, rules)  # replaces the first: the same tensors, still in the window
    assert len(hooks) == 4
    m(batch(0)[0])
    assert [p.requires_grad for p in m.parameters()] == [False, False, False, False, True, False]
    hooks.remove()
    assert [p.requires_grad for p in m.parameters()] == [True, True, True, True, True, False]


def test_a_group_transform_that_says_it_switches_trainability_is_switched_as_freeze_is():
    """The fused stage takes the fact from the transform (``switches_trainability``), not from
    its class: one's own group transform that states it gets freeze's switch, one that does not
    is left alone."""

    class Hold(GroupTransform):
        switches_trainability = True

        def apply_(self, params, grads):
            for p in params:
                p.grad = None

    class Scale(GroupTransform):
        def apply_(self, params, grads):
            torch._foreach_mul_(grads, 0.5)

    registry.register("hold", Hold)
    registry.register("halve", Scale)
    m = model()
    hooks = attach(m, {"h": {"params": "0.*", "transforms": ["hold"]}, "s": {"params": "4.*", "transforms": ["halve"]}})
    assert hooks.changes_trainability
    m(batch(0)[0])
    assert [p.requires_grad for p in m.parameters()] == [False, False, True, True, True, True]
    hooks.remove()
    assert all(p.requires_grad for p in m.parameters())
    hooks = attach(m, {"s": {"params": "*", "transforms": ["halve"]}})
    assert not hooks.changes_trainability
    m(batch(0)[0])
    assert all(p.requires_grad for p in m.parameters())
