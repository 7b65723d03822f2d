import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from gradmod.weight_init import INITS, apply_init

CONF = Path(__file__).resolve().parents[1] / "gradmod" / "conf" / "init"


class Node(nn.Module):
    """A tree of modules labelled like the Korean article's 1(2(4,5),3(6))."""

    def __init__(self, label, *children):
        super().__init__()
        self.label = label
        self.kids = nn.ModuleList(children)


def small_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 20),
        nn.Linear(20, 5, bias=False),
    )


def test_apply_visits_in_post_order():
    tree = Node(1, Node(2, Node(4), Node(5)), Node(3, Node(6)))
    order = []
    tree.apply(lambda m: order.append(m.label) if isinstance(m, Node) else None)
    assert order == [4, 5, 2, 6, 3, 1]


def test_xavier_is_uniform_in_bound_with_zero_bias():
    torch.manual_seed(0)
    net = apply_init(small_net(), "xavier")
    for layer in (net[0], net[4], net[5]):
        w = layer.weight
        fan_in = w[0].numel()
        fan_out = w.shape[0] * w[0, 0].numel() if w.dim() > 2 else w.shape[0]
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert w.abs().max() <= bound
        assert w.abs().max() > 0.9 * bound  # fills the range, not PyTorch's narrower default
        if layer.bias is not None:
            assert torch.equal(layer.bias, torch.zeros_like(layer.bias))
    # BatchNorm keeps its (1, 0) init
    assert torch.equal(net[1].weight, torch.ones(8)) and torch.equal(net[1].bias, torch.zeros(8))


def test_kaiming_std_matches_fan_in():
    torch.manual_seed(0)
    lin = apply_init(nn.Linear(400, 300), "kaiming")
    assert lin.weight.std().item() == pytest.approx(math.sqrt(2 / 400), rel=0.02)
    assert torch.equal(lin.bias, torch.zeros(300))


def test_default_leaves_weights_alone():
    torch.manual_seed(0)
    net = small_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    apply_init(net, "default")
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_unknown_init_lists_allowed_names():
    with pytest.raises(ValueError, match=r"unknown init 'xavir'; allowed: default, xavier, kaiming"):
        apply_init(small_net(), "xavir")


def test_config_group_names_every_scheme():
    files = {p.stem: OmegaConf.load(p) for p in CONF.glob("*.yaml")}
    assert set(files) == set(INITS)
    assert all(cfg.name == stem for stem, cfg in files.items())
