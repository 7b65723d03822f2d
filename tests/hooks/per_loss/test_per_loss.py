"""The per_loss stage against torchjd 0.18: weights on random Gramians, one step's .grad on a
shared-trunk model, loss weightings over many steps; its refusals, statistics and state."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchjd.aggregation as tja  # the reference implementation (a test dependency, torchjd[full])
import torchjd.scalarization as tjs
from torch import nn
from torchjd.autojac import backward as tj_backward
from torchjd.autojac import jac_to_grad

import gradmod
from gradmod.hooks.per_loss.methods import bases as M

SEEDED = {"pcgrad", "random", "graddrop", "gradvac"}  # draw from the generator: same seed, same draws
SOLVER = {"cagrad", "nash_mtl"}  # a numerical solver on both sides: 1e-4
REFERENCE = {
    "pcgrad": lambda k: tja.PCGrad(),
    "mgda": lambda k: tja.MGDA(),
    "cagrad": lambda k: tja.CAGrad(c=0.5),
    "imtl_g": lambda k: tja.IMTLG(),
    "aligned_mtl": lambda k: tja.AlignedMTL(),
    "upgrad": lambda k: tja.UPGrad(),
    "dualproj": lambda k: tja.DualProj(),
    "gradvac": lambda k: tja.GradVac(),
    "mean": lambda k: tja.Mean(),
    "sum": lambda k: tja.Sum(),
    "random": lambda k: tja.Random(),
    "nash_mtl": lambda k: tja.NashMTL(n_tasks=k),
    "graddrop": lambda k: tja.GradDrop(),
}
GRAMIAN = sorted(m for m in REFERENCE if m != "graddrop")


def _jacobian(k: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    J = torch.randn(k, d, generator=g, dtype=torch.float64)
    J[0] = -0.7 * J[1] + 0.3 * J[0]  # at least one conflicting pair
    return J


@pytest.mark.parametrize("name", GRAMIAN)
@pytest.mark.parametrize("k", [2, 3, 5])
def test_weights_equal_torchjd_on_random_jacobians(name, k):
    method, ref = M.build(name, {}), REFERENCE[name](k)
    gen = torch.Generator()
    for seed in range(4):  # several calls: the stateful methods carry their state along
        J = _jacobian(k, 40, 100 * k + seed)
        torch.manual_seed(seed)
        expected = ref(J)
        gen.manual_seed(seed)
        got = method.weights(J @ J.T, gen) @ J
        tol = 1e-4 if name in SOLVER else 1e-10
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
@pytest.mark.parametrize("k", [10, 16])
def test_dual_cone_weights_equal_torchjd_with_many_tasks(name, k):
    """The k bound-constrained problems solved together, against torchjd's quadprog."""
    method, ref = M.build(name, {}), REFERENCE[name](k)
    for seed in range(3):
        J = _jacobian(k, 3 * k, 7 * k + seed)
        torch.testing.assert_close(method.weights(J @ J.T, torch.Generator()) @ J, ref(J), rtol=0, atol=1e-10)


def test_bound_qps_meet_the_optimality_conditions():
    """v >= u, the multipliers H v >= 0 on the bounds and 0 off them, on ill-conditioned and
    degenerate H too (repeated, opposite and zero task gradients)."""
    from gradmod.hooks.per_loss.methods import solvers

    rng = np.random.default_rng(0)
    for trial in range(400):
        k = int(rng.integers(2, 17))
        J = rng.standard_normal((k, int(rng.integers(1, 30))))
        if trial % 4 == 1 and k > 2:  # repeated and opposite task gradients: degenerate problems
            J[1:3] = J[0], -J[0]
        if trial % 4 == 2:  # a task with no gradient
            J[-1] = 0.0
        H = J @ J.T + (1e-4 if trial % 4 != 3 else 1e-12) * np.eye(k)
        U = rng.random((k, k)) * (rng.random((k, k)) < 0.6)
        V = solvers.bound_qps(H, U)
        lam, scale = V @ H, 1e-9 * (1 + np.abs(H).max()) * (1 + np.abs(V).max())
        assert (V >= U).all()
        assert (lam >= -scale).all()
        assert (np.abs(lam * (V - U)) <= scale * (1 + np.abs(V - U))).all()
        np.testing.assert_array_equal(solvers.bound_qp(H, U[0]), V[0])


def test_graddrop_equals_torchjd_on_a_random_jacobian():
    J = _jacobian(4, 50, 7)
    torch.manual_seed(3)
    expected = tja.GradDrop()(J)
    U = torch.rand(J.shape[1], generator=torch.Generator().manual_seed(3), dtype=J.dtype)
    torch.testing.assert_close(M.build("graddrop", {}).aggregate(J, U), expected, rtol=1e-12, atol=1e-12)


class Shared(nn.Module):
    """A shared trunk (Linear layers, or convolutions then Linear) and one head per task."""

    def __init__(self, k: int, conv: bool = False):
        super().__init__()
        if conv:
            self.trunk = nn.Sequential(
                nn.Conv2d(1, 3, 3),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(3, 4, 3, padding=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(4 * 3 * 3, 12),
                nn.ReLU(),
            )
        else:
            self.trunk = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU())
        self.heads = nn.ModuleDict(
            {f"t{i}": nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)) for i in range(k)}
        )

    def forward(self, x):
        z = self.trunk(x)
        return {name: h(z) for name, h in self.heads.items()}


def _batch(k: int, conv: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 1, 8, 8, generator=g) if conv else torch.randn(6, 10, generator=g)
    ys = {f"t{i}": torch.randint(0, 3, (6,), generator=g) for i in range(k)}
    return x.double(), ys


def _losses(model, x, ys):
    out = model(x)
    return {n: F.cross_entropy(out[n], ys[n]) for n in out}


def _reference_grads(model, x, ys, aggregator, seed):
    """torchjd: the trunk's Jacobian aggregated into .grad; the heads the gradient of the sum."""
    losses = _losses(model, x, ys)
    trunk = list(model.trunk.parameters())
    heads = list(model.heads.parameters())
    head_grads = torch.autograd.grad(sum(losses.values()), heads, retain_graph=True)
    tj_backward(list(losses.values()), inputs=trunk)
    torch.manual_seed(seed)
    jac_to_grad(trunk, aggregator)
    for p, g in zip(heads, head_grads):
        p.grad = g
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("k", [2, 5])
def test_one_step_grad_equals_torchjd(name, k):
    torch.manual_seed(0)
    model = Shared(k).double()
    x, ys = _batch(k, False)
    expected = _reference_grads(copy.deepcopy(model), x, ys, REFERENCE[name](k), seed=11)
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [name]}})
    hooks.stage("per_loss").generator.manual_seed(11)
    hooks.backward(_losses(model, x, ys))
    tol = 1e-4 if name in SOLVER else 1e-6
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=tol, atol=tol, msg=n)


@pytest.mark.parametrize("name", ["pcgrad", "upgrad", "mgda", "graddrop"])
def test_one_step_grad_equals_torchjd_with_convolutions(name):
    torch.manual_seed(1)
    model = Shared(3, conv=True).double()
    x, ys = _batch(3, True)
    expected = _reference_grads(copy.deepcopy(model), x, ys, REFERENCE[name](3), seed=5)
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [name]}})
    hooks.stage("per_loss").generator.manual_seed(5)
    hooks.backward(_losses(model, x, ys))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["upgrad", "mgda", "pcgrad"])
def test_modules_rule_aggregates_the_representation_gradient(name):
    """A hand-written reference: the task gradients of the trunk's output, aggregated by
    torchjd, pushed through the trunk; the heads the gradient of the sum."""
    torch.manual_seed(2)
    k = 3
    model = Shared(k).double()
    x, ys = _batch(k, False)
    ref = copy.deepcopy(model)
    z = ref.trunk(x)
    losses = [F.cross_entropy(h(z), ys[n]) for n, h in ref.heads.items()]
    Jz = torch.stack([torch.autograd.grad(L, z, retain_graph=True)[0] for L in losses])
    torch.manual_seed(4)
    agg = REFERENCE[name](k)(Jz.flatten(1)).view_as(z)
    heads = list(ref.heads.parameters())
    head_grads = torch.autograd.grad(sum(losses), heads, retain_graph=True)
    z.backward(agg)
    for p, g in zip(heads, head_grads):
        p.grad = g
    hooks = gradmod.attach(model, {"rep": {"modules": "trunk", "stage": "per_loss", "transforms": [name]}})
    hooks.stage("per_loss").generator.manual_seed(4)
    hooks.backward(_losses(model, x, ys))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=n)


def _train_weighting(name, args, scalarizer, steps=100, epoch=10):
    """``steps`` SGD steps with gradmod's weighting and with torchjd's scalarizer, side by side.
    FAMO: by default both update from the same batch's losses after the step; with
    ``update_from: next_batch`` ours takes the next batch's losses, so torchjd's is given those."""
    torch.manual_seed(3)
    k = 3
    ours, theirs = Shared(k).double(), None
    theirs = copy.deepcopy(ours)
    hooks = gradmod.attach(ours, {"w": {"params": "*", "transforms": [{"name": name, **args}]}})
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.05)
    extra = list(scalarizer.parameters()) if name == "uw" else []
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.05)
    opt_s = torch.optim.Adam(extra, lr=args.get("lr", 0.001)) if extra else None
    for step in range(steps):
        x, ys = _batch(k, False, seed=step)
        next_batch = args.get("update_from") == "next_batch"
        opt_a.zero_grad()
        hooks.backward(_losses(ours, x, ys))
        opt_a.step()
        if name == "famo" and not next_batch:
            with torch.no_grad():
                hooks.after_step(_losses(ours, x, ys))
        opt_b.zero_grad()
        L = torch.stack(list(_losses(theirs, x, ys).values()))
        if name == "famo" and next_batch and step > 0:
            scalarizer.update(L)
        scalarizer(L).backward()
        opt_b.step()
        if name == "famo" and not next_batch:
            with torch.no_grad():
                scalarizer.update(torch.stack(list(_losses(theirs, x, ys).values())))
        if opt_s is not None:
            opt_s.step()
            opt_s.zero_grad()
        if (step + 1) % epoch == 0:
            hooks.end_epoch()
            if name == "dwa":
                scalarizer.step()
    return ours, theirs


@pytest.mark.parametrize(
    "name,args,make",
    [
        ("geometric_mean", {}, lambda: tjs.GeometricMean()),
        ("uw", {"lr": 0.01}, lambda: tjs.UW(3)),
        ("dwa", {}, lambda: tjs.DWA()),
        ("famo", {}, lambda: tjs.FAMO(3)),
        ("famo", {"update_from": "next_batch"}, lambda: tjs.FAMO(3)),
        ("famo", {"min_losses": [0.1, 0.3, 0.05]}, lambda: tjs.FAMO(3, min_losses=torch.tensor([0.1, 0.3, 0.05]))),
    ],
)
def test_loss_weightings_equal_torchjd_scalarization_over_100_steps(name, args, make):
    ours, theirs = _train_weighting(name, args, make())
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize(
    "method, when, words",
    [
        ({"name": "famo", "min_losses": [0.1, 0.2]}, "backward", "hooks.w: .*'famo': min_losses has 2 values for 3 "),
        ({"name": "graddrop", "leak": [0.1, 0.2]}, "backward", "hooks.w: .*'graddrop': leak has 2 values for 3 losses"),
        ({"name": "famo", "min_losses": 0.1}, "attach", "min_losses=0.1 must be a list of numbers, one per loss"),
        ({"name": "graddrop", "leak": 0.5}, "attach", "leak=0.5 must be a list of numbers, one per loss"),
        ({"name": "famo", "min_losses": [0.1, "a", 0.0]}, "attach", "min_losses\\[1\\]='a' must be a finite number"),
        ({"name": "graddrop", "leak": [0.1, 2, 0.0]}, "attach", "leak\\[1\\]=2 must be a number >= 0.0 and <= 1.0"),
        ({"name": "uw", "init": float("inf")}, "attach", "init=inf must be a number >= -50.0 and <= 50.0"),
    ],
)
def test_a_per_task_argument_that_does_not_fit_is_one_line(method, when, words):
    """A scalar where a list of one number per loss belongs raised a TypeError (a traceback
    from the command line); a list of another length was refused without the rule's name."""
    model = Shared(3).double()
    x, ys = _batch(3, False, seed=0)
    with pytest.raises(ValueError, match=words) as e:
        hooks = gradmod.attach(model, {"w": {"params": "*", "transforms": [method]}})
        assert when == "backward", "refused only at the backward"
        hooks.backward(_losses(model, x, ys))
    assert "\n" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("weight_decay", [0.0, 0.001])
def test_the_weightings_host_adam_equals_torchs_adam_and_resumes_it(weight_decay):
    """uw's and famo's Adam on host floats equals ``torch.optim.Adam`` in float64 to rounding,
    and each resumes from the other's state dict (a checkpoint either way)."""
    from gradmod.hooks.per_loss.methods.loss_weightings import HostAdam

    g = torch.Generator().manual_seed(0)
    start = [0.3, -0.2, 0.0, 1.5]
    ours = HostAdam(start, lr=0.025, weight_decay=weight_decay)
    theirs = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theirs], lr=0.025, weight_decay=weight_decay)
    for step in range(60):
        grad = torch.randn(4, generator=g, dtype=torch.float64)
        ours.step(grad.tolist())
        theirs.grad = grad
        opt.step()
        torch.testing.assert_close(
            torch.tensor(ours.values, dtype=torch.float64), theirs.detach(), rtol=1e-12, atol=1e-14
        )
        if step == 20:  # torch's Adam resumed from our checkpoint
            opt = torch.optim.Adam([theirs], lr=0.025, weight_decay=weight_decay)
            opt.load_state_dict(copy.deepcopy(ours.state_dict()))
        if step == 40:  # ours resumed from torch's
            ours = HostAdam(theirs.tolist(), lr=0.025, weight_decay=weight_decay)
            ours.load_state_dict(copy.deepcopy(opt.state_dict()))


class OneLinearHeads(nn.Module):
    def __init__(self, k: int = 3):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU())
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(12, 3) for i in range(k)})

    def forward(self, x):
        z = self.trunk(x)
        return {n: h(z) for n, h in self.heads.items()}


@pytest.mark.parametrize("name", ["sum", "mean", "random", "geometric_mean", "uw", "dwa", "famo"])
def test_loss_weightings_take_one_ordinary_backward(name):
    """A method whose weights need no task gradient: the matmuls of one plain backward of the
    sum, no batched pass, each loss's backward once (the step's dispatched ops, deterministic)."""
    from gradmod.testing.opcount import OpCounter

    def matmuls(rule):
        torch.manual_seed(0)
        model = OneLinearHeads()
        x, ys = _batch(3, False)
        hooks = gradmod.attach(model, {"mtl": rule}) if rule else None
        for _ in range(2):  # the second step: past the first forward's trace
            model.zero_grad(set_to_none=True)
            losses = _losses(model, x.float(), ys)
            with OpCounter() as ops:
                hooks.backward(losses) if hooks else sum(losses.values()).backward()
        return {op: n for op, n in ops.by_op.items() if "mm" in op or "softmax_backward" in op}

    plain = matmuls(None)
    assert plain == {"aten.mm.default": 9, "aten._log_softmax_backward_data.default": 3}
    for params in ("trunk.*", "*"):  # a part of the model, the shipped weighting files' every parameter
        assert matmuls({"params": params, "transforms": [name]}) == plain, params


def test_statistics_are_the_task_gradients_norms_cosines_and_conflicts():
    torch.manual_seed(5)
    model = Shared(3).double()
    x, ys = _batch(3, False)
    losses = _losses(model, x, ys)
    trunk = list(model.trunk.parameters())
    J = torch.stack(
        [torch.cat([g.flatten() for g in torch.autograd.grad(L, trunk, retain_graph=True)]) for L in losses.values()]
    )
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["mgda"]}})
    hooks.backward(_losses(model, x, ys))
    stats = hooks.read_stats()["mtl/mgda"]
    norms = J.norm(dim=1)
    for i, n in enumerate(losses):
        assert stats[f"norm/{n}"] == pytest.approx(norms[i].item(), rel=1e-9)
    cos = (J[0] @ J[1] / (norms[0] * norms[1])).item()
    assert stats["cos/t0,t1"] == pytest.approx(cos, rel=1e-9)
    G = J @ J.T
    conflicts = sum(float(G[i, j] < 0) for i in range(3) for j in range(i + 1, 3)) / 3
    assert stats["conflict"] == pytest.approx(conflicts)
    w = M.build("mgda", {}).weights(G, torch.Generator())
    assert [stats[f"weight/{n}"] for n in losses] == pytest.approx(w.tolist(), rel=1e-9)
    assert stats["calls"] == 1


def test_task_statistics_of_a_window_fold_the_same_across_reads_and_checkpoints():
    """The calls' statistics are formed when read: a window split by a checkpoint gives the
    same bits as one read, and the means equal a per-call computation by hand."""
    from gradmod.hooks.per_loss.record import TaskRecord

    g = torch.Generator().manual_seed(0)
    calls = []
    for c in range(9):
        J = torch.randn(3, 5, generator=g, dtype=torch.float64)
        calls.append((None if c == 4 else J @ J.T, torch.rand(3, generator=g, dtype=torch.float64)))
    whole, split = TaskRecord(), TaskRecord()
    for c, (G, w) in enumerate(calls):
        whole.add(["a", "b", "c"], G, w)
        split.add(["a", "b", "c"], G, w)
        if c == 5:
            resumed = TaskRecord()
            resumed.load_state_dict(split.state_dict())
            split = resumed
    (n, one), (m, two) = whole.take(), split.take()
    assert n == m == 9 and torch.equal(one, two)
    stats = whole.summarize(n, one.tolist())
    norms = torch.stack([G.diagonal().sqrt() if G is not None else torch.zeros(3) for G, _ in calls])
    assert stats["norm/b"] == pytest.approx(norms[:, 1].mean().item(), rel=1e-12)
    cos = [G[0, 2] / (G[0, 0] * G[2, 2]).sqrt() if G is not None else torch.tensor(0.0) for G, _ in calls]
    assert stats["cos/a,c"] == pytest.approx(torch.stack(cos).mean().item(), rel=1e-12)
    assert stats["weight/c"] == pytest.approx(torch.stack([w[2] for _, w in calls]).mean().item(), rel=1e-12)


@pytest.mark.parametrize("name", ["gradvac", "pcgrad", "famo", "uw", "nash_mtl"])
def test_resume_from_state_dict_is_bit_identical(name):
    def run(model, hooks, opt, steps):
        for step in steps:
            x, ys = _batch(3, False, seed=step)
            opt.zero_grad()
            hooks.backward(_losses(model, x, ys))
            opt.step()

    params = "*" if name in ("famo", "uw") else "trunk.*"
    rules = {"mtl": {"params": params, "transforms": [name]}}
    torch.manual_seed(6)
    straight = Shared(3).double()
    start = copy.deepcopy(straight)
    hooks = gradmod.attach(straight, rules)
    hooks.stage("per_loss").generator.manual_seed(9)
    opt = torch.optim.SGD(straight.parameters(), lr=0.1)
    run(straight, hooks, opt, range(6))

    first = copy.deepcopy(start)
    hooks = gradmod.attach(first, rules)
    hooks.stage("per_loss").generator.manual_seed(9)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    run(first, hooks, opt, range(3))
    state, model_state = copy.deepcopy(hooks.state_dict()), copy.deepcopy(first.state_dict())
    hooks.remove()

    resumed = copy.deepcopy(start)
    resumed.load_state_dict(model_state)
    hooks = gradmod.attach(resumed, rules)
    hooks.load_state_dict(state)
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    run(resumed, hooks, opt, range(3, 6))
    for (n, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), n


def test_refusals_are_one_line():
    model = Shared(2).double()
    x, ys = _batch(2, False)
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["pcgrad"]}})
    with pytest.raises(ValueError, match=r"hooks\.mtl: a per_loss rule .* got one scalar"):
        hooks.backward(sum(_losses(model, x, ys).values()))
    with pytest.raises(ValueError, match="got one"):
        hooks.backward({"t0": _losses(model, x, ys)["t0"]})
    with pytest.raises(RuntimeError, match=r"hooks\.mtl: .*through hooks.backward"):
        sum(_losses(model, x, ys).values()).backward()
    hooks.remove()
    bad = [
        ({"a": {"params": "trunk.*", "transforms": ["pcgrad", "mgda"]}}, "exactly one"),
        ({"a": {"params": "trunk.*", "transforms": ["pcgrad", "clamp"]}}, "'clamp' cannot run at stage 'per_loss'"),
        ({"a": {"params": "trunk.*", "stage": "fused", "transforms": ["upgrad"]}}, "stage 'per_loss' only"),
        ({"a": {"params": "trunk.*", "transforms": [{"name": "cagrad", "c": -1}]}}, "c=-1"),
        ({"a": {"params": "trunk.*", "transforms": [{"name": "mgda", "foo": 1}]}}, "unknown argument"),
        (
            {
                "a": {"params": "trunk.*", "transforms": ["upgrad"]},
                "b": {"params": "trunk.0.*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]},
            },
            "not both",
        ),
        (
            {
                "a": {"params": "trunk.*", "transforms": ["upgrad"]},
                "b": {"params": "trunk.0.*", "transforms": [{"name": "clamp", "bound": 1.0}]},
            },
            "not both",
        ),
        (
            {
                "a": {"params": "trunk.*", "transforms": ["upgrad"]},
                "b": {"params": "trunk.0.*", "transforms": ["mgda"]},
            },
            "also in per_loss rule",
        ),
    ]
    for rules, message in bad:
        with pytest.raises(ValueError, match=message) as e:
            gradmod.attach(model, rules)
        assert "\n" not in str(e.value)


def test_a_fused_rule_after_per_loss_sees_the_aggregate():
    torch.manual_seed(7)
    model = Shared(2).double()
    ref = copy.deepcopy(model)
    x, ys = _batch(2, False)
    hooks = gradmod.attach(ref, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    hooks.backward(_losses(ref, x, ys))
    torch.nn.utils.clip_grad_norm_(list(ref.trunk.parameters()), 0.01)
    hooks = gradmod.attach(
        model,
        {
            "mtl": {"params": "trunk.*", "transforms": ["upgrad"]},
            "clip": {"params": "trunk.*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.01}]},
        },
    )
    hooks.backward(_losses(model, x, ys))
    hooks.after_backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)


def _rank(rank, world, port, rules, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Shared(3).double()
    x, ys = _batch(3, False)
    share = slice(rank * 3, rank * 3 + 3)  # this rank's half of the batch

    def mean_(tensors):
        for t in tensors:
            dist.all_reduce(t)
            t.div_(world)

    hooks = gradmod.attach(model, rules)
    hooks.stage("per_loss").reduce = mean_
    hooks.stage("per_loss").generator.manual_seed(2)
    hooks.backward(_losses(model, x[share], {n: y[share] for n, y in ys.items()}))
    # A params rule's update is already the global one; DDP averages every other gradient.
    own = rules["r"].get("params") == "trunk.*"
    mean_([p.grad for n, p in model.named_parameters() if not (own and n.startswith("trunk"))])
    torch.save({n: p.grad for n, p in model.named_parameters()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [
        {"params": "trunk.*", "transforms": ["upgrad"]},
        {"modules": "trunk", "stage": "per_loss", "transforms": ["mgda"]},
        {"params": "*", "transforms": ["geometric_mean"]},
    ],
)
def test_two_gloo_ranks_equal_one_process_on_the_joined_batch(rule, tmp_path):
    from helpers import free_port, spawn_ranks

    rules = {"r": rule}
    spawn_ranks(_rank, 2, free_port(), rules, str(tmp_path))
    torch.manual_seed(0)
    model = Shared(3).double()
    x, ys = _batch(3, False)
    hooks = gradmod.attach(model, rules)
    hooks.stage("per_loss").generator.manual_seed(2)
    hooks.backward(_losses(model, x, ys))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-6, atol=1e-9, msg=f"rank {rank}: {n}")


class Twice(nn.Module):
    """A trunk whose Linear and Conv each run twice per forward (their task gradient sums the calls)."""

    def __init__(self, k: int):
        super().__init__()
        self.trunk = nn.ModuleDict(
            {"conv": nn.Conv2d(2, 2, 3, padding=1), "norm": nn.GroupNorm(1, 2), "lin": nn.Linear(8, 8)}
        )
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(8, 3) for i in range(k)})

    def forward(self, x):
        t = self.trunk
        h = torch.tanh(t["conv"](torch.tanh(t["conv"](x))))
        h = t["norm"](h).flatten(1)[:, :8]
        z = torch.tanh(t["lin"](torch.tanh(t["lin"](h))))
        return {n: head(z) for n, head in self.heads.items()}


@pytest.mark.parametrize("name", ["upgrad", "pcgrad", "graddrop"])
def test_layers_called_twice_and_other_layers_equal_torchjd(name):
    torch.manual_seed(8)
    model = Twice(3).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 4, 4, generator=g).double()
    ys = {f"t{i}": torch.randint(0, 3, (5,), generator=g) for i in range(3)}
    expected = _reference_grads(copy.deepcopy(model), x, ys, REFERENCE[name](3), seed=5)
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [name]}})
    hooks.stage("per_loss").generator.manual_seed(5)
    hooks.backward(_losses(model, x, ys))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["nash_mtl", "famo"])
def test_scaled_losses_give_the_weights_of_the_unscaled_ones(name):
    """fp16's GradScaler multiplies the losses: the weights must not see the factor."""
    params = "*" if name == "famo" else "trunk.*"
    torch.manual_seed(9)
    model = Shared(3).double()
    ref = copy.deepcopy(model)
    rules = {"mtl": {"params": params, "transforms": [name]}}
    hooks, ref_hooks = gradmod.attach(model, rules), gradmod.attach(ref, rules, replace=False)
    hooks.set_grad_scale(torch.tensor(1024.0))
    for step in range(2):
        x, ys = _batch(3, False, seed=step)
        hooks.backward({n: 1024.0 * L for n, L in _losses(model, x, ys).items()})
        ref_hooks.backward(_losses(ref, x, ys))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad / 1024.0, q.grad, rtol=1e-5, atol=1e-9, msg=n)


def test_bf16_autocast_runs_and_stays_close_to_float32():
    torch.manual_seed(10)
    model = Shared(2)
    ref = copy.deepcopy(model)
    x, ys = _batch(2, False)
    x = x.float()
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = _losses(model, x, ys)
    hooks.backward(losses)
    ref_hooks = gradmod.attach(ref, {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})
    ref_hooks.backward(_losses(ref, x, ys))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=0.1, atol=0.02, msg=n)


def test_fsdp_sharded_parameters_are_refused(monkeypatch):
    import gradmod.hooks.mesh.sharded as S

    monkeypatch.setattr(S, "is_sharded", lambda t: True)
    with pytest.raises(ValueError, match="FSDP-sharded"):
        gradmod.attach(Shared(2), {"mtl": {"params": "trunk.*", "transforms": ["upgrad"]}})


@pytest.mark.parametrize("rescale", [1, 2])
def test_cagrad_rescale_is_libmtls_form(rescale):
    """LibMTL's CAGrad: the simplex point minimising ``x^T G b + c |g_0| sqrt(x^T G x)`` (scipy,
    from the uniform start), the update ``mean + c |g_0| / |J^T x| J^T x``, divided by
    ``1 + c^2`` (rescale 1) or ``1 + c`` (rescale 2); written here from that description."""
    from scipy.optimize import minimize

    J = _jacobian(3, 30, 11)
    G = (J @ J.T).numpy()
    k, c = 3, 0.5
    b = np.full(k, 1.0 / k)
    c_norm = c * np.sqrt(G.mean() + 1e-8)

    def objective(x):
        return x @ G @ b + c_norm * np.sqrt(x @ G @ x + 1e-8)

    x = minimize(objective, b, bounds=[(0, 1)] * k, constraints={"type": "eq", "fun": lambda x: 1 - x.sum()}).x
    gw = torch.from_numpy(x) @ J
    update = J.mean(0) + c_norm / gw.norm() * gw
    expected = update / (1 + c**2 if rescale == 1 else 1 + c)
    got = M.build("cagrad", {"c": c, "rescale": rescale}).weights(torch.from_numpy(G), torch.Generator()) @ J
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rescale=3; allowed: 0, 1, 2"):
        M.build("cagrad", {"rescale": 3})


def test_uw_starts_from_init():
    """LibMTL starts the log-variances at -0.5: the first weights are 0.5 exp(0.5)."""
    losses = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert M.build("uw", {"init": -0.5}).loss_weights(losses, torch.Generator()) == [0.5 * math.exp(0.5)] * 2
    assert M.build("uw", {}).loss_weights(losses, torch.Generator()) == [0.5, 0.5]


def test_nash_mtl_weights_the_heads_by_argument():
    """``heads: weighted`` (LibMTL, the authors): the heads get the gradient of
    ``sum_i alpha_i L_i`` with the uncapped weights; the trunk's update is unchanged."""
    torch.manual_seed(12)
    k = 3
    plain = Shared(k).double()
    weighted = copy.deepcopy(plain)
    x, ys = _batch(k, False)
    gradmod.attach(plain, {"mtl": {"params": "trunk.*", "transforms": ["nash_mtl"]}}).backward(_losses(plain, x, ys))
    hooks = gradmod.attach(
        weighted, {"mtl": {"params": "trunk.*", "transforms": [{"name": "nash_mtl", "heads": "weighted"}]}}
    )
    hooks.backward(_losses(weighted, x, ys))
    alpha = torch.from_numpy(np.array(hooks.stage("per_loss").rules[0].method.alpha)).double()
    ref = copy.deepcopy(plain)
    L = torch.stack(list(_losses(ref, x, ys).values()))
    heads = list(ref.heads.parameters())
    for p, q, g in zip(
        weighted.heads.parameters(), plain.heads.parameters(), torch.autograd.grad((alpha * L).sum(), heads)
    ):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(q.grad, g)  # the default: the plain sum
    for p, q in zip(weighted.trunk.parameters(), plain.trunk.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows", ["examples", "batch"])
def test_modules_rule_rows_follow_torchjd_or_libmtl(rows):
    """``rows: examples`` (default): the Gramian of the output's task gradients over every
    example's entries (torchjd's features, MGDA-UB); ``rows: batch``: of each task's gradient
    summed over the batch first (LibMTL's rep_grad). Either way the per-example task
    gradients, weighted, go down the trunk. Reference: torchjd's UPGrad weighting, by hand."""
    torch.manual_seed(13)
    k = 3
    model = Shared(k).double()
    x, ys = _batch(k, False)
    ref = copy.deepcopy(model)
    z = ref.trunk(x)
    losses = [F.cross_entropy(h(z), ys[n]) for n, h in ref.heads.items()]
    Jz = torch.stack([torch.autograd.grad(L, z, retain_graph=True)[0] for L in losses])  # [k, B, F]
    rows_of = Jz.flatten(1) if rows == "examples" else Jz.sum(1)
    w = tja.UPGradWeighting()(rows_of @ rows_of.T)
    heads = list(ref.heads.parameters())
    head_grads = torch.autograd.grad(sum(losses), heads, retain_graph=True)
    z.backward(torch.tensordot(w, Jz, 1))
    for p, g in zip(heads, head_grads):
        p.grad = g
    rule = {"modules": "trunk", "stage": "per_loss", "transforms": ["upgrad"], "rows": rows}
    hooks = gradmod.attach(model, {"rep": rule})
    hooks.backward(_losses(model, x, ys))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)
    with pytest.raises(ValueError, match=r"hooks\.r\.rows: only a per_loss rule on modules"):
        gradmod.attach(Shared(2), {"r": {"params": "trunk.*", "transforms": ["upgrad"], "rows": "batch"}})
    with pytest.raises(ValueError, match=r"hooks\.r\.rows: 'sum'; allowed: examples, batch"):
        gradmod.attach(Shared(2), {"r": {**rule, "rows": "sum"}})


@pytest.mark.parametrize("case", ["opposite", "zero", "repeated", "tiny", "nearly_opposite"])
def test_nash_mtl_on_degenerate_task_gradients_equals_torchjd(case):
    """Where a convex step has no solution (a task without gradient, two exactly opposite)
    the last weights stay, as torchjd's; where it has one, the same one (1e-8)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(30, generator=g, dtype=torch.float64) for _ in range(2))
    J = {
        "opposite": torch.stack([a, -a]),
        "zero": torch.stack([a, torch.zeros_like(a), b]),
        "repeated": torch.stack([a, a, b]),
        "tiny": torch.stack([1e-8 * a, b]),
        "nearly_opposite": torch.stack([a, -a + 1e-3 * b]),
    }[case]
    method, ref = M.build("nash_mtl", {}), tja.NashMTL(n_tasks=len(J))
    for _ in range(3):
        torch.testing.assert_close(method.weights(J @ J.T, None) @ J, ref(J), rtol=0, atol=1e-8)


def test_nash_mtl_without_ecos_is_refused_in_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ecos" else real(name, *a))
    with pytest.raises(
        ValueError, match=r"per_loss method 'nash_mtl' needs ecos, not installed \(pip install ecos"
    ) as e:
        M.build("nash_mtl", {})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "method", ["sum", "mean", "random", "famo", {"name": "fixed", "weights": [0.5, 1.0, 2.0]}], ids=str
)
def test_only_a_weighting_that_reads_the_losses_reduces_them(method):
    """Under data parallelism a weighting whose weights depend on the loss values (famo)
    averages them across the ranks each step (and reads them to the host); sum, mean and
    random leave them unread, one collective (and one GPU sync) a step fewer, and give the
    same gradients as without a reduce."""
    torch.manual_seed(0)
    model, x, ys = Shared(3).double(), *_batch(3, False)
    twin = copy.deepcopy(model)
    reduced = []
    hooks = gradmod.attach(model, {"r": {"params": "*", "transforms": [method]}})
    hooks.stage("per_loss").reduce = lambda tensors: reduced.append(len(tensors))  # one rank: the mean is itself
    hooks.stage("per_loss").generator.manual_seed(2)
    hooks.backward(_losses(model, x, ys))
    plain = gradmod.attach(twin, {"r": {"params": "*", "transforms": [method]}})
    plain.stage("per_loss").generator.manual_seed(2)
    plain.backward(_losses(twin, x, ys))
    assert reduced == ([1] if method == "famo" else [])
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("params", ["trunk.*", "*"])
@pytest.mark.parametrize("given", ["by_name", "listed"])
def test_fixed_weights_equal_torchjds_constant_aggregator(params, given):
    """``fixed`` on the trunk: torchjd's ``Constant`` of the trunk's Jacobian, the heads the
    plain sum's gradient; on every parameter: autograd of ``sum_i w_i L_i``. By name, the
    weights follow the tasks whatever order the mapping has; float64."""
    k, w = 3, [0.5, -1.5, 2.0]
    torch.manual_seed(0)
    model = Shared(k).double()
    x, ys = _batch(k, False)
    weights = {f"t{i}": w[i] for i in reversed(range(k))} if given == "by_name" else w
    if params == "trunk.*":
        expected = _reference_grads(copy.deepcopy(model), x, ys, tja.Constant(torch.tensor(w, dtype=torch.float64)), 0)
    else:
        ref = copy.deepcopy(model)
        L = _losses(ref, x, ys)
        sum(wi * L[f"t{i}"] for i, wi in enumerate(w)).backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
    hooks = gradmod.attach(model, {"f": {"params": params, "transforms": [{"name": "fixed", "weights": weights}]}})
    hooks.backward(_losses(model, x, ys))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-13, atol=1e-15, msg=n)
    assert hooks.read_stats()["f/fixed"] == {**{f"weight/t{i}": w[i] for i in range(k)}, "calls": 1}


@pytest.mark.parametrize(
    "weights, when, words",
    [
        (
            {"t0": 1.0, "t1": 2.0},
            "backward",
            "weights name t0, t1, the losses are t0, t1, t2; give one weight per loss",
        ),
        ({"t0": 1, "t1": 2, "t2": 3, "t3": 4}, "backward", "weights name t0, t1, t2, t3, the losses are t0, t1, t2"),
        ([1.0, 2.0], "backward", "2 weights for 3 losses; give one per loss"),
        ([], "attach", "weights is empty; give one weight per task"),
        ("t0", "attach", "weights='t0'; give a mapping of task name to weight, or a list in the losses' order"),
        ([1.0, float("inf"), 2.0], "attach", "per_loss method 'fixed': weights\\[1\\]=inf must be a finite number"),
        ({"t0": 1.0, "t1": "x", "t2": 1.0}, "attach", "per_loss method 'fixed': weights\\[t1\\]='x' must be a finite"),
    ],
)
def test_fixed_weights_that_do_not_fit_are_one_line(weights, when, words):
    torch.manual_seed(0)
    model = Shared(3).double()
    x, ys = _batch(3, False)
    rule = {"f": {"params": "*", "transforms": [{"name": "fixed", "weights": weights}]}}
    with pytest.raises(ValueError, match=words) as e:
        hooks = gradmod.attach(model, rule)
        assert when == "backward", "refused only at the backward"
        hooks.backward(_losses(model, x, ys))
    assert str(e.value).startswith("hooks.f") and "\n" not in str(e.value)
