import math

import pytest
import torch
from torch import nn

import gradmod
from gradmod.hooks import attach, registry
from gradmod.hooks import transforms as T

G = torch.tensor([-0.5, -0.005, 0.0, 0.003, 2.0])


def fused_stage(spec, grads: list[torch.Tensor]) -> None:
    """Run ``spec`` at the fused stage on parameters whose ``.grad`` are ``grads`` (in place)."""
    model = nn.Module()
    for i, g in enumerate(grads):
        model.register_parameter(f"p{i}", nn.Parameter(torch.zeros_like(g)))
        getattr(model, f"p{i}").grad = g
    with attach(model, {"r": {"params": "*", "transforms": [spec]}}, stage="fused") as hooks:
        hooks.after_backward()


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"name": "clamp", "min": -0.01, "max": 0.01}, [-0.01, -0.005, 0.0, 0.003, 0.01]),
        ({"name": "clamp", "min": 0.0}, [0.0, 0.0, 0.0, 0.003, 2.0]),
        ({"name": "clamp", "bound": 0.01}, [-0.01, -0.005, 0.0, 0.003, 0.01]),
        ("zero", [0.0] * 5),
        ("min_zero", [0.0, 0.0, 0.0, 0.003, 2.0]),
        ({"name": "scale", "factor": 2}, [-1.0, -0.01, 0.0, 0.006, 4.0]),
        ("sign", [-1.0, -1.0, 0.0, 1.0, 1.0]),
    ],
)
def test_transform_values_and_input_untouched(spec, expected):
    grad = G.clone()
    step = T.build(spec)
    out = step(grad)
    assert torch.allclose(out, torch.tensor(expected))
    assert torch.equal(grad, G), "a transform must not modify its input"
    # The fused (in-place, foreach) form gives the same numbers.
    grads = [G.clone(), G.clone()]
    fused_stage(spec, grads)
    for g in grads:
        assert torch.allclose(g, torch.tensor(expected))


def test_norm_clip_and_centralize():
    g = torch.tensor([[3.0, 4.0], [0.0, 0.0]])  # norm 5
    assert torch.allclose(T.build({"name": "norm_clip", "max_norm": 1.0})(g).norm(), torch.tensor(1.0), atol=1e-5)
    assert torch.equal(T.build({"name": "norm_clip", "max_norm": 10.0})(g), g)
    c = T.build("centralize")(g)
    assert torch.allclose(c, torch.tensor([[-0.5, 0.5], [0.0, 0.0]]))


def test_noise_is_annealed():
    torch.manual_seed(0)
    step = T.build({"name": "noise", "std": 1.0, "decay": 1.0})
    big = torch.zeros(100_000)
    first = step(big).std().item()
    step.fn.at_step(9)  # after 9 optimizer steps: std 1/10
    tenth = step(big).std().item()
    assert abs(first - 1.0) < 0.02 and abs(tenth - 0.1) < 0.005


def test_log_statistics_against_hand_computation():
    obs = T.build("log")
    a = torch.tensor([-1.0, 2.0, 2.0, 0.0])
    b = torch.tensor([3.0, float("inf"), -4.0, 0.0])
    assert obs(a) is None and obs(b) is None  # observe only
    s = obs.fn.read()
    assert s["calls"] == 2
    assert s["min"] == -4.0 and s["max"] == math.inf
    assert s["norm"] == math.inf  # b is not finite
    assert s["frac_negative"] == pytest.approx((0.25 + 0.25) / 2)
    assert s["nonfinite"] == 1 and s["any_negative"] is True
    assert obs.fn.read() is None  # the window was consumed


def test_log_norm_and_mean():
    obs = T.build("log")
    obs(torch.tensor([3.0, 4.0]))
    obs(torch.tensor([0.0, 1.0]))
    s = obs.fn.read()
    assert s["norm"] == pytest.approx((5.0 + 1.0) / 2)
    assert s["mean"] == pytest.approx((3.5 + 0.5) / 2)
    assert s["any_negative"] is False and s["frac_negative"] == 0.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "clamp", "min": 1.0, "max": -1.0}, "min=1.0 is greater than max=-1.0"),
        ({"name": "clamp"}, "needs bound, or min, max or both"),
        ({"name": "clamp", "min": "a"}, "must be a number"),
        ({"name": "clamp", "lo": 1}, "unknown argument(s) lo; allowed: min, max, bound"),
        ({"name": "clamp", "bound": 0.01, "max": 0.02}, "give bound (the range [-bound, bound]) or min/max, not both"),
        ({"name": "clamp", "bound": -0.01}, "bound=-0.01 must be >= 0"),
        ("clampp", "unknown transform 'clampp'; allowed: "),
        ({"name": "noise", "std": -1}, "std=-1 must be >= 0"),
        ({"name": "norm_clip", "max_norm": 0}, "must be > 0"),
        ({"name": "scale"}, "needs argument(s) factor"),
        (3, "a transform must be a name or a mapping"),
    ],
)
def test_bad_specs_are_clear_value_errors(spec, message):
    with pytest.raises(ValueError) as e:
        T.build(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_symmetric_clamp_is_clip_grad_value():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(100))
    p.grad = torch.randn(100)
    got = T.build({"name": "clamp", "bound": 0.3})(p.grad)
    torch.nn.utils.clip_grad_value_([p], 0.3)
    assert torch.equal(got, p.grad)


def test_register_user_transform():
    def halve_positive():
        return lambda grad: torch.where(grad > 0, grad / 2, grad)

    gradmod.register("test_halve_positive", halve_positive)
    try:
        assert "test_halve_positive" in T.names()
        assert torch.equal(T.build("test_halve_positive")(torch.tensor([-2.0, 2.0])), torch.tensor([-2.0, 1.0]))
        # No foreach form: the fused stage falls back to the plain function, in place.
        grads = [torch.tensor([4.0, -1.0])]
        fused_stage("test_halve_positive", grads)
        assert torch.equal(grads[0], torch.tensor([2.0, -1.0]))
        with pytest.raises(ValueError, match="already registered"):
            gradmod.register("test_halve_positive", halve_positive)
    finally:
        registry.unregister("test_halve_positive")


def test_required_names_registered():
    assert {"clamp", "zero", "min_zero", "log", "scale", "norm_clip", "noise", "sign", "centralize"} <= set(T.names())
