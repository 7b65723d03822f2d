"""Where rules come from and how several sets share a model: shipped hook files by name,
several files merged by rule name, ``attach(..., replace=False)``; ``agc``'s ``norm_type``
against timm's ``adaptive_clip_grad``."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach, load_rules
from gradmod.hooks.rules.sources import SHIPPED, shipped_names

CLAMP = {"clip": {"params": "0.*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}
ZERO = {"zero": {"params": "2.*", "transforms": ["zero"]}}


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def backward(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(torch.randn(16, 6, generator=g) * 5), torch.randint(3, (16,), generator=g)).backward()


def test_shipped_names_are_the_hydra_group_and_load_from_any_folder(tmp_path, monkeypatch):
    from helpers import CONF

    assert SHIPPED == CONF / "hooks"
    assert shipped_names() == sorted(p.stem for p in (CONF / "hooks").glob("*.yaml"))
    monkeypatch.chdir(tmp_path)
    assert load_rules("log") == {"log": {"params": "*", "transforms": ["log"]}}
    assert load_rules("clip.yaml") == load_rules(CONF / "hooks" / "clip.yaml")


def test_a_local_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "log").write_text("mine: {params: '*', transforms: [zero]}\n")
    assert list(load_rules("log")) == ["mine"]


def test_several_files_and_mappings_merge_by_rule_name():
    merged = load_rules(["clip", "log", ZERO])
    assert list(merged) == ["clip", "log", "zero"]
    assert merged["zero"] == ZERO["zero"] and merged["clip"] == load_rules("clip")["clip"]


@pytest.mark.parametrize(
    "spec, words",
    [
        (["clip", {"clip": {"params": "*", "transforms": ["zero"]}}], ["'clip'", "mapping #2", "rename"]),
        ("lgo", ["'lgo' not found", "shipped hook files: agc, ", " clip, ", " pcgrad, "]),
        ("nowhere/log.yaml", ["'nowhere/log.yaml' not found"]),
        ([3], ["item #1", "mapping"]),
    ],
)
def test_bad_rule_sources_are_one_line(spec, words):
    with pytest.raises(ValueError) as e:
        load_rules(spec)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_replace_false_adds_a_second_set_and_both_act():
    model, ref = tiny_model(), tiny_model()
    first = attach(model, CLAMP)
    second = attach(model, ZERO, replace=False)
    backward(model)
    backward(ref)
    assert len(first) == 2 and len(second) == 2
    for name in ("0.weight", "0.bias"):
        g, r = dict(model.named_parameters())[name].grad, dict(ref.named_parameters())[name].grad
        assert torch.equal(g, r.clamp(-0.01, 0.01)) and not torch.equal(g, r)
    assert all(p.grad.count_nonzero() == 0 for p in model[2].parameters())
    attach(model, ZERO)  # a plain attach replaces both sets
    assert len(first) == 0 and len(second) == 0


def test_replace_false_refuses_tensors_another_set_carries():
    model = tiny_model()
    kept = attach(model, CLAMP)
    with pytest.raises(ValueError, match=r"^attach: 0.weight, 0.bias already carry hooks .*replace=False"):
        attach(model, {"z": {"params": "0.*", "transforms": ["zero"]}}, replace=False)
    assert len(kept) == 2  # the refused call left the first set alone
    kept.remove()
    attach(model, {"z": {"params": "0.*", "transforms": ["zero"]}}, replace=False).remove()


def agc_rule(**args) -> dict:
    return {"agc": {"params": "*", "stage": "fused", "transforms": [{"name": "agc", **args}]}}


def agc_reference(model: nn.Module, clip_factor: float, eps: float, norm_type: float) -> list[torch.Tensor]:
    """Unit by unit in float64, a unit being a weight's slice along dim 0."""
    out = []
    for p in model.parameters():
        w, g = p.detach().double(), p.grad.double()
        units = [(w, g)] if p.dim() <= 1 else list(zip(w, g))
        rows = []
        for wu, gu in units:
            limit = clip_factor * max(torch.linalg.vector_norm(wu, norm_type).item(), eps)
            n = torch.linalg.vector_norm(gu, norm_type).item()
            rows.append(gu * (limit / n) if n > limit else gu)
        out.append(rows[0] if p.dim() <= 1 else torch.stack(rows))
    return out


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_agc_norm_type_matches_a_unit_by_unit_computation(norm_type):
    model = tiny_model()
    hooks = attach(model, agc_rule(clip_factor=0.05, norm_type=norm_type))
    backward(model)
    expected = agc_reference(model, 0.05, 1e-3, norm_type)
    hooks.after_backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-5, atol=1e-9)
    hooks.remove()


def timm_agc():
    """timm's ``utils/agc.py`` (it imports torch only), without the seconds timm's import takes."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        pytest.skip("timm is not installed (pip install timm)")
    path = Path(spec.origin).parent / "utils" / "agc.py"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("timm_agc", path))
    module.__spec__.loader.exec_module(module)
    return module


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_agc_is_timms_adaptive_clip_grad_bit_for_bit(norm_type):
    agc = timm_agc()
    model, ref = tiny_model(), tiny_model()
    hooks = attach(model, agc_rule(clip_factor=0.05, norm_type=norm_type))
    backward(model)
    backward(ref)
    hooks.after_backward()
    agc.adaptive_clip_grad(ref.parameters(), clip_factor=0.05, eps=1e-3, norm_type=norm_type)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    hooks.remove()


def test_agc_norm_type_is_checked():
    with pytest.raises(ValueError, match="norm_type=0.5 must be >= 1 or 'inf'"):
        attach(tiny_model(), agc_rule(norm_type=0.5))


@pytest.mark.slow  # timm's import and a ResNet: about 10 s
@pytest.mark.parametrize(
    "mode, transform",
    [
        ("agc", {"name": "agc", "clip_factor": 0.01, "norm_type": 1.0}),
        ("norm", {"name": "global_norm_clip", "max_norm": 0.01, "norm_type": 1.0}),
        ("value", {"name": "clamp", "min": -0.01, "max": 0.01}),
    ],
)
def test_timms_dispatch_clip_grad_on_its_resnet10t(mode, transform):
    timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from timm.utils.clip_grad import dispatch_clip_grad

    def backward() -> nn.Module:
        torch.manual_seed(0)
        net = timm.create_model("resnet10t", num_classes=5)
        g = torch.Generator().manual_seed(2)
        F.cross_entropy(net(torch.randn(2, 3, 32, 32, generator=g)), torch.tensor([1, 4])).backward()
        return net

    ours, ref, raw = backward(), backward(), backward()
    hooks = attach(ours, {"c": {"params": "*", "stage": "fused", "transforms": [transform]}})
    hooks.after_backward()
    dispatch_clip_grad(ref.parameters(), 0.01, mode=mode, norm_type=1.0)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert any(not torch.equal(p.grad, r.grad) for p, r in zip(ours.parameters(), raw.parameters()))  # it clipped
    hooks.remove()
