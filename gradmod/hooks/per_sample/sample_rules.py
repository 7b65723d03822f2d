"""The per_sample rules of one ``attach`` call, from its targets, and what they refuse
(each in one line, before anything is attached)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gradmod.hooks.per_sample.scores import Scores
from gradmod.hooks.per_sample.stats import PerSampleClip, PerSampleLog

LOSS_REDUCTIONS = ("mean", "sum")


def check_options(loss_reduction: str, batch_dim: int | None) -> None:
    """The stage's options: how the loss reduces over the batch, and where the batch is."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}; allowed: {', '.join(LOSS_REDUCTIONS)}")
    if batch_dim is not None and (isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0):
        raise ValueError(f"batch_dim={batch_dim!r}; allowed: an int >= 0 (the inputs' batch dimension)")


def check_model(model: nn.Module) -> None:
    """BatchNorm in training mode mixes the examples of a batch: no per-example gradient exists."""
    mixing = [
        n or type(model).__name__
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if mixing:
        shown = ", ".join(mixing[:5]) + (f" and {len(mixing) - 5} more" if len(mixing) > 5 else "")
        raise ValueError(
            f"per_sample rules need each example's own gradient, but BatchNorm in training mode "
            f"mixes the examples of a batch ({shown}); use GroupNorm instead (model.norm=group)"
        )


def check_rule(rule: str, names: list[str], accepted: list[str]) -> None:
    """Each transform once: an example's gradient is clipped once, its statistics kept once."""
    if len(set(names)) < len(names):
        raise ValueError(f"hooks.{rule}.transforms: give {', '.join(accepted)} at most once each")


def check_targets(model: nn.Module, targets: list) -> None:
    """Refuse what would make the per_sample stage wrong, each in one line (``targets``:
    every rule's)."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    private = [t for t in targets if t.stage == "per_sample"]
    if not private:
        return
    check_model(model)
    covered = {t.name: t.rule for t in private}
    noisy = sorted({t.rule for t in private for s in t.steps if _adds_noise(t.rule, s)})
    if len(noisy) > 1:
        raise ValueError(
            f"hooks: per_sample rules {', '.join(noisy)} both add noise; one rule may (one privacy "
            "budget): put the parameters in one rule"
        )
    twice = next((t for t in private if [u.rule for u in private if u.name == t.name] != [t.rule]), None)
    if twice is not None:
        raise ValueError(
            f"hooks.{twice.rule}: {twice.name!r} is in two per_sample rules; each example's "
            "gradient is clipped once: select it in one"
        )
    # The claim (an epsilon) holds only where every trained parameter gets the noisy rule's
    # clipping and noise: another per_sample rule (log only, or clip without noise) is no cover.
    missing = [n for n in trainable if covered.get(n) not in noisy]
    if noisy and missing:
        shown = ", ".join(
            f"{n} ({'rule ' + covered[n] + ', no noise' if n in covered else 'no rule'})" for n in missing[:5]
        )
        shown += f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"hooks.{noisy[0]}: with noise every trained parameter must be in that rule, else the "
            f"privacy claim is false; not covered: {shown} (select them in hooks.{noisy[0]} or set "
            "requires_grad=False)"
        )


def _adds_noise(rule: str, step) -> bool:
    """Whether a per_sample step adds noise at some step: a noise_multiplier > 0, or a
    schedule of one, which must then have noise from the first step on."""
    if step.kind != "per_sample" or not isinstance(step.fn, PerSampleClip):
        return False
    scheduled = step.schedules.get("noise_multiplier")
    if scheduled is not None and step.fn.noise_multiplier <= 0:
        raise ValueError(
            f"hooks.{rule}: per_sample_clip's noise_multiplier={scheduled} is 0 at the first step, so the "
            "first steps get no noise and later ones do; every step needs noise > 0 for a privacy claim "
            "(start the schedule above 0, or give no noise_multiplier)"
        )
    return scheduled is not None or step.fn.noise_multiplier > 0


@dataclass
class Rule:
    name: str
    params: list[nn.Parameter]
    clip: PerSampleClip | None = None
    log: PerSampleLog | None = None
    scores: Scores | None = None


def per_sample_rules(targets: list, params: dict[str, nn.Parameter]) -> list[Rule]:
    """The per_sample targets grouped by rule, in config order."""
    rules: dict[str, Rule] = {}
    for t in targets:
        if t.stage == "per_sample":
            rule = rules.setdefault(t.rule, Rule(t.rule, [], *_steps(t.steps)))
            rule.params.append(params[t.name])
    return list(rules.values())


def _steps(steps: list) -> tuple[PerSampleClip | None, PerSampleLog | None, Scores | None]:
    clip = next((s.fn for s in steps if isinstance(s.fn, PerSampleClip)), None)
    log = next((s.fn for s in steps if isinstance(s.fn, PerSampleLog)), None)
    return clip, log, next((s.fn for s in steps if isinstance(s.fn, Scores)), None)
