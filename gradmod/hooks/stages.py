"""The stages, in one table: when a rule's transforms act on a parameter's gradient.

``STAGES`` lists them in the order they finish writing a gradient, which is the order of
the plan (``HookSet.describe``) and of ``HookSet.after_backward``:

* ``penalty``: a term the loss gains from its own gradient (``grad_penalty``,
  ``input_grad_penalty``), added in ``HookSet.backward`` before the backward that fills
  ``.grad``, which every other stage then sees (``gradmod.hooks.penalty``).
* ``hook``: ``Tensor.register_hook`` on the parameter (or a module's output); each
  backward's local gradient, before it is accumulated into ``.grad``.
* ``per_loss``: several losses' gradients of the rule's parameters (or of a module's
  output), combined into one by ``HookSet.backward(losses)`` (``gradmod.hooks.per_loss``).
* ``per_sample``: each example's gradient before the batch sum; the clipped, noised mean
  is written at the start of ``HookSet.after_backward``.
* ``sharpness``: the gradient at the rule's parameters moved to ``w + e``, from a second
  forward and backward that ``HookSet.backward(loss, closure=fn)`` runs
  (``gradmod.hooks.sharpness``).
* ``fused``: the accumulated ``.grad`` tensors after backward, grouped per transform.

Each stage names the transform kinds it runs (``accepts``) and the kind that puts a rule
there whatever the rule's ``stage:`` says (``implied_by``): a group transform runs fused
(all the rule's gradients at once), a per_sample transform per_sample, a per_loss one
per_loss. The kinds are the registry's (``gradmod.hooks.registry.KINDS``).

Each row also says what the stage combines with, as facts that ``gradmod.hooks.compatible``
reads once in ``attach`` (no stage checks another by name): whether it runs the step's
backward itself (``runs_backward``), counts each example's gradient (``counts_examples``),
replaces its parameters' gradient (``replaces_grad``), acts in every backward pass
(``sees_each_pass``) or on the accumulated ``.grad`` in place (``in_place``), and whether its
rules may have a window (``windows``). Code outside the rooms asks these facts too, never a
stage's name: whether a param rule also holds the parameters frozen at attach
(``follows_frozen``), whether ``HookSet.backward`` hands it several named losses
(``several_losses``), why a training loop other than gradmod's cannot drive it
(``foreign_loop``), whether the console's plan marks its rules (``plan_tag``), which
stage counts the examples (``counting_examples()``), and which keeps each example's scores
when a rule asks for them (``keeping_scores()``: a loop hands it each batch's dataset indices).

Each row names the class that runs the stage (``home``, a ``gradmod.hooks.stage.Stage``
in the stage's own folder), loaded on first use: this table stays torch-free for the
command line. A new stage is a row here and a folder.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageFacts:
    """One stage: its name, the transform kinds it runs, the kind that implies it, its class."""

    name: str
    accepts: tuple[str, ...]  # transform kinds a rule at this stage may hold
    implied_by: str | None  # a rule holding a transform of this kind runs here
    default: bool  # may be attach(stage=...)'s default for rules that set none
    modules: bool  # modules: rules (a module's output gradient) run here
    needs_after_backward: bool  # HookSet.after_backward() finishes its work before optimizer.step()
    sees: str = ""  # what its transforms act on, for messages
    home: str = ""  # "module:Class" of the Stage that runs it
    # What it combines with (each a phrase for messages where it holds, "" where not):
    runs_backward: str = ""  # it runs the step's backward itself: how
    counts_examples: str = ""  # it counts each example's gradient once per step: why that matters
    replaces_grad: str = ""  # it writes its parameters' gradient itself: the gradient it replaces
    sees_each_pass: bool = False  # its hooks act in every backward pass that reaches a tensor
    in_place: bool = False  # it transforms the accumulated .grad in place, after backward
    windows: bool = False  # a rule here may have an ``active`` window (the others act every step)
    # rule keys of its own -> the one line for a rule at another stage that gives one
    rule_keys: tuple[tuple[str, str], ...] = ()
    follows_frozen: bool = False  # a param rule also holds the frozen parameters its globs match
    several_losses: bool = False  # HookSet.backward(losses) hands it several named losses
    foreign_loop: str = ""  # why a loop not gradmod's ({trainer}) cannot drive it, for its one line
    plan_tag: bool = False  # the console's plan marks its rules [name]
    model_input: bool = False  # its modules rules read a module's input, not its output (@input: the model's)
    differentiates_inputs: bool = False  # its modules rules differentiate the loss by a module's input
    scores: bool = False  # a rule here may keep each example's scores (transforms: [scores]; see_batch, take_scores)


STAGES: tuple[StageFacts, ...] = (
    StageFacts(
        "penalty",
        ("penalty",),
        "penalty",
        default=False,
        modules=True,
        needs_after_backward=True,
        sees="the loss's own gradient, differentiated (a term added to the loss)",
        home="gradmod.hooks.penalty.stage:PenaltyStage",
        windows=True,
        model_input=True,
        differentiates_inputs=True,
        foreign_loop=(
            "penalty rules (a term of the loss's own gradient) are refused under {trainer}: it calls backward "
            "on the loss itself, and the term is added in hooks.backward(loss); train with gradmod's trainer "
            "(gradmod +hooks=grad_penalty), or add the term in your own loss (docs/guide/penalties.md)"
        ),
        plan_tag=True,
    ),
    StageFacts(
        "hook",
        ("elementwise",),
        None,
        default=True,
        modules=True,
        needs_after_backward=False,
        sees="each backward's local gradient",
        home="gradmod.hooks.hook.stage:HookStage",
        sees_each_pass=True,
        windows=True,
    ),
    StageFacts(
        "per_loss",
        ("per_loss",),
        "per_loss",
        default=False,
        modules=True,
        needs_after_backward=False,
        sees="each loss's gradient",
        home="gradmod.hooks.per_loss.stage:PerLossStage",
        runs_backward="its method runs the backward passes of several losses itself",
        replaces_grad="the gradient that its method's update replaces",
        rule_keys=(("rows", "only a per_loss rule on modules (its output's task gradients) has rows"),),
        several_losses=True,
        foreign_loop=(
            "per_loss rules combine the gradients of several named losses through hooks.backward(losses), "
            "and {trainer} calls backward on one summed loss itself; train with gradmod's trainer (python "
            "train.py +hooks=upgrad) or call hooks.backward(losses) in your own loop"
        ),
    ),
    StageFacts(
        "per_sample",
        ("per_sample",),
        "per_sample",
        default=False,
        modules=False,
        needs_after_backward=True,
        sees="each example's gradient",
        home="gradmod.hooks.per_sample.stage:PerSampleStage",
        counts_examples="the privacy accounting counts one gradient per example per step",
        replaces_grad="the batch gradient that the per_sample stage replaces",
        follows_frozen=True,
        scores=True,
        foreign_loop=(
            "per_sample rules (per-example clipping, DP-SGD) are refused under {trainer}: its loop scales the "
            "loss for accumulation and samples fixed-size batches, so neither the clipping nor an epsilon "
            "would be true; train with gradmod's trainer (python train.py +hooks=dp) or attach the rules in "
            "your own loop (gradmod.PoissonSampler, gradmod.Accountant)"
        ),
        plan_tag=True,
    ),
    StageFacts(
        "sharpness",
        ("sharpness",),
        "sharpness",
        default=False,
        modules=False,
        needs_after_backward=True,
        sees="the gradient at the rule's parameters moved by a second forward and backward",
        home="gradmod.hooks.sharpness.stage:SharpnessStage",
        runs_backward="it runs a second forward and backward itself",
        foreign_loop=(
            "sharpness rules (SAM) are refused under {trainer}: its loop runs the backward itself, and SAM "
            "needs a second forward and backward at the moved weights; train with gradmod's trainer (gradmod "
            "+hooks=sam), or attach the rules in your own loop (Lightning: manual optimisation) and call "
            "hooks.backward(loss, closure=fn)"
        ),
    ),
    StageFacts(
        "fused",
        ("elementwise", "group"),
        "group",
        default=True,
        modules=False,
        needs_after_backward=True,
        sees="all the rule's accumulated .grad after backward",
        home="gradmod.hooks.fused.stage:FusedStage",
        in_place=True,
        windows=True,
        plan_tag=True,
    ),
)

_BY_NAME = {s.name: s for s in STAGES}
DEFAULT = "hook"  # a rule's stage when neither the rule nor attach(stage=...) sets one


def get(name: str) -> StageFacts:
    """The stage called ``name``; a KeyError for an unknown name (callers word their own error)."""
    return _BY_NAME[name]


def names() -> tuple[str, ...]:
    """The stage names in order."""
    return tuple(s.name for s in STAGES)


def default_names() -> tuple[str, ...]:
    """The stages a rule may get when it sets none (``attach(stage=...)``)."""
    return tuple(s.name for s in STAGES if s.default)


def order(name: str) -> int:
    """The stage's position: a smaller one acts on a gradient before a larger one."""
    return STAGES.index(_BY_NAME[name])


def implied_by(kind: str) -> StageFacts | None:
    """The stage a transform of ``kind`` forces on its rule, or None (element-wise: the rule's choice)."""
    return next((s for s in STAGES if s.implied_by == kind), None)


def counting_examples() -> str:
    """The stage that counts each example's gradient once per step: its rules clip per example
    and add the noise that the privacy accounting reads."""
    (name,) = (s.name for s in STAGES if s.counts_examples)
    return name


def keeping_scores() -> str:
    """The stage whose rules may keep each example's scores (``scores``): a loop tells it which
    examples each batch holds (``see_batch``) and reads them out (``take_scores``)."""
    (name,) = (s.name for s in STAGES if s.scores)
    return name


def stage_class(name: str) -> Any:
    """The ``gradmod.hooks.stage.Stage`` subclass that runs stage ``name`` (imports torch)."""
    module, cls = get(name).home.split(":")
    return getattr(importlib.import_module(module), cls)
