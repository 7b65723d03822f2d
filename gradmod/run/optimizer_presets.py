"""The schemas of the shipped optimizer recipes beyond one torch optimizer with its defaults
(``optimizer=muon_split``, ``lars``, ``lamb``): each recipe's values written once, as ``MuonConfig``'s
in ``gradmod.run.config``; ``gradmod/conf/optimizer/NAME.yaml`` names its schema and sets none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradmod.run.config import AdamConfig, SGDConfig


@dataclass
class MuonSplitConfig(AdamConfig):
    """``optimizer=muon_split``: Muon as modded-nanogpt runs it (its 2024 GPT-2 speedrun records):
    Muon (lr 0.05, momentum 0.95, Nesterov, no weight decay) on the hidden matrices, and Adam with
    betas (0.8, 0.95) at a rate of its own for the embeddings (0.6), the head (0.008) and the rest,
    the scalars and vectors (0.04). docs/guide/optimizers.md"""

    lr: float = 0.04
    betas: list[float] = field(default_factory=lambda: [0.8, 0.95])
    eps: float = 1e-10
    groups: list[Any] = field(
        default_factory=lambda: [
            {"params": "@embeddings", "lr": 0.6},
            {"params": "@last_layer", "lr": 0.008},
            {
                "params": "@matrices",
                "optimizer": {
                    "_target_": "gradmod.optim.Muon",
                    "lr": 0.05,
                    "momentum": 0.95,
                    "nesterov": True,
                    "ns_steps": 5,
                    "weight_decay": 0.0,
                    "split": 1,
                },
            },
        ]
    )


@dataclass
class LarsConfig(SGDConfig):
    """``optimizer=lars``: SGD with momentum whose matrices and kernels (every parameter but
    ``@vectors``: biases, norms, layer-scale gammas) step by LARS's trust ratio ``eta ||w|| /
    (||g|| + wd ||w||)``, their weight decay inside it; the vectors plain SGD without decay, as
    pytorch-optimizer's ``LARS`` (SimCLR's eta 0.001, weight decay 1e-6; docs/guide/optimizers.md)."""

    lr: float = 0.1
    groups: list[Any] = field(
        default_factory=lambda: [
            {
                "params": "*",
                "exclude": "@vectors",
                "trust_ratio": {"eta": 0.001, "mode": "scale", "weight_decay": 1e-6},
            }
        ]
    )


@dataclass
class LambConfig(AdamConfig):
    """``optimizer=lamb``: Adam without bias correction, decoupled weight decay 0.01, and LAMB's trust
    ratio ``min(||w||, 10) / (||u|| + eps)`` on the step of every parameter but ``@vectors`` (biases,
    norms: no ratio, no decay), as pytorch-optimizer's ``Lamb`` (docs/guide/optimizers.md)."""

    _target_: str = "gradmod.optim.Adam"
    eps: float = 1e-6
    weight_decay: float = 0.01
    decoupled_weight_decay: bool = True
    bias_correction: bool = False
    no_decay: list[str] = field(default_factory=lambda: ["@vectors"])
    groups: list[Any] = field(
        default_factory=lambda: [
            {"params": "*", "exclude": "@vectors", "trust_ratio": {"of": "update", "clamp": 10.0, "eps": 1e-6}}
        ]
    )
