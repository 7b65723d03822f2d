"""Stock Hugging Face configs, default dropout kept (tiny sizes only): the per_sample stage
gives each example's gradient under the batch forward's own dropout masks (float64, against
one autograd gradient per example of that same forward), or refuses in one line naming the
module and the config key to change. Dropout inside torch's TransformerEncoderLayer likewise (right)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradmod.hooks.hookset import attach

transformers = pytest.importorskip("transformers", reason="the models are built from transformers' configs")

VOCAB, B, T = 37, 3, 5
SMALL = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=8)
    )


def _bert():
    return transformers.BertForSequenceClassification(
        transformers.BertConfig(**SMALL, max_position_embeddings=8, num_labels=3)
    )


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=2))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, num_key_value_heads=2))


def _t5():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return transformers.T5ForConditionalGeneration(cfg)


class Logits(nn.Module):
    def __init__(self, hf: nn.Module, seq2seq: bool = False):
        super().__init__()
        self.hf, self.seq2seq = hf, seq2seq

    def forward(self, idx):
        if self.seq2seq:
            return self.hf(input_ids=idx, decoder_input_ids=idx[:, :3]).logits
        return self.hf(input_ids=idx).logits


def _rule(max_norm: float) -> dict:
    return {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": max_norm}]}}


def check_or_refusal(
    model: nn.Module, x: torch.Tensor, rtol: float = 1e-10, read=lambda out: out, paths: dict | None = None
) -> str | None:
    """None where the stage's clipped mean equals the reference's to ``rtol``; else its one-line
    refusal. ``read``: the tensor of the model's output to train; ``paths``: filled with each
    parameter's path."""
    model = model.double().train()
    x = x.double() if x.is_floating_point() else x
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    out = read(model(x))
    weights = torch.randn_like(out)
    per = [torch.autograd.grad((out[i] * weights[i]).sum(), list(params.values()), retain_graph=True, allow_unused=True)
           for i in range(len(x))]  # fmt: skip
    per = [[torch.zeros_like(p) if g is None else g for g, p in zip(row, params.values())] for row in per]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in row)) for row in per])
    max_norm = float(norms.median())
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    want = [sum(c * row[k] for c, row in zip(coef, per)) / len(x) for k in range(len(params))]
    hooks = attach(model, _rule(max_norm))
    torch.manual_seed(1)  # the same dropout masks as the reference's forward
    try:
        ((read(model(x)) * weights).sum() / len(x)).backward()
    except ValueError as e:
        hooks.remove()
        assert "\n" not in str(e)
        return str(e)
    hooks.after_backward()
    scale = max(float(w.norm()) for w in want)
    for (name, p), w in zip(params.items(), want):
        err = float((p.grad - w).norm())
        assert err <= rtol * max(float(w.norm()), 1e-3 * scale), f"{name}: error {err:.2e}"
    if paths is not None:
        paths.update(hooks.stage("per_sample").paths())
    hooks.remove()
    return None


# model -> None (right) or (module named, config key named) in the refusal. GPT-2's and BERT's
# position embeddings, called on one row of ids for the whole batch, are followed with their
# output expanded to the batch, so nothing of theirs is replayed. Llama's, Qwen2's and T5's
# RMSNorm compute in float32 whatever the model's dtype: their gradients agree to float32's rounding.
# T5's relative position bias is looked up with the batch (its closed form): its dropout stays.
CASES = {
    "gpt2": (_gpt2, None),
    "bert": (_bert, None),
    "llama": (_llama, None),
    "qwen2": (_qwen2, None),
    "t5": (_t5, None),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_stock_configs_with_their_dropout_are_right_or_refused_in_one_line(name):
    make, refused = CASES[name]
    torch.manual_seed(0)
    model = Logits(make(), seq2seq=name == "t5")
    rtol = 1e-6 if name in ("llama", "qwen2", "t5") else 1e-10
    msg = check_or_refusal(model, torch.randint(0, VOCAB, (B, T)), rtol=rtol)
    if refused is None:
        assert msg is None, msg
    else:
        assert msg is not None and all(word in msg for word in refused), msg


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gpt2_as_hugging_face_returns_it_is_right_in_closed_form_with_its_dropout():
    """Called as it comes (its output holds the key/value cache, new at every forward) and
    with its default dropout (0.1): its position embedding, called on one row for the whole
    batch, is followed with that row expanded (the cache compared by the tensors it holds),
    so no module is replayed per example."""
    torch.manual_seed(0)
    model, paths = _gpt2(), {}
    assert model.config.use_cache and model.config.resid_pdrop == 0.1
    msg = check_or_refusal(model, torch.randint(0, VOCAB, (B, T)), read=lambda out: out.logits, paths=paths)
    assert msg is None, msg
    assert len(paths) == len(list(model.parameters())) and "general" not in set(paths.values()), paths


def test_dropout_inside_a_transformer_encoder_layer_is_right():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)  # dropout=0.1 by default
    # attention's projections in closed form: every dropout mask is the batch forward's own
    msg = check_or_refusal(nn.Sequential(layer, nn.Flatten(), nn.Linear(40, 3)), torch.randn(B, T, 8))
    assert msg is None, msg


def _scale_norms():
    import importlib

    from gradmod.hooks.per_sample.forms.layers import NAMED_FORMS, SCALE_NORM

    found = [nn.RMSNorm]
    for (module, name), form in NAMED_FORMS.items():
        if form is SCALE_NORM:
            found.append(getattr(importlib.import_module(module), name))
    return found


@pytest.mark.parametrize("norm", _scale_norms(), ids=lambda c: c.__name__)
def test_rmsnorms_answer_in_closed_form_and_right(norm):
    from gradmod.hooks.per_sample.forms.layers import SCALE_NORM, form_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), norm(6), nn.Linear(6, 3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)  # not all ones: the weight's own gradient matters
    assert form_of(model[1]) is SCALE_NORM
    # Hugging Face's compute their variance in float32 whatever the model's dtype
    assert check_or_refusal(model, torch.randn(B, T, 4), rtol=1e-6) is None
