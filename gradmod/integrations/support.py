"""What the Lightning and Transformers callbacks share: attach with the checks a
callback cannot do without, and the ``log`` statistics as flat scalar entries."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from gradmod.hooks.hookset import HookSet, attach


def attach_for(trainer: str, model: nn.Module, rules: Mapping[str, Any], stage: str, scaled: bool) -> HookSet:
    """``attach(..., replace=False)``, so several callbacks share the model (overlapping
    tensors stay refused), refusing in one line what a callback cannot honour:
    ``zclip(on_spike="skip")`` (a callback cannot skip one optimizer step, and zeroing the
    gradients is not a skip under momentum or weight decay), and hook-stage rules when
    ``scaled`` (fp16 with a GradScaler: backward's gradients are scaled), and per_sample
    rules (see ``docs/privacy.md``)."""
    hooks = attach(model, rules, stage=stage, replace=False)
    if hooks.per_sample is not None:
        rule = hooks.per_sample.rules[0].name
        hooks.remove()
        raise ValueError(f"hooks.{rule}: per_sample rules (per-example clipping, DP-SGD) are refused under {trainer}: "
                         "its loop scales the loss for accumulation and samples fixed-size batches, so neither the "
                         "clipping nor an epsilon would be true; train with gradmod's trainer (python train.py "
                         "+hooks=dp) or attach the rules in your own loop")
    skipping = [t.rule for t in hooks.targets for s in t.steps if s.kind == "group" and s.fn.skip]
    hooked = [t.rule for t in hooks.targets if t.stage == "hook" or t.kind == "module"]
    if skipping or (scaled and hooked):
        hooks.remove()
    if skipping:
        raise ValueError(f"hooks.{skipping[0]}: zclip(on_spike='skip') cannot skip an optimizer step under {trainer}; "
                         "use on_spike: clip")
    if scaled and hooked:
        raise ValueError(f"hooks.{hooked[0]}: hook-stage rules would see fp16's scaled gradients; "
                         "use stage: fused (it runs after unscaling)")
    return hooks


def flat_stats(hooks: HookSet) -> dict[str, float]:
    """``grad/<tensor>/<field>``: every scalar of ``read_stats()`` (one host sync)."""
    return {f"grad/{key}/{field}": float(value) for key, stats in hooks.read_stats().items()
            for field, value in stats.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
