"""``freeze`` switches ``requires_grad``: a frozen tensor takes no part in the backward.

While a ``freeze`` rule acts (always, or inside its ``active`` window) its parameters have
``requires_grad=False``, so autograd computes none of their gradients (nor the input
gradients of layers that only frozen tensors need); at the window's end they train again.
The switch is made at the attached model's next forward (a forward pre-hook, ahead of
FSDP2's own, which unshards with the sharded parameters' ``requires_grad``): a step's
micro-batches all see one state, and a clock moved by ``after_backward``, ``set_step`` or
``load_state_dict`` (a resume inside or after a window) takes effect before the next graph is
built. A DDP wrapper built after attach still holds every parameter in its reducer; DDP
follows the switch only with ``find_unused_parameters=True`` and no static graph, else it is
refused in one line at the first forward. Only what the switch turned off is turned back on
(a tensor the user froze stays frozen), also when the hooks are removed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradmod.hooks.rules.switched import SWITCHED_OFF


class TrainabilitySwitch:
    """The ``freeze`` rules of one attach call: ``rules`` maps rule -> its parameters;
    ``core.inactive``: the rules outside their window now."""

    def __init__(self, model: nn.Module, rules: dict[str, list[nn.Parameter]], core: Any):
        self._rules, self._core = rules, core
        self._applied: frozenset[str] | None = None  # core.inactive as last applied
        self._ddp_checked: Any = None
        self._handle = model.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if torch._C._are_functorch_transforms_active():  # a replay (torch.func), not a training forward
            return
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and ddp is not self._ddp_checked:
            self._check_ddp(ddp)
        if self._core.inactive != self._applied:
            self.apply()

    def _check_ddp(self, ddp: DistributedDataParallel) -> None:
        if not ddp.find_unused_parameters or ddp.static_graph:
            rule = next(iter(self._rules))
            raise ValueError(
                f"hooks.{rule}: freeze switches requires_grad, which DDP follows only when built with "
                "DistributedDataParallel(model, find_unused_parameters=True) and no static_graph; the "
                "trainer does so"
            )
        self._ddp_checked = ddp

    def frozen(self) -> list[nn.Parameter]:
        """The parameters a rule acting now freezes."""
        inactive = self._core.inactive
        return [p for rule, ps in self._rules.items() if rule not in inactive for p in ps]

    def apply(self) -> None:
        """Each parameter's ``requires_grad`` as the rules acting now want it."""
        self._applied = self._core.inactive
        keep = {id(p) for p in self.frozen()}
        for ps in self._rules.values():
            for p in ps:
                if id(p) in keep and p.requires_grad:
                    p.requires_grad_(False)
                    SWITCHED_OFF[p] = self
                elif id(p) not in keep and SWITCHED_OFF.get(p) is self:
                    p.requires_grad_(True)
                    del SWITCHED_OFF[p]

    def remove(self) -> None:
        self._handle.remove()
        for ps in self._rules.values():
            for p in ps:
                if SWITCHED_OFF.get(p) is self:
                    p.requires_grad_(True)
                    del SWITCHED_OFF[p]
        self._rules = {}
