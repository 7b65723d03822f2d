"""What the Lightning and Transformers callbacks share: attach with the checks a
callback cannot do without, and the ``log`` statistics as flat scalar entries."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from gradmod.hooks import registry as R
from gradmod.hooks import stages
from gradmod.hooks.hookset import HookSet, attach
from gradmod.hooks.rules.targets import build_targets
from gradmod.hooks.schedules import Length


def refuse_private(trainer: str, rules: Mapping[str, Any], stage: str) -> None:
    """Rules at the stage that counts the examples (per-example clipping, DP-SGD), read from
    the rules alone (before any model): refused in one line when the callback is made, not
    when training starts."""
    private = stages.get(stages.counting_examples())
    for name, spec in rules.items():
        if not isinstance(spec, Mapping):
            continue  # attach names what is wrong with it
        transforms = spec.get("transforms") or []
        kinds = set()
        for t in transforms if isinstance(transforms, list) else []:
            try:
                kinds.add(R.entry(R.parse_spec(t)[0]).stage)
            except ValueError:
                continue
        if private.name in kinds or spec.get("stage", stage) == private.name:
            raise ValueError(f"hooks.{name}: " + private.foreign_loop.format(trainer=trainer))


def attach_for(
    trainer: str,
    model: nn.Module,
    rules: Mapping[str, Any],
    stage: str,
    scaled: bool,
    shared: tuple[str, Mapping[str, HookSet]] = ("", {}),
    total_steps: int | None = None,
    steps_per_epoch: int | None = None,
) -> HookSet:
    """``attach(..., replace=False)``, so several callbacks share the model (overlapping
    tensors stay refused; ``shared``: this callback's rule sources and the other callbacks'
    live rules by their sources, to say so in one line), refusing in one line what a
    callback cannot honour:
    ``zclip(on_spike="skip")`` (a callback cannot skip one optimizer step, and zeroing the
    gradients is not a skip under momentum or weight decay), and hook-stage rules when
    ``scaled`` (fp16 with a GradScaler: backward's gradients are scaled), per_sample
    rules (see ``docs/guide/privacy.md``), per_loss rules (the loop's backward takes one loss) and
    sharpness rules (the loop's own backward cannot take a second pass)."""
    _refuse_shared(trainer, model, rules, stage, *shared, Length(steps_per_epoch, total_steps))
    hooks = attach(model, rules, stage=stage, replace=False, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
    for facts in (s for s in stages.STAGES if s.foreign_loop):  # a stage a foreign loop cannot drive
        rule = next((t.rule for t in hooks.targets if t.stage == facts.name), None)
        if rule is not None:
            hooks.remove()
            raise ValueError(f"hooks.{rule}: " + facts.foreign_loop.format(trainer=trainer))
    skipping = [t.rule for t in hooks.targets for s in t.steps if s.kind == "group" and s.fn.skip]
    hooked = [t.rule for t in hooks.targets if stages.get(t.stage).sees_each_pass or t.kind == "module"]
    if skipping or (scaled and hooked):
        hooks.remove()
    if skipping:
        raise ValueError(
            f"hooks.{skipping[0]}: zclip(on_spike='skip') cannot skip an optimizer step under {trainer}; "
            "use on_spike: clip"
        )
    if scaled and hooked:
        raise ValueError(
            f"hooks.{hooked[0]}: hook-stage rules would see fp16's scaled gradients; "
            "use stage: fused (it runs after unscaling)"
        )
    return hooks


def flat_stats(hooks: HookSet) -> dict[str, float]:
    """``grad/<tensor>/<field>``: every scalar of ``read_stats()`` (one host sync)."""
    return {
        f"grad/{key}/{field}": float(value)
        for key, stats in hooks.read_stats().items()
        for field, value in stats.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _refuse_shared(
    trainer: str,
    model: nn.Module,
    rules: Mapping[str, Any],
    stage: str,
    own: str,
    peers: Mapping[str, HookSet],
    length: Length,
) -> None:
    """Two callbacks on the same tensors: one line saying to give one callback both sources."""
    if not peers:
        return
    mine = {t.key for t in build_targets(model, rules, stage, length)}
    for theirs, hooks in peers.items():
        shared = [t.key for t in hooks.targets if t.key in mine]
        if shared:
            shown = ", ".join(dict.fromkeys(shared[:3])) + (" and more" if len(set(shared)) > 3 else "")
            raise ValueError(
                f"{trainer}: two GradmodCallbacks on the same tensors ({shown}); give one callback "
                f"several rule sources instead: GradmodCallback([{theirs}, {own}])"
            )


def sources(rules: Any) -> str:
    """How a callback's rules were given, for ``_refuse_shared``'s line: ``'clip'``,
    ``{'z': ...}`` (a mapping by its rule names)."""
    if isinstance(rules, (list, tuple)):
        return ", ".join(sources(r) for r in rules)
    if isinstance(rules, Mapping):
        return "{" + ", ".join(f"{name!r}: ..." for name in rules) + "}"
    return repr(str(rules))


def stats_line(flat: Mapping[str, float], step: int, report_to: Any) -> str:
    """``flat_stats`` as one console line: how many entries of how many tensors went where,
    and the largest gradient norm among them."""
    fields = [key.removeprefix("grad/").rpartition("/") for key in flat]
    tensors = {tensor for tensor, _, _ in fields}
    norms = {tensor: flat[f"grad/{tensor}/{field}"] for tensor, _, field in fields if field == "norm"}
    where = [r for r in ([report_to] if isinstance(report_to, str) else list(report_to or [])) if r != "none"]
    line = (
        f"gradmod step {step}: {len(flat)} statistics of {len(tensors)} tensors to "
        f"{', '.join(where) if where else 'log_history (report_to is none)'}"
    )
    if norms:
        top = max(norms, key=lambda t: norms[t])
        line += f"; largest norm {norms[top]:.4g} ({top})"
    return line
