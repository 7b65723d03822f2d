"""Convolutions' closed form: the clipped sum by torch's weight-gradient kernel (or one matmul
of the unfolded input on tiny maps) and the Gram-matrix norms equal the per-example weights
in float64, in every configuration of stride, dilation, groups and padding mode; the cost
rule picks per-example weights only where they are cheaper (resnet18-GroupNorm's plan)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks.hookset import attach
from gradmod.hooks.per_sample.forms import layers

CONVS = {
    "conv1d_groups_dilation": (lambda: nn.Conv1d(4, 6, 3, stride=2, groups=2, dilation=2), (4, 11)),
    "conv2d_zeros": (lambda: nn.Conv2d(3, 5, 3, padding=1), (3, 6, 7)),
    "conv2d_stride_tiny_map": (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1), (3, 3, 3)),  # 2x2 positions
    "conv2d_one_position": (lambda: nn.Conv2d(3, 5, 3, padding=1), (3, 1, 1)),
    "conv2d_reflect": (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 5, 6)),
    "conv2d_circular": (lambda: nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="circular"), (2, 5, 6)),
    "conv2d_replicate_groups": (lambda: nn.Conv2d(4, 4, 2, padding=1, groups=4, padding_mode="replicate"), (4, 5, 5)),
    "conv2d_same_even_kernel": (lambda: nn.Conv2d(2, 3, 4, padding="same", bias=False), (2, 6, 5)),
    "conv3d_same": (lambda: nn.Conv3d(2, 2, 2, padding="same"), (2, 3, 4, 3)),
}


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("case", list(CONVS))
def test_clipped_sum_and_norms_equal_the_per_example_weights(case):
    torch.manual_seed(0)
    make, shape = CONVS[case]
    m = make().double()
    a = torch.randn(5, *shape, dtype=torch.float64)
    b = torch.randn_like(m(a))
    w = torch.rand(5, dtype=torch.float64)
    names = {n for n, _ in m.named_parameters()}
    per = layers.CONV.per_example(m, a, b, names)
    got_sum = layers.CONV.weighted(m, a, b, w, names)
    got_norms = layers.CONV.norms2(m, a, b, names)
    for n in names:
        torch.testing.assert_close(got_sum[n], torch.tensordot(w, per[n], 1), rtol=1e-12, atol=1e-12, msg=n)
        torch.testing.assert_close(got_norms[n], per[n].flatten(1).square().sum(1), rtol=1e-12, atol=1e-12, msg=n)


def test_per_example_weights_only_where_they_cost_less_than_gram_matrices():
    m = nn.Conv2d(64, 64, 3, padding=1)
    at = {size: torch.empty(32, 64, size, size) for size in (8, 4, 2)}
    b = {size: torch.empty(32, 64, size, size) for size in (8, 4, 2)}
    assert layers.CONV.materialises(m, at[8], b[8])  # 64 positions: forming [B, 64, 576] is cheaper
    assert not layers.CONV.materialises(m, at[4], b[4])  # 16: the Gram matrices [B, 16, 16] are
    assert not layers.CONV.materialises(m, at[2], b[2])


def test_resnet18_groupnorm_plan_names_each_convolutions_path():
    """(Its per-example gradients against the loop: test_per_sample_zoo's slow resnet18 test.)"""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))
    hooks = attach(model, {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}})
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.randint(0, 3, (2,))).backward()
    hooks.after_backward()
    paths = hooks.stage("per_sample").paths()
    # 16x16 and 8x8 maps form per-example weights; 4x4 and smaller take Gram norms
    assert paths["conv1.weight"] == paths["layer1.0.conv1.weight"] == "closed form"
    assert paths["layer2.0.conv2.weight"] == paths["layer3.1.conv1.weight"] == paths["layer4.1.conv2.weight"] == "Gram"
    assert paths["layer2.0.downsample.0.weight"] == "Gram" and paths["bn1.weight"] == "closed form"
    assert all(p.grad is not None for p in model.parameters())
    hooks.remove()


class TwoConvs(nn.Module):
    """A convolution on the data (its input takes no gradient), one on its features, a head;
    ``shared``: the second reuses the first's weight."""

    def __init__(self, shared=False):
        super().__init__()
        self.c1, self.c2, self.head = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1), nn.Linear(48, 3)
        if shared:
            self.c2.weight = self.c1.weight

    def forward(self, x):
        return self.head(torch.tanh(self.c2(torch.tanh(self.c1(x)))).flatten(1))


@pytest.mark.parametrize("shared", [False, True], ids=["own_weights", "shared_weight"])
def test_after_the_first_backward_autograd_no_longer_forms_the_convolution_weight_gradients(shared):
    """From the second backward the layers run on detached weights (the stage sums their clipped
    gradients itself): autograd hands their parameters a gradient once; the per-example
    gradients stay the loop's."""
    from tests.hooks.per_sample.test_per_sample_zoo import loop_reference

    torch.manual_seed(0)
    model = TwoConvs(shared).double()
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    want, max_norm = loop_reference(model, x, y, lambda out, t: F.cross_entropy(out, t, reduction="none"))
    arrived = {n: 0 for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        p.register_hook(lambda g, n=n: arrived.__setitem__(n, arrived[n] + 1))
    hooks = attach(model, {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]}})
    for _ in range(3):
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)
    # the first backward only (it checks every form against autograd's whole gradients), a weight
    # shared by two convolutions too (both its calls followed), and the Linear head's
    assert arrived == {n: 1 for n in arrived}, arrived
    hooks.remove()


def test_a_forward_that_raises_leaves_the_parameters_as_they_were():
    torch.manual_seed(0)
    model = TwoConvs()
    before = dict(model.named_parameters())
    hooks = attach(model, {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}})
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()  # from here the convolutions run detached
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5, 4, 4))  # the wrong number of channels
    assert all(p is before[n] for n, p in model.named_parameters())
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()
    assert all(p.grad is not None for p in model.parameters())
    hooks.remove()
