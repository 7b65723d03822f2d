"""DP-SGD in a run: which rule adds noise, how batches are sampled, the noise a target
epsilon needs, and the combinations refused in one line before any work.

A rule adds noise when its ``per_sample_clip`` has ``noise_multiplier > 0`` (a privacy
claim), or when ``privacy.target_epsilon`` picks that multiplier for the one per_sample_clip
rule. ``data.sampling=auto`` then samples Poisson batches, as the accounting assumes.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

from gradmod.hooks import stages
from gradmod.hooks import transforms as T
from gradmod.hooks.rules.syntax import transform_list
from gradmod.hooks.schedules import Length, Schedule, is_schedule, parse_schedule
from gradmod.run.config import Config
from gradmod.training.loader import poisson_steps, steps_per_epoch
from gradmod.training.privacy import make_accountant, noise_for_epsilon, scale_for_epsilon

log = logging.getLogger(__name__)

CLIP = "per_sample_clip"
PER_SAMPLE_STRATEGIES = ("single", "ddp")
MAX_DISTINCT_SIGMAS = 64  # a noise schedule's values the accountant composes one by one


@dataclass
class Privacy:
    """What the accountant needs: the rule's noise multiplier, the sample rate, the planned steps."""

    rule: str
    noise_multiplier: float  # the first step's
    sample_rate: float
    steps: int
    sigmas: list[float] | None = None  # a scheduled noise_multiplier: each planned step's value

    def noise_at(self, t: int) -> float:
        """The noise multiplier of optimizer step ``t`` (0 for the first)."""
        if self.sigmas is None:
            return self.noise_multiplier
        return self.sigmas[min(t, len(self.sigmas) - 1)]  # a resume may train longer: the last value


def _clips(rules: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(rule, per_sample_clip arguments) of every rule that clips per example."""
    out = []
    for name, spec in (rules or {}).items():
        transforms = (spec or {}).get("transforms") or []
        for t in transform_list(transforms):
            try:
                fn, args = T.parse_spec(t)
            except ValueError:
                continue  # attach reports a malformed transform with its rule
            if fn == CLIP:
                _check_clip(name, t)
                out.append((name, args))
    return out


def _check_clip(rule: str, spec: Any) -> None:
    """per_sample_clip's own checks of its arguments (a schedule's at its start), before
    its noise multiplier is read."""
    if isinstance(spec, Mapping):
        spec = {k: (v["start"] if is_schedule(v) and "start" in v else v) for k, v in spec.items()}
    try:
        T.build(spec)
    except ValueError as e:
        raise ValueError(f"hooks.{rule}.transforms: {e}") from None


def _sigma(rule: str, value: Any) -> float | Schedule:
    """A noise multiplier as the rule gives it: a number, or a schedule."""
    if is_schedule(value):
        return parse_schedule(value, f"hooks.{rule}.noise_multiplier")
    return float(value or 0)


@dataclass(frozen=True)
class Plan:
    """DP-SGD's reading of the rules, made once per set-up (``plan``) and handed on."""

    clips: tuple[tuple[str, dict[str, Any]], ...]  # (rule, per_sample_clip arguments), each checked
    private: tuple[str, ...]  # the rules at the per_sample stage: set so, or implied by per_sample_clip
    noisy: tuple[tuple[str, float | Schedule], ...]  # the rules whose clip adds noise, with that noise
    target_epsilon: float | None
    sampling: str  # data.sampling resolved: auto is poisson when a rule adds noise, else shuffle

    @property
    def adds_noise(self) -> bool:
        return bool(self.noisy) or self.target_epsilon is not None


def plan(cfg: Config) -> Plan:
    """Which rules clip per example and which add noise, read from ``cfg.hooks`` once."""
    clips = _clips(cfg.hooks)
    private = stages.counting_examples()
    named = {name for name, spec in (cfg.hooks or {}).items() if (spec or {}).get("stage") == private}
    sigmas = [(name, _sigma(name, args.get("noise_multiplier"))) for name, args in clips]
    # A noise_multiplier > 0, or any schedule of one: one that starts at 0 still adds noise
    # later, and ``_scheduled`` refuses its noiseless steps.
    noisy = tuple((name, s) for name, s in sigmas if isinstance(s, Schedule) or s > 0)
    target = cfg.privacy.target_epsilon
    sampling = cfg.data.sampling
    if sampling == "auto":
        sampling = "poisson" if noisy or target is not None else "shuffle"
    return Plan(tuple(clips), tuple(sorted(named | {name for name, _ in clips})), noisy, target, sampling)


def check(cfg: Config, dp: Plan | None = None) -> Plan:
    """The one-line refusals of DP-SGD's combinations, before the run claims its folder;
    the plan they read (``dp``, made here when not given)."""
    dp = dp or plan(cfg)
    t, private, target = cfg.trainer, dp.private, dp.target_epsilon
    if private and t.strategy not in PER_SAMPLE_STRATEGIES:
        raise ValueError(
            f"hooks.{private[0]}: the per_sample stage runs under trainer.strategy="
            f"{'|'.join(PER_SAMPLE_STRATEGIES)} only, not {t.strategy}"
        )
    if private and t.precision == "fp16":
        raise ValueError(
            f"hooks.{private[0]}: the per_sample stage clips unscaled gradients, which fp16's "
            "GradScaler does not give; use trainer.precision=fp32 or bf16"
        )
    if target is not None:
        clips = [name for name, _ in dp.clips]
        if not (math.isfinite(target) and target > 0):
            raise ValueError(f"privacy.target_epsilon={target} must be a finite number > 0, or null")
        if len(clips) != 1:
            found = f"found {', '.join(clips)}" if clips else "found none; add +hooks=dp"
            raise ValueError(f"privacy.target_epsilon needs exactly one rule with {CLIP} to give its noise to; {found}")
    if dp.adds_noise:
        make_accountant(cfg.privacy.accountant)  # Opacus missing: one line saying what to install
    if dp.adds_noise and cfg.data.keep.which != "random":
        raise ValueError(  # the examples kept depend on every example's data: no epsilon covers that choice
            f"data.keep.which={cfg.data.keep.which} chooses the training examples by their scores, which the "
            "noisy rule's epsilon does not account for; use data.keep.which=random under DP noise"
        )
    if dp.sampling == "poisson" and t.strategy == "ddp" and not private:
        raise ValueError(
            "data.sampling=poisson under trainer.strategy=ddp needs a per_sample rule (e.g. +hooks=dp): "
            "DDP's own all-reduce cannot take the empty batches Poisson sampling draws; "
            "use data.sampling=shuffle"
        )
    return dp


def prepare(
    cfg: Config,
    train_size: int,
    world_size: int,
    resumed: Mapping[str, Any] | None = None,
    dp: Plan | None = None,
) -> tuple[dict[str, Any], Privacy | None]:
    """The rules to attach (``privacy.target_epsilon``'s noise filled in) and what the
    accountant needs (None when no rule adds noise). ``resumed``: the checkpoint's privacy
    state; a run under the same target keeps the noise its start chose, so that the plan,
    the log and the summary name the noise the steps get. ``dp``: ``check``'s plan."""
    dp = dp or plan(cfg)
    if not dp.adds_noise:
        return cfg.hooks, None
    t = cfg.trainer
    rate, _ = poisson_steps(train_size, cfg.data.batch_size, world_size, t.accumulate)
    steps = steps_per_epoch(train_size, cfg.data.batch_size, world_size, t.accumulate, dp.sampling) * t.epochs
    _warn(cfg, dp, train_size)
    rules = copy.deepcopy(cfg.hooks)
    scheduled = next(((rule, s) for rule, s in dp.noisy if isinstance(s, Schedule)), None)
    if scheduled is not None:
        length = Length(steps // t.epochs, steps)
        return rules, _scheduled(cfg, rules, scheduled, rate, steps, length)
    if dp.target_epsilon is None:
        ((rule, sigma),) = dp.noisy[:1]
        assert isinstance(sigma, float)
        return rules, Privacy(rule, sigma, rate, steps)
    return rules, _for_target(cfg, dp, rules, rate, steps, resumed)


def _for_target(
    cfg: Config, dp: Plan, rules: dict[str, Any], rate: float, steps: int, resumed: Mapping[str, Any] | None
) -> Privacy:
    """``privacy.target_epsilon``'s noise, set in the one per_sample_clip rule of ``rules``
    (a resumed run's, or one for the planned steps)."""
    assert dp.target_epsilon is not None
    ((rule, args),) = dp.clips
    kept = _kept_noise(dp.target_epsilon, resumed)
    if kept is not None:
        _set_noise(rules[rule], kept)
        log.info(
            "privacy.target_epsilon=%s: keeping the noise_multiplier %.4f chosen at the run's start "
            "(not one for the %d steps now planned); epsilon may exceed the target",
            dp.target_epsilon,
            kept,
            steps,
        )
        return Privacy(rule, kept, rate, steps)
    sigma = noise_for_epsilon(dp.target_epsilon, cfg.privacy.delta, rate, steps, cfg.privacy.accountant)
    _set_noise(rules[rule], sigma)
    replaced = (
        f" (replacing hooks.{rule}'s noise_multiplier={args['noise_multiplier']})"
        if args.get("noise_multiplier")
        else ""
    )
    log.info(
        "privacy.target_epsilon=%s: noise_multiplier %.4f for %d steps at sample rate %.5f%s",
        dp.target_epsilon,
        sigma,
        steps,
        rate,
        replaced,
    )
    return Privacy(rule, sigma, rate, steps)


def _warn(cfg: Config, dp: Plan, train_size: int) -> None:
    """What makes the reported epsilon weaker than it reads: shuffled batches, a large delta."""
    if dp.sampling == "shuffle":
        log.warning(
            "data.sampling=shuffle with a noisy per_sample rule: the reported epsilon assumes Poisson "
            "sampling (data.sampling=poisson), which shuffled batches do not give"
        )
    if cfg.privacy.delta >= 1.0 / train_size:
        log.warning(
            "privacy.delta=%g is not below 1 / training set size (%d examples): such a delta allows "
            "releasing an example outright; use e.g. %g",
            cfg.privacy.delta,
            train_size,
            10 ** math.floor(math.log10(0.1 / train_size)),
        )


def _kept_noise(target: float, resumed: Mapping[str, Any] | None) -> float | None:
    """The noise a resumed run's start chose for the same target (None: choose it now)."""
    if not resumed or resumed.get("target_epsilon") != target or not resumed.get("noise_multiplier"):
        return None
    return float(resumed["noise_multiplier"])


def _scheduled(
    cfg: Config, rules: dict[str, Any], scheduled: tuple[str, Schedule], rate: float, steps: int, length: Length
) -> Privacy:
    """A scheduled noise multiplier: every planned step's value, all > 0 (a step without
    noise voids the claim); with ``privacy.target_epsilon``, the schedule scaled so that
    the run's history spends at most the target."""
    rule, schedule = scheduled
    where = f"hooks.{rule}.noise_multiplier"
    schedule.check(length, where)
    sigmas = [schedule.value(t, length) for t in range(steps)]
    if min(sigmas) <= 0:
        t = next(t for t, s in enumerate(sigmas) if s <= 0)
        raise ValueError(
            f"{where}: the schedule reaches {sigmas[t]:g} at step {t}; every step needs noise > 0 "
            f"for a privacy claim ({'start' if t == 0 else 'end'} the schedule above 0)"
        )
    distinct = len(set(sigmas))
    if distinct > MAX_DISTINCT_SIGMAS:
        raise ValueError(
            f"{where}: a {schedule.kind} schedule gives {distinct} distinct noise multipliers over {steps} "
            f"steps; the accountant composes one mechanism per value (about 40 ms each, at every epsilon), "
            f"so at most {MAX_DISTINCT_SIGMAS}: use exp or step (constant between changes)"
        )
    target = cfg.privacy.target_epsilon
    if target is not None:
        scale = scale_for_epsilon(target, cfg.privacy.delta, rate, sigmas, cfg.privacy.accountant)
        scaled = _scaled(rules[rule], scale)
        _set_noise(rules[rule], scaled)
        sigmas = [parse_schedule(scaled, where).value(t, length) for t in range(steps)]  # as the rule computes them
        log.info(
            "privacy.target_epsilon=%s: the noise_multiplier schedule scaled by %.4f (first step %.4f, last %.4f)",
            target,
            scale,
            sigmas[0],
            sigmas[-1],
        )
    return Privacy(rule, sigmas[0], rate, steps, sigmas)


def _scaled(spec: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """The rule's noise_multiplier schedule with every value times ``scale`` (its start and
    end: each schedule is linear in them)."""
    transforms = spec["transforms"]
    for t in [transforms] if isinstance(transforms, (str, Mapping)) else transforms:
        name, args = T.parse_spec(t)
        if name == CLIP:
            sched = dict(args["noise_multiplier"])
            return {**sched, **{k: sched[k] * scale for k in ("start", "end") if sched.get(k) is not None}}
    raise AssertionError("no per_sample_clip in the noisy rule")


def _set_noise(spec: dict[str, Any], sigma: Any) -> None:
    transforms = spec["transforms"]
    transforms = [transforms] if isinstance(transforms, (str, Mapping)) else list(transforms)
    for i, t in enumerate(transforms):
        name, args = T.parse_spec(t)
        if name == CLIP:
            transforms[i] = {"name": CLIP, **args, "noise_multiplier": sigma}
    spec["transforms"] = transforms
