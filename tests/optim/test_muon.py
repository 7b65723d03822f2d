"""optimizer=muon: torch.optim.Muon on @matrices, AdamW on the rest, bitwise equal to the same
pair built by hand (a CNN's kernels as the matrices torch's Muon takes); kernels in any memory
format."""

from __future__ import annotations

import dataclasses

import torch
from helpers import CONF, compose_config
from omegaconf import OmegaConf
from torch import nn
from torch.func import functional_call

from gradmod.app.config_store import validate
from gradmod.models import MnistCNN, TinyGPT
from gradmod.optim import CombinedOptimizer
from gradmod.run.config import MuonConfig
from gradmod.run.factories import model_optimizer

MUON = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_steps": 5, "weight_decay": 0.01}  # the shipped recipe
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.01}


def shipped(model):
    return model_optimizer(validate(compose_config("optimizer=muon")).optimizer, model)


def test_the_shipped_recipe_is_the_reference_one():
    opt = shipped(TinyGPT(65))
    assert isinstance(opt, CombinedOptimizer)
    adamw, muon = opt.optimizers
    assert type(adamw) is torch.optim.AdamW and isinstance(muon, torch.optim.Muon)
    assert {k: muon.defaults[k] for k in MUON} == MUON and muon.defaults["adjust_lr_fn"] is None  # "original"
    assert {k: adamw.defaults[k] for k in ADAMW} == ADAMW


def test_the_recipe_is_written_once_in_the_schema():
    """optimizer=muon's file names its schema and sets none of the recipe: Python's MuonConfig()
    and the command line's optimizer=muon are one recipe."""
    written = OmegaConf.to_container(OmegaConf.load(CONF / "optimizer" / "muon.yaml"))
    assert set(written) == {"defaults", "_target_"} and written["_target_"] == MuonConfig._target_
    assert OmegaConf.to_container(compose_config("optimizer=muon").optimizer) == dataclasses.asdict(MuonConfig())


def test_muon_on_the_tiny_transformer_equals_torchs_pair_by_hand():
    torch.manual_seed(0)
    model, twin = TinyGPT(65), TinyGPT(65)
    twin.load_state_dict(model.state_dict())
    opt = shipped(model)
    named = dict(twin.named_parameters())
    matrices = [n for n, p in named.items() if p.ndim == 2 and n.split(".")[0] not in ("embed", "position", "head")]
    assert len(matrices) == 12
    pair = [
        torch.optim.Muon([named[n] for n in matrices], **MUON),
        torch.optim.AdamW([p for n, p in named.items() if n not in matrices], **ADAMW),
    ]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 65, (2, 8), generator=g), torch.randint(0, 65, (2, 8), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        for o in pair:
            o.zero_grad()
        nn.functional.cross_entropy(twin(x), y).backward()
        for o in pair:
            o.step()
    moved = dict(model.named_parameters())
    assert all(torch.equal(moved[n], p) for n, p in named.items())
    assert not torch.equal(moved["blocks.0.fc1.weight"], TinyGPT(65).blocks[0].fc1.weight)


def test_muon_on_the_cnn_equals_torchs_muon_on_the_kernels_as_matrices():
    """The reference holds each kernel as an out x (in*3*3) matrix leaf (torch's Muon takes
    only those) and runs the same network through it; AdamW on biases and the last layer."""
    torch.manual_seed(0)
    model = MnistCNN(1, 10)
    ref = MnistCNN(1, 10)
    leaves = {
        n: nn.Parameter(
            p.detach().reshape(len(p), -1).clone() if n.startswith("conv") and p.ndim == 4 else p.detach().clone()
        )
        for n, p in model.named_parameters()
    }
    kernels = ["conv1.weight", "conv2.weight"]
    pair = [
        torch.optim.Muon([leaves[n] for n in kernels], **MUON),
        torch.optim.AdamW([p for n, p in leaves.items() if n not in kernels], **ADAMW),
    ]
    opt = shipped(model)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.rand(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        for o in pair:
            o.zero_grad()
        as_model = {n: p.view(shapes[n]) for n, p in leaves.items()}
        nn.functional.cross_entropy(functional_call(ref, as_model, (x,)), y).backward()
        for o in pair:
            o.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, leaves[n].view(shapes[n])), n
    state = opt.state_dict()["state"]
    kernel_buffers = [s["momentum_buffer"] for s in state.values() if "momentum_buffer" in s]
    assert [tuple(b.shape) for b in kernel_buffers] == [(32, 1, 3, 3), (32, 32, 3, 3)]  # saved as the kernels


def test_a_channels_last_kernel_gets_the_same_update_to_rounding():
    """Columns in memory order: the orthogonalised matrix is the same up to a permutation of
    its columns (Newton-Schulz commutes with it), so the update agrees to bfloat16 rounding."""
    torch.manual_seed(0)
    flat = MnistCNN(1, 10)
    last = MnistCNN(1, 10).to(memory_format=torch.channels_last)
    last.load_state_dict(flat.state_dict())
    assert not last.conv2.weight.is_contiguous()
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    before = flat.conv2.weight.detach().clone()
    for model in (flat, last):
        opt = shipped(model)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    step_flat, step_last = flat.conv2.weight - before, last.conv2.weight - before
    assert step_flat.abs().max() > 1e-3
    torch.testing.assert_close(step_last, step_flat, atol=2e-4, rtol=0)
