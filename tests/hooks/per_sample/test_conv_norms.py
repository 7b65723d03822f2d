"""A convolution's per-example weight gradients and their norms (``conv_grads``) against
torch.func's per-example gradients in float64: by the grouped kernel and by the matmul of the
unfolded input, and the Gram-matrix norms over the channels-last patches, in every
configuration of stride, dilation, groups and padding mode; which path the cost rule takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from gradmod.hooks.per_sample.forms import conv_grads

CONVS = {
    "conv1d_groups_dilation": (lambda: nn.Conv1d(4, 6, 3, stride=2, groups=2, dilation=2), (4, 11)),
    "conv2d_zeros": (lambda: nn.Conv2d(3, 5, 3, padding=1), (3, 6, 7)),
    "conv2d_stride_dilation": (lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), dilation=(1, 2)), (3, 7, 6)),
    "conv2d_one_position": (lambda: nn.Conv2d(3, 5, 3, padding=1), (3, 1, 1)),
    "conv2d_reflect": (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 5, 6)),
    "conv2d_circular_groups": (
        lambda: nn.Conv2d(4, 6, 3, padding=(1, 2), groups=2, padding_mode="circular"),
        (4, 5, 6),
    ),
    "conv2d_replicate_depthwise": (
        lambda: nn.Conv2d(4, 4, 2, padding=1, groups=4, padding_mode="replicate"),
        (4, 5, 5),
    ),
    "conv2d_same_even_kernel": (lambda: nn.Conv2d(2, 3, 4, padding="same", bias=False), (2, 6, 5)),
    "conv3d_same": (lambda: nn.Conv3d(2, 2, 2, padding="same"), (2, 3, 4, 3)),
}


def _vmap_weight_grads(m: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Example i's gradient of ``<m(a_i), b_i>`` with respect to the weight."""
    params = {k: v.detach() for k, v in m.named_parameters()}

    def inner(p, ai, bi):
        return (functional_call(m, p, (ai[None],))[0] * bi).sum()

    return vmap(grad(inner), in_dims=(None, 0, 0))(params, a, b)["weight"]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("case", list(CONVS))
@pytest.mark.parametrize("few_channels", [0, 1 << 30], ids=["grouped_kernel", "unfolded_matmul"])
def test_per_example_weights_and_gram_norms_equal_vmap_grad(case, few_channels, monkeypatch):
    monkeypatch.setattr(conv_grads, "FEW_CHANNELS", few_channels)
    torch.manual_seed(0)
    make, shape = CONVS[case]
    m = make().double()
    a = torch.randn(5, *shape, dtype=torch.float64)
    b = torch.randn_like(m(a))
    want = _vmap_weight_grads(m, a, b)
    torch.testing.assert_close(conv_grads.per_example_weight(m, a, b), want, rtol=1e-10, atol=1e-12)
    norms2 = want.flatten(1).square().sum(1)
    torch.testing.assert_close(conv_grads.gram_norms2(m, a, b), norms2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(conv_grads.weight_norms2(m, a, b), norms2, rtol=1e-10, atol=1e-12)


def test_patches_last_hold_the_patches_channels_innermost():
    m = nn.Conv2d(6, 4, (2, 3), stride=2, padding=1, groups=2)
    x = torch.randn(3, 6, 5, 7)
    first, last = conv_grads.patches(m, x), conv_grads.patches_last(m, x)  # [B, g, C_g K, L], [B, g, L, K C_g]
    taps = m.kernel_size[0] * m.kernel_size[1]
    as_last = first.reshape(3, 2, 3, taps, -1).permute(0, 1, 4, 3, 2).reshape(last.shape)
    assert torch.equal(as_last, last)


def test_norms_by_gram_matrices_only_where_they_cost_less(monkeypatch):
    """resnet18's 3x3 convolutions of 64 channels: 8x8 maps (64 positions) form the per-example
    weights ``[B, 64, 576]``, 4x4 and smaller the Gram matrices of their positions."""
    calls = []
    real = conv_grads.gram_norms2
    monkeypatch.setattr(conv_grads, "gram_norms2", lambda *args: calls.append(1) or real(*args))
    m = nn.Conv2d(64, 64, 3, padding=1)
    for size, gram in ((8, False), (4, True), (2, True), (1, True)):
        calls.clear()
        conv_grads.weight_norms2(m, torch.randn(2, 64, size, size), torch.randn(2, 64, size, size))
        assert bool(calls) == gram, size


def test_few_channels_unfold_their_input_only_while_it_stays_small(monkeypatch):
    """An image's 1 or 3 channels: one matmul of the unfolded input, unless the patches would
    exceed PATCHES_MAX elements (then the grouped kernel, which unfolds nothing)."""
    calls = []
    real = conv_grads.patches
    monkeypatch.setattr(conv_grads, "patches", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(conv_grads, "PATCHES_MAX", 4 * 27 * 64)  # 4 examples, 3x3x3 taps, 8x8 positions
    m = nn.Conv2d(3, 4, 3, padding=1)
    for size, unfolds in ((8, True), (9, False)):
        calls.clear()
        a = torch.randn(4, 3, size, size)
        got = conv_grads.per_example_weight(m, a, torch.randn(4, 4, size, size))
        assert got.shape == (4, 4, 3, 3, 3) and bool(calls) == unfolds, size
