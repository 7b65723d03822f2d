"""A weight shared between calls (a tied embedding and output layer, a layer called twice) takes
Gram norms with the calls' cross terms where that pays: right at every step (float64, against
one autograd gradient per example), named ``Gram`` in the plan, never ``[B, vocab, d]``."""

from __future__ import annotations

import torch
from torch import nn

from gradmod.hooks.hookset import attach
from tests.hooks.per_sample.test_per_sample_detached import B, check_steps

VOCAB, D, T = 50, 16, 3


class Shared(nn.Module):
    """Every pairing: an Embedding called twice, a Linear called twice, the Embedding's weight as
    the output layer's."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(VOCAB, D), nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx) + 0.5 * self.emb(idx.flip(1))
        x = torch.tanh(self.mix(torch.tanh(self.mix(x))))
        return self.head(x).mean(1)


def test_shared_weights_stay_right_without_per_example_tensors():
    torch.manual_seed(0)
    check_steps(Shared(), lambda: torch.randint(0, VOCAB, (B, T)))


def test_the_plan_names_them_gram():
    torch.manual_seed(0)
    model = Shared()
    hooks = attach(model, {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}})
    model(torch.randint(0, VOCAB, (B, T))).sum().backward()
    hooks.after_backward()
    assert hooks.stage("per_sample").paths() == {"emb.weight": "Gram", "mix.weight": "Gram", "mix.bias": "Gram"}
    hooks.remove()
