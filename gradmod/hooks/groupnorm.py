"""BatchNorm mixes the examples of a batch; GroupNorm does not (Opacus' ``ModuleValidator.fix``)."""

from __future__ import annotations

import math

from torch import nn


def _group_norm(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    channels = bn.num_features
    groups = math.gcd(32, channels)  # 32 groups where the channels divide, as Wu & He use
    return nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine).to(
        device=bn.weight.device if bn.affine else None, dtype=bn.weight.dtype if bn.affine else None
    )


def replace_batchnorm(model: nn.Module) -> nn.Module:
    """Every BatchNorm of ``model`` replaced, in place, by a GroupNorm over the same channels
    (``gcd(32, channels)`` groups); returns ``model`` (a BatchNorm root: its replacement)."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return _group_norm(model)
    for name, child in model.named_children():
        setattr(model, name, replace_batchnorm(child))
    return model
