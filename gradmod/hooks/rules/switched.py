"""The parameters a live ``freeze`` rule switched off (``requires_grad=False`` while it acts).

They are trainable parameters all the same: attaching again during a window selects them as
such (``gradmod.hooks.rules.targets``), and their ``requires_grad`` comes back with the rule.
"""

from __future__ import annotations

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# parameter -> the switch that turned its requires_grad off, while it is off
SWITCHED_OFF = WeakIdKeyDictionary()


def switched_off(p: nn.Parameter) -> bool:
    """``p`` is frozen by a live ``freeze`` rule (its ``requires_grad`` comes back with it)."""
    return p in SWITCHED_OFF
