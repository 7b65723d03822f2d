"""The per_loss stage under hostile use: a nan in one task, a task set that changes, a
loss weighting on a module's output, checkpoints loaded with ``weights_only``, a compiled
model, Lightning and Transformers loops, a malformed method of one's own."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchjd.aggregation as tja  # the reference (a test dependency, torchjd[full])
from helpers import SharedTrunk, lightning_args, nan_task_spares_the_state, per_loss_method, trunk_losses
from torch import nn
from torchjd.autojac import backward as tj_backward
from torchjd.autojac import jac_to_grad

import gradmod
from gradmod.hooks.per_loss import stage as per_loss_stage
from gradmod.integrations.support import attach_for
from gradmod.testing.opcount import OpCounter

OBJ = "tests.support.task_objects"
CPU = ["trainer.device=cpu", "trainer.progress=false", "trainer.threads=1"]
STATEFUL = ["famo", "dwa", "uw", "nash_mtl", "gradvac"]


def _rule(name: str) -> dict:
    params = "*" if name in ("famo", "uw", "dwa") else "trunk.*"
    return {"mtl": {"params": params, "transforms": [name]}}


@pytest.mark.filterwarnings("error")  # no solver's warning leaks out
@pytest.mark.parametrize("name", ["upgrad", "pcgrad", "mgda", "graddrop", "nash_mtl", "modules", "random"])
def test_a_constant_loss_is_a_task_without_gradient(name):
    """A task with no labels in the batch often returns a constant 0 (no graph): its task
    gradient is zero, as for a loss of the graph that does not depend on the parameters
    (it raised "element 0 of tensors does not require grad")."""
    if not per_loss_method(name if name != "modules" else "upgrad"):
        pytest.skip(f"{name} is not registered in this build")
    rule = (
        {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]} if name == "modules" else _rule(name)["mtl"]
    )
    grads = []
    for constant in (True, False):
        model = SharedTrunk(3).double()
        hooks = gradmod.attach(model, {"mtl": rule})
        hooks.stage("per_loss").generator.manual_seed(0)
        losses = trunk_losses(model)
        losses["t2"] = torch.zeros((), dtype=torch.float64) if constant else 0.0 * losses["t2"]
        hooks.backward(losses)
        grads.append([p.grad for p in model.trunk.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
        assert a.abs().sum() > 0 or name == "mgda"  # mgda: the tasks' hull holds 0, its min-norm point


@pytest.mark.parametrize("name", ["upgrad", "dualproj", "imtl_g", "nash_mtl", "cagrad", "mgda", "famo", "uw"])
def test_a_nan_in_one_task_gives_a_nan_update_and_leaves_the_state_alone(name):
    if not per_loss_method(name):
        pytest.skip(f"{name} is not registered in this build")
    nan_task_spares_the_state(_rule(name), name)


@pytest.mark.slow
def test_a_nan_in_one_task_ends_the_run_diverged(compose_cfg, tmp_path):
    from gradmod.app.cli import run
    from gradmod.training.nonfinite import Diverged

    common = [
        *CPU,
        f"data._target_={OBJ}.two_targets",
        "data.batch_size=20",
        "trainer.epochs=1",
        f"model._target_={OBJ}.TwoHeads",
        f"loss._target_={OBJ}.RegNanAt",
        "+loss.per_task=false",
        "metric={cls: accuracy, reg: none}",
        "+hooks=upgrad",
    ]
    with pytest.raises(Diverged, match=r"^diverged: the loss and a parameter became non-finite"):
        run(compose_cfg(*common), tmp_path / "warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no matplotlib warning from an empty panel
        summary = run(compose_cfg(*common, "trainer.nonfinite=skip"), tmp_path / "skip")
    assert summary["status"] == "ok" and summary["skipped_steps"] == 1
    assert (tmp_path / "skip" / "tasks.png").read_bytes()[:4] == b"\x89PNG"  # the per-task plot
    assert not (tmp_path / "skip" / "grad_norms.png").exists()  # per_loss records hold no norm to draw


def test_the_task_plot_draws_what_was_logged_and_nothing_else(tmp_path):
    from gradmod.reporting.plots import has_norms
    from gradmod.reporting.task_plots import has_tasks, loss_rule_keys, plot_tasks

    rows = [
        (s, {"mtl/upgrad": {"norm/a": 1.0, "cos/a,b": -0.2 * s, "conflict": 1.0, "weight/a": 0.5, "calls": 1}})
        for s in (1, 2)
    ]
    history = [
        {"epoch": e, "tasks": {"a": {"test_loss": 1.0 / e, "test_metric": 0.5, "metric": "accuracy"}}} for e in (1, 2)
    ]
    assert loss_rule_keys(rows) == ["mtl/upgrad"] and not has_norms(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_tasks(rows, history, tmp_path / "tasks.png")
        plot_tasks([], history, tmp_path / "history_only.png")  # a loss weighting logged nothing yet
    assert (tmp_path / "tasks.png").read_bytes()[:4] == b"\x89PNG"
    assert not has_tasks([], [{"epoch": 1, "test_loss": 1.0}])
    with pytest.raises(ValueError, match="nothing|no per_loss statistics"):
        plot_tasks([], [{"epoch": 1}], tmp_path / "empty.png")


@pytest.mark.parametrize("name", STATEFUL)
def test_a_changed_task_set_is_one_line_for_a_method_with_state_per_task(name):
    if not per_loss_method(name):
        pytest.skip(f"{name} is not registered in this build")
    model = SharedTrunk().double()
    hooks = gradmod.attach(model, _rule(name))
    hooks.backward(trunk_losses(model))
    losses = trunk_losses(model, 1)
    with pytest.raises(ValueError, match=rf"hooks\.mtl: per_loss method '{name}' keeps a state per task") as e:
        hooks.backward({"t0": losses["t0"], "t2": losses["t2"], "t9": losses["t1"]})
    assert "\n" not in str(e.value)


def test_the_same_tasks_in_another_order_keep_their_state():
    """A method's state is by task: losses given in another order are put back in the first."""
    ours, ref = SharedTrunk().double(), SharedTrunk().double()
    hooks, ref_hooks = gradmod.attach(ours, _rule("uw")), gradmod.attach(ref, _rule("uw"), replace=False)
    for step in range(3):
        losses, ref_losses = trunk_losses(ours, step), trunk_losses(ref, step)
        hooks.backward(dict(reversed(list(losses.items()))))
        ref_hooks.backward(ref_losses)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["uw", "gradvac", "dwa"])
def test_a_resumed_run_keeps_the_tasks_order_of_its_state(name):
    """A method's state is by position in the first backward's order of the tasks: a resumed
    run whose losses come in another order continues as the uninterrupted one (it took the
    resumed run's first order, each task then read another's state)."""

    def steps(model, hooks, at, reverse=False):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in at:
            opt.zero_grad()
            losses = trunk_losses(model, step)
            hooks.backward(dict(reversed(list(losses.items()))) if reverse else losses)
            opt.step()
            hooks.end_epoch()

    straight, first, resumed = SharedTrunk().double(), SharedTrunk().double(), SharedTrunk().double()
    steps(straight, gradmod.attach(straight, _rule(name)), range(4))
    hooks = gradmod.attach(first, _rule(name))
    steps(first, hooks, range(2))
    state = copy.deepcopy(hooks.state_dict())
    resumed.load_state_dict(first.state_dict())
    hooks = gradmod.attach(resumed, _rule(name))
    hooks.load_state_dict(state)
    steps(resumed, hooks, range(2, 4), reverse=True)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)


def test_a_stateless_method_takes_a_changed_task_set():
    model = SharedTrunk().double()
    hooks = gradmod.attach(model, _rule("upgrad"))
    hooks.backward(trunk_losses(model))
    losses = trunk_losses(model, 1)
    hooks.backward({"t0": losses["t0"], "t2": losses["t2"]})
    assert model.trunk[0].weight.grad is not None


@pytest.mark.parametrize("name", ["famo", "dwa", "geometric_mean", "uw"])
def test_a_modules_rule_with_a_loss_weighting_weights_the_output_gradient(name):
    """The weighted sum's gradient enters the trunk through its output; the heads get the
    plain sum's. Reference: the weights from a params rule on the same losses, by hand.
    Each head hands the output its loss's gradient in the one backward of the sum (each
    loss's log-softmax backward runs once); where they cannot be told apart (``head_edges``
    finds none), the weighted sum's own pass to the output, the same gradients."""
    if not per_loss_method(name):
        pytest.skip(f"{name} is not registered in this build")
    model = SharedTrunk().double()
    ref = copy.deepcopy(model)
    hooks = gradmod.attach(model, {"rep": {"modules": "trunk", "stage": "per_loss", "transforms": [name]}})
    method = gradmod.hooks.per_loss.methods.bases.build(name, {})
    for step in range(4):
        model.zero_grad()
        ref.zero_grad()
        with pytest.MonkeyPatch.context() as mp:
            if step >= 2:
                mp.setattr(per_loss_stage, "head_edges", lambda losses, out: None)
            with OpCounter() as ops:
                hooks.backward(trunk_losses(model, step))
        assert ops.by_op["aten._log_softmax_backward_data.default"] == (3 if step < 2 else 6)
        losses = trunk_losses(ref, step)
        L = torch.stack(list(losses.values()))
        w = torch.as_tensor(method.loss_weights(L.detach().clone(), torch.Generator()), dtype=L.dtype)
        trunk, heads = list(ref.trunk.parameters()), list(ref.heads.parameters())
        for p, g in zip(trunk, torch.autograd.grad((w * L).sum(), trunk, retain_graph=True)):
            p.grad = g
        for p, g in zip(heads, torch.autograd.grad(L.sum(), heads)):
            p.grad = g
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14, msg=f"step {step}: {n}")


def test_a_modules_rule_whose_module_never_ran_is_one_line():
    model = SharedTrunk().double()
    hooks = gradmod.attach(model, {"rep": {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]}})
    with torch.no_grad():
        model(torch.randn(2, 6, dtype=torch.float64))
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    losses = {n: h(x).sum() for n, h in model.heads.items()}
    with pytest.raises(ValueError, match=r"hooks\.rep: no module of this modules rule ran in a training forward"):
        hooks.backward(losses)


@pytest.mark.parametrize("name", ["nash_mtl", "gradvac", "famo", "uw", "dwa"])
def test_checkpoints_load_with_weights_only_and_resume_identically(name):
    if not per_loss_method(name):
        pytest.skip(f"{name} is not registered in this build")

    def steps(model, hooks, opt, at):
        for step in at:
            opt.zero_grad()
            hooks.backward(trunk_losses(model, step))
            opt.step()
            hooks.end_epoch()

    straight, first = SharedTrunk().double(), SharedTrunk().double()
    hooks = gradmod.attach(straight, _rule(name))
    steps(straight, hooks, torch.optim.SGD(straight.parameters(), lr=0.1), range(4))
    hooks = gradmod.attach(first, _rule(name))
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    steps(first, hooks, opt, range(2))
    buffer = io.BytesIO()
    torch.save({"hooks": hooks.state_dict(), "model": first.state_dict()}, buffer)
    hooks.remove()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # as gradmod's checkpoint loader reads it
    resumed = SharedTrunk().double()
    resumed.load_state_dict(saved["model"])
    hooks = gradmod.attach(resumed, _rule(name))
    hooks.load_state_dict(saved["hooks"])
    steps(resumed, hooks, torch.optim.SGD(resumed.parameters(), lr=0.1), range(2, 4))
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("method", ["mean", "famo", "fixed"])
def test_hook_stage_rules_on_the_heads_see_their_plain_gradient_beside_a_loss_weighting(method):
    """A loss weighting on the trunk takes the weighted sum's one backward where it may, the
    heads' gradients then divided back by their loss's weight after it; a hook-stage rule
    on a head saw ``w_i`` times its gradient there (a clamp cut the wrong values, ``log``
    read a third of the norm under ``mean``). Such heads get the plain sum's own backward."""
    transform = {"name": "fixed", "weights": [0.5, 2.0, 4.0]} if method == "fixed" else method
    model = SharedTrunk().double()
    hooks = gradmod.attach(
        model,
        {
            "mtl": {"params": "trunk.*", "transforms": [transform]},
            "clip": {"params": "heads.t0.*", "transforms": [{"name": "clamp", "bound": 0.02}]},
            "log": {"params": "heads.t1.weight", "transforms": ["log"]},
        },
    )
    hooks.backward(trunk_losses(model))
    ref = SharedTrunk().double()
    heads = list(ref.heads.parameters())
    expected = torch.autograd.grad(sum(trunk_losses(ref).values()), heads)
    for (n, p), g in zip(model.heads.named_parameters(), expected):
        torch.testing.assert_close(p.grad, g.clamp(-0.02, 0.02) if n.startswith("t0.") else g, msg=n)
    assert hooks.read_stats()["heads.t1.weight"]["norm"] == pytest.approx(float(expected[2].norm()))  # t1.weight


@pytest.mark.parametrize("method", ["upgrad", "mean", "modules"])
@pytest.mark.parametrize("per_sample", ["per_sample_clip", "log"])
def test_a_per_sample_rule_beside_a_per_loss_rule_is_one_line(method, per_sample):
    """The per_sample stage follows one backward of one loss per step; the per_loss stage runs
    its own passes (each head per task, a weighted sum whose heads are scaled back in .grad,
    which the per_sample stage then overwrites). A per_sample rule on other parameters than
    a per_loss rule's raised from inside the backward, or gave the heads a third of their
    gradient under ``mean``: refused when attached."""
    transform = {"name": "per_sample_clip", "max_norm": 1.0} if per_sample == "per_sample_clip" else "log"
    rules = {
        "mtl": (
            {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]}
            if method == "modules"
            else {"params": "trunk.*", "transforms": [method]}
        ),
        "dp": {"params": "heads.*", "stage": "per_sample", "transforms": [transform]},
    }
    with pytest.raises(
        ValueError, match=r"^hooks\.dp: a per_sample rule does not combine with per_loss rule 'mtl'"
    ) as e:
        gradmod.attach(SharedTrunk().double(), rules)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mtl", ["params", "modules"])
def test_a_hook_stage_modules_rule_beside_a_gradient_method_is_one_line(mtl):
    """A gradient method's backward runs one pass per task and then the rest: a hook-stage
    rule on a module's output fired in each (``log`` counted 6 calls a step at k = 3 and
    averaged the tasks' gradients). Refused when attached."""
    rules = {
        "mtl": {"params": "trunk.*", "transforms": ["upgrad"]}
        if mtl == "params"
        else {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"]},
        "watch": {"modules": "trunk.2", "transforms": ["log"]},
    }
    with pytest.raises(
        ValueError, match=r"^hooks\.watch: a hook-stage modules rule \('trunk\.2:output'\) .* rule 'mtl'"
    ) as e:
        gradmod.attach(SharedTrunk().double(), rules)
    assert "\n" not in str(e.value)


def test_a_hook_stage_modules_rule_beside_a_loss_weighting_sees_the_weighted_sums_gradient_once():
    """``mean`` on the trunk, each head its own loss's: one backward, so the output's hook
    fires once and sees the gradient of the weighted sum, as in a plain backward of it."""
    model = SharedTrunk().double()
    hooks = gradmod.attach(
        model,
        {"mtl": {"params": "trunk.*", "transforms": ["mean"]}, "watch": {"modules": "trunk", "transforms": ["log"]}},
    )
    hooks.backward(trunk_losses(model))
    ref = SharedTrunk().double()
    g = torch.Generator().manual_seed(0)  # the draws _losses makes
    z = ref.trunk(torch.randn(5, 6, generator=g, dtype=torch.float64))
    z.retain_grad()
    sum(F.cross_entropy(h(z), torch.randint(0, 3, (5,), generator=g)) for h in ref.heads.values()).div(3).backward()
    stats = hooks.read_stats()["trunk:output"]
    assert stats["calls"] == 1
    assert stats["norm"] == pytest.approx(float(z.grad.norm()))


@pytest.mark.parametrize("trainer", ["Lightning", "Transformers' Trainer"])
def test_per_loss_rules_are_refused_at_set_up_under_lightning_and_transformers(trainer):
    with pytest.raises(ValueError, match=rf"^hooks\.mtl: per_loss rules combine .* and {trainer} calls backward") as e:
        attach_for(trainer, SharedTrunk(), _rule("upgrad"), "hook", scaled=False)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_per_loss_rules_are_refused_when_lightning_sets_up(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed")
    import lightning as L

    from gradmod.integrations.lightning import GradmodCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = SharedTrunk()

        def training_step(self, batch, i):
            x, y = batch
            return sum(F.cross_entropy(o, y) for o in self.net(x).values())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 6), torch.randint(0, 3, (8,))))
    trainer = L.Trainer(
        **lightning_args(
            str(tmp_path),
            max_epochs=1,
            callbacks=[GradmodCallback({"mtl": {"params": "net.trunk.*", "transforms": ["upgrad"]}})],
        )
    )
    with pytest.raises(ValueError, match=r"^hooks\.mtl: per_loss rules combine"):
        trainer.fit(Module(), data)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [_rule("upgrad")]
    + [{"rep": {"modules": "trunk", "stage": "per_loss", "transforms": [m]}} for m in ("upgrad", "geometric_mean")],
    ids=["params", "modules", "modules_weighting"],
)
def test_a_compiled_model_gets_the_eager_models_gradients(rule):
    """torch.compile's backward kernels do not run batched: the stage takes k passes instead
    (a modules rule: the one backward, its output ending a compiled graph; compiled with the
    heads, it was no input of theirs: a TypeError, or a loss weighting that did nothing)."""
    torch._dynamo.reset()  # each case compiles afresh, whatever ran before
    model, ref = SharedTrunk(2), SharedTrunk(2)
    hooks = gradmod.attach(model, rule)
    ref_hooks = gradmod.attach(ref, rule, replace=False)
    net = torch.compile(model)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    for _ in range(2):
        model.zero_grad()
        ref.zero_grad()
        hooks.backward({n: F.cross_entropy(o, y) for n, o in net(x).items()})
        ref_hooks.backward({n: F.cross_entropy(o, y) for n, o in ref(x).items()})
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert hooks.stage("per_loss").batched is ("rep" in rule)  # a modules rule: no batched backward to turn off


def test_a_malformed_method_is_refused_when_registered_or_attached():
    from gradmod.hooks import registry
    from gradmod.hooks.per_loss.methods.bases import Method

    class NotAMethod:
        kind = "gramian"

        def weights(self, G, gen):
            return torch.ones(len(G))

    class NoWeights(Method):
        pass

    class BadKind(Method):
        kind = "tasks"

    for cls, message in [
        (NotAMethod, "builds a NotAMethod, not a Method"),
        (NoWeights, "a method of kind 'gramian' defines weights, and NoWeights does not"),
        (BadKind, "kind='tasks'; allowed: gramian, jacobian, losses"),
    ]:
        with pytest.raises(TypeError, match=message) as e:
            registry.register("mine", cls, kind="per_loss")
        assert "\n" not in str(e.value)
    registry.register("made_by_a_function", lambda: {"weights": None}, kind="per_loss")
    with pytest.raises(ValueError, match="per_loss method 'made_by_a_function': its factory builds a dict"):
        gradmod.attach(SharedTrunk(), {"r": {"params": "trunk.*", "transforms": ["made_by_a_function"]}})


def test_the_own_method_page_runs_as_written():
    """docs/guide/own_method.md: its method registered as written, its YAML rule attached;
    the update is the mean of the unit task gradients, by hand."""
    import re

    import yaml
    from helpers import ROOT

    from gradmod.hooks import registry

    page = (ROOT / "docs" / "guide" / "own_method.md").read_text()
    python = re.findall(r"```python\n(.*?)```", page, re.S)
    (rules,) = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", page, re.S)]
    try:
        exec(compile(python[0], "own_method.md", "exec"), {})
        model = SharedTrunk().double()
        ref = copy.deepcopy(model)
        hooks = gradmod.attach(model, rules)
        hooks.backward(trunk_losses(model))
        losses = list(trunk_losses(ref).values())
        trunk, heads = list(ref.trunk.parameters()), list(ref.heads.parameters())
        rows = [torch.cat([g.flatten() for g in torch.autograd.grad(L, trunk, retain_graph=True)]) for L in losses]
        update = sum(r / r.norm() for r in rows) / len(rows)
        got = torch.cat([p.grad.flatten() for p in model.trunk.parameters()])
        torch.testing.assert_close(got, update, rtol=0, atol=1e-14)
        for p, g in zip(model.heads.parameters(), torch.autograd.grad(sum(losses), heads)):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-14)
        assert "weight/t0" in hooks.read_stats()["unit_mean/unit_mean"]
        with pytest.raises(ValueError, match="per_loss method 'unit_mean': eps=0 must be > 0"):
            gradmod.attach(SharedTrunk(), {"r": {"params": "trunk.*", "transforms": [{"name": "unit_mean", "eps": 0}]}})
    finally:
        registry.unregister("unit_mean")


class _OutMatmul(torch.autograd.Function):
    """A Linear whose backward writes through ``out=``, as torch.compile's kernels do: no
    batching rule, so a batched backward through it fails."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, gw = torch.empty_like(x), torch.empty_like(w)
        torch.mm(g, w, out=gx)
        torch.mm(g.T, x, out=gw)
        return gx, gw


def test_a_backward_that_cannot_run_batched_falls_back_to_k_passes():
    class Trunk(nn.Module):
        """Linears on few rows (a batched backward pays there) behind the op that cannot run batched."""

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 6, dtype=torch.float64))
            self.wide, self.narrow = nn.Linear(8, 64), nn.Linear(64, 8)

        def forward(self, x):
            h = torch.tanh(_OutMatmul.apply(x, self.w))
            return torch.tanh(self.narrow(torch.tanh(self.wide(h))))

    torch.manual_seed(3)
    model = SharedTrunk().double()
    model.trunk = Trunk().double()
    ref = copy.deepcopy(model)
    hooks = gradmod.attach(model, _rule("upgrad"))
    for _ in range(2):  # the first backward traces; the second tries the batched one
        model.zero_grad()
        hooks.backward(trunk_losses(model))
    assert hooks.stage("per_loss").batched is False
    losses = list(trunk_losses(ref).values())
    trunk = list(ref.trunk.parameters())
    rows = torch.stack(
        [torch.cat([g.flatten() for g in torch.autograd.grad(L, trunk, retain_graph=True)]) for L in losses]
    )
    got = torch.cat([p.grad.flatten() for p in model.trunk.parameters()])
    torch.testing.assert_close(got, tja.UPGrad()(rows), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["upgrad", "mgda", "famo", "fixed"])
def test_parameters_frozen_or_unfrozen_after_attach_follow_requires_grad(name):
    """Training freezes and unfreezes layers as it goes (a backbone frozen for some epochs):
    each backward follows ``requires_grad`` as a plain one does. A frozen parameter gets no
    gradient (the rule combines the tasks over its trainable tensors); one unfrozen after
    attach is outside every rule and gets the gradient of the sum. (The parameters that
    trained at attach were kept: a head unfrozen later got none, a frozen Linear got the
    rule's update, a frozen parameter answered directly raised.) Reference: torchjd."""
    method = {"name": "fixed", "weights": [1.0, 2.0, 0.5]} if name == "fixed" else name
    params = "*" if name in ("famo", "fixed") else "trunk.*"
    model = SharedTrunk().double()
    model.heads.t1.requires_grad_(False)
    hooks = gradmod.attach(model, {"mtl": {"params": params, "transforms": [method]}})
    hooks.backward(trunk_losses(model))
    model.heads.t1.requires_grad_(True)
    model.trunk[0].weight.requires_grad_(False)  # answered directly (its rows do not pay)
    model.trunk[2].weight.requires_grad_(False)  # answered from its rows
    model.zero_grad()
    ref = SharedTrunk().double()  # (a deep copy would keep the hooks)
    for p, q in zip(model.parameters(), ref.parameters()):
        q.requires_grad_(p.requires_grad)
    hooks.stage("per_loss").generator.manual_seed(0)
    hooks.backward(trunk_losses(model, 1))

    losses = list(trunk_losses(ref, 1).values())
    frozen = [ref.trunk[0].weight, ref.trunk[2].weight]
    late = list(ref.heads.t1.parameters())  # unfrozen after attach: outside the rule
    trained = [p for p in ref.parameters() if p.requires_grad]
    if name in ("upgrad", "mgda"):
        ruled = [p for p in trained if any(p is q for q in ref.trunk.parameters())]
    else:
        ruled = [p for p in trained if all(p is not q for q in late)]
    rest = [p for p in trained if all(p is not q for q in ruled)]
    for p, g in zip(rest, torch.autograd.grad(sum(losses), rest, retain_graph=True)):
        p.grad = g
    if name in ("upgrad", "mgda"):
        tj_backward(losses, inputs=ruled)
        jac_to_grad(ruled, {"upgrad": tja.UPGrad, "mgda": tja.MGDA}[name]())
    else:  # a loss weighting: the gradient of its weighted sum (famo's, logits at 0: 1 / (L_i sum_j 1 / L_j))
        inverse = [1.0 / (float(loss.detach()) + 1e-8) for loss in losses]
        w = [1.0, 2.0, 0.5] if name == "fixed" else [v / sum(inverse) for v in inverse]
        sum(wi * loss for wi, loss in zip(w, losses)).backward(inputs=ruled)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if any(q is f for f in frozen):
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-12, msg=n)
