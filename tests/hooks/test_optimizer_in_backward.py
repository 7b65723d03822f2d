"""The optimizer stepped inside backward (a post-accumulate-grad hook per parameter, as
torchtune's ``optimizer_in_bwd`` does): rules that act after backward would change a
``.grad`` already used (and zeroed), so they are refused in one line; hook-stage rules
run before the step and still work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradmod.hooks import attach


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)


def step_in_backward(model: nn.Module, lr: float = 0.1) -> dict:
    """One SGD optimizer per parameter, stepped and zeroed by its post-accumulate-grad hook."""
    optim_dict = {p: torch.optim.SGD([p], lr=lr) for p in model.parameters()}

    def optim_step(param: nn.Parameter) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(optim_step)
    return optim_dict


def data() -> torch.Tensor:
    return torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))


def loss_of(model: nn.Module) -> torch.Tensor:
    return (model(data()) ** 2).mean()


@pytest.mark.parametrize(
    "rules",
    [
        {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.1}]}},
        {"c": {"params": "linear1.*", "stage": "fused", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}},
        {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}},
    ],
    ids=["group", "fused", "per_sample"],
)
def test_rules_after_backward_are_refused_at_attach(rules):
    model = transformer()
    step_in_backward(model)
    with pytest.raises(ValueError) as err:
        attach(model, rules)
    message = str(err.value)
    assert "\n" not in message and "steps an optimizer inside backward" in message and "stage: hook" in message


def test_hooks_added_after_attach_are_refused_at_the_first_step_in_backward():
    model = transformer()
    attach(model, {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.1}]}})
    step_in_backward(model)
    with pytest.raises(ValueError, match="optimizer steps inside backward .* found since attach"):
        loss_of(model).backward()


def test_hooks_added_after_attach_are_refused_at_after_backward_where_no_step_is_watched():
    model = transformer()  # the rule's first parameter (the one watched) has no optimizer hook
    hooks = attach(
        model, {"norm": {"params": "linear*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.1}]}}
    )
    optim_dict = step_in_backward(model.linear2)
    assert len(optim_dict) == 2
    loss_of(model).backward()
    with pytest.raises(ValueError, match="found since attach"):
        hooks.after_backward()


def test_hook_stage_rules_act_before_the_step_in_backward():
    bound = 0.01
    model = transformer()
    step_in_backward(model)
    attach(model, {"c": {"params": "*", "transforms": [{"name": "clamp", "min": -bound, "max": bound}]}})
    loss_of(model).backward()  # each parameter stepped in its hook, with the clamped gradient

    ref = transformer()  # by hand: the full gradient, clamped, one SGD step
    loss_of(ref).backward()
    clipped = 0
    with torch.no_grad():
        for p in ref.parameters():
            clipped += int((p.grad.abs() > bound).sum())
            p -= 0.1 * p.grad.clamp(-bound, bound)
    assert clipped > 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        assert p.grad is None  # zeroed by the step in backward


def test_a_post_accumulate_hook_without_an_optimizer_is_left_alone():
    model = transformer()
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: seen.append(param.grad.norm()))
    hooks = attach(model, {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.1}]}})
    loss_of(model).backward()
    hooks.after_backward()
    assert len(seen) == len(list(model.parameters()))
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total == pytest.approx(0.1, rel=1e-4)  # the clip ran


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(8, 3) for _ in range(3)])

    def losses(self, x):
        z = self.trunk(x)
        return {
            f"t{i}": torch.nn.functional.cross_entropy(h(z), torch.full((len(x),), i)) for i, h in enumerate(self.heads)
        }


@pytest.mark.parametrize("method", ["mean", "random", "geometric_mean", "famo", "modules"])
def test_a_per_loss_rule_acts_before_the_step_in_backward(method):
    """A loss weighting's gradients reach each parameter before its post-accumulate hook
    steps it, its scaled or divided-back parameters too (the trunk the weighted sum's
    gradient, the heads the plain sum's), and a modules rule's through its output: against
    the same step taken after backward."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    rule = {"w": {"params": "trunk.*", "transforms": [method]}}
    if method == "modules":
        rule = {"w": {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]}}
    ref = TwoHeads()
    hooks = attach(ref, rule)
    hooks.backward(ref.losses(x))
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    model = TwoHeads()
    step_in_backward(model)
    attach(model, rule).backward(model.losses(x))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        assert p.grad is None  # zeroed by the step in backward


def test_a_per_loss_method_of_the_task_gradients_is_refused_with_a_step_in_backward():
    """Its update is written to ``.grad`` after the backward, past the step."""
    model = TwoHeads()
    step_in_backward(model)
    with pytest.raises(
        ValueError, match="steps an optimizer inside backward.*a loss weighting or a modules: rule"
    ) as e:
        attach(model, {"w": {"params": "trunk.*", "transforms": ["upgrad"]}})
    assert "\n" not in str(e.value)
