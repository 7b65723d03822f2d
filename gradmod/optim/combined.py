"""Several optimizers as one ``torch.optim.Optimizer``.

Everything above an optimizer talks to it through a few names: LR schedulers read and write
``param_groups`` (and check ``isinstance(optimizer, Optimizer)``), ``GradScaler`` unscales the
gradients of ``param_groups`` and calls ``step()``, checkpoints call ``state_dict()`` and
``load_state_dict()``, DCP (FSDP2) maps ``param_groups`` to names. ``CombinedOptimizer`` is a
subclass of torch's ``Optimizer`` whose ``param_groups`` are its optimizers' own group dicts,
in order, so a scheduler's change reaches them; its ``state_dict()`` is the one a single torch
optimizer holding all these groups would give (state by parameter index, groups in order).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator, MutableMapping, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer


class CombinedOptimizer(Optimizer):
    """``optimizers`` (each holding its own parameters) stepped, zeroed and saved as one."""

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        if not optimizers or not all(isinstance(o, Optimizer) for o in optimizers):
            raise ValueError("CombinedOptimizer takes a non-empty list of torch.optim.Optimizer objects")
        seen: set[int] = set()
        for i, o in enumerate(optimizers):
            mine = {id(p) for g in o.param_groups for p in g["params"]}
            if mine & seen:
                raise ValueError(
                    f"CombinedOptimizer: optimizer {i} ({type(o).__name__}) holds a parameter another holds"
                )
            seen |= mine
        self.optimizers = list(optimizers)
        self.defaults = self.optimizers[0].defaults  # what add_param_group's groups get
        # torch's Optimizer.__init__ would add groups of its own: only its hooks and profiling are set up here
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # read from the optimizers
        """Every optimizer's groups, in order: the same dicts (a scheduler's ``lr`` lands there)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> MutableMapping[Tensor, Any]:  # type: ignore[override]  # a view of the optimizers' own
        """Parameter -> its state, in the optimizer that holds it."""
        return _State(self.optimizers)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._patch_step_function()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of each optimizer, in order; ``closure`` (the loss and its backward) runs once, first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A new group goes to the first optimizer (the base one, of the parameters no entry chose)."""
        self.optimizers[0].add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """One torch optimizer's state dict: parameter indices count on across the optimizers."""
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o in self.optimizers:
            own = o.state_dict()
            state.update({k + offset: v for k, v in own["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in own["param_groups"]]
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``state_dict()``'s form (or DCP's, keyed by parameter names), split back into each
        optimizer's own ``load_state_dict``, which pairs keys with parameters by position."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the loaded optimizer state has {len(groups)} parameter groups; this optimizer has "
                f"{len(self.param_groups)} ({', '.join(type(o).__name__ for o in self.optimizers)})"
            )
        first = 0
        for o in self.optimizers:
            mine = groups[first : first + len(o.param_groups)]
            held = {k for g in mine for k in g["params"]}
            o.load_state_dict(
                {"state": {k: v for k, v in state_dict["state"].items() if k in held}, "param_groups": mine}
            )
            first += len(o.param_groups)

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


class _State(MutableMapping):
    """The optimizers' ``state`` as one mapping; a parameter's entry lives in its own optimizer's."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self._optimizers = optimizers

    def _owner(self, p: Tensor) -> Optimizer:
        for o in self._optimizers:
            if any(q is p for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError(p)

    def __getitem__(self, p: Tensor) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: Tensor, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: Tensor) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p: object) -> bool:  # without creating an entry, as a defaultdict's lookup would
        return any(p in o.state for o in self._optimizers)

    def get(self, p: Tensor, default: Any = None) -> Any:
        return self[p] if p in self else default

    def __iter__(self) -> Iterator[Tensor]:
        return (p for o in self._optimizers for p in list(o.state))

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)
