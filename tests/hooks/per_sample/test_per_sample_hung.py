"""A rule that keeps autograd's gradient (``scores``, ``log``): after the first backward its
layers run on detached weights and each output hangs from them, so the call gives their
gradient through autograd (the sum of the per-example ones where it forms them, else the
batch's). Checked in float64 against an untouched copy (the batch gradient) and one autograd
gradient per example (GraNd), on convolutions, Linear layers over sequences, a small Embedding
and GPT-2's Conv1D; autograd's batch weight gradient is not computed besides; parameter hooks
still fire; a batch that makes per-example tensors the dearer way still gets its gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradmod.hooks import attach
from gradmod.hooks.per_sample import stage as stage_module
from gradmod.hooks.per_sample.forms import layers
from gradmod.models import MnistCNN

SCORES = {"s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}}
VOCAB, T = 11, 16


class SeqNet(nn.Module):
    """A small Embedding (its table smaller than the tokens' Gram matrix) and Linear layers over
    each example's positions: all form per-example gradients."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.mix = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx)))).mean(1)


def _gpt2() -> nn.Module:
    tf = pytest.importorskip("transformers", reason="the model is built from transformers' config")
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=T,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = tf.GPT2LMHeadModel(cfg)

        def forward(self, idx):
            return self.hf(input_ids=idx).logits.mean(1)[:, :3]

    return Logits()


def _per_example_norms(ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = [p for p in ref.parameters() if p.requires_grad]
    norms = []
    for i in range(len(x)):
        g = torch.autograd.grad(F.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]), params, allow_unused=True)
        norms.append(sum(v.square().sum() for v in g if v is not None).sqrt())
    return torch.stack(norms)


@pytest.fixture
def hung(monkeypatch) -> list[int]:
    """Outputs hung from their layer's weights, counted per forward (``hung.append(0)`` starts one)."""
    counts: list[int] = [0]
    real = stage_module.hang

    def counting(out, params, sums):
        counts[-1] += 1
        real(out, params, sums)

    monkeypatch.setattr(stage_module, "hang", counting)
    return counts


def check_steps(model: nn.Module, inputs, hung: list[int], steps: int = 3) -> list[int]:
    """Each step's gradients equal the copy's, GraNd the per-example loop's; returns each step's
    number of hung outputs."""
    model = model.double().train()
    ref = copy.deepcopy(model)
    hooks = attach(model, SCORES)
    stage = hooks.stage("per_sample")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    expected = []
    for step in range(steps):
        x, y = inputs(), torch.randint(0, 3, (5,))
        expected.append(_per_example_norms(ref, x, y))
        ref.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()
        stage.see_batch(torch.arange(5) + 5 * step, y)
        hung.append(0)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        hooks.after_backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=f"step {step}, {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    grand = stage.take_scores()["grand"]
    torch.testing.assert_close(grand, torch.cat(expected), rtol=1e-9, atol=1e-12)
    hooks.remove()
    return hung[1:]


def test_convolutions_hang_after_the_first_backward_and_stay_right(hung):
    torch.manual_seed(0)
    # conv1 and conv2 form per-example weights, l1 takes |a_i||b_i|: all three give their gradients
    assert check_steps(MnistCNN(), lambda: torch.randn(5, 1, 28, 28, dtype=torch.float64), hung) == [0, 3, 3]


def test_an_embedding_and_linear_layers_over_sequences_hang_and_stay_right(hung):
    torch.manual_seed(0)
    assert check_steps(SeqNet(), lambda: torch.randint(0, VOCAB, (5, T)), hung) == [0, 3, 3]


class Twice(nn.Module):
    """One Linear called twice in a forward: autograd adds the two calls' gradients."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


def test_a_layer_called_twice_gives_both_calls_gradients_and_passes_the_probe(hung):
    """Two hung calls of one layer: the gradient autograd adds up is no call's own tensor, so
    the probe compares it with the calls' sum along its direction, and nothing is refused."""
    torch.manual_seed(0)
    assert check_steps(Twice(), lambda: torch.randn(5, 6, dtype=torch.float64), hung) == [0, 3, 3]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gpt2s_conv1d_layers_hang_and_stay_right(hung):
    torch.manual_seed(0)
    counts = check_steps(_gpt2(), lambda: torch.randint(0, VOCAB, (5, T)), hung)
    assert counts == [0, 4, 4]  # c_attn, c_proj, c_fc and the MLP's c_proj (lm_head shares wte: attached)


class BatchWeightGrads(TorchDispatchMode):
    """The weight shapes of the convolution backwards that compute a weight gradient."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default and args[-1][1]:
            self.shapes.append(tuple(args[2].shape))
        return func(*args, **(kwargs or {}))


def test_a_later_step_computes_no_batch_weight_gradient_of_a_hung_convolution():
    """The per-example weights (one grouped kernel, or a matmul for conv1's one channel) replace
    autograd's batch weight gradients of the hung layers."""
    torch.manual_seed(0)
    model, x, y = MnistCNN(), torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    hooks = attach(model, SCORES)
    runs = []
    for _ in range(2):
        with BatchWeightGrads() as seen:
            hooks.stage("per_sample").see_batch(torch.arange(16), y)
            F.cross_entropy(model(x), y).backward()
            hooks.after_backward()
        runs.append(sorted(seen.shapes))
    conv1, conv2 = tuple(model.conv1.weight.shape), tuple(model.conv2.weight.shape)
    grouped = (16 * conv2[0], *conv2[1:])  # every example's conv2 weight at once
    assert runs[0] == sorted([conv1, conv2, grouped])  # autograd's, and the stage's per-example ones
    assert runs[1] == [grouped]
    hooks.remove()


def test_parameter_hooks_see_every_hung_gradient():
    """Tensor hooks and post-accumulate hooks (what DDP's reducer and hook-stage rules use)
    fire on a hung weight at every backward, with its gradient."""
    torch.manual_seed(0)
    model = MnistCNN()
    twin = copy.deepcopy(model)
    hooks = attach(model, SCORES)
    seen, accumulated = [], []
    model.conv2.weight.register_hook(lambda g: seen.append(g.clone()))
    model.conv2.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    for _ in range(3):
        x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
        hooks.stage("per_sample").see_batch(torch.arange(4), y)
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
        twin.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        torch.testing.assert_close(seen[-1], twin.conv2.weight.grad)
        torch.testing.assert_close(accumulated[-1], twin.conv2.weight.grad)
        model.zero_grad()
    assert len(seen) == len(accumulated) == 3
    hooks.remove()


def test_a_batch_too_large_for_per_example_tensors_gets_the_batch_gradient(monkeypatch, hung):
    """A hung call whose batch no longer allows per-example weights: it gives the batch's
    gradient, its norms by Gram matrices."""
    torch.manual_seed(0)
    model = MnistCNN().double()
    twin = copy.deepcopy(model)
    hooks = attach(model, SCORES)
    stage = hooks.stage("per_sample")
    for step, bsz in enumerate([4, 4, 40, 40]):
        if step == 2:  # conv2's per-example weights (18,432 numbers each) fit 4 examples, not 40
            monkeypatch.setattr(layers, "MATERIALISE_MAX", 18_432 * 10)
        x, y = torch.randn(bsz, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (bsz,))
        stage.see_batch(torch.arange(bsz), y)
        hung.append(0)
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
        twin.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=f"step {step}, {name}")
        model.zero_grad()
    assert hung[1:] == [0, 3, 3, 3]
    assert [layer.materialised for layer in stage.layers][:2] == [True, False]
    hooks.remove()


def test_a_forward_that_raises_inside_a_hung_layer_leaves_the_next_step_right():
    """The layer's parameters are back after the error, and its next call hangs once."""
    torch.manual_seed(0)
    model = Twice().double()
    twin = copy.deepcopy(model)
    hooks = attach(model, SCORES)
    for step in range(4):
        x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
        if step == 2:
            with pytest.raises(RuntimeError):
                model.lin(torch.randn(5, 7, dtype=torch.float64))  # the wrong width: F.linear raises
        hooks.stage("per_sample").see_batch(torch.arange(5), y)
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
        twin.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        assert model.lin.weight is dict(model.named_parameters())["lin.weight"]
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=f"step {step}, {name}")
        model.zero_grad()
    hooks.remove()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_a_backward_that_builds_a_graph_through_a_hung_layer_is_one_line(how):
    """The hung layers' weight gradients have no graph of their own: create_graph=True is
    refused in one line, not answered with first-order terms only (a gradient the loss takes of
    itself, a penalty's start, is refused as it is taken)."""
    torch.manual_seed(0)
    model = Twice()
    hooks = attach(model, SCORES)
    for step in range(2):
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        hooks.stage("per_sample").see_batch(torch.arange(5), y)
        loss = F.cross_entropy(model(x), y)
        if step == 0:
            loss.backward()
            hooks.after_backward()
            continue
        want = r"backward\(create_graph=True\) after the first step" if how == "backward" else "a gradient of itself"
        with pytest.raises(ValueError, match=want) as err:
            if how == "backward":
                loss.backward(create_graph=True)
            else:
                torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        assert "\n" not in str(err.value)
    hooks.remove()
