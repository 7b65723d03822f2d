"""One registry of transforms whose entries say their kind, and the stage table it points to."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from gradmod.hooks import attach, registry, stages
from gradmod.hooks import transforms as T
from gradmod.hooks.fused.group import GroupTransform
from gradmod.hooks.per_loss.methods.bases import Method
from gradmod.hooks.stage import Stage


def test_every_shipped_transform_says_its_kind():
    assert set(registry.names("group")) == {"global_norm_clip", "agc", "zclip", "freeze", "autoclip", "orthogonalize"}
    assert registry.names("per_sample") == ["per_sample_clip", "scores"]
    assert {"pcgrad", "mgda", "upgrad"} <= set(registry.names("per_loss"))
    assert {"clamp", "zero", "min_zero", "log", "scale", "sign", "norm_clip", "centralize", "noise"} <= set(
        registry.names("elementwise")
    )
    assert registry.entry("log").observer and not registry.entry("clamp").observer
    assert "per_sample" in registry.entry("log").at_stage  # log keeps per-example statistics there
    assert [registry.entry(n).stage for n in ("clamp", "agc", "per_sample_clip", "pcgrad")] == [
        None,
        "fused",
        "per_sample",
        "per_loss",
    ]


def test_stage_table_order_and_kinds():
    assert [s.name for s in stages.STAGES] == ["penalty", "hook", "per_loss", "per_sample", "sharpness", "fused"]
    assert stages.names() == ("penalty", "hook", "per_loss", "per_sample", "sharpness", "fused")
    assert stages.order("penalty") < stages.order("hook")  # the term is in the loss before any gradient
    assert stages.default_names() == ("hook", "fused")
    assert stages.order("hook") < stages.order("per_loss") < stages.order("per_sample") < stages.order("fused")
    assert stages.order("per_sample") < stages.order("sharpness") < stages.order("fused")
    assert {k: stages.implied_by(k).name for k in ("group", "per_sample", "per_loss", "sharpness", "penalty")} == {
        "penalty": "penalty",
        "group": "fused",
        "per_sample": "per_sample",
        "per_loss": "per_loss",
        "sharpness": "sharpness",
    }
    assert stages.implied_by("elementwise") is None
    # every kind runs at some stage, every stage runs only known kinds
    assert {k for s in stages.STAGES for k in s.accepts} == set(registry.KINDS)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"kind": "batch"}, "kind='batch'; allowed: elementwise, group, per_sample, per_loss"),
        ({"kind": "group", "foreach": lambda: None}, "a group transform has no foreach form"),
        ({"kind": "per_sample", "observer": True}, "observer=True is for elementwise transforms only"),
    ],
)
def test_register_refuses_a_bad_kind_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words):
        registry.register("bad_kind", lambda: None, **kwargs)
    assert "bad_kind" not in registry.names()


class UnitNorm(GroupTransform):
    """A plugin's group transform: all the rule's gradients scaled to total L2 norm 1."""

    name = "unit_norm"

    def apply_(self, params, grads):
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        coef = 1.0 / (norm + 1e-6)
        torch._foreach_mul_(grads, coef)
        self.record.add(norm, coef)


def test_a_plugin_group_transform_runs_fused_over_the_whole_rule():
    registry.register("unit_norm", UnitNorm, kind="group")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.randn(5, 4)
    model(x).square().sum().backward()
    expected = [p.grad / torch.cat([q.grad.flatten() for q in model.parameters()]).norm() for p in model.parameters()]
    model.zero_grad()
    hooks = attach(model, {"u": {"params": "*", "transforms": ["unit_norm"]}})  # default stage hook: implied fused
    assert {d["stage"] for d in hooks.describe()} == {"fused"}
    model(x).square().sum().backward()
    hooks.after_backward()
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want)
    assert hooks.read_stats()["u/unit_norm"]["calls"] == 1
    with pytest.raises(ValueError, match="group transform 'unit_norm' .* it runs at stage 'fused' only"):
        attach(model, {"u": {"params": "*", "stage": "hook", "transforms": ["unit_norm"]}})
    hooks.remove()


def test_a_transform_of_another_stage_is_refused_with_what_runs_there():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError) as e:
        attach(model, {"r": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}, "zclip"]}})
    assert "hooks.r.transforms: 'zclip' cannot run at stage 'per_sample'; allowed there: " in str(e.value)
    assert "log" in str(e.value) and "per_sample_clip" in str(e.value)


def test_stages_act_in_the_table_order_and_the_plan_lists_them_so():
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    rules = {
        "twice": {"params": "*", "stage": "fused", "transforms": [{"name": "scale", "factor": 2.0}]},
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1e6}]},
    }
    with attach(model, rules) as hooks:
        assert dict(hooks.chains)["weight"] == ["per_sample_clip", "scale"]  # per_sample before fused
        model(x).square().mean().backward()
        hooks.after_backward()
    for p, g in zip(model.parameters(), plain):  # the per_sample mean (nothing clipped), then doubled
        torch.testing.assert_close(p.grad, 2 * g)


def test_one_door_registers_every_kind_and_exports_the_base_classes():
    import gradmod
    from gradmod.hooks.fused.group import GroupTransform as Group
    from gradmod.hooks.per_loss.methods.bases import Method
    from gradmod.hooks.per_sample.forms.layers import Form, register_form

    assert (gradmod.GroupTransform, gradmod.Method, gradmod.Form) == (Group, Method, Form)
    assert gradmod.register_form is register_form and gradmod.register is registry.register

    class Unit(gradmod.GroupTransform):
        def apply_(self, params, grads):
            torch._foreach_mul_(grads, 2.0)

    class Half(gradmod.Method):
        name = "half_test"

        def weights(self, G, gen):
            return torch.full((G.shape[0],), 0.5, dtype=G.dtype)

    gradmod.register("double_test", Unit, kind="group")
    gradmod.register("half_test", Half, kind="per_loss")
    gradmod.register("negate_test", lambda: torch.neg)
    assert [registry.entry(n).kind for n in ("double_test", "half_test", "negate_test")] == [
        "group",
        "per_loss",
        "elementwise",
    ]
    model = nn.Linear(3, 1, bias=False)
    with attach(model, {"d": {"params": "*", "transforms": ["negate_test", "double_test"], "stage": "fused"}}) as h:
        model(torch.ones(2, 3)).sum().backward()
        h.after_backward()
    torch.testing.assert_close(model.weight.grad, torch.full((1, 3), -4.0))


def test_a_class_of_a_base_registers_as_its_kind_and_another_kind_is_refused_in_one_line():
    """A Method or GroupTransform subclass needs no ``kind=``; given another kind it would
    fail only when a rule first called it, so it is refused when registered."""
    import gradmod

    class Unit(gradmod.GroupTransform):
        def apply_(self, params, grads):
            pass

    class Half(gradmod.Method):
        def weights(self, G, gen):
            return torch.full((G.shape[0],), 0.5, dtype=G.dtype)

    gradmod.register("unit_kindless_test", Unit, overwrite=True)
    gradmod.register("half_kindless_test", Half, overwrite=True)
    assert [registry.entry(n).kind for n in ("unit_kindless_test", "half_kindless_test")] == ["group", "per_loss"]
    for cls, kind in [(Half, "elementwise"), (Half, "group"), (Unit, "per_loss")]:
        with pytest.raises(ValueError, match=rf"is a \w+, so a \w+ transform, not kind={kind!r}") as e:
            gradmod.register("wrong_kind_test", cls, kind=kind)
        assert "\n" not in str(e.value)
    assert "wrong_kind_test" not in registry.names()


def test_a_function_factory_that_builds_no_function_is_refused_at_attach_in_one_line():
    """Registered without a kind (elementwise), a factory function building a Method would
    fail at the first backward ("object is not callable"): refused when the rule is attached."""
    import gradmod

    class Half(gradmod.Method):
        def weights(self, G, gen):
            return torch.full((G.shape[0],), 0.5, dtype=G.dtype)

    gradmod.register("half_by_function_test", lambda: Half())
    with pytest.raises(
        ValueError, match=r"'half_by_function_test': its factory built a Half, .* a Method is kind 'per_loss'"
    ) as e:
        attach(nn.Linear(3, 1), {"r": {"params": "*", "transforms": ["half_by_function_test"]}})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kind, made, message",
    [
        (
            "per_loss",
            lambda: lambda G, gen: None,
            "per_loss method 'made_test': its factory builds a function, not a Method",
        ),
        ("per_loss", lambda: NoWeights(), "a method of kind 'gramian' defines weights, and NoWeights does not"),
        (
            "group",
            lambda: torch.neg,
            "transform 'made_test': its factory built a builtin_function_or_method, where a group",
        ),
    ],
)
def test_a_factory_function_that_builds_the_wrong_thing_for_its_kind_is_one_line_at_attach(kind, made, message):
    """The CLI prints a ValueError as one line; a TypeError from a check of gradmod's own would
    be a traceback, as if gradmod had a bug."""
    registry.register("made_test", made, kind=kind, overwrite=True)
    try:
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            attach(nn.Linear(3, 1), {"r": {"params": "*", "transforms": ["made_test"]}})
        assert "\n" not in str(e.value) and str(e.value).startswith("hooks.r.transforms: ")
    finally:
        registry.unregister("made_test")


class NoWeights(Method):
    """A per_loss method of kind gramian that forgot its ``weights``."""


def test_one_door_registers():
    """``gradmod.register`` is the one door: the former ones are gone, not forwarded."""
    import gradmod.hooks
    import gradmod.hooks.per_loss

    for module, name in [
        (gradmod.hooks, "register"),
        (T, "register"),
        (gradmod.hooks.per_loss, "register"),
        (registry, "register_at_stage"),
        (registry, "register_old_door"),
        (registry, "warn_moved"),
    ]:
        assert not hasattr(module, name), f"{module.__name__}.{name}"
    assert "register" not in gradmod.hooks.__all__


def test_a_stage_is_reached_by_its_name_only():
    """``hooks.stage("per_sample")`` reaches a stage; HookSet has no attribute per stage."""
    hooks = attach(
        nn.Linear(3, 1), {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}}
    )
    assert hooks.stage("per_sample") is hooks.stages[0] and hooks.stage("fused") is None
    assert not any(hasattr(hooks, name) for name in stages.names()) and not hasattr(hooks, "set_per_sample")
    hooks.remove()


def test_the_stage_table_says_which_stage_keeps_scores_and_only_its_class_keeps_them():
    """What a loop asks of the hooks about scores is a fact of the table (``scores``,
    ``keeping_scores()``): that stage's class hands them over (``see_batch``, ``take_scores``),
    every other stage answers ``keeps_scores`` False, and a HookSet reaches the stage by the
    fact where a rule keeps scores."""
    assert [s.name for s in stages.STAGES if s.scores] == [stages.keeping_scores()] == ["per_sample"]
    for facts in stages.STAGES:
        cls = stages.stage_class(facts.name)
        keeper = all(callable(getattr(cls, m, None)) for m in ("see_batch", "take_scores"))
        assert keeper == facts.scores, facts.name
        assert facts.scores or cls.keeps_scores is Stage.keeps_scores, facts.name
    model = nn.Linear(3, 2)
    logged = attach(model, {"l": {"params": "*", "stage": "per_sample", "transforms": ["log"]}})
    assert logged.stage(stages.keeping_scores()) is not None and logged.keeping_scores is None
    scored = attach(model, {"s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}})
    assert scored.keeping_scores is scored.stage(stages.keeping_scores()) is scored.stages[0]
    plain = attach(model, {"c": {"params": "*", "transforms": ["sign"]}})
    assert plain.keeping_scores is None
    plain.remove()


def test_the_catalog_imports_nothing_and_each_row_resolves_to_its_kind():
    """The shipped table is plain strings; each ``module:factory`` it names builds its kind."""
    import ast
    import inspect

    from gradmod.hooks import catalog

    tree = ast.parse(inspect.getsource(catalog))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    bases = registry.kind_bases()
    for name, kind, _, forms in catalog.SHIPPED:
        entry = registry.entry(name)
        assert entry.kind == kind and callable(entry.factory), name
        if kind in bases:
            assert issubclass(entry.factory, bases[kind]), name
        assert (entry.foreach is not None) == ("foreach" in forms), name
        assert set(entry.at_stage) == set(forms.get("at_stage", {})), name
