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


def test_the_estimates_are_the_hessians_of_the_runs_weights(runs):
    """The last estimate (step 12, the run's last) against eigvalsh of torch.func.hessian at the
    weights model.pt holds, on the same probe batch (the first 16 training examples), eval mode."""
    from gradmod.analysis.self_influence import run_data, run_model
    from gradmod.data import as_float

    folder = runs["curvature"]
    rows = _rows(folder / "curvature.csv")
    assert sorted({int(r["step"]) for r in rows}) == [0, 4, 8, 12]
    assert {r["group"] for r in rows} == {"conv1.*", "conv2.bias"}
    import dataclasses

    config = dataclasses.asdict(validate(compose_config(*TINY_FAKE, *RULE)))
    data = run_data(config, folder)
    model = run_model(config, data)()
    model.load_state_dict(torch.load(folder / "model.pt"))
    model.eval()
    x, y = as_float(data.train_x[:16]), data.train_y[:16]
    params = {n: p.detach() for n, p in model.named_parameters()}
    for row in (r for r in rows if int(r["step"]) == 12):
        names = [n for n in params if (n.startswith("conv1.") if row["group"] == "conv1.*" else n == "conv2.bias")]
        sizes = [params[n].numel() for n in names]

        def loss(flat, names=names, sizes=sizes):
            moved = dict(params) | {n: v.view_as(params[n]) for n, v in zip(names, flat.split(sizes))}
            return F.cross_entropy(functional_call(model, moved, (x,)), y)

        h = hessian(loss)(torch.cat([params[n].reshape(-1) for n in names])).double()
        exact = torch.linalg.eigvalsh(h).flip(0)[:2].tolist()
        got = [float(row["top1"]), float(row["top2"])]
        assert got == pytest.approx(exact, rel=1e-4, abs=1e-6), (row["group"], got, exact)
        assert abs(float(row["trace"]) - float(h.trace())) <= 3 * float(row["trace_se"])


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
