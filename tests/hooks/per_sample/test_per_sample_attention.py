"""nn.MultiheadAttention's projections in closed form (recorded inside torch's attention
function, no replay): float64 against one autograd gradient per example of the same batch
forward (so attention's dropout masks are the batch's), in every configuration of the module
torch runs through its projections; the plan names the path; a later use of a weight outside
the module is refused by the probe check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks.hookset import attach
from gradmod.hooks.per_sample.forms import layers
from gradmod.hooks.per_sample.forms.attention import AttentionForm

B, T, S, E = 4, 5, 3, 8


def rule(max_norm=1.0):
    return {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]}}


class Attend(nn.Module):
    """One attention call (self, or over a memory of S steps), pooled to 3 classes."""

    def __init__(self, mode="self", batch_first=True, need_weights=False, mask=None, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, 2, batch_first=batch_first, **kw)
        self.mem = nn.Linear(E, kw.get("kdim") or E)
        self.head = nn.Linear(E, 3)
        self.mode, self.need_weights, self.mask, self.first = mode, need_weights, mask, batch_first

    def forward(self, x):
        bd = 0 if self.first else 1
        q = x if self.first else x.transpose(0, 1)
        m = self.mem(q.narrow(1 - bd, 0, S))  # a memory of S steps, its own (per-example) input
        kw = {}
        if self.mask == "padding":
            pad = torch.zeros(x.shape[0], S if self.mode != "self" else T, dtype=torch.bool)
            pad[::2, -1] = True
            kw["key_padding_mask"] = pad
        elif self.mask == "causal":
            kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(T)
            kw["is_causal"] = True
        k, v = {"self": (q, q), "kv": (m, m), "qkv": (m, m.flip(1 - bd))}[self.mode]
        out, w = self.attn(q, k, v, need_weights=self.need_weights, **kw)
        out = out if self.first else out.transpose(0, 1)
        extra = 0 if w is None else w.sum((1, 2)).unsqueeze(1)
        return self.head(out.mean(1)) + extra


CASES = {
    "self_batch_first": dict(),
    "self_seq_first": dict(batch_first=False),
    "cross_kv": dict(mode="kv"),
    "cross_qkv": dict(mode="qkv"),
    "kdim_vdim_narrow": dict(mode="qkv", kdim=6, vdim=6),
    "kdim_vdim_wide": dict(mode="qkv", kdim=12, vdim=12),
    "need_weights": dict(need_weights=True),
    "key_padding_mask": dict(mask="padding"),
    "causal": dict(mask="causal"),
    "zero_attn_no_bias": dict(add_zero_attn=True, bias=False),
    "dropout": dict(dropout=0.3),
}


class SelfOnFeatures(nn.Module):
    """Self-attention on features that carry a gradient (a Linear's output)."""

    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(E, E), nn.MultiheadAttention(E, 2, batch_first=True), nn.Linear(E, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


def per_example_reference(model, x, seed=1):
    """Each example's gradient from the batch forward's own graph (its dropout masks), the clipped mean."""
    params = dict(model.named_parameters())
    torch.manual_seed(seed)
    out = model(x)
    w = torch.randn_like(out)
    per = []
    for i in range(len(x)):
        g = torch.autograd.grad((out[i] * w[i]).sum(), list(params.values()), retain_graph=True, allow_unused=True)
        per.append([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params.values())])
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in row)) for row in per])
    max_norm = float(norms.median())
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    want = {n: sum(c * row[k] for c, row in zip(coef, per)) / len(x) for k, n in enumerate(params)}
    return want, w, max_norm


def clipped(model, x, w, max_norm, seed=1, steps=1):
    hooks = attach(model, rule(max_norm))
    for _ in range(steps):
        torch.manual_seed(seed)  # the reference's dropout masks
        ((model(x) * w).sum() / len(x)).backward()
        hooks.after_backward()
    return hooks


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ghost", [False, True], ids=["materialised", "gram"])
def test_projections_equal_per_example_autograd_in_float64(case, ghost, monkeypatch):
    monkeypatch.setattr(AttentionForm, "materialises", lambda self, m, a, b: not ghost)
    torch.manual_seed(0)
    model = Attend(**CASES[case]).double().train()
    x = torch.randn(B, T, E, dtype=torch.float64)
    want, w, max_norm = per_example_reference(model, x)
    hooks = clipped(model, x, w, max_norm, steps=2)  # the second through the probe check
    paths = hooks.stage("per_sample").paths()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)
        if name.startswith("attn."):
            assert paths[name] == ("Gram" if ghost else "closed form"), (name, paths[name])
    hooks.remove()


def test_no_replay_of_the_module_and_bias_kv_keeps_the_general_path(monkeypatch):
    calls = []
    real = layers.FuncForm.per_example
    monkeypatch.setattr(layers.FuncForm, "per_example", lambda self, *a: calls.append(1) or real(self, *a))
    torch.manual_seed(0)
    model = Attend().double()
    x = torch.randn(B, T, E, dtype=torch.float64)
    hooks = clipped(model, x, torch.ones(B, 3, dtype=torch.float64), 1.0, steps=2)
    assert calls == []
    hooks.remove()
    model = Attend(add_bias_kv=True).double()
    want, w, max_norm = per_example_reference(model, x)
    hooks = clipped(model, x, w, max_norm)
    assert calls and hooks.stage("per_sample").paths()["attn.in_proj_weight"] == "general: torch.func over attn"
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("detached", [False, True], ids=["in_graph", "detached"])
def test_a_later_use_of_a_projection_weight_outside_the_module_is_refused(detached):
    torch.manual_seed(0)
    model = (SelfOnFeatures() if detached else Attend()).double()
    x = torch.randn(B, T, E, dtype=torch.float64)
    hooks = attach(model, rule())
    F.cross_entropy(model(x), torch.zeros(B, dtype=torch.long)).backward()
    hooks.after_backward()
    with pytest.raises(ValueError, match=r"'attn.in_proj_weight' got part of its gradient outside") as err:
        loss = F.cross_entropy(model(x), torch.zeros(B, dtype=torch.long)) + model.attn.in_proj_weight[:2].sum()
        loss.backward()
    assert "\n" not in str(err.value)
    hooks.remove()


def test_after_the_first_backward_autograd_no_longer_forms_the_projection_weight_gradients():
    """Op count: the stage sums the clipped weight gradients itself, so from the second backward
    autograd's own (what the first one checks every form against) is not computed."""
    torch.manual_seed(0)
    model = SelfOnFeatures().double()
    x = torch.randn(B, T, E, dtype=torch.float64)
    arrived = {n: 0 for n, _ in model.attn.named_parameters()}
    for n, p in model.attn.named_parameters():
        p.register_hook(lambda g, n=n: arrived.__setitem__(n, arrived[n] + 1))
    want, w, max_norm = per_example_reference(model, x)
    arrived = dict.fromkeys(arrived, 0)
    hooks = clipped(model, x, w, max_norm, steps=3)
    assert arrived == dict.fromkeys(arrived, 1), arrived  # the first backward only
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)
    hooks.remove()
    assert all(p is model.attn.get_parameter(n) for n, p in model.attn.named_parameters())


class MemoryOfData(nn.Module):
    """Cross-attention over the raw input (no gradient): its k and v projections stay in the graph."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(E, E)
        self.attn = nn.MultiheadAttention(E, 2, batch_first=True)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        return self.head(self.attn(self.q(x), x, x, need_weights=False)[0].mean(1))


def test_a_memory_without_gradient_keeps_its_projections_followed():
    torch.manual_seed(0)
    model = MemoryOfData().double()
    x = torch.randn(B, T, E, dtype=torch.float64)
    want, w, max_norm = per_example_reference(model, x)
    hooks = clipped(model, x, w, max_norm, steps=3)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)
    hooks.remove()


def test_a_torch_whose_attention_function_hides_its_projections_is_refused_in_one_line(monkeypatch):
    from gradmod.hooks.per_sample.forms import attention

    monkeypatch.setattr(attention, "_MHA_FORWARD", F.multi_head_attention_forward)  # dispatches again
    torch.manual_seed(0)
    model = SelfOnFeatures().double()
    hooks = attach(model, rule())
    with pytest.raises(ValueError, match=r"'attn\.\S+' got a gradient from outside every module call") as err:
        F.cross_entropy(model(torch.randn(B, T, E, dtype=torch.float64)), torch.zeros(B, dtype=torch.long)).backward()
    assert "\n" not in str(err.value)
    hooks.remove()


def test_weights_kept_in_the_graph_are_checked_along_their_probe_every_backward(monkeypatch):
    """A log-only rule keeps autograd's gradients (nothing detached): a later use outside the
    module is caught by the probe of the recorded projections (``attention.probe``)."""
    monkeypatch.setattr(AttentionForm, "materialises", lambda self, m, a, b: False)
    torch.manual_seed(0)
    model = SelfOnFeatures().double()
    x, y = torch.randn(B, T, E, dtype=torch.float64), torch.zeros(B, dtype=torch.long)
    hooks = attach(model, {"watch": {"params": "*", "stage": "per_sample", "transforms": ["log"]}})
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
    with pytest.raises(ValueError, match=r"'attn.out_proj.weight' got part of its gradient outside"):
        (F.cross_entropy(model(x), y) + model.attn.out_proj.weight[0].sum()).backward()
    hooks.remove()


def test_a_forward_that_raises_inside_attention_leaves_its_parameters_and_torch_as_they_were():
    torch.manual_seed(0)
    model = SelfOnFeatures()
    before = dict(model.named_parameters())
    hooks = attach(model, rule())
    x, y = torch.randn(B, T, E), torch.zeros(B, dtype=torch.long)
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()  # from here the projections run detached
    with pytest.raises((RuntimeError, AssertionError)):
        model.attn(x, torch.randn(B, T, E + 1), torch.randn(B, T, E + 1))  # key and value of the wrong width
    assert all(p is before[n] for n, p in model.named_parameters())
    assert not torch._C._is_torch_function_mode_enabled()  # no recording left open
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()
    hooks.remove()
