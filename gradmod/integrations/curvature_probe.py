"""The curvature rule in the Lightning and Transformers callbacks (``gradmod.training.curvature``).

A callback given a curvature rule takes it out of the rules it attaches (``split_rules``), keeps
the first ``batch`` examples (all by default) of the first training batch the loop sees as the
probe batch, and estimates at step 0 (before the first optimizer step) and after every
``every``-th optimizer step (``Estimates``: ``gradmod.hooks.curvature``, which leaves training as
it was).

``state_dict`` is what a checkpoint keeps: the rows, the probe batch (a resumed run estimates on
the same examples, not on the first batch it sees) and the step of the last estimate. The
eigenvectors that warm-start the next estimate are left out, as in gradmod's trainer: the first
estimate after a resume starts cold (the same values to ``tol``, in more products)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from gradmod.training.curvature import Estimates, check_rules, first_lr, split_rules


class Probe:
    """``rest``: the rules to attach; ``estimates``: the curvature rules' rows and latest values."""

    def __init__(self, rules: Mapping[str, Any]):
        rest, found = split_rules(rules)
        self.rest: dict[str, Any] = rest or {}
        self.estimates = Estimates(found)
        self.batch: Any = None  # the first training batch's first examples
        self.at: int | None = None  # the step of the last estimate

    def __bool__(self) -> bool:
        return bool(self.estimates.rules)

    def check(self, model: torch.nn.Module) -> None:
        check_rules(self.estimates.rules, model)

    def keep(self, batch: Any) -> None:
        """The first batch seen, cut to the largest ``batch`` of the rules (copied: the loop's is its own)."""
        if self and self.batch is None:
            sizes = [r.batch for r in self.estimates.rules]
            self.batch = head(batch, None if None in sizes else max(n for n in sizes if n is not None))

    def run(self, model, loss_fn, step: int, optimizer, take: Callable[[Any], Any], forward=None) -> dict[str, Any]:
        """The rules due at ``step`` (once a step), each on ``take(head(batch, rule.batch))`` on the
        model's device (a batch restored from a checkpoint is on the host); this estimate's values by
        ``<rule>/<group>/<field>`` ({} when none was due)."""
        due = self.estimates.due(step) if self.batch is not None and step != self.at else []
        if not due:
            return {}
        self.at = step
        device = next(model.parameters()).device
        probe = lambda r: take(head(self.batch, r.batch, device))  # noqa: E731
        return self.estimates.estimate(due, model, loss_fn, probe, step, first_lr(optimizer), forward)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": list(self.estimates.rows), "batch": self.batch, "at": self.at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.estimates.rows = list(state.get("rows", []))
        self.batch = state.get("batch", self.batch)
        self.at = state.get("at", self.at)


def head(value: Any, n: int | None, device: torch.device | None = None) -> Any:
    """The first ``n`` examples of a batch (all with ``None``; on ``device`` if given): tensors cut
    along their first dimension, mappings, lists and tuples through; anything else as it is."""
    if isinstance(value, torch.Tensor):
        cut = (value[:n] if value.dim() else value).detach()
        return cut.clone() if device is None else cut.to(device, copy=True)
    if isinstance(value, Mapping):
        return {k: head(v, n, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [head(v, n, device) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else items
    return value
