"""A parameter whose use starts after the first backward (functionally, or in the loss) is
refused in one line at that backward, through every path (a Linear's norms without
per-example weights, a convolution's per-example weights, an embedding); models the stage
follows whole run several float32 steps without a false refusal; each form's probe equals the
per-example gradients' sum along the same direction (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks.hookset import attach
from gradmod.hooks.per_sample.forms import layers as forms
from gradmod.hooks.per_sample.probes import ghost_probe, probe_dot, probe_for
from tests.hooks.per_sample.test_per_sample_zoo import CASES, labels


def _rule() -> dict:
    return {
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": 0.0}]}
    }


class Late(nn.Module):
    """``layer`` in a small classifier; from ``late = True`` on, its weight is used again
    functionally (``extra``) besides the layer's own call."""

    def __init__(self, layer: nn.Module, width: int, extra):
        super().__init__()
        self.layer, self.head, self.extra, self.late = layer, nn.LazyLinear(3), extra, False

    def forward(self, x):
        h = self.layer(x)
        if self.late:
            h = h + self.extra(self, x)
        return self.head(torch.tanh(h).flatten(1))


def _hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(4, 5)


LATE = {
    "linear_2d": (lambda: nn.Linear(5, 4), lambda: torch.randn(6, 5), lambda m, x: F.linear(x, m.layer.weight)),
    "conv2d": (
        lambda: nn.Conv2d(2, 3, 3, padding=1),
        lambda: torch.randn(6, 2, 5, 5),
        lambda m, x: F.conv2d(x, m.layer.weight, padding=1),
    ),
    "embedding": (
        lambda: nn.Embedding(9, 4),
        lambda: torch.randint(0, 9, (6, 5)),
        lambda m, x: F.embedding(x.flip(1), m.layer.weight),
    ),
    "hf_conv1d": (_hf_conv1d, lambda: torch.randn(6, 5), lambda m, x: x @ m.layer.weight),
}


@pytest.mark.parametrize("name", list(LATE))
def test_a_use_that_starts_after_the_first_backward_is_refused_in_one_line(name):
    pytest.importorskip("transformers") if name == "hf_conv1d" else None
    make, inputs, extra = LATE[name]
    torch.manual_seed(0)
    model = Late(make(), 4, extra)
    hooks = attach(model, _rule())
    for step in range(3):
        model.late = step == 2
        x, y = inputs(), torch.randint(0, 3, (6,))
        if step < 2:
            F.cross_entropy(model(x), y).backward()
            hooks.after_backward()
            continue
        with pytest.raises(ValueError, match="'layer.weight' got part of its gradient outside") as err:
            F.cross_entropy(model(x), y).backward()
            hooks.after_backward()
        assert "\n" not in str(err.value) and "after the first backward" in str(err.value)
    hooks.remove()


def test_a_penalty_added_to_the_loss_later_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    hooks = attach(model, _rule())
    for step in range(3):
        loss = F.cross_entropy(model(torch.randn(6, 5)), torch.randint(0, 3, (6,)))
        if step == 2:
            loss = loss + 1e-3 * model[2].weight.square().sum()  # weight decay written into the loss
            with pytest.raises(ValueError, match="'2.weight' got part of its gradient outside"):
                loss.backward()
        else:
            loss.backward()
            hooks.after_backward()
    hooks.remove()


# In the default suite a few models through every path; the slow suite walks the whole zoo.
FEW = ["encoder_layer", "lstm_outputs", "embedding_padding", "instance_norm", "tied_functional", "functional_use"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", [c if c in FEW else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_models_followed_whole_run_float32_steps_without_a_false_refusal(case):
    torch.manual_seed(0)
    make, inputs, spec, loss_fn, _ = CASES[case]
    model = make()
    hooks = attach(model, _rule())
    for _ in range(3):
        x = inputs()
        loss_fn(model(*x) if isinstance(x, tuple) else model(x), labels(spec)).mean().backward()
        hooks.after_backward()
    hooks.remove()


def _probe_cases():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    return {
        "linear_seq": (forms.LINEAR, nn.Linear(5, 4), torch.randn(3, 6, 5)),
        "hf_conv1d": (forms.NAMED_FORMS[("transformers.pytorch_utils", "Conv1D")], Conv1D(4, 5), torch.randn(3, 6, 5)),
        "conv1d_groups": (forms.CONV, nn.Conv1d(4, 6, 3, stride=2, groups=2, dilation=2), torch.randn(3, 4, 11)),
        "conv2d_reflect": (forms.CONV, nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), torch.randn(3, 2, 5, 6)),
        "conv3d": (forms.CONV, nn.Conv3d(2, 2, 2, padding="same"), torch.randn(3, 2, 3, 4, 3)),
        "embedding_padding": (
            forms.FORMS[nn.Embedding],
            nn.Embedding(9, 4, padding_idx=0),
            torch.randint(0, 9, (3, 5)),
        ),
        "layernorm_2d": (forms.FORMS[nn.LayerNorm], nn.LayerNorm((4, 5)), torch.randn(3, 2, 4, 5)),
        "groupnorm": (forms.FORMS[nn.GroupNorm], nn.GroupNorm(2, 4), torch.randn(3, 4, 5)),
    }


@pytest.mark.parametrize(
    "case",
    [
        "linear_seq",
        "hf_conv1d",
        "conv1d_groups",
        "conv2d_reflect",
        "conv3d",
        "embedding_padding",
        "layernorm_2d",
        "groupnorm",
    ],
)
def test_each_forms_probe_equals_the_per_example_sum_along_its_direction(case):
    torch.manual_seed(0)
    form, m, a = _probe_cases()[case]
    m = m.double()
    with torch.no_grad():
        m.weight.add_(torch.randn_like(m.weight) * 0.1)  # a LayerNorm's ones would hide a wrong index
    a = a.double() if a.is_floating_point() else a
    with torch.no_grad():
        b = torch.randn_like(m(a))
    names = {n for n, _ in m.named_parameters()}
    probes = {n: probe_for(p, k) for k, (n, p) in enumerate(m.named_parameters())}
    per = form.per_example(m, a, b, names)
    got = ghost_probe(form, m, a, b, probes, names)
    for n in names:
        want = probe_dot(per[n], probes[n])
        assert abs(float(got[n] - want)) <= 1e-10 * max(1.0, abs(float(want))), n


class SeqFirst(nn.Module):
    """Sequence-first input [T, B, D]; every parameter acts before the pooling over time."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x))).mean(0)


def test_a_batch_that_is_not_dim_0_is_refused_unless_declared():
    from tests.hooks.per_sample.test_per_sample_zoo import loop_reference

    torch.manual_seed(0)
    model, x, y = SeqFirst().double(), torch.randn(6, 4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    hooks = attach(model, _rule())
    with pytest.raises(ValueError, match=r"SeqFirst's outputs do not grow with dim 0 of its inputs") as err:
        model(x)
    assert "attach(batch_dim=...)" in str(err.value) and "\n" not in str(err.value)
    hooks.remove()
    want, max_norm = loop_reference(model, x, y, lambda out, t: F.cross_entropy(out, t, reduction="none"), dim=1)
    rules = {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]}}
    hooks = attach(model, rules, batch_dim=1)
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"batch_dim=-1; allowed: an int >= 0"):
        attach(model, rules, batch_dim=-1)


class Positions(nn.Module):
    """Token embeddings plus position embeddings looked up once for the whole batch (one row of
    ids, as HF models do by default); ``squeeze``: the sum reshapes the one row by its shape."""

    def __init__(self, squeeze: bool):
        super().__init__()
        self.tok, self.pos, self.head, self.squeeze = nn.Embedding(9, 4), nn.Embedding(6, 4), nn.Linear(4, 3), squeeze

    def forward(self, idx):
        pos = self.pos(torch.arange(idx.shape[1])[None])  # [1, T, 4]
        h = self.tok(idx) + (pos.reshape(idx.shape[1], 4) if self.squeeze else pos)
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("squeeze", [False, True])
def test_a_one_row_call_is_expanded_to_the_batch_where_the_outputs_stay_the_same(squeeze):
    from tests.hooks.per_sample.test_per_sample_zoo import check

    torch.manual_seed(0)
    model = Positions(squeeze)
    check(
        model,
        torch.randint(0, 9, (4, 5)),
        torch.randint(0, 3, (4,)),
        lambda out, y: F.cross_entropy(out, y, reduction="none"),
    )
    hooks = attach(model, _rule())
    model(torch.randint(0, 9, (4, 5)))
    paths = {type(layer.form).__name__: layer.broadcast for layer in hooks.stage("per_sample").layers if "pos.weight" in [
        n for n, p in model.named_parameters() if any(p is q for q in layer.names.values())]}  # fmt: skip
    # expanded: the embedding's closed form; squeezed by shape: the whole model on the general path
    assert paths == ({"FuncForm": False} if squeeze else {"EmbeddingForm": True})
    hooks.remove()


class Paths(nn.Module):
    """One layer per path: a small Linear on sequences (per-example weights), a Linear on 2-D
    input (norms |a||b|), an LSTM (its recurrence replayed), a parameter used by its parent
    (torch.func over the parent), position embeddings on one row (expanded)."""

    def __init__(self):
        super().__init__()
        self.seq, self.rnn, self.pos = nn.Linear(4, 4), nn.LSTM(4, 4, batch_first=True), nn.Embedding(9, 4)
        self.scale, self.head = nn.Parameter(torch.ones(4)), nn.Linear(4, 3)

    def forward(self, x):
        h = self.rnn(self.seq(x) + self.pos(torch.arange(x.shape[1])[None]))[0].mean(1)
        return self.head(h * self.scale)


def test_the_stage_names_each_parameters_path():
    from gradmod.run.per_sample_paths import paths_line

    torch.manual_seed(0)
    model = Paths()
    hooks = attach(model, _rule())
    assert hooks.stage("per_sample").paths() == {}  # before the first training forward
    F.cross_entropy(model(torch.randn(3, 5, 4)), torch.randint(0, 3, (3,))).backward()
    hooks.after_backward()
    paths = hooks.stage("per_sample").paths()
    assert paths["seq.weight"] == paths["seq.bias"] == "closed form"
    assert paths["head.weight"] == "Gram"
    assert {paths[n] for n in paths if n.startswith("rnn.")} == {"replay"}
    # a table larger than the tokens' Gram matrix (9 x 4 > 5 x 5) is never formed per example
    assert paths["pos.weight"] == "Gram, one row expanded to the batch"
    assert paths["scale"] == "general: torch.func over Paths"
    assert paths_line(paths).startswith("per_sample paths (10 parameters): 4 replay, 2 closed form, 2 Gram, ")
    hooks.remove()


class ItemInForward(nn.Module):
    """A parameter on the general path whose forward branches on a value (``.item()``)."""

    def __init__(self):
        super().__init__()
        self.w, self.fc = nn.Parameter(torch.ones(3)), nn.Linear(3, 2)

    def forward(self, x):
        h = x * self.w
        return self.fc(h * 2 if h.sum().item() > 0 else h)


def test_a_module_torch_func_cannot_replay_is_refused_in_one_line():
    model = ItemInForward()
    hooks = attach(model, _rule())
    with pytest.raises(ValueError, match=r"per_sample: torch.func cannot replay ItemInForward per example") as err:
        model(torch.randn(4, 3)).sum().backward()
    assert "\n" not in str(err.value) and "register_form" in str(err.value)
    hooks.remove()


def test_an_empty_batch_after_set_up_gives_zeros_and_under_poisson_the_noise_alone():
    from gradmod.hooks.stage import Loop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 3))
    hooks = attach(model, _rule())
    F.cross_entropy(model(torch.randn(4, 2, 5)), torch.randint(0, 3, (4,))).backward()  # sets the stage up
    hooks.after_backward()
    model.zero_grad()
    F.cross_entropy(model(torch.randn(0, 2, 5)), torch.zeros(0, dtype=torch.long), reduction="sum").backward()
    hooks.after_backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    noisy = {
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": 2.0}]}
    }
    hooks = attach(model, noisy)
    hooks.set_up(Loop(poisson=True, step_examples=4))
    gen = torch.Generator().manual_seed(3)
    hooks.stage("per_sample").generator = gen
    F.cross_entropy(model(torch.randn(0, 2, 5)), torch.zeros(0, dtype=torch.long), reduction="sum").backward()
    hooks.after_backward()
    want = torch.Generator().manual_seed(3)
    for p in model.parameters():  # N(0, (sigma C)^2) / expected batch, drawn in parameter order
        torch.testing.assert_close(p.grad, torch.randn(p.shape, generator=want) * 2.0 / 4)
    hooks.remove()
