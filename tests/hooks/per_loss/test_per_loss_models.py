"""Every tensor a per_loss rule claims gets its per-task gradient, on models people use:
attention (``out_proj`` used inside ``F.multi_head_attention_forward``), a Linear whose weight
is also used through ``F.linear``, a tied embedding, an LSTM, tiny HF BERT and GPT-2 built
from configs. One step's ``.grad`` against torchjd 0.18 (``backward`` + ``jac_to_grad``), float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchjd.aggregation as tja  # the reference implementation (a test dependency, torchjd[full])
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode
from torchjd.autojac import backward as tj_backward
from torchjd.autojac import jac_to_grad

import gradmod
from gradmod.hooks.per_loss import stage as per_loss_stage
from gradmod.hooks.per_loss import task_grads as task_grads_module
from gradmod.testing.opcount import OpCounter

B, T, D, V = 4, 5, 8, 11
REFERENCE = {
    "upgrad": tja.UPGrad,
    "mgda": tja.MGDA,
    "pcgrad": tja.PCGrad,
    "imtl_g": tja.IMTLG,
    "aligned_mtl": tja.AlignedMTL,
    "cagrad": lambda: tja.CAGrad(c=0.5),
}
TOL = {"cagrad": 1e-6}  # Clarabel's tolerance on both sides; the rest 1e-10


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(self.emb(x)).mean(1)


class Attend(nn.Module):
    """Self-attention called by keywords, then attention to a memory (key is value)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.selfattn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.selfattn(query=h, key=h, value=h, need_weights=False)[0]
        m = torch.tanh(h)
        return self.cross(h, m, m, need_weights=False)[0].mean(1)


class AttendDefaults(nn.Module):
    """MultiheadAttention as constructed by default (time major, attention weights returned),
    with a padding mask."""

    def __init__(self):
        super().__init__()
        self.emb, self.mha = nn.Embedding(V, D), nn.MultiheadAttention(D, 2)
        self.register_buffer("pad", torch.arange(T).expand(B, T) == T - 1)  # each example's last token

    def forward(self, x):
        h = self.emb(x).transpose(0, 1)  # [T, B, D]
        out, weights = self.mha(h, h, h, key_padding_mask=self.pad)
        return out.mean(0) + weights.mean((1, 2))[:, None]


class Wide(nn.Module):
    """Linears on few rows (4 examples) against their features: the rows' Gram route."""

    def __init__(self):
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(V, D), nn.Linear(D, 64), nn.Linear(64, D)

    def forward(self, x):
        return torch.tanh(self.down(torch.tanh(self.up(self.emb(x).mean(1)))))


class EndsInLinear(Wide):
    """The trunk's output is a Linear's own output (the layer on the rows' route)."""

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.emb(x).mean(1))))


class Convolved(Wide):
    """A convolution over the tokens before the wide Linears (which hold most parameters)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.conv(self.emb(x).transpose(1, 2))).mean(2)
        return torch.tanh(self.down(torch.tanh(self.up(h))))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(V, D), nn.LSTM(D, D, batch_first=True)

    def forward(self, x):
        out, (h, _) = self.lstm(self.emb(x))
        return out.mean(1) + h[0]


class Tied(nn.Module):
    """The decoder's weight is the embedding's."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(V, D), nn.Linear(D, D)
        self.dec = nn.Linear(D, V, bias=False)
        self.dec.weight = self.emb.weight

    def forward(self, x):
        return torch.tanh(self.dec(torch.tanh(self.lin(self.emb(x))))).mean(1)[:, :D]


class BothWays(nn.Module):
    """``lin`` runs as a module and its weight is used again through ``F.linear``."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.lin2 = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.lin(self.emb(x)))
        return torch.tanh(F.linear(self.lin2(h), self.lin.weight)).mean(1)


class Tempered(nn.Module):
    """A learned temperature: a 0-d parameter (as CLIP's ``logit_scale``)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(V, D), nn.Linear(D, D)
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        return torch.tanh(self.lin(self.emb(x).mean(1))) * self.temperature


class Parametrized(nn.Module):
    """Weights computed from their parameters at each forward (torch's parametrizations):
    weight norm, an orthogonal map, spectral norm (whose power iteration updates its buffers)."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

        self.emb = nn.Embedding(V, D)
        self.a, self.b, self.c = (
            weight_norm(nn.Linear(D, D)),
            orthogonal(nn.Linear(D, D)),
            spectral_norm(nn.Linear(D, D)),
        )

    def forward(self, x):
        z = self.emb(x).mean(1)
        for layer in (self.a, self.b, self.c):
            z = torch.tanh(layer(z))
        return z


class Siamese(nn.Module):
    """One encoder run on two halves of each example (a weight used by two calls)."""

    def __init__(self):
        super().__init__()
        self.emb, self.enc = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, x):
        half = x.shape[1] // 2
        left, right = (torch.tanh(self.enc(self.emb(p).mean(1))) for p in (x[:, :half], x[:, half:]))
        return left * right


class HF(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(input_ids=x).last_hidden_state.mean(1)


def bert():
    tf = pytest.importorskip("transformers", reason="transformers is not installed")
    config = tf.BertConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return HF(tf.BertModel(config, add_pooling_layer=False))


def gpt2():
    tf = pytest.importorskip("transformers", reason="transformers is not installed")
    config = tf.GPT2Config(
        vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    config.bos_token_id = config.eos_token_id = 0
    return HF(tf.GPT2Model(config))


class Heads(nn.Module):
    def __init__(self, trunk: nn.Module, k: int = 3):
        super().__init__()
        self.trunk = trunk
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(D, 3) for i in range(k)})

    def forward(self, x):
        z = self.trunk(x)
        return {n: h(z) for n, h in self.heads.items()}


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    return x, {f"t{i}": torch.randint(0, 3, (B,), generator=g) for i in range(3)}


def _losses(model, x, ys):
    out = model(x)
    return {n: F.cross_entropy(out[n], ys[n]) for n in out}


def _torchjd_grads(model, x, ys, aggregator) -> dict[str, torch.Tensor]:
    losses = list(_losses(model, x, ys).values())
    trunk, heads = list(model.trunk.parameters()), list(model.heads.parameters())
    head_grads = torch.autograd.grad(sum(losses), heads, retain_graph=True)
    tj_backward(losses, inputs=trunk)
    torch.manual_seed(5)
    jac_to_grad(trunk, aggregator)
    for p, g in zip(heads, head_grads):
        p.grad = g
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(make, name: str, heads: bool = True) -> gradmod.hooks.HookSet:
    torch.manual_seed(1)
    model = (Heads(make()) if heads else make()).double()
    x, ys = _batch()
    expected = _torchjd_grads(copy.deepcopy(model), x, ys, REFERENCE[name]())
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [name]}})
    hooks.stage("per_loss").generator.manual_seed(5)
    hooks.backward(_losses(model, x, ys))
    scale = max(g.abs().max() for g in expected.values())
    tol = TOL.get(name, 1e-10) * float(scale)
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} got no gradient"
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=tol, msg=n)
    return hooks


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_a_0d_parameter_equals_torchjd(name):
    """A 0-d parameter's k task gradients are k numbers: one column of the Jacobian."""
    hooks = _compare(Tempered, name)
    assert hooks.stage("per_loss").model.trunk.temperature.grad.dim() == 0


class Penalty(nn.Module):
    """A module whose output is a loss itself (a 0-d tensor)."""

    def forward(self, z):
        return z.pow(2).mean()


class Penalised(Heads):
    def __init__(self):
        super().__init__(Wide(), k=2)
        self.penalty = Penalty()

    def forward(self, x):
        out = super().forward(x)
        return {**out, "t2": self.penalty(self.trunk(x))}


@pytest.mark.parametrize("rows", ["examples", "batch"])
def test_a_modules_rule_on_a_0d_output_equals_the_reference(rows, monkeypatch):
    """The module's output is one loss (a 0-d tensor): its k task gradients are k numbers (the
    loss's own is 1, the others' 0), aggregated by torchjd and pushed down; the other
    parameters get the gradient of the sum. Both routes: the one backward refuses it (no node
    hands the output its gradient), each loss's pass takes it."""
    torch.manual_seed(1)
    model = Penalised().double()
    x, ys = _batch()

    def losses(m):
        out = m(x)
        return {**{n: F.cross_entropy(out[n], ys[n]) for n in ("t0", "t1")}, "t2": out["t2"]}

    ref = copy.deepcopy(model)
    L = losses(ref)
    pen = L["t2"]
    Jz = torch.stack(
        [
            torch.autograd.grad(loss, pen, retain_graph=True, allow_unused=True)[0]
            if loss is pen
            else torch.zeros((), dtype=pen.dtype)
            for loss in L.values()
        ]
    )
    agg = REFERENCE["upgrad"]()(Jz[:, None])[0]  # batch rows of a 0-d output: the same one column
    others = [p for p in ref.parameters()]
    plain = torch.autograd.grad(L["t0"] + L["t1"], others, retain_graph=True, allow_unused=True)
    through = torch.autograd.grad(pen, others, grad_outputs=agg, allow_unused=True)
    expected = [a if b is None else b if a is None else a + b for a, b in zip(plain, through)]
    hooks = gradmod.attach(
        model, {"rep": {"modules": "penalty", "stage": "per_loss", "transforms": ["upgrad"], "rows": rows}}
    )
    hooks.backward(losses(model))
    for (n, p), e in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_transformer_encoder_trunk_equals_torchjd(name):
    hooks = _compare(Encoder, name)
    answered = {id(p) for layer in hooks.stage("per_loss").layers for p in layer.module.parameters(recurse=False)}
    attn = hooks.stage("per_loss").model.trunk.enc.layers[0].self_attn
    assert id(attn.out_proj.weight) not in answered  # used inside F.multi_head_attention_forward
    assert id(hooks.stage("per_loss").model.trunk.enc.layers[0].linear1.weight) in answered  # a plain Linear call


@pytest.mark.parametrize(
    "make", [Encoder, Attend, AttendDefaults], ids=["encoder", "keywords_and_memory", "defaults_with_padding"]
)
def test_attention_projects_query_key_and_value_apart_without_zero_buffers(make, monkeypatch):
    """Given one tensor as query and key (or key and value), MultiheadAttention projects it
    in one matmul and takes q, k, v apart by indexing, whose backward zero-fills the whole
    projection per task; under a per_loss rule it gets aliases and projects them apart:
    equal to torchjd, and no zero-filled buffer in the stage's backward."""

    def zeros_in_second_backward(hooks) -> int:
        model = hooks.stage("per_loss").model
        x, ys = _batch(1)
        hooks.backward(_losses(model, x, ys))  # the first backward traced the forward
        with OpCounter() as ops:
            hooks.backward(_losses(model, x, ys))
        hooks.remove()
        return ops.by_op["aten.zeros.default"] + ops.by_op["aten.select_backward.default"]  # batched, k passes

    assert zeros_in_second_backward(_compare(make, "upgrad")) == 0
    monkeypatch.setattr(per_loss_stage, "split_in_projections", lambda model, owned: [])
    assert zeros_in_second_backward(_compare(make, "upgrad")) > 0  # torch's packed path: the buffers avoided


@pytest.mark.parametrize(
    "make, batched", [(Wide, True), (Encoder, False), (Convolved, False)], ids=["wide", "encoder", "convolved"]
)
def test_one_batched_backward_where_the_rows_route_holds_most_parameters_else_k_passes(make, batched, monkeypatch):
    """The Linears on few rows take their task gradients' Gramian from their k output
    gradients, which one batched backward gives; a trunk whose tensors need their own k
    gradients (attention, Linears on many token rows), or a convolution, takes k ordinary
    passes."""
    seen = []
    real = per_loss_stage.task_grads
    monkeypatch.setattr(
        per_loss_stage, "task_grads", lambda *a, batched, **kw: seen.append(batched) or real(*a, batched=batched, **kw)
    )
    hooks = _compare(make, "upgrad")  # equal to torchjd either way
    x, ys = _batch(1)
    hooks.backward(_losses(hooks.stage("per_loss").model, x, ys))
    assert seen == [batched, batched]


class Around(Heads):
    """A head that also reads the trunk other than through its output: a trunk weight used
    by the head, or a trunk module called again outside the trunk."""

    def __init__(self, way: str):
        super().__init__(Wide())
        self.way = way

    def forward(self, x):
        z = self.trunk(x)
        out = {n: h(z) for n, h in self.heads.items()}
        if self.way == "weight":
            out["t0"] = out["t0"] + F.linear(z, self.trunk.up.weight)[:, :3]
        elif self.way == "module":
            out["t1"] = out["t1"] + self.trunk.emb(x).mean(1)[:, :3]
        elif self.way == "detached":  # only through the output after all: the frontier serves
            out["t2"] = out["t2"] + self.trunk.emb.weight.detach()[:4, :3]
        return out


@pytest.mark.parametrize("way, through", [("weight", False), ("module", False), ("detached", True)])
def test_the_batched_backward_starts_at_the_trunks_output_only_where_every_path_runs_through_it(
    way, through, monkeypatch
):
    """Each loss goes down its own head to the trunk's output, and the k gradients found there
    go down the trunk in one batched pass, only where no path from a loss reaches the rule's
    tensors around that output; the gradients equal torchjd's either way."""
    calls = []
    real = task_grads_module.task_grads_through
    monkeypatch.setattr(task_grads_module, "task_grads_through", lambda *a: calls.append(1) or real(*a))
    hooks = _compare(lambda: Around(way), "upgrad", heads=False)
    assert hooks.stage("per_loss").batched and bool(calls) is through


class Stemmed(Heads):
    """The trunk reads an embedding outside it: below the trunk's output, a tensor outside
    a ``trunk.*`` rule gets a gradient too."""

    def __init__(self):
        super().__init__(nn.Sequential(nn.Linear(D, D), nn.Tanh()))
        self.stem = nn.Embedding(V, D)

    def forward(self, x):
        z = self.trunk(self.stem(x).mean(1))
        return {n: h(z) for n, h in self.heads.items()}


class PooledOutside(Heads):
    """The trunk gives a sequence and the model pools it: every loss reaches the trunk through
    one pooling op, which none of them owns."""

    def __init__(self):
        super().__init__(nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.Tanh()))

    def forward(self, x):
        z = self.trunk(x).mean(1)
        return {n: h(z) for n, h in self.heads.items()}


class SharedHead(Heads):
    """One head's output enters two losses."""

    def __init__(self):
        super().__init__(Wide())

    def forward(self, x):
        out = super().forward(x)
        return {**out, "t1": out["t1"] + out["t0"]}


class Fixed(gradmod.Method):
    """A loss weighting of given weights."""

    kind = "losses"

    def __init__(self, weights: list[float]):
        self.given = weights

    def loss_weights(self, losses, gen):
        return torch.tensor(self.given, dtype=losses.dtype)


class FixedList(Fixed):
    """The same weights as host floats (a loss weighting may give a list)."""

    def loss_weights(self, losses, gen):
        return list(self.given)


@pytest.mark.parametrize("params", ["trunk.*", "*"])
def test_a_loss_weighting_may_give_host_floats_and_must_give_one_per_loss(params):
    """A list of weights gives the tensor's bits; a count other than the losses' is refused in one line."""
    grads = []
    for cls in (Fixed, FixedList):
        gradmod.register("fixed_weights_test", cls, overwrite=True)  # for this test only (conftest)
        torch.manual_seed(1)
        model = Heads(Wide()).double()
        x, ys = _batch()
        hooks = gradmod.attach(
            model, {"w": {"params": params, "transforms": [{"name": "fixed_weights_test", "weights": [0.5, 3.0, 2.0]}]}}
        )
        hooks.backward(_losses(model, x, ys))
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    hooks.remove()
    hooks = gradmod.attach(
        model, {"w": {"params": params, "transforms": [{"name": "fixed_weights_test", "weights": [0.5, 2.0]}]}}
    )
    with pytest.raises(
        ValueError,
        match=r"^hooks\.w: per_loss method 'fixed_weights_test' gave 2 loss weights for 3 losses; give one per loss$",
    ):
        hooks.backward(_losses(model, x, ys))


@pytest.mark.parametrize(
    "make, params, one",
    [
        (lambda: Heads(Wide()), "trunk.*", True),
        (lambda: Heads(Encoder()), "trunk.*", True),
        (lambda: Heads(Recurrent()), "trunk.*", True),
        (lambda: Heads(bert()), "trunk.*", True),
        (lambda: Heads(gpt2()), "trunk.*", True),
        (PooledOutside, "trunk.*", True),
        (lambda: Around("weight"), "trunk.*", True),
        (lambda: Heads(Wide()), ["trunk.*", "heads.t0.*"], True),
        (SharedHead, ["trunk.*", "heads.t0.*"], True),
        (Stemmed, "trunk.*", False),
        (SharedHead, "trunk.*", False),
    ],
    ids=[
        "wide",
        "encoder",
        "lstm",
        "hf_bert",
        "hf_gpt2",
        "pooled_outside",
        "head_reads_a_trunk_weight",
        "a_head_in_the_rule",
        "the_shared_head_in_the_rule",
        "stem_outside",
        "shared_head",
    ],
)
@pytest.mark.parametrize("name", ["random", "famo", "geometric_mean", "zero_weight"])
def test_a_loss_weighting_takes_one_backward_where_one_loss_alone_reaches_each_other_tensor(make, params, one, name):
    """The rule's tensors the weighted sum's gradient, every other parameter the plain sum's:
    in one backward (each loss's log-softmax backward runs once) where each other tensor is
    reached by one loss alone (it gets ``w_i`` times its gradient, divided back), else two
    (the plain sum's for the rest): a stem below the trunk, a head two losses share, a zero
    weight. Against autograd of both sums, float64."""
    torch.manual_seed(1)
    model = make().double()
    x, ys = _batch()
    method = {"name": "fixed", "weights": [0.5, 0.0, 2.0]} if name == "zero_weight" else name
    hooks = gradmod.attach(model, {"w": {"params": params, "transforms": [method]}})
    with OpCounter() as ops:
        hooks.backward(_losses(model, x, ys))
    passes = ops.by_op["aten._log_softmax_backward_data.default"]  # 3 a pass, fewer for a restricted one
    assert passes == 3 if one and name != "zero_weight" else passes > 3
    stats = hooks.read_stats()[f"w/{method if isinstance(method, str) else method['name']}"]
    w = torch.tensor([stats[f"weight/t{i}"] for i in range(3)], dtype=torch.float64)
    assert not torch.allclose(w, w[0].expand(3))  # the weights differ: a plain sum would not pass
    L = torch.stack(list(_losses(model, x, ys).values()))
    named = dict(model.named_parameters())
    mine = [
        n for n in named if any(n.startswith(q.rstrip("*")) for q in ([params] if isinstance(params, str) else params))
    ]
    rest = [n for n in named if n not in mine]
    expected = dict(zip(mine, torch.autograd.grad((w * L).sum(), [named[n] for n in mine], retain_graph=True)))
    expected |= dict(zip(rest, torch.autograd.grad(L.sum(), [named[n] for n in rest])))
    for n, p in named.items():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-12, atol=1e-14, msg=n)


def _output_task_grads(model, x, ys) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The trunk's output ``z``, the losses, and each loss's gradient of ``z`` (its own pass)."""
    seen = []
    handle = model.trunk.register_forward_hook(lambda m, args, out: seen.append(out))
    losses = list(_losses(model, x, ys).values())
    handle.remove()
    (z,) = seen
    return z, losses, torch.stack([torch.autograd.grad(loss, z, retain_graph=True)[0] for loss in losses])


def _pushed_down(model, z, losses, agg) -> dict[str, torch.Tensor]:
    """``agg`` down the trunk from ``z``; the heads the gradient of the sum."""
    heads = list(model.heads.parameters())
    head_grads = torch.autograd.grad(sum(losses), heads, retain_graph=True)
    z.backward(agg)
    for p, g in zip(heads, head_grads):
        p.grad = g
    return {n: p.grad for n, p in model.named_parameters()}


def _modules_reference(model, x, ys, name: str, rows: str) -> dict[str, torch.Tensor]:
    """The task gradients of the trunk's output, aggregated by torchjd (rows ``batch``:
    LibMTL's rep_grad, the weights of the batch-summed gradients' Gramian), pushed down the
    trunk; the heads the gradient of the sum."""
    z, losses, Jz = _output_task_grads(model, x, ys)
    torch.manual_seed(5)
    if rows == "batch":
        S = Jz.sum(1).flatten(1)
        w = REFERENCE[name]().gramian_weighting(S @ S.T)
        agg = torch.tensordot(w, Jz, 1)
    else:
        agg = REFERENCE[name]()(Jz.flatten(1)).view_as(z)
    return _pushed_down(model, z, losses, agg)


@pytest.mark.parametrize(
    "make, one",
    [
        (lambda: Heads(Wide()), True),
        (lambda: Heads(Encoder()), True),
        (lambda: Heads(Recurrent()), True),
        (lambda: Heads(bert()), True),
        (lambda: Heads(gpt2()), True),
        (PooledOutside, False),
        (SharedHead, False),
    ],
    ids=["wide", "encoder", "lstm", "hf_bert", "hf_gpt2", "pooled_outside", "shared_head"],
)
@pytest.mark.parametrize("name, rows", [("upgrad", "examples"), ("mgda", "examples"), ("upgrad", "batch")])
def test_a_modules_rule_takes_one_backward_where_each_loss_has_a_head_of_its_own(make, one, name, rows):
    """The trunk's output's k task gradients are caught where each head hands them on, in
    the one backward of the sum (each loss's log-softmax backward runs once), where one loss
    alone reaches each node that takes the output in; else each loss's own pass to it (a
    pooling every head shares, a head two losses read). Against the hand-written reference
    with torchjd's aggregators, float64."""
    torch.manual_seed(1)
    model = make().double()
    x, ys = _batch()
    expected = _modules_reference(copy.deepcopy(model), x, ys, name, rows)
    rule = {"modules": "trunk", "stage": "per_loss", "transforms": [name], "rows": rows}
    hooks = gradmod.attach(model, {"rep": rule})
    with OpCounter() as ops:
        hooks.backward(_losses(model, x, ys))
    passes = ops.by_op["aten._log_softmax_backward_data.default"]
    assert passes == 3 if one else passes > 3
    scale = max(g.abs().max() for g in expected.values())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-10 * float(scale), msg=n)
    assert hooks.read_stats()[f"rep/{name}"]["calls"] == 1


def _graddrop_batch_reference(model, x, ys, seed: int, leak: float) -> dict[str, torch.Tensor]:
    """GradDrop as its authors and LibMTL apply it to a representation ``z`` [B, F]: each
    task's gradient of ``z`` times ``sign(z)``, summed over the batch, gives each feature's
    sign purity ``P``; one uniform draw per feature keeps, for every example, the tasks whose
    summed sign it picks (a ``leak`` of the rest); the heads the gradient of the sum."""
    z, losses, Jz = _output_task_grads(model, x, ys)  # [k, B, F]
    S = (Jz * z.detach().sign()).sum(1)
    P = 0.5 * (1 + S.sum(0) / (S.abs().sum(0) + 1e-7))
    U = torch.rand(P.shape, generator=torch.Generator().manual_seed(seed), dtype=z.dtype)
    keep = ((P > U) & (S > 0)) | ((P < U) & (S < 0))  # [k, F]
    return _pushed_down(model, z, losses, (Jz * (leak + (1 - leak) * keep.unsqueeze(1).to(z.dtype))).sum(0))


@pytest.mark.parametrize(
    "make", [lambda: Heads(Wide()), lambda: Heads(Encoder()), lambda: Heads(Recurrent()), PooledOutside]
)
@pytest.mark.parametrize("leak", [None, 0.25])
def test_graddrop_with_batch_rows_is_the_authors_form_on_a_representation(make, leak):
    """``rows: batch`` on a modules rule: GradDrop's purity per feature from the batch sums of
    the signed task gradients (the paper, LibMTL), not per coordinate of each example; against
    the hand-written reference, float64, one backward of the sum or each loss's pass."""
    torch.manual_seed(1)
    model = make().double()
    x, ys = _batch()
    expected = _graddrop_batch_reference(copy.deepcopy(model), x, ys, seed=3, leak=leak or 0.0)
    method = "graddrop" if leak is None else {"name": "graddrop", "leak": [leak] * 3}
    got = {}
    for rows in ("batch", "examples"):
        twin = copy.deepcopy(model)
        hooks = gradmod.attach(
            twin, {"rep": {"modules": "trunk", "stage": "per_loss", "transforms": [method], "rows": rows}}
        )
        hooks.stage("per_loss").generator.manual_seed(3)
        hooks.backward(_losses(twin, x, ys))
        got[rows] = dict(twin.named_parameters())
    for n in expected:
        torch.testing.assert_close(got["batch"][n].grad, expected[n], rtol=1e-12, atol=1e-14, msg=n)
    assert any(not torch.allclose(got["examples"][n].grad, expected[n]) for n in expected if n.startswith("trunk"))


def test_rows_are_for_a_gramian_method_or_graddrop():
    with pytest.raises(
        ValueError, match=r"^hooks\.rep\.rows: only a Gramian method or graddrop has rows; 'famo' is 'losses'$"
    ):
        gradmod.attach(
            Heads(Wide()), {"rep": {"modules": "trunk", "stage": "per_loss", "transforms": ["famo"], "rows": "batch"}}
        )


@pytest.mark.parametrize("name", ["upgrad", "graddrop", "mean"])
def test_a_modules_rule_under_bf16_autocast_hands_its_output_a_bf16_gradient(name, monkeypatch):
    """Under CPU autocast the trunk's output is bfloat16 and the Gramian runs in float32: the
    aggregate goes back to bfloat16 for the output's hook (a hook may not change the type).
    The one backward and each loss's pass agree (a loss weighting's to bfloat16's rounding:
    its sum of the caught gradients and autograd's of the weighted ones round apart), and
    both near the float32 step."""

    def grads(dtype):
        torch.manual_seed(1)
        model = Heads(Wide())
        hooks = gradmod.attach(model, {"rep": {"modules": "trunk", "stage": "per_loss", "transforms": [name]}})
        hooks.stage("per_loss").generator.manual_seed(2)
        x, ys = _batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            out = model(x)
        hooks.backward({n: F.cross_entropy(out[n].float(), ys[n]) for n in out})
        return [p.grad for p in model.parameters()]

    one = grads(torch.bfloat16)
    monkeypatch.setattr(per_loss_stage, "head_edges", lambda losses, out: None)  # each loss's own pass
    for a, b, c in zip(one, grads(torch.bfloat16), grads(torch.float32)):
        if name == "mean":
            torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * float(b.abs().max()))
        else:
            assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0.05, atol=0.05 * float(c.abs().max()))


@pytest.mark.parametrize("method", ["fixed", "mean", "random", "famo", "upgrad", "modules"])
def test_micro_batches_accumulate_each_ones_gradient(method):
    """Two backward calls before a step (gradient accumulation): ``.grad`` holds the sum of
    what each call gives alone, a loss weighting's scaled and divided-back parameters too
    (scaled as their gradient arrives, ``.grad`` being taken)."""
    rule = {"params": "trunk.*", "transforms": [method]}
    if method == "fixed":
        rule["transforms"] = [{"name": "fixed", "weights": [0.5, 1.5, 3.0]}]
    elif method == "modules":
        rule = {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]}
    torch.manual_seed(1)
    model = Heads(Wide()).double()
    alone = copy.deepcopy(model)
    hooks, hooks_alone = gradmod.attach(model, {"w": rule}), gradmod.attach(alone, {"w": rule})
    expected = [torch.zeros_like(p) for p in alone.parameters()]
    for seed in (0, 1):
        x, ys = _batch(seed)
        hooks.backward(_losses(model, x, ys))
        alone.zero_grad(set_to_none=True)
        hooks_alone.backward(_losses(alone, x, ys))
        expected = [e + p.grad for e, p in zip(expected, alone.parameters())]
    for (n, p), e in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-14, msg=n)


def test_the_frontier_is_the_called_module_above_a_list_of_layers():
    """A TransformerEncoder's parameters all lie in its ``layers`` (a ModuleList, never called):
    the frontier is the encoder, whose outputs exist."""
    from gradmod.hooks.per_loss.saved import frontier_module

    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    model = Heads(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    assert frontier_module(model, list(model.trunk.parameters())) is model.trunk
    assert frontier_module(model, list(model.trunk.layers[1].parameters())) is model.trunk.layers[1]


def test_the_heads_run_once_per_task_in_the_batched_backward(monkeypatch):
    """Ten heads: from the trunk's output down, each head's backward runs for its own task
    alone, where a batched backward from the losses runs each head for all ten rows (nine of
    them zero); flops counted by torch's FlopCounterMode, the gradients the same."""
    torch.manual_seed(0)
    model = Heads(Wide(), k=10).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    ys = {n: torch.randint(0, 3, (B,), generator=g) for n in model.heads}

    def step_flops() -> tuple[int, list[torch.Tensor]]:
        m = copy.deepcopy(model)
        hooks = gradmod.attach(m, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
        hooks.backward(_losses(m, x, ys))  # the first backward traces the forward
        m.zero_grad()
        with FlopCounterMode(display=False) as flops:
            hooks.backward(_losses(m, x, ys))
        return flops.get_total_flops(), [p.grad for p in m.parameters()]

    through, grads = step_flops()
    monkeypatch.setattr(task_grads_module, "reached", lambda *a: None)
    around, expected = step_flops()
    head_input_grads = 10 * (10 - 1) * B * 3 * D * 2  # the zero rows' matmuls through the heads
    assert around - through >= head_input_grads, (around, through)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "make",
    [Recurrent, Tied, BothWays, Wide, EndsInLinear, Parametrized, Siamese],
    ids=["lstm", "tied", "both_ways", "wide", "ends_in_linear", "parametrized", "siamese"],
)
@pytest.mark.parametrize("name", ["upgrad", "pcgrad", "cagrad"])
def test_rnn_tied_and_functional_weights_equal_torchjd(make, name):
    _compare(make, name)


@pytest.mark.parametrize("make", [bert, gpt2], ids=["bert", "gpt2"])
@pytest.mark.parametrize("name", ["upgrad", "mgda"])
def test_hf_trunks_from_configs_equal_torchjd(make, name):
    _compare(make, name)


def test_a_linear_used_both_ways_moves_under_pcgrad_in_the_trainer_loop():
    """The weight used through ``F.linear`` too: answered directly, never left without gradient."""
    torch.manual_seed(2)
    model = Heads(BothWays()).double()
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["pcgrad"]}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.trunk.lin.weight.detach().clone()
    for step in range(2):
        x, ys = _batch(step)
        opt.zero_grad()
        hooks.backward(_losses(model, x, ys))
        opt.step()
    assert not torch.equal(model.trunk.lin.weight, before)
    assert all(layer.module is not model.trunk.lin for layer in hooks.stage("per_loss").layers)


def test_lstm_modules_rule_aggregates_every_output_including_the_state():
    """A ``modules:`` rule on an LSTM: its output and its (h, c) are the representation; the
    task gradients of all of them aggregated (torchjd on the joined rows), none left plain."""
    torch.manual_seed(3)
    model = Heads(Recurrent()).double()
    x, ys = _batch()
    ref = copy.deepcopy(model)
    emb = ref.trunk.emb(x)
    out, (h, c) = ref.trunk.lstm(emb)
    z = out.mean(1) + h[0]
    losses = [F.cross_entropy(head(z), ys[n]) for n, head in ref.heads.items()]
    rows = torch.stack(
        [torch.cat([g.flatten() for g in torch.autograd.grad(L, [out, h], retain_graph=True)]) for L in losses]
    )
    agg = tja.UPGrad()(rows)
    heads = list(ref.heads.parameters())
    head_grads = torch.autograd.grad(sum(losses), heads, retain_graph=True)
    torch.autograd.backward([out, h], [agg[: out.numel()].view_as(out), agg[out.numel() :].view_as(h)])
    for p, g in zip(heads, head_grads):
        p.grad = g
    hooks = gradmod.attach(model, {"rep": {"modules": "trunk.lstm", "stage": "per_loss", "transforms": ["upgrad"]}})
    hooks.backward(_losses(model, x, ys))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_inside_the_trunk(reentrant):
    """Non-reentrant checkpointing: the same gradients as torchjd's; reentrant checkpointing,
    which refuses torch.autograd.grad, is refused in one line naming what works."""

    class Checkpointed(Wide):
        def forward(self, x):
            body = lambda h: torch.tanh(self.down(torch.tanh(self.up(h))))  # noqa: E731
            return checkpoint(body, self.emb(x).mean(1), use_reentrant=reentrant)

    if not reentrant:
        _compare(Checkpointed, "upgrad")
        return
    model = Heads(Checkpointed()).double()
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    x, ys = _batch()
    with pytest.raises(ValueError, match=r"hooks\.mtl: .*use_reentrant=True; checkpoint with use_reentrant=False") as e:
        hooks.backward(_losses(model, x, ys))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_loss_weighting_across_a_reentrant_checkpoint_is_refused_not_wrong(reentrant):
    """A reentrant checkpoint builds its segment's graph in the backward, so the graph cannot
    show that a tensor outside the rule (``trunk.0``, excluded) lies below the losses' joins:
    refused in one line, not given the weighted sum's gradient in one backward. Non-reentrant:
    the graph shows it, so two backward passes, the plain sum's gradient on ``trunk.0``."""

    class Segment(Heads):
        def __init__(self):
            super().__init__(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh()))
            self.stem = nn.Embedding(V, D)

        def forward(self, x):
            z = checkpoint(self.trunk, self.stem(x).mean(1), use_reentrant=reentrant)
            return {n: h(z) for n, h in self.heads.items()}

    torch.manual_seed(1)
    model = Segment().double()
    x, ys = _batch()
    rule = {"params": ["stem.*", "trunk.*"], "exclude": "trunk.0.*", "transforms": ["random"]}
    hooks = gradmod.attach(model, {"w": rule})
    if reentrant:
        with pytest.raises(ValueError, match=r"hooks\.w: .*use_reentrant=True; checkpoint with use_reentrant=False"):
            hooks.backward(_losses(model, x, ys))
        return
    with OpCounter() as ops:
        hooks.backward(_losses(model, x, ys))
    assert ops.by_op["aten._log_softmax_backward_data.default"] == 6
    stats = hooks.read_stats()["w/random"]
    w = torch.tensor([stats[f"weight/t{i}"] for i in range(3)], dtype=torch.float64)
    L = torch.stack(list(_losses(model, x, ys).values()))
    inside = [model.stem.weight, model.trunk[2].weight, model.trunk[2].bias]
    outside = [model.trunk[0].weight, model.trunk[0].bias, *model.heads.parameters()]
    for p, g in zip(inside, torch.autograd.grad((w * L).sum(), inside, retain_graph=True)):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    for p, g in zip(outside, torch.autograd.grad(L.sum(), outside)):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)


def test_a_sparse_embedding_is_refused_in_one_line():
    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D, sparse=True)

        def forward(self, x):
            return self.emb(x).mean(1)

    with pytest.raises(ValueError, match=r"hooks\.mtl: 'trunk\.emb\.weight' has sparse gradients") as e:
        gradmod.attach(Heads(Sparse()), {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    assert "\n" not in str(e.value)


def test_the_trace_leaves_batchnorm_statistics_and_the_random_state_alone():
    torch.manual_seed(4)
    trunk = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.5))
    model, ref = Heads(trunk).double(), None
    ref = copy.deepcopy(model)
    x = torch.randn(B, D, dtype=torch.float64)
    gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    torch.manual_seed(9)
    out = model(x)
    torch.manual_seed(9)
    expected = ref(x)
    for n in out:
        torch.testing.assert_close(out[n], expected[n], rtol=0, atol=0)
    torch.testing.assert_close(model.trunk[1].running_mean, ref.trunk[1].running_mean, rtol=0, atol=0)
    assert int(model.trunk[1].num_batches_tracked) == 1


class Counting(nn.Module):
    """A running count and mean set by assignment (new buffer tensors each forward), and the
    input scaled in place, as a forward may do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(D, dtype=torch.float64))
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        self.seen = self.seen + 1
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        x /= 2.0
        return torch.tanh(self.lin(x))


def test_the_trace_leaves_reassigned_buffers_and_the_inputs_alone():
    """The first training forward's trace runs the model once more: buffers the forward sets
    by assignment are put back (they kept the trace's update, counted twice), and inputs it
    changes in place are the caller's again for the forward itself (the step's outputs were
    those of an input scaled twice)."""
    torch.manual_seed(4)
    model = Heads(Counting()).double()
    ref = copy.deepcopy(model)
    x = torch.randn(B, D, dtype=torch.float64)
    gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    mine, theirs = x.clone(), x.clone()
    out, expected = model(mine), ref(theirs)
    for n in out:
        torch.testing.assert_close(out[n], expected[n], rtol=0, atol=0)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert float(model.trunk.seen) == 1.0
    torch.testing.assert_close(model.trunk.mean, ref.trunk.mean, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["upgrad", "imtl_g"])
def test_a_loss_on_the_weights_themselves_equals_torchjd(name):
    """One loss is a penalty on the trunk's weights (an L2 term): it uses them outside the
    model's forward, where the first forward's trace cannot see it, so a Linear on the rows'
    route takes that step's task gradients directly (its rows' Gram held only the part
    through its output: the penalty's gradient was lost, and every weight with it)."""
    torch.manual_seed(1)
    model = Heads(Wide()).double()
    x, ys = _batch()

    def losses(m):
        return {**_losses(m, x, ys), "l2": 0.01 * sum(p.pow(2).sum() for p in m.trunk.parameters())}

    ref = copy.deepcopy(model)
    tasks = list(losses(ref).values())
    trunk, heads = list(ref.trunk.parameters()), list(ref.heads.parameters())
    head_grads = torch.autograd.grad(sum(tasks), heads, retain_graph=True)
    tj_backward(tasks, inputs=trunk)
    jac_to_grad(trunk, REFERENCE[name]())
    for p, g in zip(heads, head_grads):
        p.grad = g
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [name]}})
    hooks.backward(losses(model))
    assert hooks.stage("per_loss").layers  # the rows' route is taken on the steps without such a loss
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10 * scale, msg=n)
