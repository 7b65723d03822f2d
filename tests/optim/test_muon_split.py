"""Muon the modded-nanogpt way: ``split`` (a fused Q, K, V orthogonalised as three matrices),
Hugging Face's ``Conv1D`` (stored ``(in, out)``) against a ``Linear`` copy, and
``optimizer=muon_split`` against its optimizers built by hand."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config
from torch import nn

import gradmod
from gradmod.app.config_store import validate
from gradmod.models import TinyGPT
from gradmod.run.factories import optimizer_spec

pytest.importorskip("torch.optim", reason="torch.optim.Muon").Muon  # noqa: B018
Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
D, STEPS = 16, 4


class Fused(nn.Module):
    """A block with a fused Q, K, V matrix and an output matrix: ``Linear`` or GPT-2's ``Conv1D``."""

    def __init__(self, conv1d: bool):
        super().__init__()
        self.c_attn = Conv1D(3 * D, D) if conv1d else nn.Linear(D, 3 * D)
        self.c_proj = Conv1D(D, D) if conv1d else nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(D, dim=-1)
        return self.c_proj(q * torch.tanh(k) + v)


class Apart(nn.Module):
    """The same block with Q, K and V as three ``Linear`` layers."""

    def __init__(self, fused: Fused):
        super().__init__()
        weight, bias = fused.c_attn.weight.detach(), fused.c_attn.bias.detach()
        if isinstance(fused.c_attn, Conv1D):
            weight = weight.T  # Conv1D holds (in, out)
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        for i, layer in enumerate((self.q, self.k, self.v)):
            layer.weight.data.copy_(weight[i * D : (i + 1) * D])
            layer.bias.data.copy_(bias[i * D : (i + 1) * D])
        self.c_proj = nn.Linear(D, D)
        proj = fused.c_proj.weight.detach()
        self.c_proj.weight.data.copy_(proj.T if isinstance(fused.c_proj, Conv1D) else proj)
        self.c_proj.bias.data.copy_(fused.c_proj.bias.detach())

    def forward(self, x):
        return self.c_proj(self.q(x) * torch.tanh(self.k(x)) + self.v(x))


def fused_weight(model):
    w = model.c_attn.weight
    return w.T if isinstance(model.c_attn, Conv1D) else w


@pytest.mark.parametrize("conv1d", [False, True])
def test_split_is_three_separate_matrices(conv1d):
    """``split: 3`` on ``c_attn`` (a Linear, or GPT-2's Conv1D) steps as torch's Muon on Q, K, V apart."""
    torch.manual_seed(0)
    fused = Fused(conv1d)
    apart = Apart(fused)
    spec = {
        "_target_": "torch.optim.SGD",
        "lr": 0.1,
        "groups": [
            {"params": "c_attn.weight", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02, "split": 3}},
            {"params": "c_proj.weight", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02}},
        ],
    }
    mine = gradmod.optimizer(fused, spec)
    matrices = [apart.q.weight, apart.k.weight, apart.v.weight, apart.c_proj.weight]
    rest = [p for n, p in apart.named_parameters() if n.endswith("bias")]
    theirs = [torch.optim.Muon(matrices, lr=0.02), torch.optim.SGD(rest, lr=0.1)]
    for _ in range(STEPS):  # one backward (the three layers'); the fused block gets those gradients
        apart.zero_grad()
        apart(torch.randn(5, D)).square().mean().backward()
        qkv_grad = torch.cat([apart.q.weight.grad, apart.k.weight.grad, apart.v.weight.grad])
        fused.c_attn.weight.grad = qkv_grad.T.clone() if conv1d else qkv_grad.clone()
        fused.c_attn.bias.grad = torch.cat([apart.q.bias.grad, apart.k.bias.grad, apart.v.bias.grad])
        proj_grad = apart.c_proj.weight.grad
        fused.c_proj.weight.grad = proj_grad.T.clone() if conv1d else proj_grad.clone()
        fused.c_proj.bias.grad = apart.c_proj.bias.grad.clone()
        mine.step()
        for o in theirs:
            o.step()
    qkv = torch.cat([apart.q.weight, apart.k.weight, apart.v.weight])
    assert torch.equal(fused_weight(fused), qkv)
    proj = fused.c_proj.weight.T if conv1d else fused.c_proj.weight
    assert torch.equal(proj, apart.c_proj.weight)


def test_a_conv1d_weight_steps_as_its_linear_copy():
    """Muon's lr adjustment reads the (out, in) shape: sqrt(max(1, out / in)) = 2 for a 4D x D matrix,
    where torch's Muon on the stored (in, out) weight would take 1."""
    torch.manual_seed(0)
    conv, linear = Conv1D(4 * D, D), nn.Linear(D, 4 * D)
    linear.weight.data.copy_(conv.weight.detach().T)
    mine = gradmod.optimizer(
        conv,
        {
            "_target_": "torch.optim.SGD",
            "groups": [{"params": "weight", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02}}],
        },
    )
    theirs = torch.optim.Muon([linear.weight], lr=0.02)
    stored = torch.optim.Muon([w := nn.Parameter(conv.weight.detach().clone())], lr=0.02)
    assert [g.get("transposed") for g in mine.optimizers[1].param_groups] == [True]
    for _ in range(STEPS):
        g = torch.randn(4 * D, D)
        conv.weight.grad, linear.weight.grad, w.grad = g.T.clone(), g.clone(), g.T.clone()
        mine.step()
        theirs.step()
        stored.step()
    assert torch.equal(conv.weight.T, linear.weight)
    assert not torch.allclose(w.T, linear.weight)  # the stored shape's adjustment differs


def test_a_split_that_does_not_divide_is_one_line():
    with pytest.raises(
        ValueError,
        match=r"^optimizer.groups.0.optimizer \(Muon\): split=5 does not divide the 48 out features of a matrix of shape \(48, 16\); allowed: a divisor",
    ) as e:
        gradmod.optimizer(
            Fused(False),
            {
                "_target_": "torch.optim.SGD",
                "groups": [{"params": "c_attn.weight", "optimizer": {"_target_": "gradmod.optim.Muon", "split": 5}}],
            },
        )
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^optimizer.groups.0.optimizer \(Muon\): split=0 must be an int >= 1"):
        validate(compose_config("optimizer=muon", "+optimizer.groups.0.optimizer.split=0"))


def test_muon_split_is_its_optimizers_by_hand():
    spec = optimizer_spec(validate(compose_config("optimizer=muon_split")).optimizer)
    torch.manual_seed(0)
    model = TinyGPT(65)
    other = TinyGPT(65)
    other.load_state_dict(model.state_dict())
    mine = gradmod.optimizer(model, spec)
    named = dict(other.named_parameters())
    embeddings = [named["embed.weight"], named["position.weight"]]
    head = [named["head.weight"], named["head.bias"]]
    matrices = [p for n, p in named.items() if n.startswith("blocks.") and p.ndim == 2]
    rest = [p for p in named.values() if all(p is not q for q in embeddings + head + matrices)]
    adam = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    theirs = [
        torch.optim.Adam(
            [{"params": rest, "lr": 0.04}, {"params": embeddings, "lr": 0.6}, {"params": head, "lr": 0.008}], **adam
        ),
        torch.optim.Muon(matrices, lr=0.05, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0),
    ]
    for _ in range(3):
        x, y = torch.randint(0, 65, (2, 8)), torch.randint(0, 65, (2, 8))
        for net, opts in ((model, [mine]), (other, theirs)):
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            for o in opts:
                o.step()
    for (n, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), n
