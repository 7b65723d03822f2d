"""Weight-init schemes by name, applied with ``module.apply`` (the Korean article's pattern).

``apply`` visits submodules in post-order (children before their parent), so each
scheme only has to handle one layer at a time.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

# Layers whose weights the schemes touch; BatchNorm/LayerNorm keep their (1, 0) init.
_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


def _xavier(module: nn.Module) -> None:
    if isinstance(module, _LAYERS):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def _kaiming(module: nn.Module) -> None:
    # fan_in keeps the forward activations' variance for ReLU networks (He et al. 2015).
    if isinstance(module, _LAYERS):
        nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# None: leave PyTorch's own per-layer init alone.
INITS: dict[str, Callable[[nn.Module], None] | None] = {
    "default": None,
    "xavier": _xavier,
    "kaiming": _kaiming,
}


def apply_init(model: nn.Module, name: str) -> nn.Module:
    """Re-initialise ``model`` in place with the scheme ``name``; returns the model."""
    if name not in INITS:
        raise ValueError(f"unknown init {name!r}; allowed: {', '.join(INITS)}")
    fn = INITS[name]
    if fn is not None:
        model.apply(fn)
    return model
