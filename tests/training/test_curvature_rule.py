"""``+hooks=curvature``: estimates every N steps into metrics.csv, curvature.csv and curvature.png,
equal to the Hessian of the run's own weights taken independently; training unchanged; bad input
in one line."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_FAKE, compose_config
from torch.func import functional_call, hessian

from gradmod.app.config_store import validate
from gradmod.run import runner
from gradmod.run.folder import endings

RULE = [
    "+hooks=curvature",
    "hooks.curvature.params=[conv1.*,conv2.bias]",
    "hooks.curvature.transforms.0.every=4",
    "hooks.curvature.transforms.0.k=2",
    "hooks.curvature.transforms.0.iterations=200",
    "hooks.curvature.transforms.0.tol=1e-7",
    "hooks.curvature.transforms.0.probes=64",
    "hooks.curvature.transforms.0.batch=16",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, extra in (("plain", []), ("curvature", RULE)):
        folder = tmp_path_factory.mktemp(name)
        ending = runner.execute(lambda extra=extra: validate(compose_config(*TINY_FAKE, *extra)), folder)
        assert ending.status == "ok", ending.error
        out[name] = folder
    return out


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _exact(folder, overrides, group_names, n):
    """group -> the exact Hessian (float64) of the loss on the first ``n`` training examples at the
    weights model.pt holds, eval mode, over the parameters ``group_names[group]`` picks."""
    import dataclasses

    from gradmod.analysis.self_influence import run_data, run_model
    from gradmod.data import as_float

    config = dataclasses.asdict(validate(compose_config(*TINY_FAKE, *overrides)))
    data = run_data(config, folder)
    model = run_model(config, data)()
    model.load_state_dict(torch.load(folder / "model.pt"))
    model.eval()
    x, y = as_float(data.train_x[:n]), data.train_y[:n]
    params = {name: p.detach() for name, p in model.named_parameters()}
    out = {}
    for group, picks in group_names.items():
        names = [name for name in params if picks(name)]
        sizes = [params[name].numel() for name in names]

        def loss(flat, names=names, sizes=sizes):
            moved = dict(params) | {name: v.view_as(params[name]) for name, v in zip(names, flat.split(sizes))}
            return F.cross_entropy(functional_call(model, moved, (x,)), y)

        out[group] = hessian(loss)(torch.cat([params[name].reshape(-1) for name in names])).double()
    return out


def test_the_estimates_are_the_hessians_of_the_runs_weights(runs):
    """The last estimate (step 12, the run's last) against eigvalsh of torch.func.hessian at the
    weights model.pt holds, on the same probe batch (the first 16 training examples), eval mode."""
    folder = runs["curvature"]
    rows = _rows(folder / "curvature.csv")
    assert sorted({int(r["step"]) for r in rows}) == [0, 4, 8, 12]
    assert {r["group"] for r in rows} == {"conv1.*", "conv2.bias"}
    picks = {"conv1.*": lambda n: n.startswith("conv1."), "conv2.bias": lambda n: n == "conv2.bias"}
    exact = _exact(folder, RULE, picks, 16)
    for row in (r for r in rows if int(r["step"]) == 12):
        h = exact[row["group"]]
        top = torch.linalg.eigvalsh(h).flip(0)[:2].tolist()
        got = [float(row["top1"]), float(row["top2"])]
        assert got == pytest.approx(top, rel=1e-4, abs=1e-6), (row["group"], got, top)
        assert abs(float(row["trace"]) - float(h.trace())) <= 3 * float(row["trace_se"])


def test_the_probe_batch_is_one_training_batch_unless_given(tmp_path):
    """Without ``batch`` the probe is the first data.batch_size (10) training examples, so an
    estimate costs the same number of training steps at any batch size; not all 60."""
    rule = [
        "+hooks=curvature",
        "hooks.curvature.params=conv2.bias",
        "hooks.curvature.transforms.0.every=12",
        "hooks.curvature.transforms.0.tol=1e-9",
    ]
    ending = runner.execute(lambda: validate(compose_config(*TINY_FAKE, *rule)), tmp_path)
    assert ending.status == "ok", ending.error
    last = _rows(tmp_path / "curvature.csv")[-1]
    assert last["step"] == "12"  # the run's last step: at the weights model.pt holds
    got = float(last["top1"])
    one, every = (_exact(tmp_path, rule, {"b": lambda n: n == "conv2.bias"}, n)["b"] for n in (10, 60))
    assert got == pytest.approx(float(torch.linalg.eigvalsh(one)[-1]), rel=1e-6)
    assert got != pytest.approx(float(torch.linalg.eigvalsh(every)[-1]), rel=1e-3)


def test_training_is_unchanged_and_the_metrics_carry_the_latest_estimate(runs):
    a = torch.load(runs["plain"] / "model.pt")
    b = torch.load(runs["curvature"] / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    metrics = _rows(runs["curvature"] / "metrics.csv")
    last = [r for r in _rows(runs["curvature"] / "curvature.csv") if r["step"] == "12"]
    for row in last:
        assert float(metrics[-1][f"curvature/{row['group']}/top1"]) == pytest.approx(float(row["top1"]), rel=1e-9)
        assert float(metrics[-1][f"curvature/{row['group']}/trace"]) == pytest.approx(float(row["trace"]), rel=1e-9)
    assert (runs["curvature"] / "curvature.png").stat().st_size > 0


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "hooks.curvature.transforms.0.every=0",
            "hooks.curvature: every=0 must be an int >= 1 (optimizer steps between",
        ),
        (
            "hooks.curvature.transforms.0.batch=0",
            "hooks.curvature: batch=0 must be an int >= 1 (training examples in the probe batch) or null",
        ),
        (
            "hooks.curvature.params=fc*",
            "hooks.curvature.params: 'fc*' matches no trainable parameter; names look like: conv1.weight",
        ),
        ("+hooks.curvature.transforms.0.steps=3", "hooks.curvature: curvature has no argument steps; allowed: batch"),
        ("hooks.curvature.transforms.0.per=block", "hooks.curvature: per='block'; allowed: glob, layer, all"),
        ("hooks.curvature.transforms=[curvature,zero]", "hooks.curvature: curvature observes and transforms nothing"),
    ],
)
def test_bad_input_is_one_line(tmp_path, override, line):
    ending = runner.execute(lambda: validate(compose_config(*TINY_FAKE, "+hooks=curvature", override)), tmp_path)
    assert ending.status == "failed" and ending.exit_code == 2
    message = endings.message(ending.error)
    assert message.startswith(line) and "\n" not in message, message
    assert not (tmp_path / "metrics.csv").exists()


def test_an_estimate_says_when_lanczos_stopped_before_its_tolerance(caplog):
    """Capped at one Lanczos step the residual stays above ``tol``: the row keeps it and the log
    line says so; converged, the residual is within ``tol`` and the line says nothing of it."""
    from gradmod.training.curvature import CurvatureRule, Estimates

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    batch = (torch.randn(16, 5), torch.randint(0, 3, (16,)))
    capped = CurvatureRule("capped", iterations=1, tol=1e-3)
    full = CurvatureRule("full", iterations=60, tol=1e-3)
    estimates = Estimates([capped, full])
    with caplog.at_level("INFO", logger="gradmod.curvature"):
        estimates.estimate([capped, full], model, F.cross_entropy, lambda r: batch, step=0, lr=0.1)
    rows = {r["rule"]: r for r in estimates.rows}
    assert rows["capped"]["residual"] > 1e-3 and rows["full"]["residual"] <= 1e-3
    assert estimates.latest["capped/*/residual"] == rows["capped"]["residual"]
    lines = {r.getMessage().split(" ")[0]: r.getMessage() for r in caplog.records}
    assert "(not converged in 1 Lanczos steps: residual " in lines["capped"] and "tol 0.001)" in lines["capped"]
    assert "not converged" not in lines["full"]
