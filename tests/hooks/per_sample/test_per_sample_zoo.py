"""The per_sample stage on the layers of transformers, RNNs and fine-tuned models, in float64,
against the per-example loop (one autograd backward per example, flat clipping at the median
norm, no noise): every parameter's clipped mean to 1e-12 relative. Models built to escape
the hooks are followed by the general path or refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks.hookset import attach
from gradmod.hooks.per_sample import Form, register_form
from gradmod.hooks.per_sample.forms import layers as forms

RTOL = 1e-12


def dp_rule(max_norm=1.0, noise=0.0):
    return {
        "dp": {
            "params": "*",
            "transforms": [{"name": "per_sample_clip", "max_norm": max_norm, "noise_multiplier": noise}],
        }
    }


def split(x, i, dim):
    if isinstance(x, torch.Tensor):
        return x.narrow(dim, i, 1)
    return type(x)(split(t, i, dim) for t in x)


def loop_reference(model, x, y, loss_fn, dim=0):
    """Each example's gradient by its own backward; the clipped mean at the median norm."""
    per = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        xi = split(x, i, dim)
        loss_fn(model(*xi) if isinstance(xi, tuple) else model(xi), y[i : i + 1]).sum().backward()
        per.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in d.values())) for d in per])
    max_norm = float(norms.median())
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    want = {n: sum(c * d[n] for c, d in zip(coef, per)) / len(y) for n in per[0]}
    return want, max_norm


def check(model, x, y, loss_fn, dim=0):
    model = model.double()
    x = tuple(t.double() if t.is_floating_point() else t for t in x) if isinstance(x, tuple) else x
    x = x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    want, max_norm = loop_reference(model, x, y, loss_fn, dim)
    hooks = attach(model, dp_rule(max_norm))
    loss_fn(model(*x) if isinstance(x, tuple) else model(x), y).mean().backward()
    hooks.after_backward()
    # relative to the parameter's gradient, or to the largest where it is zero in exact arithmetic
    # (a key bias before softmax, a bias before InstanceNorm)
    scale = max(float(w.norm()) for w in want.values())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        err = float((p.grad - want[name]).norm())
        assert err <= RTOL * max(float(want[name].norm()), 1e-3 * scale), f"{name}: error {err:.2e}"
    hooks.remove()


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def seq_ce(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).sum(1)


class Pool(nn.Module):
    """A sequence model's output to class logits: mean over time (time in ``time_dim``)."""

    def __init__(self, inner, d, classes=3, time_dim=1, pick=lambda out: out):
        super().__init__()
        self.inner, self.head, self.time_dim, self.pick = inner, nn.Linear(d, classes), time_dim, pick
        self.batch_first = time_dim != 0  # sequence-first inputs carry the batch in dim 1

    def forward(self, *x):
        return self.head(torch.tanh(self.pick(self.inner(*x))).mean(self.time_dim))


class LastHidden(nn.Module):
    """An RNN classifying from h_n (and c_n): its outputs unused."""

    def __init__(self, rnn, classes=3):
        super().__init__()
        self.rnn, self.batch_first = rnn, rnn.batch_first
        d = rnn.hidden_size * (2 if rnn.bidirectional else 1) * rnn.num_layers
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        _, h = self.rnn(x)
        h = h[0] + h[1] if isinstance(h, tuple) else h
        return self.head(h.movedim(0, 1).flatten(1))


class MHA(nn.Module):
    def __init__(self, batch_first, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        self.batch_first = batch_first

    def forward(self, x):
        return self.attn(x, x, x)[0]


class Functional(nn.Module):
    """``F.linear(x, self.fc.weight)``: the Linear's own forward never runs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(F.linear(x, self.fc.weight, self.fc.bias)))


class Tied(nn.Module):
    """GPT-2's tie written functionally: the embedding's weight as the output projection."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, idx):
        return F.linear(torch.tanh(self.mix(self.emb(idx))), self.emb.weight)


class ParentUsesChild(nn.Module):
    """A parameter registered on the parent and its child (Opacus' DPLSTM does so), used by the parent."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(5, 5)
        self.w = self.cell.weight
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.cell(x)) @ self.w)


class ZeroDim(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(0.7))
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x * self.t)


class Affine(nn.Module):
    """A user's layer with its own registered form."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(d) + 0.5)
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.scale + self.shift


class AffineForm(Form):
    def per_example(self, m, a, b, names):
        dims = tuple(range(1, a.dim() - 1))
        out = {"scale": (a * b).sum(dims), "shift": b.sum(dims)}
        return {n: out[n] for n in names}


register_form(Affine, AffineForm())


def rnn_case(cls, batch_first, **kw):
    return lambda: Pool(
        cls(4, 5, batch_first=batch_first, **kw),
        5 * (2 if kw.get("bidirectional") else 1),
        time_dim=1 if batch_first else 0,
        pick=lambda out: out[0],
    )


def conv1d_hf():
    from transformers.pytorch_utils import Conv1D

    return nn.Sequential(Conv1D(6, 5), nn.Tanh(), Conv1D(3, 6))


def seq(b=4, t=5, d=5, first=True):
    return torch.randn(b, t, d) if first else torch.randn(t, b, d)


# name -> (model, input, labels, loss, batch dim of the input)
CASES = {
    "layernorm_seq": (lambda: Pool(nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7)), 7), lambda: seq(4, 6), 4, ce, 0),
    "layernorm_t_eq_d": (lambda: Pool(nn.LayerNorm(5), 5), lambda: seq(4, 5), 4, ce, 0),
    "layernorm_2d_shape": (lambda: Pool(nn.LayerNorm((6, 5)), 5), lambda: seq(4, 6), 4, ce, 0),
    "mha_batch_first": (lambda: Pool(MHA(True), 8), lambda: seq(4, 5, 8), 4, ce, 0),
    "mha_seq_first_t_eq_b": (lambda: Pool(MHA(False), 8, time_dim=0), lambda: seq(4, 4, 8, first=False), 4, ce, 1),
    "mha_bias_kv": (lambda: Pool(MHA(True, add_bias_kv=True), 8), lambda: seq(4, 5, 8), 4, ce, 0),
    "encoder_layer": (
        lambda: Pool(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 8),
        lambda: seq(4, 5, 8),
        4,
        ce,
        0,
    ),
    "encoder_layer_seq_first": (
        lambda: Pool(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, norm_first=True), 8, time_dim=0),
        lambda: seq(4, 4, 8, first=False),
        4,
        ce,
        1,
    ),
    "decoder_layer": (
        lambda: Pool(nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 8),
        lambda: (seq(4, 5, 8), seq(4, 3, 8)),
        4,
        ce,
        0,
    ),
    "lstm_outputs": (rnn_case(nn.LSTM, True), lambda: seq(4, 6, 4), 4, ce, 0),
    "lstm_seq_first_t_eq_b": (
        rnn_case(nn.LSTM, False, num_layers=2, bidirectional=True),
        lambda: seq(4, 4, 4, False),
        4,
        ce,
        1,
    ),
    "lstm_h_n": (lambda: LastHidden(nn.LSTM(4, 5, batch_first=True)), lambda: seq(4, 6, 4), 4, ce, 0),
    "gru": (rnn_case(nn.GRU, True, num_layers=2), lambda: seq(4, 6, 4), 4, ce, 0),
    "gru_h_n_seq_first": (lambda: LastHidden(nn.GRU(4, 5, bidirectional=True)), lambda: seq(4, 4, 4, False), 4, ce, 1),
    "rnn_relu": (rnn_case(nn.RNN, True, nonlinearity="relu", bias=False), lambda: seq(4, 6, 4), 4, ce, 0),
    "embedding_padding": (
        lambda: Pool(nn.Embedding(9, 5, padding_idx=0), 5),
        lambda: torch.randint(0, 9, (4, 6)),
        4,
        ce,
        0,
    ),
    "hf_conv1d": (lambda: Pool(conv1d_hf(), 3), lambda: seq(4, 6, 5), 4, ce, 0),
    "weight_norm_out_eq_b": (
        lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(5, 4)), nn.Tanh(), nn.Linear(4, 3)),
        lambda: torch.randn(4, 5),
        4,
        ce,
        0,
    ),
    "functional_use": (Functional, lambda: torch.randn(4, 5), 4, ce, 0),
    "tied_functional": (Tied, lambda: torch.randint(0, 11, (4, 5)), (4, 5, 11), seq_ce, 0),
    "parent_uses_child": (ParentUsesChild, lambda: torch.randn(4, 5), 4, ce, 0),
    "zero_dim_param": (ZeroDim, lambda: torch.randn(4, 5), 4, ce, 0),
    "custom_form": (lambda: Pool(nn.Sequential(nn.Linear(5, 6), Affine(6)), 6), lambda: seq(4, 3), 4, ce, 0),
    "conv_groupnorm": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 25, 3)
        ),
        lambda: torch.randn(4, 2, 5, 5),
        4,
        ce,
        0,
    ),
    "instance_norm": (
        lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, affine=True), nn.Flatten(), nn.Linear(3 * 4, 3)),
        lambda: torch.randn(4, 2, 6),
        4,
        ce,
        0,
    ),
}


class Merge(nn.Module):
    """The batch merged with time inside the model: the Linear's calls do not split per
    example, the model's own forward does (the general path on the whole model)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.fc(x.flatten(0, 1) * self.w).view(x.shape[0], -1)


CASES["batch_merged_with_time"] = (Merge, lambda: torch.randn(4, 5, 3), 4, lambda out, y: ce(out[:, :3], y), 0)


def labels(spec):
    shape = (spec,) if isinstance(spec, int) else spec[:2]
    return torch.randint(0, 3 if isinstance(spec, int) else spec[2], shape)


@pytest.mark.parametrize("case", list(CASES))
def test_zoo_equals_the_per_example_loop(case):
    torch.manual_seed(0)
    make, inputs, spec, loss_fn, dim = CASES[case]
    model, x, y = make(), inputs(), labels(spec)
    check(model, x, y, loss_fn, dim)


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=23, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg)


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=23,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(cfg)


class Logits(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, idx):
        return self.hf(input_ids=idx).logits


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_tiny_hf_models_equal_the_per_example_loop(name):
    torch.manual_seed(0)
    if name == "gpt2":
        model, y, loss_fn = Logits(tiny_gpt2()), torch.randint(0, 23, (3, 6)), seq_ce
    else:
        model, y, loss_fn = Logits(tiny_bert()), torch.randint(0, 3, (3,)), ce
    check(model, torch.randint(0, 23, (3, 6)), y, loss_fn)


@pytest.mark.slow
def test_resnet18_groupnorm_equals_the_per_example_loop():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))
    check(model, torch.randn(3, 3, 32, 32), torch.randint(0, 3, (3,)), ce)


def first_backward_error(model, x, loss):
    hooks = attach(model, dp_rule())
    with pytest.raises(ValueError) as err:
        loss(model(x)).backward()
        hooks.after_backward()
    hooks.remove()
    assert "\n" not in str(err.value)
    return str(err.value)


class PackedTagger(nn.Module):
    """Tokens and their lengths in, packed inside: embedding, a 2-layer bidirectional LSTM on the
    packed sequences, heads on the final states and on the padded outputs' mean."""

    def __init__(self, sort: bool):
        super().__init__()
        self.sort = sort
        self.emb = nn.Embedding(20, 6)
        self.lstm = nn.LSTM(6, 5, num_layers=2, bidirectional=True, batch_first=True)
        self.head, self.pooled = nn.Linear(10, 3), nn.Linear(10, 3)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(
            self.emb(tokens), lengths, batch_first=True, enforce_sorted=self.sort
        )
        out, (h, _) = self.lstm(packed)
        out = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])[0]
        return self.head(torch.cat([h[-2], h[-1]], -1)) + self.pooled(out.sum(1) / lengths.unsqueeze(1))


@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
def test_packed_sequences_equal_the_per_example_loop(sort):
    """Each sequence's recurrence stops at its own length (the reverse direction starts there)."""
    torch.manual_seed(0)
    lengths = torch.tensor([7, 6, 4, 4, 2, 1]) if sort else torch.tensor([3, 7, 1, 5, 2, 6])
    tokens = torch.randint(0, 20, (6, 7))
    y = torch.randint(0, 3, (6,))
    check(PackedTagger(sort), (tokens, lengths), y, lambda out, t: F.cross_entropy(out, t, reduction="none"))


def test_a_parameter_used_in_the_loss_is_refused_not_dropped():
    model = nn.Linear(5, 3)
    msg = first_backward_error(model, torch.randn(4, 5), lambda out: out.sum() + model.weight.square().sum())
    assert "'weight' got part of its gradient outside the module calls the stage follows" in msg


def test_embedding_max_norm_and_lstm_projection_are_refused():
    msg = first_backward_error(nn.Embedding(5, 3, max_norm=1.0), torch.randint(0, 5, (4, 2)), lambda out: out.sum())
    assert "max_norm" in msg and "Embedding" in msg
    msg = first_backward_error(
        nn.LSTM(3, 4, proj_size=2, batch_first=True), torch.randn(4, 2, 3), lambda out: out[0].sum()
    )
    assert "proj_size" in msg


def test_a_model_whose_output_merges_the_batch_is_refused_naming_the_parameter():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x.flatten(0, 1))

    hooks = attach(Flat(), dp_rule())
    with pytest.raises(ValueError, match=r"'fc.weight' \(used by fc\) has no module whose forward covers") as err:
        hooks.stage("per_sample").model(torch.randn(4, 5, 3))
    assert "\n" not in str(err.value)


def test_a_part_called_instead_of_the_attached_model_is_refused():
    model = nn.Sequential(nn.Linear(5, 3))
    hooks = attach(model, dp_rule())
    model[0](torch.randn(4, 5)).sum().backward()
    with pytest.raises(ValueError, match="never ran a training forward"):
        hooks.after_backward()


def test_register_form_checks_its_arguments():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_form(int, AffineForm())
    with pytest.raises(TypeError, match="Form instance"):
        register_form(Affine, lambda *a: None)
    assert forms.form_of(Affine(3)).__class__ is AffineForm


def opacus_layers():
    """Every layer type Opacus 1.6 has a grad sampler for, in a small classifier (input, labels)."""
    from opacus.layers import DPGRU, DPLSTM, DPMultiheadAttention

    class Seq(nn.Module):  # Opacus' DP RNN layers and attention return tuples
        def __init__(self, inner, d, pick=lambda out: out[0]):
            super().__init__()
            self.inner, self.head, self.pick = inner, nn.Linear(d, 3), pick

        def forward(self, x):
            return self.head(torch.tanh(self.pick(self.inner(x))).mean(1))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = DPMultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0].mean(1))

    img, sq = torch.randn(4, 2, 6, 6), torch.randn(4, 5, 4)
    return {
        "linear": (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(4, 6)),
        "conv1d": (nn.Sequential(nn.Conv1d(2, 3, 3, stride=2), nn.Flatten(), nn.LazyLinear(3)), torch.randn(4, 2, 9)),
        "conv2d": (nn.Sequential(nn.Conv2d(2, 4, 3, groups=2, padding=1), nn.Flatten(), nn.LazyLinear(3)), img),
        "conv3d": (nn.Sequential(nn.Conv3d(1, 2, 2), nn.Flatten(), nn.LazyLinear(3)), torch.randn(4, 1, 3, 4, 3)),
        "layernorm": (nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 3)), torch.randn(4, 6)),
        "groupnorm": (nn.Sequential(nn.GroupNorm(2, 2), nn.Flatten(), nn.Linear(72, 3)), img),
        "instancenorm": (nn.Sequential(nn.InstanceNorm2d(2, affine=True), nn.Flatten(), nn.Linear(72, 3)), img),
        "embedding": (nn.Sequential(nn.Embedding(9, 4), nn.Flatten(), nn.Linear(20, 3)), torch.randint(0, 9, (4, 5))),
        "dplstm": (Seq(DPLSTM(4, 5, batch_first=True), 5), sq),
        "dpgru": (Seq(DPGRU(4, 5, batch_first=True), 5), sq),
        "dp_attention": (Attn(), torch.randn(4, 5, 8)),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "kind",
    [
        "linear",
        "conv1d",
        "conv2d",
        "conv3d",
        "layernorm",
        "groupnorm",
        "instancenorm",
        "embedding",
        "dplstm",
        "dpgru",
        "dp_attention",
    ],
)
def test_opacus_layers_equal_opacus_and_the_loop(kind):
    opacus = pytest.importorskip("opacus")
    import copy

    torch.manual_seed(0)
    model, x = opacus_layers()[kind]
    model(x)  # lazy layers take their shapes
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    y = torch.randint(0, 3, (4,))
    theirs = copy.deepcopy(model)
    _, max_norm = loop_reference(model, x, y, ce)
    gsm = opacus.GradSampleModule(theirs)
    opt = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=max_norm, expected_batch_size=4
    )
    F.cross_entropy(gsm(x), y).backward()
    opt.pre_step()
    check(model, x, y, ce)  # ours against the loop, to 1e-12
    hooks = attach(model, dp_rule(max_norm))
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()
    for (name, p), q in zip(model.named_parameters(), gsm.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_functional_call_on_a_freshly_attached_model_neither_fails_nor_sets_the_stage_up():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    hooks = attach(model, {**dp_rule(), "c": {"params": "*", "stage": "fused", "transforms": ["zero"]}})
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    x = torch.randn(4, 5)
    torch.func.functional_call(model, params, (x,)).sum().backward()  # no "fully_shard" error
    assert hooks.stage("per_sample").layers is None and all(p.grad is not None for p in params.values())
    ce(model(x), torch.zeros(4, dtype=torch.long)).mean().backward()  # the model's own first forward sets it up
    hooks.after_backward()
    assert len(hooks.stage("per_sample").layers) == 2


def test_replace_batchnorm_gives_groupnorm_over_the_same_channels():
    from gradmod.hooks.per_sample import replace_batchnorm

    model = replace_batchnorm(nn.Sequential(nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48), nn.Sequential(nn.BatchNorm1d(6))))
    assert [
        (type(m).__name__, m.num_groups, m.num_channels) for m in model.modules() if isinstance(m, nn.GroupNorm)
    ] == [("GroupNorm", 16, 48), ("GroupNorm", 2, 6)]
