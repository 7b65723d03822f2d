"""The per_loss methods torchjd 0.18 ships beside the older ones (ConFIG, FairGrad, Krum,
TrimmedMean, ExcessMTL, PCD, CR-MOGM, MoDo, SDMGrad; the scalarizations COSMOS, IMTL-L,
PBI, STCH), against torchjd itself in float64: on the matrices its aggregation tests use
(``peer_matrices``), in one step of the stage, over many steps for the loss weightings;
and their state, draws, non-finite losses and refusals."""

from __future__ import annotations

import io

import pytest
import torch
import torchjd.aggregation as tja  # the reference implementation (a test dependency, torchjd[full])
import torchjd.scalarization as tjs
from helpers import SharedTrunk, nan_task_spares_the_state, trunk_losses
from peer_matrices import named
from torchjd.autojac import backward as tj_backward
from torchjd.autojac import jac_to_grad

import gradmod
from gradmod.hooks.per_loss.methods import bases as M


def _f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


PER_TASK, PER_SECONDARY = "one per task", "one per secondary task"  # list arguments, made for each k


def _per_task(k: int, top: float = 2.0) -> list[float]:
    """k numbers in [0, top], not all equal."""
    return [top * ((i % 4) / 3.0) for i in range(k)]


def _args(args: dict, k: int) -> dict:
    made = {PER_TASK: _per_task(k), PER_SECONDARY: _per_task(k - 1, 1.0)}
    return {n: made.get(v, v) if isinstance(v, str) else v for n, v in args.items()}


def _on_gramian(weighting):
    """torchjd's weighting of a matrix (MoDo, SDMGrad) given the Gramian: the update ``w^T J``."""
    return lambda J: weighting(J @ J.T) @ J


# name, arguments, torchjd's aggregator, the fewest losses it takes
GRAMIAN = [
    ("config", {}, lambda k: tja.ConFIG(), 2),
    pytest.param(
        "config", {"pref_vector": PER_TASK}, lambda k: tja.ConFIG(_f64(_per_task(k))), 2, marks=pytest.mark.slow
    ),
    pytest.param("fairgrad", {"alpha": 1.0}, lambda k: tja.FairGrad(1.0), 2, marks=pytest.mark.slow),  # 2 minutes
    ("fairgrad", {"alpha": 2.0, "max_iters": 5}, lambda k: tja.FairGrad(2.0, 5), 2),
    ("fairgrad", {"alpha": 0.0}, lambda k: tja.FairGrad(0.0), 2),
    ("krum", {"n_byzantine": 0}, lambda k: tja.Krum(0), 3),
    ("krum", {"n_byzantine": 1, "n_selected": 2}, lambda k: tja.Krum(1, 2), 4),
    ("pcd", {}, lambda k: tja.PCD(), 2),
    ("pcd", {"tau": 0.5, "beta": 0.9, "eps": 0.0}, lambda k: tja.PCD(0.5, 0.9, 0.0), 2),
    ("pcd", {"tau": PER_SECONDARY}, lambda k: tja.PCD(_f64(_per_task(k - 1, 1.0))), 2),
    ("modo", {}, lambda k: _on_gramian(tja.MoDoWeighting()), 2),
    ("modo", {"gamma": 0.5, "rho": 0.0}, lambda k: _on_gramian(tja.MoDoWeighting(0.5, 0.0)), 2),
    ("sdmgrad", {}, lambda k: _on_gramian(tja.SDMGradWeighting()), 2),
    (
        "sdmgrad",
        {"lr": 1.0, "momentum": 0.0, "n_iter": 5, "lambda_": 1.0},
        lambda k: _on_gramian(tja.SDMGradWeighting(1.0, 0.0, 5, 1.0)),
        2,
    ),
    (
        "crmogm",
        {"weighting": "upgrad"},
        lambda k: tja.GramianWeightedAggregator(tja.CRMOGMWeighting(tja.UPGradWeighting())),
        2,
    ),
    pytest.param(
        "crmogm",
        {"weighting": {"name": "mgda", "epsilon": 0.01}, "alpha": 0.5},
        lambda k: tja.GramianWeightedAggregator(tja.CRMOGMWeighting(tja.MGDAWeighting(epsilon=0.01), alpha=0.5)),
        2,
        marks=pytest.mark.slow,
    ),
]
AGGREGATORS = [
    ("trimmed_mean", {"trim_number": 0}, lambda k: tja.TrimmedMean(0), 1),
    ("trimmed_mean", {"trim_number": 1}, lambda k: tja.TrimmedMean(1), 3),
    ("trimmed_mean", {"trim_number": 2}, lambda k: tja.TrimmedMean(2), 5),
    ("excess_mtl", {}, lambda k: tja.ExcessMTL(), 2),
    ("excess_mtl", {"robust_step_size": 0.5, "n_warmup_steps": 2}, lambda k: tja.ExcessMTL(0.5, 2), 2),
    (
        "crmogm",
        {"weighting": "excess_mtl", "alpha": 0.5, "initial_weights": PER_TASK},
        lambda k: tja.WeightedAggregator(
            tja.CRMOGMWeighting(tja.ExcessMTLWeighting(), alpha=0.5, initial_weights=_f64(_per_task(k)))
        ),
        2,
    ),
]
CALLS = 3  # successive calls on each matrix (changed between them): the stateful carry their state


def _calls(J: torch.Tensor):
    """The matrix, then changed in scale and direction (the same shape: the same state)."""
    for c in range(CALLS):
        yield J * (1.0 + 0.5 * c) + 0.1 * c * J.roll(1, 1)


def _check(got: torch.Tensor, expected: torch.Tensor, J: torch.Tensor, label: str) -> None:
    """Equal to 1e-9 of the update's scale (the rows' largest entry times their number), or,
    where torchjd's update is 0 up to rounding (ConFIG on rows of one direction that cancel:
    its direction is then rounding, normalised), both that small."""
    scale = float(J.abs().max()) * len(J)
    if float(expected.norm()) < 1e-8 * scale:
        assert float(got.norm()) < 1e-8 * scale, label
        return
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9 * scale, msg=label)


@pytest.mark.parametrize("name, args, ref, rows", GRAMIAN, ids=lambda v: str(v) if isinstance(v, (str, dict)) else "")
def test_gramian_methods_equal_torchjd_on_its_test_matrices(name, args, ref, rows):
    checked = 0
    for label, J in named(rows):
        k = len(J)
        method, theirs = M.build(name, _args(args, k)), ref(k)
        method.set_tasks([f"t{i}" for i in range(len(J))])
        for c, Jc in enumerate(_calls(J)):
            got = method.weights(Jc @ Jc.T, torch.Generator()) @ Jc
            _check(got, theirs(Jc), Jc, f"{label}, call {c}")
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    "name, args, ref, rows", AGGREGATORS, ids=lambda v: str(v) if isinstance(v, (str, dict)) else ""
)
def test_aggregators_equal_torchjd_on_its_test_matrices(name, args, ref, rows):
    checked = 0
    for label, J in named(rows):
        k = len(J)
        method, theirs = M.build(name, _args(args, k)), ref(k)
        method.set_tasks([f"t{i}" for i in range(len(J))])
        for c, Jc in enumerate(_calls(J)):
            got = method.aggregate(Jc, torch.rand(Jc.shape[1], dtype=Jc.dtype))
            _check(got, theirs(Jc), Jc, f"{label}, call {c}")
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize(
    "rows, tau, eps",
    [
        ([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], 0.5, 1e-8),  # satisfied: g_1 itself
        ([[1.0, 1.0], [0.0, 1.0], [0.0, -2.0]], 0.02, 1e-8),  # anti-parallel secondaries: infeasible, g_1
        ([[1.0, 0.0], [-3.0, 0.0]], 0.02, 1e-8),  # only against g_1: -g_1's direction, |g_1|
        ([[0.0, 0.0], [1.0, 2.0], [3.0, -1.0]], 0.02, 1e-8),  # no primary gradient: 0
        ([[1.0, 2.0], [0.0, 0.0], [3.0, -1.0]], 0.02, 0.0),  # a secondary always 0, eps 0: no 1/0
        ([[1.0, 0.0], [-1.0, 1.0], [-1.0, -1.0]], 0.5, 1e-8),  # both active
    ],
)
def test_pcd_equals_torchjd_where_its_tests_know_the_answer(rows, tau, eps):
    J = torch.tensor(rows, dtype=torch.float64)
    got = M.build("pcd", {"tau": tau, "eps": eps}).weights(J @ J.T, torch.Generator()) @ J
    torch.testing.assert_close(got, tja.PCD(tau=tau, eps=eps)(J), rtol=1e-12, atol=1e-12)


def test_pcd_active_set_meets_the_optimality_conditions():
    """``[1, mu]`` with ``mu >= 0``, every constraint held, complementary slackness, on random
    Gramians of 2 to 8 tasks."""
    from gradmod.hooks.per_loss.methods.pcd import dual_active_set

    g = torch.Generator().manual_seed(0)
    for k in range(2, 9):
        for tau in (0.0, 0.02, 0.5):
            J = torch.randn(k, 10, generator=g, dtype=torch.float64)
            G = (J @ J.T).numpy()
            w = dual_active_set(G, torch.full((k - 1,), tau, dtype=torch.float64).numpy())
            slack = G[1:] @ w - tau * G.diagonal()[1:]
            assert w[0] == 1.0 and (w[1:] >= 0).all() and (slack >= -1e-8).all()
            assert abs(w[1:] @ slack) < 1e-8


STEP = [
    (n, _args(a, 3), r)
    for n, a, r, rows in (getattr(case, "values", case) for case in GRAMIAN + AGGREGATORS)
    if rows <= 3
]
# scipy's least squares takes its Jacobian by finite differences: the stage's Gramian, summed
# per layer, differs from J J^T in the last bits, and its answer by up to 1e-8
SOLVER = {"fairgrad": 1e-6}


@pytest.mark.parametrize("name, args, ref", STEP, ids=lambda v: str(v) if isinstance(v, (str, dict)) else "")
def test_three_steps_of_the_stage_equal_torchjd(name, args, ref):
    """Three SGD steps on a shared trunk (the heads the plain sum's gradient): ``backward`` +
    ``jac_to_grad`` with torchjd's aggregator (one instance: its state carried), in float64."""
    ours, theirs = SharedTrunk().double(), SharedTrunk().double()
    hooks = gradmod.attach(ours, {"mtl": {"params": "trunk.*", "transforms": [{"name": name, **args}]}})
    agg = ref(3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        for o in opts:
            o.zero_grad()
        hooks.backward(trunk_losses(ours, step))
        losses = list(trunk_losses(theirs, step).values())
        heads = list(theirs.heads.parameters())
        for p, g in zip(heads, torch.autograd.grad(sum(losses), heads, retain_graph=True)):
            p.grad = g
        tj_backward(losses, inputs=list(theirs.trunk.parameters()))
        jac_to_grad(list(theirs.trunk.parameters()), agg)
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
            tol = SOLVER.get(name, 1e-9)
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol / 10, msg=f"step {step}: {n}")
        for o in opts:
            o.step()


def _train(spec: dict, scalarizer, steps: int = 100, draw=None):
    """``steps`` SGD steps with gradmod's loss weighting and with torchjd's scalarizer side by
    side; ``draw(gen)`` sets the scalarizer's preference from a generator seeded as the stage's."""
    ours, theirs = SharedTrunk().double(), SharedTrunk().double()
    hooks = gradmod.attach(ours, {"w": {"params": "*", "transforms": [spec]}})
    hooks.stage("per_loss").generator.manual_seed(7)
    gen = torch.Generator().manual_seed(7)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs))
    opt_s = (
        torch.optim.Adam(scalarizer.parameters(), lr=spec.get("lr", 0.001)) if list(scalarizer.parameters()) else None
    )
    for step in range(steps):
        opt_a.zero_grad()
        hooks.backward(trunk_losses(ours, step))
        opt_a.step()
        opt_b.zero_grad()
        if draw is not None:
            draw(scalarizer, gen)
        scalarizer(torch.stack(list(trunk_losses(theirs, step).values()))).backward()
        opt_b.step()
        if opt_s is not None:
            opt_s.step()
            opt_s.zero_grad()
    return ours, theirs


def _dirichlet(scalarizer, gen):
    scalarizer.weights = torch._sample_dirichlet(torch.full((3,), 0.5, dtype=torch.float64), generator=gen)


W = [0.2, 0.5, 0.3]
Z = [0.1, 0.3, 0.05]


@pytest.mark.parametrize(
    "spec, make, draw",
    [
        ({"name": "cosmos", "lambda_": 0.5, "weights": W}, lambda: tjs.COSMOS(0.5, _f64(W)), None),
        (
            {"name": "cosmos", "lambda_": 2.0, "weights": "dirichlet", "concentration": 0.5},
            lambda: tjs.COSMOS(2.0, None),
            _dirichlet,
        ),
        ({"name": "imtll", "lr": 0.01}, lambda: tjs.IMTLL(3).double(), None),
        ({"name": "pbi", "theta": 5.0, "weights": W}, lambda: tjs.PBI(5.0, _f64(W)), None),
        ({"name": "pbi", "theta": 5.0, "weights": W, "reference": Z}, lambda: tjs.PBI(5.0, _f64(W), _f64(Z)), None),
        (
            {"name": "pbi", "theta": 1.0, "weights": "dirichlet", "concentration": 0.5},
            lambda: tjs.PBI(1.0, None),
            _dirichlet,
        ),
        ({"name": "stch", "mu": 0.1}, lambda: tjs.STCH(0.1), None),
        ({"name": "stch", "mu": 0.5, "weights": W, "reference": Z}, lambda: tjs.STCH(0.5, _f64(W), _f64(Z)), None),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_scalarizations_equal_torchjd_over_100_steps(spec, make, draw):
    """The weights ``df/dL_i`` at each step's losses, one ordinary backward; the Dirichlet
    preference drawn from the stage's generator, torchjd's given the same draws."""
    ours, theirs = _train(spec, make(), draw=draw)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=n)


def test_dirichlet_preferences_lie_on_the_simplex_with_the_concentrations_mean():
    """Where torchjd's user draws the preference: gradmod's draws are each on the simplex, their
    mean ``1/k`` (here: 4,000 draws of 3, concentration 0.5: the mean's std is 0.005)."""
    method = M.build("cosmos", {"lambda_": 0.0, "weights": "dirichlet", "concentration": 0.5})
    gen = torch.Generator().manual_seed(0)
    draws = _f64([method._prefer(3, gen) for _ in range(4000)])
    assert (draws >= 0).all()
    torch.testing.assert_close(draws.sum(1), torch.ones(4000, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(draws.mean(0), torch.full((3,), 1 / 3, dtype=torch.float64), rtol=0, atol=0.02)
    # lambda_ 0: cosmos is the linear scalarization with the drawn preference
    gen.manual_seed(1)
    expected = torch._sample_dirichlet(torch.full((3,), 0.5, dtype=torch.float64), generator=gen).tolist()
    gen.manual_seed(1)
    assert method.loss_weights(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), gen) == pytest.approx(
        expected, abs=1e-15
    )


STATEFUL = [
    {"name": "pcd"},
    {"name": "modo"},
    {"name": "sdmgrad"},
    {"name": "excess_mtl"},
    {"name": "excess_mtl", "n_warmup_steps": 1},
    {"name": "crmogm", "weighting": "upgrad"},
    {"name": "crmogm", "weighting": "nash_mtl"},
    {"name": "crmogm", "weighting": "uw"},
    {"name": "imtll"},
    {"name": "cosmos", "lambda_": 1.0, "weights": "dirichlet"},
]


def _rule(spec: dict) -> dict:
    losses_only = spec["name"] in ("imtll", "cosmos") or spec.get("weighting") == "uw"
    return {"mtl": {"params": "*" if losses_only else "trunk.*", "transforms": [spec]}}


@pytest.mark.parametrize("spec", STATEFUL, ids=str)
def test_checkpoints_load_with_weights_only_and_resume_bitwise(spec):
    def steps(model, hooks, opt, at):
        for step in at:
            opt.zero_grad()
            hooks.backward(trunk_losses(model, step))
            opt.step()

    straight, first = SharedTrunk().double(), SharedTrunk().double()
    hooks = gradmod.attach(straight, _rule(spec))
    steps(straight, hooks, torch.optim.SGD(straight.parameters(), lr=0.1), range(4))
    hooks = gradmod.attach(first, _rule(spec))
    steps(first, hooks, torch.optim.SGD(first.parameters(), lr=0.1), range(2))
    buffer = io.BytesIO()
    torch.save({"hooks": hooks.state_dict(), "model": first.state_dict()}, buffer)
    hooks.remove()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = SharedTrunk().double()
    resumed.load_state_dict(saved["model"])
    hooks = gradmod.attach(resumed, _rule(spec))
    hooks.load_state_dict(saved["hooks"])
    steps(resumed, hooks, torch.optim.SGD(resumed.parameters(), lr=0.1), range(2, 4))
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)


NEW = [
    {"name": "config"},
    {"name": "fairgrad", "alpha": 1.0},
    {"name": "krum", "n_byzantine": 0},
    {"name": "trimmed_mean", "trim_number": 1},
    {"name": "pcd"},
    {"name": "modo"},
    {"name": "sdmgrad"},
    {"name": "excess_mtl"},
    {"name": "crmogm", "weighting": "upgrad"},
    {"name": "crmogm", "weighting": "excess_mtl"},
    {"name": "cosmos", "lambda_": 1.0, "weights": W},
    {"name": "imtll"},
    {"name": "pbi", "theta": 5.0, "weights": W},
    {"name": "stch", "mu": 0.1},
]


@pytest.mark.parametrize("spec", NEW, ids=str)
def test_a_nan_in_one_task_gives_a_nan_update_and_leaves_the_state_alone(spec):
    rules = _rule(spec) if spec["name"] not in ("pbi", "stch") else {"mtl": {"params": "*", "transforms": [spec]}}
    nan_task_spares_the_state(rules, spec)


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            {"name": "krum", "n_byzantine": 1},
            r"hooks\.mtl: per_loss method 'krum': n_byzantine=1, n_selected=1 need at least 4 losses, got 3",
        ),
        ({"name": "krum", "n_byzantine": -1}, "n_byzantine=-1 must be a whole number from 0 to"),
        ({"name": "trimmed_mean", "trim_number": 2}, r"hooks\.mtl: .*trim_number=2 needs at least 5 losses, got 3"),
        ({"name": "pcd", "tau": [0.1]}, r"hooks\.mtl: .*'pcd': tau has 1 values for 2 secondary losses"),
        ({"name": "pcd", "tau": 1.5}, r"tau=1\.5 must be a number >= 0\.0 and <= 1\.0"),
        ({"name": "fairgrad"}, "transform 'fairgrad' needs argument\\(s\\) alpha"),
        (
            {"name": "config", "pref_vector": [1.0, 2.0]},
            r"hooks\.mtl: .*'config': pref_vector has 2 values for 3 losses",
        ),
        ({"name": "crmogm", "weighting": "graddrop"}, "'graddrop' gives an update, not weights"),
        ({"name": "crmogm", "weighting": "nope"}, "weighting='nope' is no per_loss method; allowed: "),
        ({"name": "crmogm", "weighting": "upgrad", "alpha": 2}, "alpha=2 must be a number >= 0.0 and <= 1.0"),
        (
            {"name": "cosmos", "lambda_": 1.0, "weights": "uniform"},
            "weights='uniform'; give a list of numbers, one per loss, or dirichlet",
        ),
        ({"name": "stch", "mu": 0.0}, "mu=0.0 must be a number > 0.0"),
        ({"name": "sdmgrad", "momentum": 1.0}, "momentum=1.0 must be a number >= 0.0 and <= 0.999"),
    ],
)
def test_refusals_are_one_line(spec, words):
    model = SharedTrunk().double()
    with pytest.raises(ValueError, match=words) as e:
        gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [spec]}}).backward(trunk_losses(model))
    assert "\n" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())
