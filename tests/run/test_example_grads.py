"""Each example's gradient for influence: the layers' forms against ``torch.func.vmap`` of ``grad``
(an independent computation) on the models influence is asked of, and the models where the forms
cannot give it (a weight used outside its layer, a layer that does not see the batch first, an
attention), which must take ``vmap`` after their first batch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.analysis.example_grads import ExampleGrads, by_vmap, channels_last
from gradmod.models import build_model


class Tokens(nn.Module):
    """Embedding, LayerNorm and Linear over a sequence, mean-pooled; ``tied``: the output layer is
    the embedding's table; ``functional``: the head's weight also used outside its layer."""

    def __init__(self, tied: bool = False, functional: bool = False, seq_first: bool = False):
        super().__init__()
        self.emb, self.norm, self.mix = nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 6)
        self.out = nn.Linear(6, 10, bias=False)
        if tied:
            self.out.weight = self.emb.weight
        self.functional, self.seq_first = functional, seq_first

    def forward(self, x):
        h = self.norm(self.emb(x))
        h = self.mix(h.transpose(0, 1)).transpose(0, 1) if self.seq_first else self.mix(h)
        h = torch.tanh(h).mean(1)
        logits = self.out(h)
        return logits + 0.5 * F.linear(h, self.out.weight) if self.functional else logits


class Attending(nn.Module):
    """Self-attention (``nn.MultiheadAttention``: its form records calls inside it, which this
    path does not follow) over embedded tokens."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 6), nn.Linear(6, 10)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        h = self.emb(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0].mean(1))


def _images(channels: int, size: int, n: int):
    gen = torch.Generator().manual_seed(0)
    return torch.rand(n, channels, size, size, generator=gen, dtype=torch.float64), torch.randint(
        0, 10, (n,), generator=gen
    )


def _tokens(n: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (n, 5), generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _eval(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model.double().eval()
    with torch.no_grad():  # running statistics of their own: BatchNorm's eval affine map is not the identity
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.gru, self.out = nn.Embedding(10, 6), nn.GRU(6, 6, batch_first=True), nn.Linear(6, 10)

    def forward(self, x):
        return self.out(self.gru(self.emb(x))[0][:, -1])


class Residual(nn.Module):
    """ResNet's basic block, small: ReLUs in place on BatchNorms' outputs, a skip connection."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu, self.fc = nn.ReLU(inplace=True), nn.Linear(8, 10)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        h = self.relu(self.bn2(self.conv2(h)) + h)
        return self.fc(h.mean((2, 3)))


def _resnet():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10)


def _check(model: nn.Module, batches: list, forms: bool):
    names = [n for n, _ in model.named_parameters()]
    per_example = ExampleGrads(model, names)
    for x, y in batches:
        got = per_example(x, y)
        want = by_vmap(model, names, x, y)
        assert [g.shape for g in got] == [w.shape for w in want]
        for n, g, w in zip(names, got, want):
            assert torch.allclose(g, w, rtol=1e-9, atol=1e-12), n
    assert per_example.by_forms is forms


@pytest.mark.parametrize(
    "build,data",
    [
        (lambda: build_model("mnist_cnn", in_channels=1, num_classes=10, image_size=28, norm="batch"), (1, 28)),
        (Residual, (3, 8)),
        pytest.param(_resnet, (3, 16), marks=pytest.mark.slow),
    ],
    ids=["mnist_cnn_batchnorm", "residual_block", "resnet18"],
)
def test_image_models_take_the_forms_channels_last_and_equal_vmap(build, data):
    """ResNet's ReLUs run in place on its BatchNorms' outputs: the output gradient is caught on
    the output as the layer gave it."""
    model = _eval(build())
    assert channels_last(model)
    _check(model, [_images(*data, 4), _images(*data, 3)], forms=True)


@pytest.mark.parametrize("tied", [False, True], ids=["own_head", "tied_head"])
def test_a_sequence_model_takes_the_forms_and_equals_vmap(tied):
    model = _eval(Tokens(tied=tied))
    assert not channels_last(model)  # no convolution: left as it is
    _check(model, [_tokens(7), _tokens(3)], forms=True)


@pytest.mark.parametrize(
    "model",
    [Tokens(functional=True), Tokens(seq_first=True), Attending()],
    ids=["weight_used_outside_its_layer", "layer_sees_the_sequence_first", "attention"],
)
def test_where_the_forms_cannot_give_it_vmap_does(model, caplog):
    model = _eval(model)
    with caplog.at_level(logging.INFO, logger="gradmod.scores"):
        _check(model, [_tokens(5), _tokens(4)], forms=False)
    if not isinstance(model, Attending):  # no form to try: nothing to say
        assert "by torch.func" in caplog.text


def test_a_model_neither_path_can_take_is_one_line():
    """A GRU has no form this path takes, and vmap cannot batch torch's RNN kernel: one line."""
    model = _eval(Recurrent())
    per_example = ExampleGrads(model, [n for n, _ in model.named_parameters()])
    with pytest.raises(ValueError) as e:
        per_example(*_tokens(4))
    assert "torch.func.vmap cannot batch it" in str(e.value) and "\n" not in str(e.value)
