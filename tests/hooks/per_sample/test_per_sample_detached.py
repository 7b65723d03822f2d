"""After the first backward the per_sample stage runs Linear, Conv1D and Embedding calls on
detached weights (autograd no longer computes the batch weight gradients it drops): every
later step's clipped gradients stay right (float64, against one autograd gradient per
example of an untouched copy), autograd's graph holds none of those weights, the step's
matmul flops fall to a plain step's, and a use outside the followed calls is still refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gradmod.hooks.hookset import attach

B, T, VOCAB = 3, 5, 37


def _rule(max_norm: float, log_bias: bool = False) -> dict:
    rules = {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]}}
    if log_bias:  # a log-only rule keeps autograd's batch gradient: its parameters stay in the graph
        rules = {
            "dp": {"params": "*weight", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]},
            "seen": {"params": "*bias", "transforms": [{"name": "log"}]},
        }
    return rules


def _want(ref: nn.Module, x: torch.Tensor, weights: torch.Tensor, max_norm: float, clipped) -> list[torch.Tensor]:
    """Each parameter's clipped mean from one autograd gradient per example (unclipped where not ``clipped``)."""
    params = list(ref.parameters())
    out = ref(x)
    per = [torch.autograd.grad((out[i] * weights[i]).sum(), params, retain_graph=True, allow_unused=True)
           for i in range(len(x))]  # fmt: skip
    per = [[torch.zeros_like(p) if g is None else g for g, p in zip(row, params)] for row in per]
    norms = torch.stack([sum(g.square().sum() for g, c in zip(row, clipped) if c).sqrt() for row in per])
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return [sum((c if keep else 1.0) * row[k] for c, row in zip(coef, per)) / len(x)
            for k, keep in enumerate(clipped)]  # fmt: skip


def _weights_in_graph(root) -> set[int]:
    """ids of the leaves autograd would accumulate a gradient into, from ``root``'s graph."""
    seen, stack, found = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "variable"):
            found.add(id(node.variable))
        stack += [f for f, _ in node.next_functions]
    return found


def check_steps(model: nn.Module, inputs, steps: int = 3, log_bias: bool = False, rtol: float = 1e-9) -> None:
    model = model.double().train()
    ref = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    clipped = [not (log_bias and n.endswith("bias")) for n in names]
    hooks = attach(model, _rule(0.05, log_bias))
    for step in range(steps):
        x = inputs()
        torch.manual_seed(step)
        weights = torch.randn_like(ref(x))
        want = _want(ref, x, weights, 0.05, clipped)
        loss = (model(x) * weights).sum() / len(x)
        held = _weights_in_graph(loss.grad_fn)
        loss.backward()
        hooks.after_backward()
        detached = [n for n, p in model.named_parameters() if id(p) not in held]
        # the first backward checks every form against autograd's whole gradients: nothing detached
        assert (step == 0) == (detached == []), (step, detached)
        scale = max(float(w.norm()) for w in want)
        for name, p, w in zip(names, model.parameters(), want):
            err = float((p.grad - w).norm())
            assert err <= rtol * max(float(w.norm()), 1e-3 * scale), f"step {step}, {name}: error {err:.2e}"
            p.grad = None
    hooks.remove()


class SeqMLP(nn.Module):
    """Linear layers on sequences; the first one's input is the data (no gradient of its own)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x).mean(1)


def test_linear_layers_on_data_stay_right_after_the_first_backward():
    torch.manual_seed(0)
    check_steps(SeqMLP(), lambda: torch.randn(B, T, 6, dtype=torch.float64))


def test_a_log_only_rule_keeps_autograd_gradients_of_its_parameters():
    torch.manual_seed(0)
    check_steps(SeqMLP(), lambda: torch.randn(B, T, 6, dtype=torch.float64), log_bias=True)


class TiedLM(nn.Module):
    """An embedding and its transpose as the output layer (weights tied), as GPT-2 and BERT do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx)))).mean(1)


class InPlace(nn.Module):
    """Outputs of layers on token ids and on data changed in place, as some models do."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj, self.head = nn.Embedding(VOCAB, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, idx):
        x = self.emb(idx)
        y = self.proj(torch.linspace(-1, 1, 6, dtype=x.dtype).expand_as(x))  # data: no gradient of its own
        y.mul_(2.0)
        x += y
        return self.head(torch.tanh(x)).mean(1)


def test_outputs_changed_in_place_stay_right():
    torch.manual_seed(0)
    check_steps(InPlace(), lambda: torch.randint(0, VOCAB, (B, T)))


def test_tied_embedding_and_output_layer_stay_right():
    torch.manual_seed(0)
    check_steps(TiedLM(), lambda: torch.randint(0, VOCAB, (B, T)))


def _hf(name: str) -> nn.Module:
    tf = pytest.importorskip("transformers", reason="the models are built from transformers' configs")
    small = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=8,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    if name == "bert":
        drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(tf.BertConfig(**small, max_position_embeddings=8, **drop))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**small, num_key_value_heads=2))
    return tf.T5ForConditionalGeneration(
        tf.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0)
    )


class Logits(nn.Module):
    def __init__(self, hf: nn.Module, seq2seq: bool):
        super().__init__()
        self.hf, self.seq2seq = hf, seq2seq

    def forward(self, idx):
        kw = {"decoder_input_ids": idx[:, :3]} if self.seq2seq else {}
        return self.hf(input_ids=idx, **kw).logits.mean(1)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5"])
def test_hugging_face_models_stay_right_after_the_first_backward(name):
    torch.manual_seed(0)
    model = Logits(_hf(name), seq2seq=name == "t5")
    torch.manual_seed(0)
    # Llama's and T5's RMSNorm compute in float32 whatever the model's dtype
    check_steps(model, lambda: torch.randint(0, VOCAB, (B, T)), rtol=1e-6 if name in ("llama", "t5") else 1e-9)


def _flops(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def test_a_later_step_costs_a_plain_steps_matmuls():
    torch.manual_seed(0)
    model, x = SeqMLP(), torch.randn(8, 16, 6)
    plain = copy.deepcopy(model)
    hooks = attach(model, _rule(1.0))

    def step(m):
        def run():
            F.mse_loss(m(x), torch.zeros(8, 3)).backward()
            if m is model:
                hooks.after_backward()

        return run

    base, first, later = _flops(step(plain)), _flops(step(model)), _flops(step(model))
    # the first step also forms the per-example weights autograd's weight gradients cost again
    assert first > 1.25 * base
    # later: the per-example weights replace autograd's weight gradients (plus a [2, B] x [B, numel] sum)
    assert later < 1.1 * base
    hooks.remove()


def test_a_detached_weight_used_outside_its_layer_later_is_refused():
    torch.manual_seed(0)
    model = SeqMLP()
    hooks = attach(model, _rule(1.0))
    for step in range(3):
        out = model(torch.randn(B, T, 6))
        if step == 2:  # a penalty on a detached weight: autograd brings it a gradient
            out = out + model.net[2].weight.sum()
        if step < 2:
            out.sum().backward()
            hooks.after_backward()
            continue
        with pytest.raises(ValueError, match="'net.2.weight' got part of its gradient outside") as err:
            out.sum().backward()
        assert "\n" not in str(err.value)
    hooks.remove()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_t5_switched_to_eval_mode_after_its_first_step_stays_right():
    torch.manual_seed(0)
    model = Logits(_hf("t5"), seq2seq=True)
    steps = []

    def inputs():  # from the second step on in eval mode (dropout off, as some train): the bias still batched
        model.train(not steps)
        steps.append(1)
        return torch.randint(0, VOCAB, (B, T))

    check_steps(model, inputs, rtol=1e-6)
